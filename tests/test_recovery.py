"""In-place recovery: real processes are killed or stopped, and the job must end with exactly
the digest of a failure-free run of the same seed and config."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from conftest import (
    JOB,
    beyond_ci,
    check_recovered,
    check_resized_exactly,
    check_trajectory,
    processes_left,
    read_procs,
    reference_digest,
    seeded_random,
    step_records,
    train,
    wait_for,
    with_flags,
)
from leto.protocol import keys
from leto.runtime import linux


# the phases of a step that differ (forward and backward touch no shared state: a kill there is
# the reduce-scatter's case; random kills from outside hit them too), each victim rank once; the
# parity hand-off and the update with staged gradients are killed at every chunk boundary in
# test_protection.py
@pytest.mark.parametrize(
    "rank, phase, grads",
    [
        (2, "reduce-scatter", "auto"),
        (3, "grads", "on"),
        (1, "update", "auto"),
        (0, "all-gather", "auto"),
    ],
)
def test_a_killed_worker_is_replaced_in_place_in_any_phase(
    launcher, tmp_path: Path, rank: int, phase: str, grads: str
) -> None:
    """`--protect-grads on` stages gradients as with NCCL's reduce-scatter (gloo replicates them)."""
    digest = reference_digest(launcher, tmp_path, *JOB)
    res, s = train(
        launcher, tmp_path / "run", *JOB, "--protect-grads", grads, "--inject", f"kill:rank={rank}:step=5:phase={phase}"
    )
    rec = check_recovered(res, s, digest, tmp_path / "run")[0]
    assert rec["failed_ranks"] == [rank] and rec["tier"] == "tier1"
    assert "SIGKILL" in rec["cause"]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_worker_killed_at_the_final_digest_is_replaced_and_the_digest_done_again(
    launcher, tmp_path: Path, rank: int
) -> None:
    """After the last step every rank takes part in the final digest (a collective): a rank lost
    there is adopted like one lost in a step, and the job ends with the failure-free digest."""
    digest = reference_digest(launcher, tmp_path, *JOB)
    res, s = train(launcher, tmp_path / "run", *JOB, "--inject", f"kill:rank={rank}:step=10:phase=digest")
    rec = check_recovered(res, s, digest, tmp_path / "run")[0]
    assert rec["failed_ranks"] == [rank] and rec["step"] == 10


