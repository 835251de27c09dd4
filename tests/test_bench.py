"""`leto bench recovery`: the definitions, on synthetic records, and one short real run.
(`leto bench productivity`: tests/test_bench_productivity.py.)

No test checks a wall-clock value: those depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest

from leto.bench import recovery, runs
from leto.bench.plots import segments
from leto.bench.runs import SEGMENTS, System, analyze_recovery, breakdown, median_index


def steps_every(start_step: int, n: int, t0: float, step_s: float) -> list[dict]:
    """n step records, one every step_s seconds, the first ending at t0."""
    return [{"step": start_step + i, "step_s": step_s, "time": t0 + i * step_s, "loss": 3.0} for i in range(n)]


# ----- recovery definitions
def test_in_place_recovery_timeline() -> None:
    """Leto-like: steps 1..20 at 0.1 s; the kill at 2.05 s (in step 21); the failure recorded at
    2.15 s; step 21 ends at 3.0 s (it took 0.95 s); two slow steps; then full speed."""
    recs = steps_every(1, 20, 0.1, 0.1)
    recs += [
        {"event": "failure", "time": 2.15, "rank": 1},
        {"step": 21, "step_s": 0.95, "time": 3.0},
        {"event": "recovery", "time": 3.01, "restore_s": 0.2},
        {"step": 22, "step_s": 0.3, "time": 3.3},
        {"step": 23, "step_s": 0.2, "time": 3.5},
    ]
    recs += steps_every(24, 10, 3.6, 0.1)
    r = analyze_recovery(recs, t_kill=2.05)
    assert r["failed_at"] == 20 and r["lost_steps"] == 0
    assert r["pre_step_s"] == pytest.approx(0.1)
    assert r["detect_s"] == pytest.approx(0.1)
    assert r["first_s"] == r["regain_s"] == pytest.approx(0.95)
    # steps 22 (0.3 s) and 23 (0.2 s) exceed 1.25 x 0.1 s; 24, 25, 26 do not: full speed from the end of 23
    assert r["recovery_s"] == pytest.approx(3.5 - 2.05)
    assert r["restore_s"] == pytest.approx(0.2)
    b = r["breakdown"]
    assert list(b) == list(SEGMENTS)
    assert sum(b.values()) == pytest.approx(r["recovery_s"], abs=1e-3)
    assert b["detect"] == pytest.approx(0.1) and b["restore"] == pytest.approx(0.2)
    assert b["recompute"] == 0 and b["back to speed"] == pytest.approx(0.5)


def test_restart_recovery_counts_recomputed_steps() -> None:
    """Checkpoint-restart-like: killed after step 20, resumed from the checkpoint of step 16, so
    steps 17-20 run again; those fast steps are not "back to speed", only new steps are."""
    recs = steps_every(1, 20, 0.1, 0.1)
    recs += [
        {"event": "failure", "time": 2.2},
        {"event": "restore", "time": 7.5, "step": 16, "restore_s": 0.05},
        {"step": 17, "step_s": 3.0, "time": 8.0},
    ]
    recs += steps_every(18, 10, 8.1, 0.1)  # 18, 19, 20 redone; 21.. new
    r = analyze_recovery(recs, t_kill=2.05)
    assert r["failed_at"] == 20
    assert r["lost_steps"] == 4  # 17, 18, 19, 20 completed twice
    assert r["first_s"] == pytest.approx(8.0 - 2.05)
    assert r["regain_s"] == pytest.approx(8.4 - 2.05)  # step 21
    assert r["recovery_s"] == pytest.approx(8.4 - 2.05)  # 21, 22, 23 at full speed
    b = r["breakdown"]
    assert b["recompute"] == pytest.approx(0.4) and b["back to speed"] == 0
    assert b["restart / rebuild"] == pytest.approx(8.0 - 2.2 - 0.05)
    assert sum(b.values()) == pytest.approx(r["recovery_s"], abs=1e-3)


def test_no_recovery_when_speed_never_returns() -> None:
    recs = steps_every(1, 10, 0.1, 0.1) + [{"event": "failure", "time": 1.1}] + steps_every(11, 5, 2.0, 0.5)
    r = analyze_recovery(recs, t_kill=1.05)
    assert r["regain_s"] == pytest.approx(2.0 - 1.05)
    assert r["recovery_s"] is None and r["breakdown"] is None


def test_window_and_tolerance_are_parameters() -> None:
    recs = steps_every(1, 10, 0.1, 0.1) + steps_every(11, 6, 2.0, 0.14)
    assert analyze_recovery(recs, 1.05)["recovery_s"] is None  # 0.14 > 1.25 x 0.1
    assert analyze_recovery(recs, 1.05, tolerance=1.5)["recovery_s"] == pytest.approx(2.0 - 1.05)
    assert analyze_recovery(recs, 1.05, tolerance=1.5, window=7)["recovery_s"] is None


def test_speed_is_judged_over_the_window_not_step_by_step() -> None:
    """One noisy step does not hide that throughput is back: 0.16 + 0.1 + 0.1 <= 3 x 1.25 x 0.1."""
    recs = (
        steps_every(1, 10, 0.1, 0.1)
        + [{"step": 11, "step_s": 0.9, "time": 2.0}, {"step": 12, "step_s": 0.16, "time": 2.16}]
        + steps_every(13, 4, 2.26, 0.1)
    )
    assert analyze_recovery(recs, 1.05)["recovery_s"] == pytest.approx(2.0 - 1.05)
    recs[11]["step_s"] = 0.2  # 0.4 > 0.375: the window after step 12 is the first at speed
    assert analyze_recovery(recs, 1.05)["recovery_s"] == pytest.approx(2.16 - 1.05)


def test_the_outage_is_not_inside_the_window() -> None:
    """The step in flight, redone, ends 0.6 s after the previous one (the outage is in its
    step_s); the steps after it run at full speed, so throughput is back when it ends."""
    recs = steps_every(1, 10, 0.1, 0.1) + [{"step": 11, "step_s": 0.6, "time": 1.6}] + steps_every(12, 4, 1.7, 0.1)
    r = analyze_recovery(recs, 1.05)
    assert r["recovery_s"] == r["regain_s"] == pytest.approx(1.6 - 1.05)


def test_torchft_heal_is_off_the_critical_path() -> None:
    recs = steps_every(1, 10, 0.1, 0.1) + [{"event": "failure", "time": 1.1}]
    recs += steps_every(11, 5, 2.0, 0.1) + [{"event": "heal", "time": 2.5, "restore_s": 0.3}]
    r = analyze_recovery(recs, 1.05)
    assert r["restore_s"] == pytest.approx(0.3)  # reported
    assert r["breakdown"]["restore"] == 0  # but not part of the survivors' recovery


def test_breakdown_needs_every_instant() -> None:
    assert breakdown(0.0, 0.1, None, 1.0, 2.0, 0.1) is None
    assert breakdown(0.0, 0.1, 1.0, 1.0, 1.0, 5.0)["restore"] == pytest.approx(0.9)  # clipped to its span


def test_median_index_picks_the_representative_trial() -> None:
    assert median_index([3.0, None, 1.0, 2.0]) == 3
    assert median_index([4.0, 1.0]) == 1
    assert median_index([None]) is None


def test_aggregate_and_speedup_are_ratios_of_medians() -> None:
    ok = lambda x, lost: {"ok": True, "recovery_s": x, "regain_s": x, "lost_steps": lost}  # noqa: E731
    leto = recovery.aggregate([ok(1.0, 0), ok(3.0, 0), ok(2.0, 0)])
    cr = recovery.aggregate([ok(9.0, 4), {"ok": False, "recovery_s": 1.0}, ok(7.0, 2)])
    assert leto["recovery_s"] == 2.0 and leto["representative_trial"] == 2
    assert cr["recovery_s"] == 8.0 and cr["trials_ok"] == 2 and cr["lost_steps"] == 3
    assert len(cr["trials"]) == 3
    sp = recovery.speedups({"leto": leto, "checkpoint-restart": cr}, "leto")
    assert sp == {"checkpoint-restart": 4.0}


def test_kill_step_leaves_steps_before_and_after() -> None:
    assert recovery.kill_step(40) == 12
    assert all(1 <= recovery.kill_step(n) < max(n, 2) for n in range(2, 200))


def test_plot_segments_mark_recomputed_steps() -> None:
    recs = steps_every(1, 3, 1.0, 0.5) + [
        {"step": 2, "step_s": 2.0, "time": 6.0},
        {"step": 3, "step_s": 0.5, "time": 6.5},
    ]
    segs = segments(recs, tokens_per_step=100)
    assert [s[3] for s in segs] == [False, False, False, True, True]
    assert segs[0][2] == pytest.approx(200.0) and segs[3][0] == pytest.approx(4.0)


# ----- one short real run: Leto and memory-restart, a worker SIGKILL, 1 trial
def test_recovery_bench_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(recovery, "FAILURE_ORDER", ("worker",))
    monkeypatch.setattr(
        recovery,
        "systems_for",
        lambda failure: [
            System("leto", "leto", 1),
            System("memory-restart", "memory-restart"),
            System("torchft", "torchft"),
        ],
    )
    monkeypatch.setattr(recovery, "torchft_status", lambda: "not installed")  # as on a machine without it
    args = argparse.Namespace(json=True, steps=16, trials=1, out=tmp_path / "out", workers=4, model="tiny")
    code = recovery.main(args)
    out = capsys.readouterr().out
    doc = json.loads(out)  # stdout is the JSON document and nothing else
    assert code == (0 if doc["systems"]["leto"]["recovery_s"] is not None else 1)
    assert set(doc["systems"]) == {"leto", "memory-restart", "torchft"}
    assert doc["systems"]["torchft"]["status"] == "not installed" and doc["torchft"] == "not installed"
    assert doc["speedup"]["torchft"] is None
    for name in ("leto", "memory-restart"):
        s = doc["systems"][name]
        for key in ("recovery_s", "regain_s", "detect_s", "restore_s", "lost_steps"):
            assert key in s
        assert len(s["trials"]) == 1 and s["trials_ok"] == 1, s["trials"]
        trial = s["trials"][0]
        assert trial["killed_after_step"] >= doc["config"]["kill_step"] == 5
        assert trial["regain_s"] is not None and trial["regain_s"] > trial["detect_s"] > 0
    leto, mr = doc["systems"]["leto"], doc["systems"]["memory-restart"]
    assert leto["lost_steps"] == 0  # in place: nothing completed is redone
    if leto["recovery_s"] is not None and mr["recovery_s"] is not None:
        assert doc["speedup"]["memory-restart"] == pytest.approx(mr["recovery_s"] / leto["recovery_s"], abs=0.01)
    else:
        assert doc["speedup"]["memory-restart"] is None
    assert doc["speedup_regain"]["memory-restart"] == pytest.approx(mr["regain_s"] / leto["regain_s"], abs=0.01)
    assert json.loads(Path(doc["json"]).read_text())["systems"]["leto"]["trials"] == leto["trials"]
    for png in doc["plots"]:
        assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "node_loss" not in doc


def test_watchdog_stops_a_run_that_hangs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A system that never returns is stopped at its limit and reported, not waited for."""

    def hang(*args: object, **kw: object) -> dict:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(0.05)
        return {"exit_code": 0}

    monkeypatch.setattr(runs, "run_baseline", hang)
    t0 = time.monotonic()
    run = runs.run_system(
        System("memory-restart", "memory-restart"), runs.JobConfig(), tmp_path / "r", runs.NoInjector(), limit_s=0.5
    )
    assert time.monotonic() - t0 < 10
    assert not run.ok and run.error == "stopped: still running after 0.5 s"
