"""`leto bench productivity`: what the headline charges, medians and spread over trials, the
targets, the names of the figures - on synthetic run records - and one short real run.

No test checks a wall-clock value: those depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from conftest import beyond_ci
from leto import cli
from leto.baselines.faults import Kill
from leto.bench import noise, productivity, runs
from leto.bench.productivity import (
    HEADLINE,
    IN_RUN,
    OWN,
    RATIO,
    TRIAL_MIN_RATIO,
    WORK_RATIO,
    aggregate,
    build_report,
    summarize_trial,
)
from leto.bench.runs import (
    FIRST_KILL_STEP,
    MIN_GAP_STEPS,
    Run,
    System,
    failure_schedule,
    max_failures,
    productive_fraction,
    work_time_s,
)
from leto.config import PersistenceConfig

NAMES = ["leto", "checkpoint-restart", "memory-restart", "torchft"]
CFG = runs.JobConfig(steps=100)


def steps_every(start_step: int, n: int, t0: float, step_s: float) -> list[dict]:
    """n step records, one every step_s seconds, the first ending at t0."""
    return [{"step": start_step + i, "step_s": step_s, "time": t0 + i * step_s, "loss": 3.0} for i in range(n)]


def run(
    name: str,
    t0: float,
    work_s: float,
    *,
    steps: int = 100,
    exit_s: float | None = None,
    kills: int = 0,
    ok: bool = True,
) -> Run:
    """A run launched at t0 whose last step of the work (`steps`) is recorded `work_s` later and
    which returned `exit_s` after launch (default: 1 s after the work); `kills` SIGKILLs at
    t0 + 1, 2, ... s."""
    recs = [{"step": steps, "step_s": 0.1, "time": t0 + work_s}]
    ks = [Kill({"kind": "kill", "rank": 1, "step": 3}, t0 + 1.0 + i, 3) for i in range(kills)]
    end = t0 + (work_s + 1.0 if exit_s is None else exit_s)
    return Run(name, Path(f"/nonexistent/{name}"), t0, end, 0 if ok else 1, None if ok else "exit code 1", {}, recs, ks)


def trial(
    free: dict[str, float], faulty: dict[str, float], exits: dict[str, float] | None = None, kills: int = 2
) -> dict[str, dict[str, Run]]:
    """One trial's runs from {system: work time} of its failure-free runs and of its runs with
    failures (and optionally {system: launch -> exit} of the failure-free runs)."""
    exits = exits or {}
    return {
        "failure-free": {n: run(n, 0.0, t, exit_s=exits.get(n)) for n, t in free.items()},
        "failures": {n: run(n, 1000.0, t, kills=kills) for n, t in faulty.items()},
    }


# ----- the headline
def test_headline_is_the_fastest_failure_free_run_of_any_system_over_the_wall_time_with_failures() -> None:
    """Leto's failure-free run took 50 s, checkpoint-restart's 40 s: the work can be done in 40 s, so
    Leto's 62.5 s with failures is 64 % productive, checkpoint-restart's 80 s 50 % - the per-step
    cost that made Leto's failure-free run slower is charged, not only its failures."""
    t = summarize_trial(
        CFG, trial({"leto": 50.0, "checkpoint-restart": 40.0}, {"leto": 62.5, "checkpoint-restart": 80.0}), NAMES
    )
    assert t["fastest_failure_free"] == {"system": "checkpoint-restart", "work_s": 40.0}
    leto, cr = t["systems"]["leto"], t["systems"]["checkpoint-restart"]
    assert leto[HEADLINE] == pytest.approx(40.0 / 62.5)
    assert cr[HEADLINE] == pytest.approx(40.0 / 80.0)
    assert t["difference_pp"] == {"checkpoint-restart": pytest.approx(100 * (40.0 / 62.5 - 0.5), abs=0.01)}


def test_the_fastest_system_is_measured_against_itself() -> None:
    t = summarize_trial(
        CFG, trial({"leto": 30.0, "memory-restart": 40.0}, {"leto": 37.5, "memory-restart": 50.0}), NAMES
    )
    assert t["fastest_failure_free"]["system"] == "leto"
    assert t["systems"]["leto"][HEADLINE] == pytest.approx(0.8)
    assert t["systems"]["memory-restart"][HEADLINE] == pytest.approx(0.6)


def test_secondary_figures_are_named_for_what_they_leave_out() -> None:
    """Both secondary estimates compare a system with its own speed, so its per-step costs are
    not charged; their names say so, and the old ambiguous names are gone."""
    s = summarize_trial(
        CFG, trial({"leto": 50.0, "checkpoint-restart": 40.0}, {"leto": 62.5, "checkpoint-restart": 80.0}), NAMES
    )["systems"]["leto"]
    figures = {k for k in s if k.startswith("productivity")}
    assert figures == {HEADLINE, IN_RUN, OWN}
    assert IN_RUN.endswith("excludes_per_step_costs") and OWN.endswith("excludes_per_step_costs")
    assert s[OWN] == pytest.approx(50.0 / 62.5)  # its own failure-free run
    assert s[IN_RUN] == pytest.approx(s["in_run_failure_free_s"] / 62.5)  # its own steps in the same run
    for old in ("productivity_vs_fastest", "productivity_own"):
        assert old not in s


