"""Supervision: keepers are fenced and replaced like workers, losing a keeper is never fatal while
every rank's state is intact, tier 2 is re-placed after a node loss, and a training thread that
stops advancing is found though its process heartbeats. Real signals, sent by PID from outside."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from conftest import (
    beyond_ci,
    events,
    processes_left,
    read_procs,
    reference_digest,
    step_records,
    train,
    wait_for,
)

JOB = ("--workers", "4", "--nodes", "2", "--spares", "1", "--seed", "0")


def _at_step(run_dir: Path, k: int, ctl) -> None:
    wait_for(
        lambda: (
            ctl.poll() is not None
            or ((run_dir / "metrics.jsonl").exists() and any(r["step"] >= k for r in step_records(run_dir)))
        ),
        120,
        f"step {k}",
    )
    if ctl.poll() is not None:
        raise AssertionError(f"the job ended before step {k}: {ctl.communicate()[1][-3000:]}")


def _proc(run_dir: Path, role: str, node: int | None = None, rank: int | None = None) -> dict:
    return next(
        p
        for p in read_procs(run_dir)
        if p["role"] == role and (node is None or p["node"] == node) and (rank is None or p["rank"] == rank)
    )


def _recovered(run_dir: Path, n: int, ctl) -> list[dict]:
    return wait_for(
        lambda: (
            events(run_dir, "recovery") if len(events(run_dir, "recovery")) >= n or ctl.poll() is not None else None
        ),
        120,
        f"recovery {n}",
    )


def _start(launcher, run_dir: Path, job: tuple[str, ...], step: int, *extra: str):
    """Start `leto train` and return its process once step `step` is recorded."""
    ctl = launcher.start("train", "--run-dir", str(run_dir), *job, *extra, run_dir=run_dir)
    _at_step(run_dir, step, ctl)
    return ctl


def _signal_and_recover(run_dir: Path, ctl, proc: dict, sig: int, n: int = 1) -> list[dict]:
    """Send `sig` to `proc` by PID; returns the recoveries once there are `n`."""
    os.kill(proc["pid"], sig)
    return _recovered(run_dir, n, ctl)


def _finish(ctl, run_dir: Path, digest: str) -> tuple[str, dict]:
    out, err = ctl.communicate(timeout=240)
    assert ctl.returncode == 0, out[-2000:] + err[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["digest"] == digest
    assert not processes_left(run_dir)
    return out, s


def test_a_killed_keeper_is_replaced_and_its_node_protected_again(launcher, tmp_path: Path) -> None:
    """SIGKILL of node 1's keeper alone: a new keeper is started, the workers re-encode the
    node's protection from their own state, and a later SIGKILL of a node-1 worker is rebuilt
    from the new keeper's tier 1."""
    job = (*JOB, "--steps", "16")
    digest = reference_digest(launcher, tmp_path, *job)
    run_dir = tmp_path / "run"
    ctl = _start(launcher, run_dir, job, 3)
    keeper = _proc(run_dir, "keeper", node=1)
    (rec,) = _signal_and_recover(run_dir, ctl, keeper, signal.SIGKILL)
    assert rec["failed_ranks"] == [] and rec["tier"] == "none"
    _at_step(run_dir, rec["step"] + 3, ctl)
    assert _proc(run_dir, "keeper", node=1)["pid"] != keeper["pid"]
    recs = _signal_and_recover(run_dir, ctl, _proc(run_dir, "worker", rank=3), signal.SIGKILL, 2)
    assert recs[1]["failed_ranks"] == [3] and recs[1]["tier"] == "tier1"
    _finish(ctl, run_dir, digest)


def test_a_stopped_keeper_is_fenced_within_the_heartbeat_timeout(launcher, tmp_path: Path) -> None:
    """SIGSTOP of node 0's keeper: its heartbeat stops, the controller SIGKILLs it and the job
    goes on with a new keeper for node 0."""
    job = (*JOB, "--steps", "14", "--heartbeat-timeout", "1.5")
    digest = reference_digest(launcher, tmp_path, *JOB, "--steps", "14")
    run_dir = tmp_path / "run"
    ctl = _start(launcher, run_dir, job, 3)
    keeper = _proc(run_dir, "keeper", node=0)
    (rec,) = _signal_and_recover(run_dir, ctl, keeper, signal.SIGSTOP)
    (fail,) = [f for f in events(run_dir, "failure") if f["pid"] == keeper["pid"]]
    assert fail["role"] == "keeper" and "stopped heartbeating" in fail["cause"] and "fenced" in fail["cause"]
    assert rec["failed_ranks"] == [] and rec["detect_s"] >= 1.5 - 0.1
    _finish(ctl, run_dir, digest)


