"""In-place recovery of a tensor-parallel job (TP 2 x DP 2): any (tp, dp) rank is killed with
SIGKILL in any phase of a step, including inside a TP all-reduce, a whole node is lost, a
second rank dies during the recovery, a whole replica is dropped and grown back; the job ends
with the digest of a failure-free run of the same layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import (
    beyond_ci,
    check_recovered,
    check_resized_exactly,
    processes_left,
    reference_digest,
    train,
    with_flags,
)

TP_JOB = (
    "--workers",
    "4",
    "--nodes",
    "2",
    "--spares",
    "1",
    "--tp",
    "2",
    "--persist",
    "off",
    "--steps",
    "10",
    "--seed",
    "0",
)


# rank r is (dp, tp) = divmod(r, 2): each coordinate is a victim; the TP phases kill a rank just
# before it enters the first TP all-reduce of its forward or backward pass, its TP peer already in it
@pytest.mark.parametrize(
    "rank, phase",
    [
        pytest.param(0, "forward", marks=beyond_ci),
        (1, "tp-forward"),
        pytest.param(2, "backward", marks=beyond_ci),
        (3, "tp-backward"),
        pytest.param(1, "reduce-scatter", marks=beyond_ci),
        (2, "update"),
        pytest.param(3, "all-gather", marks=beyond_ci),
    ],
)
def test_any_tp_rank_killed_in_any_phase_is_adopted_in_place(launcher, tmp_path: Path, rank: int, phase: str) -> None:
    digest = reference_digest(launcher, tmp_path, *TP_JOB)
    run = tmp_path / "run"
    res, s = train(launcher, run, *TP_JOB, "--inject", f"kill:rank={rank}:step=5:phase={phase}")
    rec = check_recovered(res, s, digest, run)[0]
    assert rec["failed_ranks"] == [rank] and rec["tier"] == "tier1" and rec["world_size"] == 4
    assert "SIGKILL" in rec["cause"]


def test_a_whole_node_of_tp_groups_is_lost_and_rebuilt_from_tier_2(launcher, tmp_path: Path) -> None:
    """Node 1 holds the whole second replica (ranks 2 and 3: both TP slices); shadows on node 0
    adopt both, their optimizer shards decoded from the tier-2 stripes."""
    digest = reference_digest(launcher, tmp_path, *TP_JOB)
    run = tmp_path / "run"
    res, s = train(launcher, run, *with_flags(TP_JOB, spares=3), "--inject", "node-kill:node=1:step=5")
    rec = check_recovered(res, s, digest, run)[0]
    assert rec["failed_nodes"] == [1] and rec["failed_ranks"] == [2, 3] and rec["tier"] == "tier2"


def test_a_second_tp_rank_killed_during_the_recovery(launcher, tmp_path: Path) -> None:
    digest = reference_digest(launcher, tmp_path, *TP_JOB)
    run = tmp_path / "run"
    injections = ("--inject", "kill:rank=1:step=4:phase=update", "--inject", "kill:rank=2:step=4:phase=recovery")
    res, s = train(launcher, run, *with_flags(TP_JOB, spares=2), *injections)
    rec = check_recovered(res, s, digest, run)[0]
    assert rec["failed_ranks"] == [1, 2] and rec["interrupted"]


def test_with_no_shadow_left_a_whole_replica_is_dropped_and_its_live_rank_becomes_a_shadow(
    launcher, tmp_path: Path
) -> None:
    """Rank 1 (replica 0, slice 1) dies with no shadow: replica 0 leaves, rank 0's process
    becomes a shadow, replica 1 goes on alone as ranks 0-1 (each slice's optimizer state
    resharded over one DP rank). When the new rank 1 dies too, that shadow adopts it, taking
    over the other slice; the run keeps the failure-free bits."""
    job = with_flags(TP_JOB, spares=0, steps=16)
    run = tmp_path / "run"
    kills = ("--inject", "kill:rank=1:step=6:phase=update", "--inject", "kill:rank=1:step=11:phase=tp-backward")
    res, s = train(launcher, run, *job, *kills)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    shrink, adopt = s["recoveries"]
    assert shrink["world_size"] == 2 and shrink["failed_ranks"] == [1] and shrink["lost_steps"] == 0
    assert adopt["world_size"] == 2 and adopt["failed_ranks"] == [1] and adopt["lost_steps"] == 0
    assert "shrinking to 2 ranks" in res.stdout
    check_resized_exactly(launcher, tmp_path, run, s, *job)
    assert not processes_left(run)


@beyond_ci
def test_after_losing_a_replica_the_job_grows_back_by_a_whole_tp_group(launcher, tmp_path: Path) -> None:
    """Node 1 (replica 1: ranks 2 and 3) dies with one warm shadow and no zygote: the job goes on
    with replica 0 alone, and once a replacement shadow started from scratch is warm the two
    shadows join as a new TP group and the job is back at 4 ranks, with the failure-free bits."""
    job = with_flags(TP_JOB, zygotes="off", steps=100)
    run = tmp_path / "run"
    res, s = train(launcher, run, *job, "--inject", "node-kill:node=1:step=6")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rec = s["recoveries"][0]
    assert rec["world_size"] == 2 and rec["failed_ranks"] == [2, 3] and rec["tier"] == "tier2"
    assert [r["world_size"] for r in s["resizes"]] == [4], s["resizes"]
    assert s["resizes"][0]["lost_steps"] == 0
    check_resized_exactly(launcher, tmp_path, run, s, *job)
    assert not processes_left(run)