def test_secondary_differences_are_reported_under_their_own_names() -> None:
    t = summarize_trial(
        CFG, trial({"leto": 50.0, "checkpoint-restart": 40.0}, {"leto": 62.5, "checkpoint-restart": 80.0}), NAMES
    )
    assert t["difference_pp_vs_own_failure_free_run_excludes_per_step_costs"]["checkpoint-restart"] == pytest.approx(
        100 * (50.0 / 62.5 - 40.0 / 80.0), abs=0.01
    )
    assert "difference_pp_in_run_estimate_excludes_per_step_costs" in t
    assert "difference_pp_vs_fastest" not in t and "difference_pp_own" not in t


# ----- the failure-free run against the fastest peer
def trials_of(*trials: dict[str, dict[str, Run]]) -> dict:
    """`aggregate` of the trials' summaries, numbered from 1."""
    summaries = [{"trial": i + 1, "order": NAMES, **summarize_trial(CFG, t, NAMES)} for i, t in enumerate(trials)]
    return aggregate(summaries, NAMES)


def test_failure_free_ratio_is_the_whole_run_against_the_fastest_other_system() -> None:
    """The whole run counts, launch to exit (start-up, the work, shutdown): Leto's work is done in
    30 s but it exits at 36 s; memory-restart exits at 32 s, checkpoint-restart at 40 s."""
    s = trials_of(
        trial(
            {"leto": 30.0, "memory-restart": 30.0, "checkpoint-restart": 35.0},
            {},
            exits={"leto": 36.0, "memory-restart": 32.0, "checkpoint-restart": 40.0},
        )
    )["systems"]
    assert s["leto"]["failure_free_run_s"] == pytest.approx(36.0)
    assert s["leto"]["failure_free_work_s"] == pytest.approx(30.0)
    assert s["leto"][RATIO] == pytest.approx(36.0 / 32.0, abs=1e-4)
    assert s["leto"][WORK_RATIO] == pytest.approx(1.0)
    assert s["leto"]["fastest_peer"] == {RATIO: "memory-restart", WORK_RATIO: "memory-restart"}
    assert s["memory-restart"][RATIO] == pytest.approx(32.0 / 36.0, abs=1e-4)  # the fastest: below 1
    assert s["checkpoint-restart"][RATIO] == pytest.approx(40.0 / 32.0, abs=1e-4)


def test_the_fastest_peer_is_one_system_compared_trial_by_trial_not_the_least_run_of_each_trial() -> None:
    """Three systems exactly as fast as one another but for the machine's noise: the least of the
    two peers' runs in each trial is below Leto's in two trials of three by noise alone, so that
    figure charges Leto for the noise (1.086). Compared with one peer, the one with the smallest
    median run (checkpoint-restart, 38 s against 39 s), in the same trials, the median is 1.0."""
    runs_ = {"leto": [38.0, 40.0, 36.0], "checkpoint-restart": [38.0, 35.0, 46.0], "memory-restart": [35.0, 46.0, 39.0]}
    s = trials_of(
        *(
            trial({n: t[i] - 1.0 for n, t in runs_.items()}, {}, exits={n: t[i] for n, t in runs_.items()})
            for i in range(3)
        )
    )["systems"]
    leto = s["leto"]
    assert leto["fastest_peer"][RATIO] == "checkpoint-restart"
    assert [r[RATIO] for r in leto["trials"]] == pytest.approx([1.0, 40.0 / 35.0, 36.0 / 46.0], abs=1e-4)
    assert leto[RATIO] == pytest.approx(1.0) and leto["spread"][RATIO] == pytest.approx([36 / 46, 40 / 35], abs=1e-4)
    assert [r[TRIAL_MIN_RATIO] for r in leto["trials"]] == pytest.approx([38 / 35, 40 / 35, 36 / 39], abs=1e-4)
    assert leto[TRIAL_MIN_RATIO] == pytest.approx(38 / 35, abs=1e-4)  # the selection's bias


def test_a_failure_free_run_that_did_not_end_cleanly_has_no_run_time() -> None:
    runs_ = trial({"leto": 30.0, "memory-restart": 25.0}, {})
    runs_["failure-free"]["memory-restart"] = run("memory-restart", 0.0, 25.0, exit_s=26.0, ok=False)
    s = trials_of(runs_)["systems"]
    assert s["memory-restart"]["failure_free_run_s"] is None and s["memory-restart"][RATIO] is None
    assert s["leto"][RATIO] is None and s["leto"]["fastest_peer"][RATIO] is None  # no peer with a clean run
    assert s["memory-restart"]["failure_free_work_s"] == pytest.approx(25.0)  # its work still counts
    assert s["leto"][WORK_RATIO] == pytest.approx(30.0 / 25.0)


