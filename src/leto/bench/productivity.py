"""`leto bench productivity`: the same training work under the same failures, per system.

Work: `steps` steps of the built-in GPT job. Failures: a Poisson process (MTBF in seconds of
failure-free training, time compressed), seeded, each a SIGKILL of a seeded random worker,
injected from outside by PID (`leto.bench.faults`). Each failure time is mapped onto training
progress - the step the first failure-free run (Leto's) had completed that many seconds after its
start - so every system loses the same workers at the same steps: on a shared machine a
time-based schedule gives a system that happens to run in a quiet minute fewer failures.

Each system runs the work failure-free and then with the failures, back to back; the systems take
turns (A, A', B, B', ...). productive fraction = failure-free time of the work / wall time of the
work with failures, with three estimates of the failure-free time:

* `productivity` (headline): the failed run's own, from its records (`runs.in_run_failure_free_s`:
  its wall time less what each failure cost, measured around each kill against the pre-failure
  step time) - under the same load as the run it is compared with; on this shared machine the
  load changed a run's speed up to 2.5x between two runs minutes apart;
* `productivity_vs_fastest`: the fastest system's failure-free run, the same for all (charges
  per-step overheads such as checkpoint writes or protection as lost time, but also any
  difference in load between the two runs);
* `productivity_own`: the system's own failure-free run (the run just before it).
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

from leto.bench import plots
from leto.bench.faults import Injector
from leto.bench.runs import (DEFAULT_MTBF_S, LETO, BenchInterrupted, JobConfig, NoInjector, Run, ScheduledKill,
                             System, default_out, failure_schedule, in_run_failure_free_s, kill_steps, log, machine,
                             productive_fraction, run_system, stdout_to_stderr, torchft_status, work_time_s)
from leto.training.model import PRESETS

DEFAULT_STEPS = 240
SCHEDULE_SEED = 0
HORIZON_S = 3600.0
SYSTEMS = (System(LETO, LETO, 1), System("checkpoint-restart", "checkpoint-restart"),
           System("memory-restart", "memory-restart"), System("torchft", "torchft"))
REFERENCES = ("productivity", "productivity_vs_fastest", "productivity_own")
DIFFERENCES = ("difference_pp", "difference_pp_vs_fastest", "difference_pp_own")


def pp(a: float | None, b: float | None) -> float | None:
    """a - b in percentage points."""
    return None if a is None or b is None else round(100.0 * (a - b), 2)


def run_all(cfg: JobConfig, out: Path, systems: list[System],
            schedule: list[ScheduledKill]) -> tuple[dict[str, dict[str, Run]], list[dict]]:
    """Per system in turn: the failure-free run, then the run with the kills. The kill steps come
    from the first failure-free run. Returns the runs and the kills (faults.Injector specs)."""
    runs: dict[str, dict[str, Run]] = {"failure-free": {}, "failures": {}}
    specs: list[dict] | None = None
    timeout_s = 120.0 + 20.0 * cfg.steps
    for system in systems:
        free = run_system(system, cfg, out / "runs" / f"failure-free-{system.name}", NoInjector(),
                          limit_s=120.0 + 2.0 * cfg.steps)
        runs["failure-free"][system.name] = free
        _log_run(system.name, "failure-free", free, cfg.steps)
        if specs is None:
            if work_time_s(free.records, free.t_start, cfg.steps) is None:
                log(f"[productivity] {system.name}'s failure-free run did not finish the work: no schedule")
                return runs, []
            specs = kill_steps(schedule, free.records, free.t_start, cfg.steps)
        run_dir = out / "runs" / f"failures-{system.name}"
        ff_s = work_time_s(free.records, free.t_start, cfg.steps) or 2.0 * cfg.steps
        run = run_system(system, replace(cfg, max_restarts=len(specs) + 3), run_dir,
                         Injector(run_dir, specs, timeout_s=timeout_s), limit_s=120.0 + 4.0 * ff_s + 30.0 * len(specs))
        runs["failures"][system.name] = run
        _log_run(system.name, "failures", run, cfg.steps)
    return runs, specs or []


def _log_run(name: str, phase: str, run: Run, steps: int) -> None:
    wall = work_time_s(run.records, run.t_start, steps)
    log(f"[productivity] {name:18} {phase:12} "
        + (f"{steps} steps in {wall:.1f} s, {len(run.kills)} failures" if wall is not None
           else f"did not finish the work: {run.error}"))


def summarize(cfg: JobConfig, runs: dict[str, dict[str, Run]]) -> dict:
    """Per system: failure-free and faulty times of the work, failures seen, productive fractions.

    The time of the work is start -> step `steps` first recorded, whatever happens after it (a
    run's exit code is reported, but a failure after the work was done does not void it)."""
    free = {n: work_time_s(r.records, r.t_start, cfg.steps) for n, r in runs["failure-free"].items()}
    known = {n: t for n, t in free.items() if t is not None}
    fastest = min(known, key=lambda n: known[n]) if known else None
    ref = known.get(fastest) if fastest else None
    systems: dict[str, dict] = {}
    for name, run in runs["failures"].items():
        wall = work_time_s(run.records, run.t_start, cfg.steps)
        kills = [k for k in run.kills if wall is None or k.time <= run.t_start + wall]
        ff = runs["failure-free"].get(name)
        in_run = in_run_failure_free_s(run.records, run.t_start, cfg.steps, [k.time for k in kills])
        systems[name] = {
            "failure_free_s": free.get(name), "wall_s": wall, "failures": len(kills), "in_run_failure_free_s": in_run,
            "productivity": productive_fraction(in_run, wall),
            "productivity_vs_fastest": productive_fraction(ref, wall),
            "productivity_own": productive_fraction(free.get(name), wall),
            "ok": wall is not None, "error": run.error, "failure_free_error": ff.error if ff else None,
            "kills": [{"at_s": round(k.time - run.t_start, 3), "rank": k.spec.get("rank"), "step": k.spec.get("step"),
                       "after_step": k.step} for k in kills],
            "run_dir": str(run.run_dir), "failure_free_run_dir": str(ff.run_dir) if ff else None}
    leto = systems.get(LETO, {})
    diffs = {key: {n: pp(leto.get(key), s[key]) for n, s in systems.items() if n != LETO} for key in REFERENCES}
    return {"reference": {"headline": "productivity: the failure-free time of the failed run itself, estimated "
                                      "from its step records (its wall time less what each failure cost)",
                          "fastest": {"failure_free_s": ref, "system": fastest},
                          "own": "productivity_own: each system's own failure-free run (the run just before it)"},
            "systems": systems, **{d: diffs[k] for d, k in zip(DIFFERENCES, REFERENCES)}}


def make_plot(out: Path, report: dict, runs: dict[str, dict[str, Run]], tokens: int) -> list[str]:
    col = []
    right = 0.0
    for name, s in report["systems"].items():
        run = runs["failures"].get(name)
        if run is None:
            continue
        prod = "-" if s["productivity"] is None else f"{100 * s['productivity']:.1f} %"
        n = s["failures"]
        title = (f"{name}: {prod} productive, {n} failure{'' if n == 1 else 's'}, work done in "
                 + ("-" if s["wall_s"] is None else f"{s['wall_s']:.0f} s")
                 + ("" if s["in_run_failure_free_s"] is None
                    else f" ({s['in_run_failure_free_s']:.0f} s without them)"))
        end = run.t_end if s["wall_s"] is None else run.t_start + s["wall_s"]
        marks = [] if s["wall_s"] is None else [(end, "done")]
        steps = [r for r in run.steps() if r["time"] <= end]  # not what a restart did after the work
        col.append(plots.Panel(title, steps, run.t_start, [k.time for k in run.kills if k.time <= end], marks))
        right = max(right, end - run.t_start)
    if not col:
        return []
    cfg = report["config"]
    path = plots.timeline([col], [f"{cfg['steps']} steps, {len(cfg['kills'])} worker kills at the same steps "
                                  f"(Poisson, MTBF {cfg['mtbf_s']:g} s)"], tokens,
                          out / "productivity-timeline.png", "Tokens/s over wall time, same work, same failures",
                          "seconds since the start of the run", xlim=(0.0, right * 1.03))
    return [str(path)]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _sec(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}s"


def _pp(x: float | None) -> str:
    return "" if x is None else f"{x:+.1f}"


def print_table(report: dict) -> None:
    cfg, ref = report["config"], report["reference"]["fastest"]
    print(f"leto bench productivity: {cfg['steps']} steps of the {cfg['model']} job, {cfg['workers']} workers on "
          f"{cfg['nodes']} nodes; {len(cfg['kills'])} worker SIGKILLs (Poisson, MTBF {cfg['mtbf_s']:g} s, seed "
          f"{cfg['seed']}) after steps {', '.join(str(k['step']) for k in cfg['kills']) or '-'}")
    print(f"  {'system':20} {'failures':>8} {'wall':>8} {'free':>8} {'productive':>10} {'leto +pp':>9} "
          f"{'vs fastest':>10} {'leto +pp':>9} {'own ref':>8} {'leto +pp':>9}")
    for name, s in report["systems"].items():
        if s.get("status"):
            print(f"  {name}: {s['status']}")
            continue
        d = [report[k].get(name) for k in DIFFERENCES]
        print(f"  {name:20} {s['failures']:>8} {_sec(s['wall_s']):>8} {_sec(s['in_run_failure_free_s']):>8} "
              f"{_pct(s['productivity']):>10} {_pp(d[0]):>9} {_pct(s['productivity_vs_fastest']):>10} {_pp(d[1]):>9} "
              f"{_pct(s['productivity_own']):>8} {_pp(d[2]):>9}" + ("" if s["ok"] else f"  FAILED: {s['error']}"))
    fastest = "-" if ref["failure_free_s"] is None else f"{ref['system']}, {ref['failure_free_s']:.1f} s"
    print(f"productive = failure-free time of the work / wall time with failures; failure-free time ('free'): "
          f"the run's own, less what its failures cost; vs fastest: the fastest failure-free run ({fastest}); "
          f"own ref: the system's own failure-free run. leto +pp: Leto's fraction minus the system's")
    print(f"plot: {', '.join(report['plots'])}\nraw results: {report['json']}")


def main(args: argparse.Namespace) -> int:
    steps = args.steps or DEFAULT_STEPS
    nodes = min(2, args.workers)
    cfg = JobConfig(workers=args.workers, nodes=nodes, steps=steps, model=args.model, mtbf_s=DEFAULT_MTBF_S)
    out = Path(args.out) if args.out else default_out("productivity")
    out.mkdir(parents=True, exist_ok=True)
    tf = torchft_status()
    systems = [s for s in SYSTEMS if not (s.kind == "torchft" and tf is not None)]
    if tf is not None:
        log(f"torchft: {tf}")
    schedule = failure_schedule(DEFAULT_MTBF_S, HORIZON_S, SCHEDULE_SEED, args.workers)
    info = machine()
    try:
        with stdout_to_stderr():
            runs, specs = run_all(cfg, out, systems, schedule)
    except BenchInterrupted as e:
        log(f"leto bench productivity: {e}; stopped")
        return 130
    info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    report: dict = {"bench": "productivity", "machine": info,
                    "config": {"workers": cfg.workers, "nodes": cfg.nodes, "model": cfg.model, "steps": steps,
                               "mtbf_s": DEFAULT_MTBF_S, "seed": SCHEDULE_SEED, "trials": 1, "kills": specs,
                               "ckpt_mtbf_s": cfg.mtbf_s,
                               "schedule": "Poisson failure times in seconds of failure-free training, mapped onto "
                                           "the first failure-free run's steps: the same kill steps and ranks for "
                                           "every system",
                               "order": "per system in turn: failure-free run, then the run with failures"},
                    "torchft": tf or "installed", **summarize(cfg, runs)}
    if tf is not None:
        report["systems"]["torchft"] = {"status": tf, **{k: None for k in REFERENCES}}
        for key in DIFFERENCES:
            report[key]["torchft"] = None
    report["json"] = str(out / "productivity.json")
    report["plots"] = make_plot(out, report, runs, PRESETS[cfg.model].batch_size * PRESETS[cfg.model].block_size)
    Path(report["json"]).write_text(json.dumps(report, indent=1))
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return 0 if report["systems"].get(LETO, {}).get("productivity") is not None else 1