@pytest.mark.parametrize("sig", [signal.SIGKILL], ids=["SIGKILL"])  # SIGSTOP: test_a_stopped_keeper_is_fenced_...
def test_a_keeper_and_a_worker_of_another_node_fail_together(launcher, tmp_path: Path, sig: int) -> None:
    """Node 0's keeper is SIGKILLed or SIGSTOPped (fenced after its heartbeat timeout, during the
    recovery of the worker) at the same moment as rank 2 of node 1 is SIGKILLed."""
    job = (*JOB, "--steps", "14")
    digest = reference_digest(launcher, tmp_path, *job)
    run_dir = tmp_path / "run"
    ctl = _start(launcher, run_dir, (*job, "--heartbeat-timeout", "1.5"), 4)
    keeper, worker = _proc(run_dir, "keeper", node=0), _proc(run_dir, "worker", rank=2)
    os.kill(keeper["pid"], sig)
    os.kill(worker["pid"], signal.SIGKILL)
    out, s = _finish(ctl, run_dir, digest)
    assert sorted(r for rec in s["recoveries"] for r in rec["failed_ranks"]) == [2]
    assert {
        p["pid"]
        for p in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if p.get("event") == "failure"
    } >= {keeper["pid"], worker["pid"]}


@pytest.mark.parametrize("mode", [(), ("--protect-every", "3")], ids=["in-place", "interval"])
def test_a_one_node_job_goes_on_when_its_keeper_dies(launcher, tmp_path: Path, mode: tuple[str, ...]) -> None:
    """No other keeper holds anything: the protection is rebuilt from the workers' own state."""
    job = ("--workers", "2", "--nodes", "1", "--spares", "0", "--steps", "14", "--seed", "0")
    digest = reference_digest(launcher, tmp_path, *job)  # protection does not change the arithmetic
    run_dir = tmp_path / "run"
    ctl = _start(launcher, run_dir, (*job, *mode), 4)
    (rec,) = _signal_and_recover(run_dir, ctl, _proc(run_dir, "keeper"), signal.SIGKILL)
    assert rec["failed_ranks"] == [] and rec["tier"] == "none"
    _finish(ctl, run_dir, digest)


@beyond_ci
def test_after_a_node_loss_the_last_nodes_keeper_may_die(launcher, tmp_path: Path) -> None:
    """The default 2-node job loses node 1 (tier 2 rebuilds it; nothing covers a second node
    loss any more: a `degraded` event says so), then node 0's keeper dies: the job goes on."""
    job = (*JOB, "--steps", "16", "--no-spare", "wait")
    digest = reference_digest(launcher, tmp_path, *job)
    run_dir = tmp_path / "run"
    ctl = _start(launcher, run_dir, job, 1, "--inject", "node-kill:node=1:step=4")
    (rec,) = _recovered(run_dir, 1, ctl)
    assert rec["failed_nodes"] == [1] and rec["tier"] == "tier2"
    _at_step(run_dir, rec["step"] + 3, ctl)
    _signal_and_recover(run_dir, ctl, _proc(run_dir, "keeper", node=0), signal.SIGKILL, 2)
    out, s = _finish(ctl, run_dir, digest)
    assert [r["tier"] for r in s["recoveries"]] == ["tier2", "none"]
    (deg,) = s["degraded"]
    assert deg["nodes"] == [0] and "tier 2 is off" in deg["what"] and "degraded" in out


def test_two_data_nodes_of_one_2_plus_2_stripe_killed_from_outside(launcher, tmp_path: Path) -> None:
    """4 nodes, --ec 2+2: stripe 0 has data nodes 0 and 1 (placement.py); both are SIGKILLed."""
    job = (
        "--workers",
        "4",
        "--nodes",
        "4",
        "--spares",
        "2",
        "--ec",
        "2+2",
        "--no-spare",
        "wait",
        "--steps",
        "12",
        "--seed",
        "0",
    )
    digest = reference_digest(launcher, tmp_path, *job)
    run_dir = tmp_path / "run"
    ctl = _start(launcher, run_dir, job, 3)
    for p in read_procs(run_dir):
        if p["node"] in (0, 1):
            os.kill(p["pid"], signal.SIGKILL)
    out, s = _finish(ctl, run_dir, digest)
    rec = s["recoveries"][0]
    assert rec["failed_nodes"] == [0, 1] and rec["failed_ranks"] == [0, 1] and rec["tier"] == "tier2"
    assert [d["nodes"] for d in s["degraded"]] == [[2, 3]]  # 1+1 over the two left: one loss, not two