# ----- trials: medians and spread
THREE_TRIALS = [
    trial({"leto": 50.0, "checkpoint-restart": 40.0}, {"leto": 50.0, "checkpoint-restart": 80.0}),  # 80 %, 50 %
    trial({"leto": 60.0, "checkpoint-restart": 30.0}, {"leto": 50.0, "checkpoint-restart": 54.5}),  # 60 %, 55 %
    trial({"leto": 35.0, "checkpoint-restart": 63.0}, {"leto": 50.0, "checkpoint-restart": 39.0}),  # 70 %, 90 %
]


def test_figures_are_medians_over_trials_with_their_min_and_max() -> None:
    rep = build_report(CFG, THREE_TRIALS, NAMES, specs=[])
    leto, cr = rep["systems"]["leto"], rep["systems"]["checkpoint-restart"]
    assert [t[HEADLINE] for t in leto["trials"]] == pytest.approx([0.8, 0.6, 0.7])
    assert leto[HEADLINE] == pytest.approx(0.7) and leto["spread"][HEADLINE] == pytest.approx([0.6, 0.8])
    assert cr[HEADLINE] == pytest.approx(30.0 / 54.5, abs=1e-4)
    assert cr["spread"][HEADLINE] == pytest.approx([0.5, 35.0 / 39.0], abs=1e-4)
    assert leto["failure_free_work_s"] == pytest.approx(50.0)
    assert leto["spread"]["failure_free_work_s"] == pytest.approx([35.0, 60.0])
    assert leto["trials_ok"] == 3 and [t["trial"] for t in leto["trials"]] == [1, 2, 3]
    assert rep["config"]["trials"] == 3 and len(rep["trials"]) == 3


def test_leto_lead_is_the_median_of_the_per_trial_differences() -> None:
    """Each trial's difference compares two runs measured against the same fastest run; the
    median of those (+30, +4.95, -19.74 pp) is not the difference of the medians (70 % - 55 %)."""
    rep = build_report(CFG, THREE_TRIALS, NAMES, specs=[])
    per_trial = [t["difference_pp"]["checkpoint-restart"] for t in rep["trials"]]
    assert per_trial == pytest.approx([30.0, 100 * (0.6 - 30.0 / 54.5), 100 * (0.7 - 35.0 / 39.0)], abs=0.01)
    assert rep["difference_pp"]["checkpoint-restart"] == pytest.approx(sorted(per_trial)[1])
    assert rep["spread"]["difference_pp"]["checkpoint-restart"] == pytest.approx([min(per_trial), max(per_trial)])


def test_the_representative_trial_is_the_median_headline() -> None:
    rep = build_report(CFG, THREE_TRIALS, NAMES, specs=[])
    assert rep["systems"]["leto"]["representative_trial"] == 3  # 70 % of 80, 60, 70
    assert rep["systems"]["checkpoint-restart"]["representative_trial"] == 2


def test_a_run_that_did_not_finish_has_no_productivity_and_is_left_out_of_the_median() -> None:
    trials = [trial({"leto": 50.0}, {"leto": 62.5}), trial({"leto": 50.0}, {"leto": 100.0})]
    trials[1]["failures"]["leto"] = run("leto", 1000.0, 80.0, steps=99)  # step 100 never recorded
    rep = build_report(CFG, trials, NAMES, specs=[])
    leto = rep["systems"]["leto"]
    assert leto["trials"][1][HEADLINE] is None and not leto["trials"][1]["ok"]
    assert leto[HEADLINE] == pytest.approx(0.8) and leto["trials_ok"] == 1


def test_failures_after_the_work_is_done_do_not_count() -> None:
    runs_ = {
        "failure-free": {"leto": run("leto", 0.0, 50.0)},
        "failures": {"leto": run("leto", 0.0, 1.5, kills=3, ok=False)},
    }  # kills at 1, 2, 3 s; done at 1.5 s
    s = summarize_trial(CFG, runs_, NAMES)["systems"]["leto"]
    assert s["failures"] == 1 and s["ok"] and s["error"] == "exit code 1"


def test_the_order_of_the_systems_rotates_from_trial_to_trial() -> None:
    systems = [System(n, n) for n in ("a", "b", "c")]
    assert [[s.name for s in productivity.trial_order(systems, t)] for t in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]


# ----- targets: measured, never assumed; a lead must hold in every trial
def _report_with(ratios: list[float | None], leads: dict[str, list[float | None]]) -> dict:
    """A report of len(ratios) trials: Leto's per-trial failure-free ratio and per-trial leads."""
    med = runs.median(ratios)
    return {
        "systems": {"leto": {RATIO: med, "trials": [{RATIO: r} for r in ratios]}},
        "difference_pp": {n: runs.median(d) for n, d in leads.items()},
        "trials": [{"difference_pp": {n: d[i] for n, d in leads.items()}} for i in range(len(ratios))],
    }


