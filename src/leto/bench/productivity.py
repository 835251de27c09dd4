"""`leto bench productivity`: the same training work under the same failures, per system, in trials.

Work: `steps` steps of the built-in GPT job. Failures: `--failures N` per run (default
DEFAULT_FAILURES), each a SIGKILL of a seeded random worker once a seeded random step is recorded,
injected from outside by PID (`leto.baselines.faults`); the steps are N uniform points over the
run's steps after the warm-up, at least `runs.MIN_GAP_STEPS` apart (`runs.failure_schedule`). The
schedule is a function of N, the steps and the seed only: every system, in every trial, loses the
same workers after the same steps, however fast the machine runs that day (a schedule in seconds
drew one failure on a fast day and six on a slow one), and the same failures in every trial make
the trials repeats of one measurement (their spread is the machine's noise, not the schedule's).

A trial runs every system failure-free and then with the failures, back to back (A, A', B, B',
...); the order of the systems rotates by one from trial to trial (trial 2 starts with B), so no
system always runs first. `--trials N` (default 3) trials; medians over the trials with their
spread ([min, max]) are reported, every trial's raw figures are in the JSON.

productive fraction = failure-free time of the work / wall time of the work with failures (launch
-> step `steps` first recorded). Three estimates of the failure-free time:

* `productivity` (the headline): the **fastest failure-free run of any system in the same
  trial** (launch -> last step of the work). It charges everything that makes a system slower
  than the fastest way to do the work: start-up, per-step costs (Leto's protection,
  checkpoint writes, memory snapshots) and the failures;
* `productivity_in_run_estimate_excludes_per_step_costs`: the failed run's own failure-free time,
  estimated from its records (`runs.in_run_failure_free_s`: its wall time less what each failure
  cost, measured around each kill against the pre-failure step time). Under the same load as the
  run, but it charges only the failures: per-step costs are in its own steps;
* `productivity_vs_own_failure_free_run_excludes_per_step_costs`: the system's own failure-free
  run in the same trial (the run just before it); per-step costs are in both runs.

Also per system: its whole failure-free run (launch -> the run returned: start-up, the work,
shutdown) and its ratio to the fastest other system's (`failure_free_ratio_to_fastest_peer`): the
other system with the smallest median run over the trials, compared trial by trial (both ran in
the same trial, minutes apart), then the median. Not the smallest of the other systems' runs in
each trial: with four peers that is the least of four noisy runs, so a system exactly as fast as
its peers would score above 1 by the noise alone (kept, named for that, as
`failure_free_ratio_to_fastest_run_of_the_trial_selection_biased`).
Every comparison printed (Leto's headline against each peer's, Leto's failure-free run against the
fastest peer's) is flagged "within noise" when the two [min, max] over trials overlap
(`leto.bench.noise`). The targets: Leto ahead of every peer on the headline in every trial, by
>= 10 pp over checkpoint-restart; Leto's ratio <= 1.03 on the median of the trials.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from leto.baselines.faults import ExternalInjector
from leto.baselines.nvrx_job import nvrx_status
from leto.bench import capacity, plots
from leto.bench.mesh import refuse_tp
from leto.bench.noise import NOISE_RULE, NOT_MEASURED, every_repeat, measured, noise_word, on_median, within_noise
from leto.bench.runs import (
    DEFAULT_MTBF_S,
    FIRST_KILL_STEP,
    LETO,
    MIN_GAP_STEPS,
    BenchInterrupted,
    JobConfig,
    NoInjector,
    Run,
    System,
    default_out,
    failure_schedule,
    in_run_failure_free_s,
    log,
    machine,
    max_failures,
    median,
    median_index,
    productive_fraction,
    run_system,
    stdout_to_stderr,
    torchft_status,
    work_time_s,
)
from leto.errors import UsageError
from leto.training.model import PRESETS

DEFAULT_STEPS = 240
DEFAULT_TRIALS = 3
# Six: about what the earlier schedule in seconds (MTBF 8 s) drew on runs of 40-50 s, the results in
# docs/benchmarks.md (five in 120 steps on 2026-12-01, six in 480 on 2026-12-04); over the default 240
# steps one kill per 40 steps on average: several recoveries per run, most steps undisturbed.
DEFAULT_FAILURES = 6
SCHEDULE_SEED = 0  # the same seed, and the same kill steps and ranks, in every trial
SYSTEMS = (
    System(LETO, LETO, 1),
    System("checkpoint-restart", "checkpoint-restart"),
    System("memory-restart", "memory-restart"),
    System("torchft", "torchft"),
    System("nvrx", "nvrx"),
)

HEADLINE = "productivity"
IN_RUN = "productivity_in_run_estimate_excludes_per_step_costs"
OWN = "productivity_vs_own_failure_free_run_excludes_per_step_costs"
FIGURES = (HEADLINE, IN_RUN, OWN)
DIFFERENCES = {
    HEADLINE: "difference_pp",
    IN_RUN: "difference_pp_in_run_estimate_excludes_per_step_costs",
    OWN: "difference_pp_vs_own_failure_free_run_excludes_per_step_costs",
}
RATIO = "failure_free_ratio_to_fastest_peer"
WORK_RATIO = "failure_free_work_ratio_to_fastest_peer"
TRIAL_MIN_RATIO = "failure_free_ratio_to_fastest_run_of_the_trial_selection_biased"
PAIRED = {RATIO: "failure_free_run_s", WORK_RATIO: "failure_free_work_s"}  # a ratio -> the figure it compares
PER_TRIAL = (
    HEADLINE,
    IN_RUN,
    OWN,
    "wall_s",
    "failures",
    "in_run_failure_free_s",
    "failure_free_work_s",
    "failure_free_run_s",
    TRIAL_MIN_RATIO,
)  # reported per trial, as medians and with their spread (and RATIO, WORK_RATIO: `paired_ratios`)

TARGET_RATIO = 1.03  # Leto's failure_free_ratio_to_fastest_peer, median, at most
TARGET_LEAD_PP = {"checkpoint-restart": 10.0}  # Leto's headline lead in pp, median, at least; other peers: > 0

DEFINITIONS = {
    HEADLINE: "headline: the fastest failure-free run of any system in the same trial (launch -> last step of "
    "the work) / this system's wall time for the work with failures (launch -> last step of the work "
    "first recorded); charges start-up, per-step costs (protection, checkpoint writes) and the failures",
    IN_RUN: "the failed run's own failure-free time (its wall time less what each failure cost, from its step "
    "records) / its wall time; charges only the failures, not per-step costs",
    OWN: "the system's own failure-free run in the same trial / its wall time with failures; per-step costs are "
    "in both, so they are not charged",
    "failure_free_work_s": "failure-free run: launch -> the last step of the work recorded",
    "failure_free_run_s": "failure-free run: launch -> the run returned (start-up, the work, shutdown); None if "
    "the run did not end cleanly",
    RATIO: "per trial, failure_free_run_s / that of the fastest peer in the same trial, then the median; the "
    "fastest peer: the other system with the smallest median failure_free_run_s over the trials",
    WORK_RATIO: "the same for failure_free_work_s",
    TRIAL_MIN_RATIO: "per trial, failure_free_run_s / the smallest of the other systems' in the same trial, then "
    "the median: the least of several noisy runs, so biased upward (a system exactly as fast as its peers "
    "scores above 1); secondary",
    "difference_pp": "per trial (Leto's headline - the system's) x 100, then the median over the trials",
    "medians": "system figures: the median over the trials that measured them (trials_ok: how many measured "
    "the headline); spread: [min, max] over the same trials",
    "within_noise": NOISE_RULE,
    "targets": "Leto ahead of every peer on the headline in every trial (difference_pp > 0; >= "
    f"{TARGET_LEAD_PP['checkpoint-restart']:g} over checkpoint-restart): met if every trial measured it and met "
    "it, MISS if any measured trial missed it, INCOMPLETE if some trials did not measure it; "
    f"{RATIO} <= {TARGET_RATIO:g} on the median of the trials (INCOMPLETE unless every trial measured it)",
}


def schedule_words(failures: int, steps: int) -> str:
    """The failure schedule in words, as `config.schedule` carries it."""
    return (
        f"{failures} failures per run, each a SIGKILL of a seeded random worker once a seeded random step is "
        "recorded (the highest step number so far: steps a restart redoes do not count again), the steps "
        f"uniform over [{FIRST_KILL_STEP}, {steps - MIN_GAP_STEPS}] and at least {MIN_GAP_STEPS} apart (seed "
        f"{SCHEDULE_SEED}); the same steps and ranks for every system in every trial, whatever the machine's "
        "speed; a system that shrinks (NVRx) is not killed where the target rank no longer exists, so its "
        "failures are those injected"
    )


def pp(a: float | None, b: float | None) -> float | None:
    """a - b in percentage points."""
    return None if a is None or b is None else round(100.0 * (a - b), 2)


def spread(values: list[float | None]) -> list[float] | None:
    """[min, max] of the values that are not None (None if there are none)."""
    vals = [v for v in values if v is not None]
    return [round(min(vals), 4), round(max(vals), 4)] if vals else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 4) if num is not None and den else None


def trial_order(systems: list[System], trial: int) -> list[System]:
    """The systems of trial `trial` (0-based), rotated by one per trial."""
    k = trial % len(systems) if systems else 0
    return list(systems[k:]) + list(systems[:k])


def run_all(
    cfg: JobConfig, out: Path, systems: list[System], specs: list[dict], trials: int
) -> tuple[list[dict[str, dict[str, Run]]], list[list[str]]]:
    """Every trial: per system in turn (rotated per trial), the failure-free run, then the run with
    the kills `specs` (faults.ExternalInjector specs: the same in every trial). Returns per trial
    the runs, and the order of every trial."""
    all_runs: list[dict[str, dict[str, Run]]] = []
    orders: list[list[str]] = []
    timeout_s = 120.0 + 20.0 * cfg.steps
    for trial in range(trials):
        runs: dict[str, dict[str, Run]] = {"failure-free": {}, "failures": {}}
        all_runs.append(runs)
        order = trial_order(systems, trial)
        orders.append([s.name for s in order])
        for system in order:
            tag = f"trial {trial + 1}/{trials}"
            free = run_system(
                system,
                cfg,
                out / "runs" / f"trial{trial + 1}-failure-free-{system.name}",
                NoInjector(),
                limit_s=120.0 + 2.0 * cfg.steps,
            )
            runs["failure-free"][system.name] = free
            _log_run(tag, system.name, "failure-free", free, cfg.steps)
            ff_s = work_time_s(free.records, free.t_start, cfg.steps)
            run_dir = out / "runs" / f"trial{trial + 1}-failures-{system.name}"
            run = run_system(
                system,
                replace(cfg, max_restarts=len(specs) + 3),
                run_dir,
                ExternalInjector(run_dir, [dict(s) for s in specs], timeout_s=timeout_s),
                limit_s=120.0 + 4.0 * (ff_s or 2.0 * cfg.steps) + 30.0 * len(specs),
            )
            runs["failures"][system.name] = run
            _log_run(tag, system.name, "failures", run, cfg.steps)
    return all_runs, orders


def _log_run(tag: str, name: str, phase: str, run: Run, steps: int) -> None:
    wall = work_time_s(run.records, run.t_start, steps)
    log(
        f"[productivity] {tag} {name:18} {phase:12} "
        + (
            f"{steps} steps in {wall:.1f} s, {len(run.kills)} failures"
            if wall is not None
            else f"did not finish the work: {run.error}"
        )
    )


def summarize_trial(cfg: JobConfig, runs: dict[str, dict[str, Run]], names: list[str]) -> dict:
    """One trial: per system (in the order of `names`) its figures, and Leto's differences.

    The time of the work is launch -> step `steps` first recorded, whatever happens after it (a
    run's exit code is reported, but a failure after the work was done does not void it)."""
    free_runs = runs["failure-free"]
    work = {n: work_time_s(r.records, r.t_start, cfg.steps) for n, r in free_runs.items()}
    whole = {n: round(r.t_end - r.t_start, 4) if r.ok and work[n] is not None else None for n, r in free_runs.items()}
    known = {n: t for n, t in work.items() if t is not None}
    fastest = min(known, key=lambda n: known[n]) if known else None
    ref = known.get(fastest) if fastest else None

    def fastest_peer(times: dict[str, float | None], name: str) -> float | None:
        return min((t for n, t in times.items() if n != name and t is not None), default=None)

    systems: dict[str, dict] = {}
    for name in names:
        run, ff = runs["failures"].get(name), free_runs.get(name)
        if run is None and ff is None:
            continue
        wall = work_time_s(run.records, run.t_start, cfg.steps) if run else None
        kills = [k for k in run.kills if wall is None or k.time <= run.t_start + wall] if run else []
        in_run = in_run_failure_free_s(run.records, run.t_start, cfg.steps, [k.time for k in kills]) if run else None
        systems[name] = {
            HEADLINE: productive_fraction(ref, wall),
            IN_RUN: productive_fraction(in_run, wall),
            OWN: productive_fraction(work.get(name), wall),
            "wall_s": wall,
            "failures": len(kills) if run else None,
            "in_run_failure_free_s": in_run,
            "failure_free_work_s": work.get(name),
            "failure_free_run_s": whole.get(name),
            TRIAL_MIN_RATIO: _ratio(whole.get(name), fastest_peer(whole, name)),
            "ok": wall is not None,
            "error": run.error if run else "not run",
            "failure_free_error": ff.error if ff else "not run",
            "kills": [
                {
                    "at_s": round(k.time - run.t_start, 3),
                    "rank": k.spec.get("rank"),
                    "step": k.spec.get("step"),
                    "after_step": k.step,
                }
                for k in kills
            ],
            "run_dir": str(run.run_dir) if run else None,
            "failure_free_run_dir": str(ff.run_dir) if ff else None,
        }
    leto = systems.get(LETO, {})
    diffs = {DIFFERENCES[f]: {n: pp(leto.get(f), s[f]) for n, s in systems.items() if n != LETO} for f in FIGURES}
    return {"fastest_failure_free": {"system": fastest, "work_s": ref}, "systems": systems, **diffs}


def aggregate(trials: list[dict], names: list[str]) -> dict:
    """Medians and spreads over trials (each `summarize_trial`'s output, with its `trial` number
    and `order`): per system, and of Leto's per-trial differences."""
    systems: dict[str, dict] = {}
    for name in names:
        recs = [{"trial": t["trial"], **t["systems"][name]} for t in trials if name in t["systems"]]
        if not recs:
            continue
        s: dict = {k: median([r[k] for r in recs]) for k in PER_TRIAL}
        s["spread"] = {k: spread([r[k] for r in recs]) for k in PER_TRIAL}
        s["trials_ok"] = sum(1 for r in recs if r[HEADLINE] is not None)
        s["representative_trial"] = _representative(recs)
        s["trials"] = recs
        systems[name] = s
    paired_ratios(systems)
    report: dict = {"systems": systems}
    peers = [n for n in systems if n != LETO]
    for key in DIFFERENCES.values():
        report[key] = {n: median([t[key].get(n) for t in trials]) for n in peers}
    report["spread"] = {
        key: {n: spread([t[key].get(n) for t in trials]) for n in peers} for key in DIFFERENCES.values()
    }
    report["trials"] = [
        {
            "trial": t["trial"],
            "order": t["order"],
            "fastest_failure_free": t["fastest_failure_free"],
            **{key: t[key] for key in DIFFERENCES.values()},
        }
        for t in trials
    ]
    return report


def paired_ratios(systems: dict[str, dict]) -> None:
    """Each system's RATIO and WORK_RATIO (`aggregate`'s systems, in place): its fastest peer is the
    other system with the smallest median of the figure compared; per trial, the system's figure
    over that peer's in the same trial (None where either is missing), then the median and spread."""
    for ratio, figure in PAIRED.items():
        for name, s in systems.items():
            known = {p: o[figure] for p, o in systems.items() if p != name and o.get(figure) is not None}
            peer = min(known, key=lambda p: known[p]) if known else None
            theirs = {r["trial"]: r[figure] for r in systems[peer]["trials"]} if peer else {}
            for rec in s["trials"]:
                rec[ratio] = _ratio(rec[figure], theirs.get(rec["trial"]))
            values = [rec[ratio] for rec in s["trials"]]
            s[ratio], s["spread"][ratio] = median(values), spread(values)
            s.setdefault("fastest_peer", {})[ratio] = peer


def _representative(recs: list[dict]) -> int | None:
    """The trial number whose headline is the (lower) median: the one plotted."""
    idx = median_index([r[HEADLINE] for r in recs])
    return recs[idx]["trial"] if idx is not None else None


def comparisons(report: dict, peers: list[str]) -> list[dict]:
    """Every comparison the bench prints, each flagged by `noise.within_noise` (their [min, max]
    over trials overlap): Leto's headline against each peer's, and Leto's whole failure-free run
    against the fastest peer's (the peer with the smallest median `failure_free_run_s`)."""
    leto = report["systems"].get(LETO, {})

    def per_trial(s: dict, key: str) -> list[float | None]:
        return [t.get(key) for t in s.get("trials", [])]

    out = []
    for peer in peers:
        s = report["systems"].get(peer, {})
        out.append(
            {
                "figure": HEADLINE,
                "peer": peer,
                "leto": leto.get(HEADLINE),
                "leto_spread": leto.get("spread", {}).get(HEADLINE),
                "peer_value": s.get(HEADLINE),
                "peer_spread": s.get("spread", {}).get(HEADLINE),
                "difference_pp": report["difference_pp"].get(peer),
                "within_noise": within_noise(per_trial(leto, HEADLINE), per_trial(s, HEADLINE)),
            }
        )
    fastest = leto.get("fastest_peer", {}).get(RATIO)  # `paired_ratios`' choice
    if fastest is not None:
        s = report["systems"][fastest]
        out.append(
            {
                "figure": "failure_free_run_s",
                "peer": fastest,
                "leto": leto.get("failure_free_run_s"),
                "leto_spread": leto.get("spread", {}).get("failure_free_run_s"),
                "peer_value": s["failure_free_run_s"],
                "peer_spread": s["spread"]["failure_free_run_s"],
                RATIO: leto.get(RATIO),
                "within_noise": within_noise(per_trial(leto, "failure_free_run_s"), per_trial(s, "failure_free_run_s")),
            }
        )
    return out


def targets(report: dict, peers: list[str]) -> list[dict]:
    """The targets, judged on what this run measured (never assumed): Leto ahead of every peer on
    the headline in every trial (by TARGET_LEAD_PP where set), from the per-trial differences; Leto's
    whole failure-free run within TARGET_RATIO of the fastest peer's, on the median of the trials.
    Each says in how many trials it was measured and met, and whether its comparison is within
    noise (`comparisons`)."""
    n = len(report.get("trials", []))
    noisy = {(c["figure"], c["peer"]): c["within_noise"] for c in report.get("comparisons", [])}
    leto = report["systems"].get(LETO, {})
    r = leto.get(RATIO)
    ratios = [t.get(RATIO) for t in leto.get("trials", [])]
    k = len(measured(ratios))
    fastest = next((c["peer"] for c in report.get("comparisons", []) if c["figure"] == "failure_free_run_s"), None)
    out = [
        {
            "name": RATIO,
            "what": "Leto's whole failure-free run (launch to end) / the fastest other system's in "
            "the same trial, median of trials",
            "target": f"<= {TARGET_RATIO:g}",
            "measured": r,
            "per_trial": ratios,
            "trials_measured": k,
            "trials_met": sum(1 for v in measured(ratios) if v <= TARGET_RATIO),
            "trials": n,
            "within_noise": noisy.get(("failure_free_run_s", fastest)),
            "result": on_median(r, r is not None and r <= TARGET_RATIO, k, n),
        }
    ]
    for peer in peers:
        need = TARGET_LEAD_PP.get(peer)

        def ok(d: float, need: float | None = need) -> bool:
            return d >= need if need is not None else d > 0

        diffs = [t["difference_pp"].get(peer) for t in report.get("trials", [])]
        out.append(
            {
                "name": f"difference_pp[{peer}]",
                "what": f"Leto's headline productivity minus {peer}'s, percentage points, in every trial",
                "target": f">= +{need:g} pp" if need is not None else "> 0 pp",
                "measured": report["difference_pp"].get(peer),
                "per_trial": diffs,
                "trials_measured": len(measured(diffs)),
                "trials_met": sum(1 for d in measured(diffs) if ok(d)),
                "trials": n,
                "within_noise": noisy.get((HEADLINE, peer)),
                "result": every_repeat(diffs, ok) if n else NOT_MEASURED,
            }
        )
    return out


def make_plot(out: Path, report: dict, runs: list[dict[str, dict[str, Run]]], tokens: int) -> list[str]:
    """Throughput over wall time of each system's representative (median-headline) trial: its
    failure-free run and its run with failures, side by side on one time axis."""
    free_col, fail_col = [], []
    right = 0.0
    for name, s in report["systems"].items():
        trial = s.get("representative_trial")
        if trial is None:
            continue
        rec = s["trials"][[r["trial"] for r in s["trials"]].index(trial)]
        ff, run = runs[trial - 1]["failure-free"].get(name), runs[trial - 1]["failures"].get(name)
        if ff is not None:
            end = ff.t_start + (rec["failure_free_work_s"] or ff.t_end - ff.t_start)
            title = (
                f"{name} (trial {trial}): work done in {_sec(rec['failure_free_work_s'])}, exit after "
                f"{_sec(rec['failure_free_run_s'])} ({_ratio_txt(rec[RATIO])} the fastest peer)"
            )
            free_col.append(
                plots.Panel(
                    title,
                    [r for r in ff.steps() if r["time"] <= end],
                    ff.t_start,
                    [],
                    [(end, "done"), (ff.t_end, "exit")],
                )
            )
            right = max(right, ff.t_end - ff.t_start)
        if run is not None:
            end = run.t_end if rec["wall_s"] is None else run.t_start + rec["wall_s"]
            n = rec["failures"] or 0
            title = (
                f"{name} (trial {trial}): {_pct(rec[HEADLINE])} productive, {n} failure{'' if n == 1 else 's'}, "
                f"work done in {_sec(rec['wall_s'])}"
            )
            steps = [r for r in run.steps() if r["time"] <= end]  # not what a restart did after the work
            fail_col.append(
                plots.Panel(
                    title,
                    steps,
                    run.t_start,
                    [k.time for k in run.kills if k.time <= end],
                    [] if rec["wall_s"] is None else [(end, "done")],
                )
            )
            right = max(right, end - run.t_start)
    if not free_col and not fail_col:
        return []
    cfg = report["config"]
    path = plots.timeline(
        [free_col, fail_col],
        ["failure-free", f"{cfg['failures']} worker kills per run, at the same steps for every system"],
        tokens,
        out / "productivity-timeline.png",
        f"Tokens/s over wall time, {cfg['steps']} steps (each system's median trial of {cfg['trials']})",
        "seconds since launch",
        xlim=(0.0, right * 1.03),
    )
    return [str(path)]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _sec(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}s"


def _pp(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1f}"


def _ratio_txt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _ratio3(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}x"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:g}"


def _with_spread(fmt: Callable[[float | None], str], value: float | None, rng: list[float] | None, trials: int) -> str:
    """'median [min-max]' (just the value when one trial measured it)."""
    if value is None or rng is None or trials <= 1 or rng[0] == rng[1]:
        return fmt(value)
    return f"{fmt(value)} [{fmt(rng[0])}..{fmt(rng[1])}]"


def print_comparisons(report: dict) -> None:
    """Each comparison with both sides' median [min..max] and its noise flag."""
    n = report["config"]["trials"]
    print(
        "\nLeto against each peer (within noise: the two [min..max] over trials overlap"
        + ("" if n > 1 else "; one trial: noise not measured")
        + ")"
    )
    for c in report["comparisons"]:
        fmt = _pct if c["figure"] == HEADLINE else _sec
        k = n if n > 1 else 1
        sides = (
            f"leto {_with_spread(fmt, c['leto'], c['leto_spread'], k)} vs "
            f"{c['peer']} {_with_spread(fmt, c['peer_value'], c['peer_spread'], k)}"
        )
        if c["figure"] == HEADLINE:
            d = c["difference_pp"]
            what, diff = f"productivity vs {c['peer']}", "-" if d is None else f"{_pp(d)} pp"
        else:
            what, diff = f"failure-free run vs the fastest peer ({c['peer']})", _ratio3(c[RATIO])
        print(f"  {what:46} {diff:>9}  ({sides}): {noise_word(c['within_noise'])}")
        if c["figure"] != HEADLINE:
            biased = report["systems"].get(LETO, {}).get(TRIAL_MIN_RATIO)
            print(
                f"    against the fastest of the other systems' runs in each trial (selection-biased): "
                f"{_ratio3(biased)}"
            )


def print_table(report: dict) -> None:
    cfg = report["config"]
    n = cfg["trials"]
    print(
        f"leto bench productivity: {cfg['steps']} steps of the {cfg['model']} job, {cfg['workers']} workers on "
        f"{cfg['nodes']} nodes, {n} trial{'' if n == 1 else 's'}; {cfg['failures']} worker SIGKILLs per run "
        f"(seed {cfg['seed']}) after steps {', '.join(str(k['step']) for k in cfg['kills']) or '-'}, the same for "
        "every system in every trial"
    )
    rc = cfg.get("rank_cpu") or {}
    if rc.get("cpu_per_rank") is not None:
        print(
            f"each process that runs a rank capped at {rc['cpu_per_rank']:g} CPU ({rc['why']}, cgroup {rc['cgroup']}): "
            "a job that shrinks loses its lost ranks' hardware, as on a GPU cluster"
        )
    else:
        print(f"rank processes not capped ({rc.get('why')}): a job that shrinks keeps every core")
    for e in cfg.get("capacity_errors") or []:
        print(f"  capping: {e}")
    print(f"medians of {n} trials, [min..max] beside them" if n > 1 else "one trial: no medians, no spread")
    head = (
        f"  {'system':20} {'productivity':>22} {'leto +pp':>20} {'failure-free run':>20} {'/ fastest peer':>20} "
        f"{'with failures':>20} {'failures':>8} {'trials':>6}"
    )
    print(head)
    secondary = []
    for name, s in report["systems"].items():
        if s.get("status"):
            print(f"  {name}: {s['status']}")
            continue
        sp, k = s["spread"], len(s["trials"])
        d = report["difference_pp"].get(name)
        lead = "" if name == LETO else _with_spread(_pp, d, report["spread"]["difference_pp"].get(name), n)
        print(
            f"  {name:20} {_with_spread(_pct, s[HEADLINE], sp[HEADLINE], k):>22} {lead:>20} "
            f"{_with_spread(_sec, s['failure_free_run_s'], sp['failure_free_run_s'], k):>20} "
            f"{_with_spread(_ratio_txt, s[RATIO], sp[RATIO], k):>20} "
            f"{_with_spread(_sec, s['wall_s'], sp['wall_s'], k):>20} {_num(s['failures']):>8} "
            f"{s['trials_ok']:>3}/{k:<2}"
        )
        d_in = "" if name == LETO else _pp(report[DIFFERENCES[IN_RUN]].get(name))
        d_own = "" if name == LETO else _pp(report[DIFFERENCES[OWN]].get(name))
        secondary.append(
            f"  {name:20} {_with_spread(_pct, s[IN_RUN], sp[IN_RUN], k):>22} {d_in:>9} "
            f"{_with_spread(_pct, s[OWN], sp[OWN], k):>22} {d_own:>9}"
        )
    print(
        "productivity = the fastest failure-free run of any system in the same trial (launch -> last step) / the\n"
        "  system's wall time with failures: it charges start-up, protection, checkpoint writes and the failures\n"
        "leto +pp: per trial Leto's productivity minus the system's, then the median\n"
        "failure-free run: launch -> the run returned; / fastest peer: per trial, that over the same trial's run of\n"
        "  the other system with the smallest median run, then the median; with failures: launch -> last step of\n"
        "  the work; trials: trials that measured the productivity / trials run"
    )
    print(
        "\nsecondary estimates, both EXCLUDE per-step costs (protection, checkpoint writes): they charge only "
        "the failures"
    )
    print(f"  {'system':20} {'in-run estimate':>22} {'leto +pp':>9} {'vs own failure-free':>22} {'leto +pp':>9}")
    for line in secondary:
        print(line)
    print_comparisons(report)
    print("\ntargets (measured in this run; a lead must hold in every trial):")
    for t in report["targets"]:
        fmt = _ratio3 if t["name"] == RATIO else _pp
        trials = ", ".join(fmt(v) for v in t["per_trial"]) or "-"
        noise = "" if t["within_noise"] is None else f"; {noise_word(t['within_noise'])}"
        print(
            f"  {t['result']:12} {t['name']:34} target {t['target']:>9}: median {fmt(t['measured'])}, trials "
            f"[{trials}], met in {t['trials_met']}/{t['trials']}{noise}"
        )
    print(f"\nplot: {', '.join(report['plots']) or '-'}\nraw results: {report['json']}")


def build_report(
    cfg: JobConfig,
    all_runs: list[dict[str, dict[str, Run]]],
    names: list[str],
    *,
    specs: list[dict],
    orders: list[list[str]] | None = None,
    torchft: str | None = None,
    info: dict | None = None,
    rank_cpu: dict | None = None,
) -> dict:
    """The JSON document (less `json` and `plots`) from every trial's runs: `config`, `definitions`,
    `systems` (medians, spreads, raw trials; in the order of `names`), Leto's differences (medians
    and spreads), `trials` (order, fastest failure-free run, differences of each trial), `targets`.
    `torchft`: why torchft did not run (None: installed)."""
    orders = orders or [list(runs["failure-free"]) for runs in all_runs]
    per_trial = [{"trial": i + 1, "order": orders[i], **summarize_trial(cfg, r, names)} for i, r in enumerate(all_runs)]
    report: dict = {
        "bench": "productivity",
        "machine": info or {},
        "config": {
            "workers": cfg.workers,
            "nodes": cfg.nodes,
            "model": cfg.model,
            "steps": cfg.steps,
            "failures": len(specs),
            "seed": SCHEDULE_SEED,
            "trials": len(all_runs),
            "kills": specs,
            "ckpt_mtbf_s": cfg.mtbf_s,
            "schedule": schedule_words(len(specs), cfg.steps),
            "order": "each trial: per system in turn, its failure-free run then its run with "
            "failures; the order of the systems rotates by one per trial",
            "rank_cpu": rank_cpu or {"cpu_per_rank": cfg.cpu_per_rank, "cgroup": None, "why": None},
            "capacity_errors": sorted(
                {
                    e
                    for runs in all_runs
                    for by in runs.values()
                    for r in by.values()
                    for e in (r.capacity or {}).get("errors", [])
                }
            ),
        },
        "torchft": torchft or "installed",
        "definitions": DEFINITIONS,
        **aggregate(per_trial, names),
    }
    measured = report["systems"]
    report["systems"] = {
        n: measured.get(n)
        or {
            "status": torchft if n == "torchft" and torchft else "not run",
            **{k: None for k in PER_TRIAL},
            "trials": [],
        }
        for n in names
    }
    for n in (n for n in names if n != LETO):  # a peer that never ran: no difference, no spread
        for key in DIFFERENCES.values():
            report[key].setdefault(n, None)
            report["spread"][key].setdefault(n, None)
    peers = [n for n in names if n != LETO]
    report["comparisons"] = comparisons(report, peers)
    verdicts = targets(report, peers)
    head = ("bench", "machine", "config", "torchft", "definitions")  # the targets right after the definitions
    return {**{k: report[k] for k in head}, "targets": verdicts, **{k: v for k, v in report.items() if k not in head}}


_ITEM = r'(?:-?[\d.e+-]+|null|"[^"\n\[\]{},]*")'
_SHORT_LIST = re.compile(rf"\[\s*({_ITEM}(?:,\s*{_ITEM})*)\s*\]")


def dumps(report: dict) -> str:
    """The JSON document, indented, with lists of numbers or names ([min, max], a trial's order)
    on one line."""
    return _SHORT_LIST.sub(lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]", json.dumps(report, indent=1))


def rank_cpu_setting(flag: str | None, ranks: int) -> dict:
    """`--rank-cpu` as {"cpu_per_rank": CPUs or None, "cgroup": "v1"/"v2"/None, "why": ...}:
    auto (the default) shares the machine's cores among the ranks where cgroups allow it."""
    flag = "auto" if flag is None else flag
    if flag == "off":
        return {"cpu_per_rank": None, "cgroup": None, "why": "--rank-cpu off"}
    found = capacity.hierarchy()
    if flag == "auto":
        if isinstance(found, str):
            return {"cpu_per_rank": None, "cgroup": None, "why": found}
        share, why = capacity.cores() / ranks, f"{capacity.cores()} cores / {ranks} ranks"
    else:
        try:
            share = float(flag)
        except ValueError:
            share = -1.0
        if not 0 < share <= capacity.cores():
            raise UsageError(
                f"leto bench productivity: error: --rank-cpu must be auto, off or a number of CPUs in "
                f"(0, {capacity.cores()}], got {flag!r}"
            )
        if isinstance(found, str):
            raise UsageError(f"leto bench productivity: error: --rank-cpu {flag}: {found}")
        why = "--rank-cpu"
    return {"cpu_per_rank": round(share, 4), "cgroup": found[1], "why": why}


def main(args: argparse.Namespace) -> int:
    refuse_tp(args, "productivity")
    steps = args.steps or DEFAULT_STEPS
    trials = getattr(args, "trials", None) or DEFAULT_TRIALS
    failures = getattr(args, "failures", None)
    failures = DEFAULT_FAILURES if failures is None else failures
    if failures < 0:
        raise UsageError(f"leto bench productivity: error: --failures must be at least 0, got {failures}")
    if failures > max_failures(steps):
        raise UsageError(
            f"leto bench productivity: error: --failures {failures} do not fit in {steps} steps: at most "
            f"{max_failures(steps)} (the first after step {FIRST_KILL_STEP}, {MIN_GAP_STEPS} steps apart, the last "
            f"{MIN_GAP_STEPS} steps before the end); give fewer --failures or more --steps"
        )
    nodes = min(2, args.workers)
    rank_cpu = rank_cpu_setting(getattr(args, "rank_cpu", None), args.workers)
    cfg = JobConfig(
        workers=args.workers,
        nodes=nodes,
        steps=steps,
        model=args.model,
        mtbf_s=DEFAULT_MTBF_S,
        cpu_per_rank=rank_cpu["cpu_per_rank"],
    )
    if rank_cpu["cpu_per_rank"] is None:
        log(f"leto bench productivity: rank processes not capped: {rank_cpu['why']}")
    out = Path(args.out) if args.out else default_out("productivity")
    out.mkdir(parents=True, exist_ok=True)
    tf, nv = torchft_status(), nvrx_status()
    systems = [s for s in SYSTEMS if not (s.kind == "torchft" and tf is not None) and not (s.kind == "nvrx" and nv)]
    names = [s.name for s in SYSTEMS]
    for name, why in (("torchft", tf), ("nvrx", nv)):
        if why is not None:
            log(f"{name}: {why}")
    specs = failure_schedule(failures, steps, SCHEDULE_SEED, args.workers)
    info = machine()
    try:
        with stdout_to_stderr():
            all_runs, orders = run_all(cfg, out, systems, specs, trials)
    except BenchInterrupted as e:
        log(f"leto bench productivity: {e}; stopped")
        return 130
    info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    report = build_report(cfg, all_runs, names, specs=specs, orders=orders, torchft=tf, info=info, rank_cpu=rank_cpu)
    report["json"] = str(out / "productivity.json")
    report["plots"] = make_plot(out, report, all_runs, PRESETS[cfg.model].batch_size * PRESETS[cfg.model].block_size)
    Path(report["json"]).write_text(dumps(report))
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return 0 if report["systems"].get(LETO, {}).get(HEADLINE) is not None else 1