def test_a_worker_killed_from_outside_right_after_the_last_step(launcher, tmp_path: Path) -> None:
    """Killed at a random moment of the final digest, or after it: the job ends successfully with
    the failure-free digest either way (recovered, or over once rank 0 recorded the result)."""
    rng, seed = seeded_random()
    digest = reference_digest(launcher, tmp_path, *JOB)
    run_dir = tmp_path / "run"
    ctl = launcher.start("train", "--run-dir", str(run_dir), *JOB, run_dir=run_dir)
    wait_for(
        lambda: (run_dir / "metrics.jsonl").exists() and any(r["step"] >= 10 for r in step_records(run_dir)),
        120,
        "step 10",
    )
    time.sleep(rng.uniform(0, 0.03))
    victim = rng.choice([p for p in read_procs(run_dir) if p["role"] == "worker"])
    linux.signal_process(victim["pid"], victim.get("start"), signal.SIGKILL)  # unless it has ended
    out, err = ctl.communicate(timeout=240)
    assert ctl.returncode == 0, f"seed {seed}: " + err[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["digest"] == digest, f"seed {seed}"
    assert all(r["failed_ranks"] == [victim["rank"]] for r in s["recoveries"]), f"seed {seed}: {s['recoveries']}"
    assert not processes_left(run_dir), f"seed {seed}"


@beyond_ci
def test_two_nodes_of_a_2_plus_2_stripe_lost_at_once(launcher, tmp_path: Path) -> None:
    job = ("--workers", "4", "--nodes", "4", "--spares", "3", "--ec", "2+2", "--steps", "10", "--seed", "0")
    digest = reference_digest(launcher, tmp_path, *JOB)  # node layout does not change the math
    res, s = train(
        launcher, tmp_path / "run", *job, "--inject", "node-kill:node=0:step=4", "--inject", "node-kill:node=3:step=4"
    )
    rec = check_recovered(res, s, digest, tmp_path / "run")[0]
    assert rec["failed_nodes"] == [0, 3], rec
    # Each node's first rank fires its own kill: on a loaded machine the second may land during
    # the recovery from the first (one record naming the cut-short generation in `interrupted`),
    # and that recovery may rebuild a rank of the interim layout from tier 1 as well.
    assert rec["tier"] == "tier2" if not rec["interrupted"] else "tier2" in rec["tier"].split("+"), rec


def test_parity_blocks_that_folded_different_versions_are_not_decoded_together() -> None:
    """An update that reached one parity node of a 2+2 stripe and not the other makes that offset
    undecodable from the two together; the decode names it instead of trusting a checksum."""
    from leto.protection.layout import Geometry, Layout
    from leto.protocol.protection import StripeReport
    from leto.recovery.rebuild import torn_offsets

    layout = Layout(0, 0, Geometry(2, 4), (0, 0, 1, 1, 2, 2, 3, 3), (2, 2))
    s = layout.tier2[1][0]
    L = layout.segment_len
    v2 = [[5] * L for _ in range(s.k)]
    reports = {s.k + j: StripeReport(v2=[row[:] for row in v2], crc2=[]) for j in range(s.m)}
    assert torn_offsets(layout, s, reports) == set()
    reports[s.k + 1].v2[1][L - 1] = 4
    assert torn_offsets(layout, s, reports) == {L - 1}
    assert torn_offsets(layout, s, {s.k: reports[s.k]}) == set()  # one parity block agrees with itself


def test_a_hung_worker_is_detected_by_heartbeat_fenced_and_replaced(launcher, tmp_path: Path) -> None:
    digest = reference_digest(launcher, tmp_path, *JOB)
    res, s = train(
        launcher,
        tmp_path / "run",
        *JOB,
        "--heartbeat-timeout",
        "1.5",
        "--inject",
        "stop:rank=2:step=4:phase=all-gather",
    )
    rec = check_recovered(res, s, digest, tmp_path / "run")[0]
    assert "hung" in rec["cause"] and rec["failed_ranks"] == [2]
    assert rec["detect_s"] >= 1.5 - 0.1  # its last heartbeat may follow the hang's start by one period


def test_a_second_failure_during_recovery(launcher, tmp_path: Path) -> None:
    digest = reference_digest(launcher, tmp_path, *JOB)
    res, s = train(
        launcher,
        tmp_path / "run",
        *with_flags(JOB, spares=2),
        "--inject",
        "kill:rank=1:step=5",
        "--inject",
        "kill:rank=2:step=5:phase=recovery",
    )
    rec = check_recovered(res, s, digest, tmp_path / "run")[0]
    assert rec["failed_ranks"] == [1, 2] and rec["interrupted"]


def test_a_failure_before_the_new_generation_is_encoded(launcher, tmp_path: Path) -> None:
    """Rank 2 dies at the start of the first step after a recovery, while the new generation's
    base encode may still be committing: the previous generation's tables rebuild it exactly."""
    digest = reference_digest(launcher, tmp_path, *JOB)
    res, s = train(
        launcher,
        tmp_path / "run",
        *with_flags(JOB, spares=2),
        "--inject",
        "kill:rank=1:step=5:phase=update",
        "--inject",
        "kill:rank=2:step=6:phase=forward",
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert s["digest"] == digest
    assert sorted({r for rec in s["recoveries"] for r in rec["failed_ranks"]}) == [1, 2]
    assert not processes_left(tmp_path / "run")


def test_random_sigkills_from_outside(launcher, tmp_path: Path) -> None:
    """Kill a random worker at a random moment, twice, from outside the job, by PID."""
    rng, seed = seeded_random()
    run_dir = tmp_path / "run"
    ctl = launcher.start("train", "--run-dir", str(run_dir), *with_flags(JOB, steps=16, spares=2), run_dir=run_dir)
    for k in (3, 9):
        wait_for(
            lambda: (run_dir / "metrics.jsonl").exists() and any(r["step"] >= k for r in step_records(run_dir)),
            120,
            f"step {k}",
        )
        time.sleep(rng.uniform(0, 0.3))
        victim = rng.choice([p for p in read_procs(run_dir) if p["role"] == "worker"])
        os.kill(victim["pid"], signal.SIGKILL)
        wait_for(
            lambda: (
                any(
                    "event" in r and r["event"] == "recovery"
                    for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                )
                or ctl.poll() is not None
            ),
            120,
            "a recovery",
        )
    out, err = ctl.communicate(timeout=240)
    assert ctl.returncode == 0, f"seed {seed}: " + err[-3000:]
    ref16 = reference_digest(launcher, tmp_path, *with_flags(JOB, steps=16))
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["digest"] == ref16 and len(s["recoveries"]) == 2, f"seed {seed}: {s['recoveries']}"
    assert not processes_left(run_dir), f"seed {seed}"


def test_an_idle_shadow_or_keeper_dying_does_not_stop_training(launcher, tmp_path: Path) -> None:
    digest = reference_digest(launcher, tmp_path, *with_flags(JOB, steps=14))
    run_dir = tmp_path / "run"
    ctl = launcher.start("train", "--run-dir", str(run_dir), *with_flags(JOB, steps=14), run_dir=run_dir)
    wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(step_records(run_dir)) >= 3, 120, "step 3")
    shadow = next(p for p in read_procs(run_dir) if p["role"] == "shadow")
    os.kill(shadow["pid"], signal.SIGKILL)
    wait_for(
        lambda: any(p["role"] == "shadow" and p["pid"] != shadow["pid"] for p in read_procs(run_dir)),
        30,
        "a replacement shadow",
    )
    keeper = next(p for p in read_procs(run_dir) if p["role"] == "keeper" and p["node"] == 0)
    os.kill(keeper["pid"], signal.SIGKILL)
    out, err = ctl.communicate(timeout=240)
    assert ctl.returncode == 0, err[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["digest"] == digest
    assert [r["failed_ranks"] for r in s["recoveries"]] == [[]]  # protection rebuilt, no rank lost
    assert not processes_left(run_dir)


def test_losing_more_than_the_codes_tolerate_stops_with_a_clear_message(launcher, tmp_path: Path) -> None:
    res, s = train(
        launcher, tmp_path / "run", *JOB, "--ec", "none", "--spares", "2", "--inject", "node-kill:node=1:step=4"
    )
    assert res.returncode == 1
    assert "cannot recover" in res.stdout and "node 1" in res.stdout and "tier 2 is off" in res.stdout
    assert not processes_left(tmp_path / "run")


def test_without_protection_a_failure_stops_the_job(launcher, tmp_path: Path) -> None:
    res, s = train(launcher, tmp_path / "run", *JOB, "--protection", "off", "--inject", "kill:rank=1:step=3")
    assert res.returncode == 1 and "protection is off" in res.stdout
    assert not processes_left(tmp_path / "run")


# ----- no shadow left: shrink, then grow back
# The built-in job computes each replica of the launch on its own, whichever rank hosts it, and
# sums their gradients in replica order: a resized run keeps the failure-free bits.
def test_with_no_shadow_left_the_survivors_take_over_the_lost_shard(launcher, tmp_path: Path) -> None:
    job = ("--workers", "4", "--nodes", "2", "--spares", "0", "--steps", "24", "--seed", "0")
    res, s = train(launcher, tmp_path / "run", *job, "--inject", "kill:rank=1:step=8:phase=update")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rec = s["recoveries"][0]
    assert rec["world_size"] == 3 and rec["failed_ranks"] == [1] and rec["tier"] == "tier1"
    assert rec["lost_steps"] == 0 and not s["resizes"]
    assert "shrinking to 3 ranks" in res.stdout
    check_resized_exactly(launcher, tmp_path, tmp_path / "run", s, *job)
    assert not processes_left(tmp_path / "run")


def test_a_balanced_shrink_re_splits_the_batch_over_the_ranks_left(launcher, tmp_path: Path) -> None:
    """`--shrink balanced`: the 3 ranks left train on 11, 11 and 10 of the 32 rows, one replica
    each, and the losses track the failure-free run."""
    job = ("--workers", "4", "--nodes", "2", "--spares", "0", "--steps", "24", "--seed", "0")
    res, s = train(
        launcher, tmp_path / "run", *job, "--shrink", "balanced", "--inject", "kill:rank=1:step=8:phase=update"
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert s["recoveries"][0]["world_size"] == 3 and "shrinking to 3 ranks" in res.stdout
    check_trajectory(launcher, tmp_path, tmp_path / "run", *job)
    assert not processes_left(tmp_path / "run")


def test_after_a_shrink_the_job_grows_back_when_a_shadow_is_ready(launcher, tmp_path: Path) -> None:
    """A node dies with one warm shadow for its two ranks and no zygote to fork another: one
    rank is adopted, the job shrinks to 3 ranks (the lost shard rebuilt from tier 2), and grows
    back to 4 once the replacement shadow, started from scratch, has warmed up."""
    job = ("--workers", "4", "--nodes", "2", "--spares", "1", "--zygotes", "off", "--steps", "100", "--seed", "0")
    res, s = train(launcher, tmp_path / "run", *job, "--inject", "node-kill:node=1:step=6")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rec = s["recoveries"][0]
    assert rec["world_size"] == 3 and rec["failed_ranks"] == [2, 3] and rec["tier"] == "tier2"
    assert [r["world_size"] for r in s["resizes"]] == [4], s["resizes"]
    assert s["resizes"][0]["lost_steps"] == 0
    check_resized_exactly(launcher, tmp_path, tmp_path / "run", s, *job)
    assert not processes_left(tmp_path / "run")


def _store(run_dir: Path):
    from leto.runtime.env import connect

    return connect(next(p for p in read_procs(run_dir) if p["role"] == "controller")["store"], 10.0)


def _recoveries(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == "recovery"]


def test_replacement_shadows_are_forked_from_the_nodes_warm_zygote(launcher, tmp_path: Path) -> None:
    """After an adoption the controller keeps --spares by forking the node's zygote (milliseconds,
    no second torch import); the forked shadow is the controller's child (a subreaper) and adopts
    the next lost rank."""
    run_dir = tmp_path / "run"
    ctl = launcher.start("train", "--run-dir", str(run_dir), *with_flags(JOB, steps=2000), run_dir=run_dir)
    wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(step_records(run_dir)) >= 3, 120, "step 3")
    store = _store(run_dir)
    zygotes = [p["id"] for p in read_procs(run_dir) if p["role"] == "zygote"]
    assert len(zygotes) == 2
    wait_for(lambda: store.check([keys.warm(z) for z in zygotes]), 120, "warm zygotes")
    forked = None
    for n, rank in enumerate((1, 2), start=1):
        before = {p["pid"] for p in read_procs(run_dir)}
        victim = next(p for p in read_procs(run_dir) if p["role"] == "worker" and p["rank"] == rank)
        os.kill(victim["pid"], signal.SIGKILL)
        wait_for(lambda: len(_recoveries(run_dir)) == n, 60, f"recovery {n}")
        if forked is not None:  # the shadow forked after the first recovery adopted this rank
            assert _recoveries(run_dir)[-1]["adopted_by"] == {str(rank): forked["id"]}
        forked = wait_for(
            lambda: next((p for p in read_procs(run_dir) if p["role"] == "shadow" and p["pid"] not in before), None),
            60,
            "a replacement shadow",
        )
        assert store.check([keys.forked(forked["id"])])  # made by a zygote, not started afresh
        with open(f"/proc/{forked['pid']}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[1]) == ctl.pid  # its parent: the controller
    ctl.send_signal(signal.SIGTERM)
    ctl.communicate(timeout=60)
    assert not processes_left(run_dir)