def test_a_lead_must_hold_in_every_trial_not_only_in_the_median() -> None:
    """checkpoint-restart: +12, +15, +9 pp - a median lead of 12 pp, but one trial under 10: MISS.
    memory-restart: ahead in every trial, if only by 0.5 pp: met."""
    peers = ["checkpoint-restart", "memory-restart"]
    got = productivity.targets(
        _report_with([1.0, 1.0, 1.0], {"checkpoint-restart": [12.0, 15.0, 9.0], "memory-restart": [0.5, 3.0, 1.0]}),
        peers,
    )
    cr, mr = got[1], got[2]
    assert (cr["name"], cr["measured"], cr["result"], cr["trials_met"]) == (
        "difference_pp[checkpoint-restart]",
        12.0,
        "MISS",
        2,
    )
    assert cr["per_trial"] == [12.0, 15.0, 9.0]
    assert (mr["result"], mr["trials_met"], mr["trials"]) == ("met", 3, 3)
    tie = productivity.targets(_report_with([1.0], {"memory-restart": [0.0]}), ["memory-restart"])[1]
    assert tie["result"] == "MISS"  # level is not ahead


def test_the_failure_free_ratio_is_judged_on_the_median_of_the_trials() -> None:
    got = productivity.targets(_report_with([1.01, 1.05, 1.02], {}), [])[0]
    assert (got["measured"], got["result"], got["trials_met"]) == (1.02, "met", 2)
    got = productivity.targets(_report_with([1.0345, 1.04, 1.0], {}), [])[0]
    assert got["result"] == "MISS" and got["measured"] == pytest.approx(1.0345)  # not rounded into a pass
    assert productivity.targets(_report_with([None, None], {}), [])[0]["result"] == "NOT MEASURED"


def test_a_target_missing_from_some_trials_is_never_met() -> None:
    """A run that failed in one trial: the targets are not met on the trials that happened to work;
    a measured trial that missed is a MISS all the same."""
    got = productivity.targets(
        _report_with([1.0, 1.0, None], {"checkpoint-restart": [30.0, None, 20.0], "torchft": [5.0, None, -1.0]}),
        ["checkpoint-restart", "torchft"],
    )
    assert [(t["result"], t["trials_measured"], t["trials"]) for t in got] == [
        ("INCOMPLETE", 2, 3),
        ("INCOMPLETE", 2, 3),
        ("MISS", 2, 3),
    ]
    assert productivity.targets(_report_with([1.0], {"torchft": [None]}), ["torchft"])[1]["result"] == "NOT MEASURED"


def test_a_peer_that_is_not_installed_is_reported_and_not_measured() -> None:
    rep = build_report(CFG, THREE_TRIALS, NAMES, specs=[], torchft="not installed")
    assert rep["systems"]["torchft"]["status"] == "not installed" and rep["systems"]["torchft"][HEADLINE] is None
    assert rep["difference_pp"]["torchft"] is None and rep["spread"]["difference_pp"]["torchft"] is None
    assert rep["systems"]["memory-restart"]["status"] == "not run"
    results = {t["name"]: t["result"] for t in rep["targets"]}
    assert results["difference_pp[torchft]"] == "NOT MEASURED"
    assert results["difference_pp[checkpoint-restart]"] == "MISS"  # +30, +4.95, -19.7 pp: not 10 in every trial
    assert results[RATIO] == "MISS"  # median 51 s / 41 s


# ----- comparisons: within noise when the spreads overlap
def test_within_noise_means_the_ranges_over_repeats_overlap() -> None:
    assert noise.within_noise([0.70, 0.80, 0.75], [0.60, 0.65, 0.70]) is True  # touch at 0.70
    assert noise.within_noise([0.71, 0.80, 0.75], [0.60, 0.65, 0.70]) is False
    assert noise.within_noise([0.60, 0.90], [0.70, 0.72]) is True  # one range inside the other
    assert noise.within_noise([0.8], [0.6, 0.7]) is None  # one repeat: no spread, noise not measured
    assert noise.within_noise([0.8, None], [0.6, 0.7]) is None  # one measured repeat
    assert "overlap" in noise.NOISE_RULE