def test_tier2_is_re_placed_so_a_second_node_loss_is_survived(launcher, tmp_path: Path) -> None:
    """4 nodes, 3+1: node 3 dies (3 nodes left: re-placed as 2+1), then node 2 (rebuilt from the
    re-placed 2+1 stripes; 1+1 over the last two)."""
    job = ("--workers", "4", "--nodes", "4", "--spares", "2", "--no-spare", "wait", "--steps", "16", "--seed", "0")
    digest = reference_digest(launcher, tmp_path, *job)
    run_dir = tmp_path / "run"
    ctl = _start(launcher, run_dir, job, 1)
    for n, node in enumerate((3, 2), start=1):
        _at_step(run_dir, 4 * n, ctl)
        for p in read_procs(run_dir):
            if p["node"] == node:
                os.kill(p["pid"], signal.SIGKILL)
        _recovered(run_dir, n, ctl)
    out, s = _finish(ctl, run_dir, digest)
    assert [(r["failed_nodes"], r["tier"]) for r in s["recoveries"]] == [([3], "tier2"), ([2], "tier2")]
    assert not s["degraded"]


def _train_to_the_digest(launcher, tmp_path: Path, floor: str, factor: str, inject: str):
    """Run the 12-step job with a progress timeout and one injection; it must end with the
    failure-free digest and leave no process behind."""
    job = (*JOB, "--steps", "12")
    digest = reference_digest(launcher, tmp_path, *job)
    res, s = train(
        launcher, tmp_path / "run", *job, "--progress-floor", floor, "--progress-factor", factor, "--inject", inject
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert s["digest"] == digest
    assert not processes_left(tmp_path / "run")
    return res, s


def test_a_stuck_training_thread_is_found_by_progress_and_replaced(launcher, tmp_path: Path) -> None:
    """`hang` stops rank 1's training thread for ever while its heartbeat thread goes on: only
    the progress counter reveals it."""
    res, s = _train_to_the_digest(launcher, tmp_path, "4", "4", "hang:rank=1:step=6:phase=backward")
    (rec,) = s["recoveries"]
    assert rec["failed_ranks"] == [1] and "made no progress" in rec["cause"] and "heartbeats" in rec["cause"]
    assert rec["detect_s"] >= 4 - 0.1


# ----- the pure parts
def test_the_tier2_code_is_re_placed_over_the_nodes_left() -> None:
    from leto.protection.layout import Geometry, Layout
    from leto.protection.placement import degradation, fitted_code

    assert fitted_code(4, (3, 1)) == (3, 1) and fitted_code(6, (2, 1)) == (2, 1)
    assert fitted_code(3, (3, 1)) == (2, 1) and fitted_code(2, (3, 1)) == (1, 1) and fitted_code(1, (3, 1)) is None
    assert fitted_code(3, (2, 2)) == (1, 2) and fitted_code(2, (2, 2)) == (1, 1)
    assert fitted_code(5, None) is None
    assert degradation(3, (3, 1)) is None and degradation(3, (2, 2)) is None
    assert "1+1" in degradation(2, (2, 2)) and "tier 2 is off" in degradation(1, (1, 1))
    layout = Layout(1, 0, Geometry(2, 4), (0, 0, 1, 2), (3, 1))  # node 3 lost, its rank adopted on node 0
    code, stripes = layout.tier2
    assert (code.k, code.m) == (2, 1) and len(stripes) == 3
    assert {r.parity_node for pos in range(layout.positions_per_node) for r in layout.routes(0, pos)} == {1, 2}


def test_progress_times_out_only_after_a_measured_step_and_a_stall() -> None:
    from leto.control.progress import ProgressCheck
    from leto.protocol.messages import DONE, parse_beat

    check = ProgressCheck(floor_s=2.0, factor=10.0)
    assert check.stalled_for("w", 5, 0.0) is None and check.stalled_for("w", 5, 100.0) is None  # no step yet
    for s in (0.1, 0.5, 0.3):
        check.record_step(s)
    assert check.timeout_s() == 3.0  # max(2, 10 x median 0.3)
    assert check.stalled_for("w", 5, 102.0) is None  # stalls count from the first measured step
    assert check.stalled_for("w", 5, 105.5) == 3.5
    check.reset()  # a recovery: the counters start afresh
    assert check.stalled_for("w", 5, 200.0) is None and check.stalled_for("w", 5, 202.9) is None
    assert check.stalled_for("w", 5, 203.5) == 3.5
    assert check.stalled_for("w", 6, 204.0) is None  # it moved
    assert parse_beat("12.5 7") == (12.5, 7) and parse_beat("12.5") == (12.5, 0) and parse_beat(DONE) is None


def test_a_tight_progress_timeout_fences_nothing_in_a_healthy_run_with_a_recovery(launcher, tmp_path: Path) -> None:
    """Start-up, the first step, a shadow's adoption, the recovery and the final digest are long
    next to a step; with a timeout of a few steps none of them is taken for a hang."""
    res, s = _train_to_the_digest(launcher, tmp_path, "1.5", "3", "kill:rank=2:step=5:phase=update")
    assert [(r["failed_ranks"], r["cause"]) for r in s["recoveries"]] == [([2], "was killed by SIGKILL")]
    assert "made no progress" not in res.stdout