def test_every_comparison_is_flagged_against_the_spreads() -> None:
    """THREE_TRIALS: Leto 60-80 %, checkpoint-restart 50-90 %: within noise. Failure-free runs: Leto
    36-61 s, checkpoint-restart 31-64 s (the only peer): within noise."""
    rep = build_report(CFG, THREE_TRIALS, NAMES, specs=[], torchft="not installed")
    by = {(c["figure"], c["peer"]): c for c in rep["comparisons"]}
    head = by[(HEADLINE, "checkpoint-restart")]
    assert head["within_noise"] is True and head["leto_spread"] == pytest.approx([0.6, 0.8])
    assert head["difference_pp"] == rep["difference_pp"]["checkpoint-restart"]
    assert by[(HEADLINE, "torchft")]["within_noise"] is None  # not measured
    run = by[("failure_free_run_s", "checkpoint-restart")]
    assert run["within_noise"] is True and run[RATIO] == rep["systems"]["leto"][RATIO]
    target = next(t for t in rep["targets"] if t["name"] == "difference_pp[checkpoint-restart]")
    assert target["within_noise"] is True


def test_a_lead_beyond_the_spreads_is_not_within_noise() -> None:
    trials = [
        trial({"leto": 40.0, "checkpoint-restart": 40.0}, {"leto": 50.0 + i, "checkpoint-restart": 80.0 + i})
        for i in range(3)
    ]
    rep = build_report(CFG, trials, NAMES, specs=[])
    (head,) = [c for c in rep["comparisons"] if c["figure"] == HEADLINE and c["peer"] == "checkpoint-restart"]
    assert head["within_noise"] is False
    results = {t["name"]: t["result"] for t in rep["targets"]}
    assert results["difference_pp[checkpoint-restart]"] == "met"  # about +30 pp in each trial


def test_the_fastest_peer_of_the_comparison_is_the_one_with_the_smallest_median_run() -> None:
    trials = [
        trial(
            {"leto": 30.0, "memory-restart": 25.0 + i, "checkpoint-restart": 20.0 + 10 * i},
            {},
            exits={"leto": 33.0 + i, "memory-restart": 26.0 + i, "checkpoint-restart": 21.0 + 10 * i},
        )
        for i in range(3)
    ]  # memory-restart 26-28 s (median 27), checkpoint-restart 21-41 s (median 31)
    rep = build_report(CFG, trials, NAMES, specs=[])
    (run,) = [c for c in rep["comparisons"] if c["figure"] == "failure_free_run_s"]
    assert run["peer"] == "memory-restart" and run["peer_value"] == pytest.approx(27.0)
    assert run["within_noise"] is False  # Leto 33-35 s


# ----- the printed table and the plot
def test_the_table_leads_with_the_headline_and_shows_medians_with_spread(capsys: pytest.CaptureFixture[str]) -> None:
    rep = build_report(CFG, THREE_TRIALS, NAMES, specs=[], torchft="not installed")
    rep.update(json="productivity.json", plots=[])
    productivity.print_table(rep)
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.strip().startswith("system"))
    assert header.split()[1] == "productivity"  # the first figure is the headline
    leto = next(line for line in out.splitlines() if line.startswith("  leto "))
    assert "70.0% [60.0%..80.0%]" in leto  # median [min..max]
    assert "EXCLUDE per-step costs" in out
    assert "MISS" in out and "failure_free_ratio_to_fastest_peer" in out and "torchft: not installed" in out
    line = next(x for x in out.splitlines() if "productivity vs checkpoint-restart" in x)
    assert line.endswith("within noise") and "70.0% [60.0%..80.0%]" in line
    assert "met in 1/3" in out  # checkpoint-restart: +30 pp in trial 1 only


def test_the_json_file_is_the_report_with_short_lists_on_one_line() -> None:
    rep = build_report(CFG, THREE_TRIALS, NAMES, specs=[], torchft="not installed")
    text = productivity.dumps(rep)
    assert json.loads(text) == json.loads(json.dumps(rep))
    assert '"productivity": [0.6, 0.8]' in text


def test_the_plot_shows_each_systems_median_trial(tmp_path: Path) -> None:
    def timed(name: str, t0: float, first_at: float, step_s: float, kill_at: float | None = None) -> Run:
        recs = steps_every(1, 100, t0 + first_at, step_s)
        kills = [Kill({"kind": "kill", "rank": 1, "step": 50}, t0 + kill_at, 50)] if kill_at else []
        return Run(name, tmp_path / name, t0, t0 + first_at + 100 * step_s + 1, 0, None, {}, recs, kills)

    trials = [
        {
            "failure-free": {n: timed(n, 0.0, 3.0, 0.1) for n in ("leto", "memory-restart")},
            "failures": {n: timed(n, 100.0, 3.0, 0.12, kill_at=8.0) for n in ("leto", "memory-restart")},
        }
    ]
    rep = build_report(CFG, trials, NAMES, specs=[{"kind": "kill", "rank": 1, "step": 50}])
    paths = productivity.make_plot(tmp_path, rep, trials, tokens=1024)
    assert len(paths) == 1 and Path(paths[0]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----- the pieces shared with the recovery bench
def test_work_time_and_productive_fraction() -> None:
    recs = steps_every(1, 5, 10.0, 1.0) + [{"event": "failure", "time": 15.0}] + steps_every(4, 3, 20.0, 1.0)
    assert work_time_s(recs, 8.0, steps=6) == pytest.approx(14.0)  # step 6 first recorded at 22
    assert work_time_s(recs, 8.0, steps=9) is None
    assert productive_fraction(40.0, 50.0) == pytest.approx(0.8)
    assert productive_fraction(None, 50.0) is None and productive_fraction(40.0, None) is None


def test_in_run_failure_free_time_takes_out_what_failures_cost() -> None:
    """Steps 1-20 at 0.1 s (step 1 done 2 s after the start); killed after step 20, resumed from
    step 16 after a 5 s restart: steps 17-20 redone, 21.. at full speed again."""
    recs = steps_every(1, 20, 2.0, 0.1)  # step 20 at 3.9 s
    recs += [{"event": "failure", "time": 4.0}, {"step": 17, "step_s": 5.0, "time": 9.0}]
    recs += steps_every(18, 13, 9.1, 0.1)  # 18..30, step 30 at 10.3 s
    kill = 3.95
    # back at speed at the end of step 21 (9.4 s): in [3.95, 9.4] only step 21 is new work
    assert runs.in_run_failure_free_s(recs, 0.0, 30, [kill]) == pytest.approx(10.3 - (9.4 - kill - 0.1))
    assert runs.in_run_failure_free_s(recs, 0.0, 30, []) == pytest.approx(10.3)  # no failure: its wall time
    assert runs.in_run_failure_free_s(recs, 0.0, 31, [kill]) is None  # the work was not finished
    # the failure-free equivalent: start-up 1.9 s + 30 steps of 0.1 s (up to rounding of the recovery point)
    assert runs.in_run_failure_free_s(recs, 0.0, 30, [kill]) == pytest.approx(1.9 + 30 * 0.1, abs=0.06)


# ----- the failure schedule: failures per run, at steps, whatever the machine's speed
def test_the_schedule_places_exactly_the_failures_asked_for() -> None:
    for n in (0, 1, 6, max_failures(240)):
        specs = failure_schedule(n, 240, 0, 4)
        assert len(specs) == n
        assert all(s["kind"] == "kill" and s["node"] is None and 0 <= s["rank"] < 4 for s in specs)


def test_the_schedule_is_a_function_of_its_seed() -> None:
    assert failure_schedule(6, 240, 0, 4) == failure_schedule(6, 240, 0, 4)
    assert failure_schedule(6, 240, 0, 4) != failure_schedule(6, 240, 1, 4)


def test_kill_steps_are_after_the_warm_up_spaced_and_before_the_end() -> None:
    """Each kill has a pre-failure step time to be measured against, and MIN_GAP_STEPS steps after
    it to recover in before the next kill or the end of the work."""
    for seed in range(20):
        for steps, n in ((240, 6), (60, 2), (60, max_failures(60)), (20, 2)):
            at = [s["step"] for s in failure_schedule(n, steps, seed, 4)]
            assert at == sorted(at) and at[0] >= FIRST_KILL_STEP and at[-1] <= steps - MIN_GAP_STEPS
            assert all(b - a >= MIN_GAP_STEPS for a, b in zip(at, at[1:], strict=False))


def test_the_kill_steps_spread_over_the_whole_run() -> None:
    """Uniform over the run: over many seeds, kills fall early, in the middle and late."""
    at = [s["step"] for seed in range(200) for s in failure_schedule(6, 240, seed, 4)]
    thirds = [sum(1 for a in at if lo <= a < lo + 80) for lo in (0, 80, 160)]
    assert all(t > 0.25 * len(at) for t in thirds), thirds
    ranks = {s["rank"] for seed in range(50) for s in failure_schedule(6, 240, seed, 4)}
    assert ranks == {0, 1, 2, 3}


def test_how_many_failures_fit_in_a_run() -> None:
    assert max_failures(FIRST_KILL_STEP + MIN_GAP_STEPS - 1) == 0
    assert max_failures(FIRST_KILL_STEP + MIN_GAP_STEPS) == 1
    assert max_failures(240) == (240 - MIN_GAP_STEPS - FIRST_KILL_STEP) // MIN_GAP_STEPS + 1
    steps = FIRST_KILL_STEP + 10 * MIN_GAP_STEPS  # room for 10 kills exactly: packed, no choice left
    at = [s["step"] for s in failure_schedule(max_failures(steps), steps, 0, 4)]
    assert at == list(range(FIRST_KILL_STEP, steps - MIN_GAP_STEPS + 1, MIN_GAP_STEPS)) and len(at) == 10
    with pytest.raises(ValueError, match="do not fit"):
        failure_schedule(max_failures(240) + 1, 240, 0, 4)
    with pytest.raises(ValueError, match="do not fit"):
        failure_schedule(-1, 240, 0, 4)


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["--failures", "-1"], "--failures must be at least 0, got -1"),
        (["--failures", str(max_failures(240) + 1)], f"do not fit in 240 steps: at most {max_failures(240)}"),
        (["--steps", "60", "--failures", "11"], f"do not fit in 60 steps: at most {max_failures(60)}"),
        (["--steps", "12"], "--failures 6 do not fit in 12 steps: at most 0"),  # the default does not fit
    ],
)
def test_the_cli_refuses_a_schedule_that_cannot_be_run_in_one_line(
    argv: list[str], problem: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_run(*a: object, **kw: object) -> object:
        raise AssertionError("no job may run")

    monkeypatch.setattr(productivity, "run_all", no_run)
    assert cli.main(["bench", "productivity", *argv]) == 2
    err = capsys.readouterr().err
    assert problem in err and len(err.strip().splitlines()) == 1, err


def test_failures_are_for_the_productivity_bench_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "recovery", "--failures", "2"]) == 2
    assert "--failures is for `leto bench productivity`" in capsys.readouterr().err


def test_the_report_states_the_schedule_in_failures_per_run(capsys: pytest.CaptureFixture[str]) -> None:
    specs = failure_schedule(2, 100, productivity.SCHEDULE_SEED, 4)
    rep = build_report(CFG, THREE_TRIALS, NAMES, specs=specs, torchft="not installed")
    cfg = rep["config"]
    assert cfg["failures"] == 2 and cfg["kills"] == specs and cfg["seed"] == productivity.SCHEDULE_SEED
    assert cfg["schedule"].startswith("2 failures per run")
    assert "mtbf_s" not in cfg and "kill_steps_from" not in cfg  # nothing in seconds of a machine's speed
    rep.update(json="productivity.json", plots=[])
    productivity.print_table(rep)
    first = capsys.readouterr().out.splitlines()[0]
    steps = ", ".join(str(s["step"]) for s in specs)
    assert f"2 worker SIGKILLs per run (seed 0) after steps {steps}, the same for every system" in first


# ----- the trials, run with a stand-in for the systems
def test_every_trial_runs_every_system_failure_free_then_with_the_same_kills(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same kills, unchanged, for every system in every trial; the order rotates; every run has
    its own folder."""
    calls: list[tuple[str, str, list[dict]]] = []

    def fake_run_system(system: System, cfg: runs.JobConfig, run_dir: Path, injector: object, limit_s: float) -> Run:
        specs = list(getattr(injector, "specs", []))
        calls.append((system.name, run_dir.name, specs))
        t0 = 1000.0 * len(calls)
        kills = [Kill(spec, t0 + 2.0 + 0.1 * spec["step"], spec["step"]) for spec in specs]
        return Run(
            system.name,
            run_dir,
            t0,
            t0 + 2.0 + 0.1 * cfg.steps + 1.0,
            0,
            None,
            {},
            steps_every(1, cfg.steps, t0 + 2.0, 0.1),
            kills,
        )

    monkeypatch.setattr(productivity, "run_system", fake_run_system)
    systems = [System("leto", "leto"), System("memory-restart", "memory-restart"), System("torchft", "torchft")]
    specs = [
        {"kind": "kill", "rank": 1, "node": None, "step": 5},
        {"kind": "kill", "rank": 2, "node": None, "step": 11},
    ]
    all_runs, orders = productivity.run_all(runs.JobConfig(steps=20), tmp_path, systems, specs, 3)
    assert orders == [
        ["leto", "memory-restart", "torchft"],
        ["memory-restart", "torchft", "leto"],
        ["torchft", "leto", "memory-restart"],
    ]
    assert len(calls) == 3 * 3 * 2 and len({c[1] for c in calls}) == len(calls)
    assert [c[1] for c in calls[:2]] == ["trial1-failure-free-leto", "trial1-failures-leto"]
    assert all(c[2] == [] for c in calls if "failure-free" in c[1])
    assert all([(k["step"], k["rank"]) for k in c[2]] == [(5, 1), (11, 2)] for c in calls if "failures-" in c[1])
    assert len(all_runs) == 3 and all(set(r["failures"]) == {"leto", "memory-restart", "torchft"} for r in all_runs)


def test_a_failure_free_run_that_did_not_finish_does_not_cancel_the_run_with_failures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kill steps do not depend on any run: a system whose failure-free run fell short still
    runs with the same kills as the others."""
    seen: dict[str, list[dict]] = {}

    def fake_run_system(system: System, cfg: runs.JobConfig, run_dir: Path, injector: object, limit_s: float) -> Run:
        seen[run_dir.name] = list(getattr(injector, "specs", []))
        last = cfg.steps - 1 if run_dir.name == "trial1-failure-free-leto" else cfg.steps  # Leto's falls short
        return Run(system.name, run_dir, 0.0, 10.0, 0, None, {}, steps_every(1, last, 2.0, 0.1), [])

    monkeypatch.setattr(productivity, "run_system", fake_run_system)
    systems = [System("leto", "leto"), System("memory-restart", "memory-restart")]
    specs = failure_schedule(1, 20, 0, 4)
    all_runs, _ = productivity.run_all(runs.JobConfig(steps=20), tmp_path, systems, specs, 1)
    assert set(all_runs[0]["failures"]) == {"leto", "memory-restart"}
    assert seen["trial1-failures-leto"] == seen["trial1-failures-memory-restart"] == specs


# ----- one short real run: Leto and memory-restart, two failures (~90 s: beyond CI's budget; the
# arithmetic above is specified on records, and `leto bench recovery`'s end-to-end test runs in CI)
@beyond_ci
def test_productivity_bench_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Real processes, one trial (the trials' orchestration is specified above): the same kills at
    the same steps for both systems; every figure is the arithmetic of the runs' own records."""
    monkeypatch.setattr(
        productivity,
        "SYSTEMS",
        (System("leto", "leto", 1), System("memory-restart", "memory-restart"), System("torchft", "torchft")),
    )
    monkeypatch.setattr(productivity, "torchft_status", lambda: "not installed")
    args = argparse.Namespace(json=True, steps=20, failures=2, trials=1, out=tmp_path / "out", workers=4, model="tiny")
    code = productivity.main(args)
    doc = json.loads(capsys.readouterr().out)  # stdout is the JSON document and nothing else
    assert code == 0
    kills = doc["config"]["kills"]
    assert doc["config"]["trials"] == 1 and doc["config"]["failures"] == 2
    assert kills == failure_schedule(2, 20, productivity.SCHEDULE_SEED, 4)
    assert doc["systems"]["torchft"]["status"] == "not installed" and doc["difference_pp"]["torchft"] is None
    (tr,) = doc["trials"]
    for name in ("leto", "memory-restart"):
        s = doc["systems"][name]
        (t,) = s["trials"]
        assert t["ok"] and s["trials_ok"] == 1, t
        assert [(k["step"], k["rank"]) for k in t["kills"]] == [(k["step"], k["rank"]) for k in kills]
        assert t[HEADLINE] == pytest.approx(tr["fastest_failure_free"]["work_s"] / t["wall_s"], abs=1e-3)
        assert t[OWN] == pytest.approx(t["failure_free_work_s"] / t["wall_s"], abs=1e-3)
        assert t[IN_RUN] == pytest.approx(t["in_run_failure_free_s"] / t["wall_s"], abs=1e-3)
        assert t["failure_free_run_s"] >= t["failure_free_work_s"]  # launch -> exit holds the work
        assert s[HEADLINE] == t[HEADLINE] and s["spread"][HEADLINE] == [t[HEADLINE], t[HEADLINE]]
    leto, mr = doc["systems"]["leto"]["trials"][0], doc["systems"]["memory-restart"]["trials"][0]
    assert doc["difference_pp"]["memory-restart"] == pytest.approx(100 * (leto[HEADLINE] - mr[HEADLINE]), abs=0.02)
    assert leto[RATIO] == pytest.approx(leto["failure_free_run_s"] / mr["failure_free_run_s"], abs=1e-3)
    assert {t["result"] for t in doc["targets"]} <= {"met", "MISS", "INCOMPLETE", "NOT MEASURED"}
    assert all(c["within_noise"] is None for c in doc["comparisons"])  # one trial: noise not measured
    assert json.loads(Path(doc["json"]).read_text())["systems"]["leto"]["trials"] == doc["systems"]["leto"]["trials"]
    assert Path(doc["plots"][0]).read_bytes()[:4] == b"\x89PNG"


def test_leto_runs_as_leto_train_defaults_persisting_and_ends_as_the_peers_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Leto's run charges what `leto train` runs by default: protection, a shadow, and persistent
    checkpoints every K steps for the default --mtbf; its job ends like the peers' (`--final
    none`: no model file, no sample), and the checkpoints go with the run."""
    seen: dict[str, object] = {}

    def leto_job(config: object) -> int:
        seen["config"] = config
        (tmp_path / "r" / "checkpoints" / "step-5").mkdir(parents=True)
        return 0

    monkeypatch.setattr(runs, "run_job", leto_job)
    run = runs.run_system(System("leto", "leto", 1), runs.JobConfig(), tmp_path / "r", runs.NoInjector(), 30)
    job = seen["config"]
    assert run.code == 0
    assert job.protection.enabled and job.recovery.spares == 1  # type: ignore[attr-defined]
    assert job.persistence.dir == str((tmp_path / "r" / "checkpoints").resolve())  # type: ignore[attr-defined]
    assert job.persistence.mtbf == PersistenceConfig().mtbf and job.persistence.every is None  # type: ignore[attr-defined]
    command = list(job.training.command)  # type: ignore[attr-defined]
    assert command[command.index("--final") + 1] == "none"
    assert not (tmp_path / "r" / "checkpoints").exists()
