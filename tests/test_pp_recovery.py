"""In-place recovery of a pipeline-parallel job: any (dp, pp, tp) rank is killed with SIGKILL in
any phase of a step, including while micro-batches are in flight between stages (a
point-to-point send or receive), in the 1F1B schedule's warm-up, steady state and cool-down, in
the tied embedding's gradient sum, the DP reduction, the update and the all-gather; a whole node
is lost; a second rank dies during the recovery; a whole replica (every stage) is dropped and
grown back. Survivors keep their processes, a shadow rebuilds the stage it adopts, and the job
ends with the digest of a failure-free run of the same layout."""

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

# DP 2 x PP 2: rank r is (dp, stage) = divmod(r, 2); node 0 holds replica 0, node 1 replica 1
PP_JOB = (
    "--workers",
    "4",
    "--nodes",
    "2",
    "--spares",
    "1",
    "--pp",
    "2",
    "--microbatches",
    "4",
    "--persist",
    "off",
    "--steps",
    "10",
    "--seed",
    "0",
)
# DP 2 x PP 2 x TP 2 over 4 nodes: each stage's TP pair is one node, so each pipeline spans two
MESH_JOB = with_flags(PP_JOB, workers=8, nodes=4, tp=2)


# each stage is a victim, the first stage's (rank 0, 2) and the last's (1, 3), in each phase; the
# pp-send and pp-recv kills hit the middle micro-batch, with others already in flight. The shadow
# waits built as stage 0: adopting a last-stage rank, it rebuilds its module as that stage.
@pytest.mark.parametrize(
    "rank, phase",
    [
        (1, "pp-send"),
        (0, "pp-warmup"),
        pytest.param(3, "pp-cooldown", marks=beyond_ci),
        (2, "tied"),
        pytest.param(1, "update", marks=beyond_ci),
        pytest.param(2, "pp-recv", marks=beyond_ci),
        pytest.param(1, "pp-steady", marks=beyond_ci),
        pytest.param(3, "reduce-scatter", marks=beyond_ci),
        pytest.param(0, "all-gather", marks=beyond_ci),
    ],
)
def test_any_stage_killed_in_any_phase_is_adopted_in_place(launcher, tmp_path: Path, rank: int, phase: str) -> None:
    digest = reference_digest(launcher, tmp_path, *PP_JOB)
    run = tmp_path / "run"
    res, s = train(launcher, run, *PP_JOB, "--inject", f"kill:rank={rank}:step=5:phase={phase}")
    rec = check_recovered(res, s, digest, run)[0]
    assert rec["failed_ranks"] == [rank] and rec["tier"] == "tier1" and rec["world_size"] == 4
    assert "SIGKILL" in rec["cause"]


def test_a_whole_node_holding_a_pipeline_is_lost_and_rebuilt_from_tier_2(launcher, tmp_path: Path) -> None:
    """Node 1 holds replica 1's two stages; shadows on node 0 adopt both, each building its stage,
    their optimizer shards decoded from the tier-2 stripes."""
    digest = reference_digest(launcher, tmp_path, *PP_JOB)
    run = tmp_path / "run"
    res, s = train(launcher, run, *with_flags(PP_JOB, spares=3), "--inject", "node-kill:node=1:step=5")
    rec = check_recovered(res, s, digest, run)[0]
    assert rec["failed_nodes"] == [1] and rec["failed_ranks"] == [2, 3] and rec["tier"] == "tier2"


def test_a_second_stage_killed_during_the_recovery(launcher, tmp_path: Path) -> None:
    digest = reference_digest(launcher, tmp_path, *PP_JOB)
    run = tmp_path / "run"
    injections = ("--inject", "kill:rank=1:step=4:phase=pp-send", "--inject", "kill:rank=2:step=4:phase=recovery")
    res, s = train(launcher, run, *with_flags(PP_JOB, spares=2), *injections)
    rec = check_recovered(res, s, digest, run)[0]
    assert rec["failed_ranks"] == [1, 2] and rec["interrupted"]


@beyond_ci
def test_after_losing_a_whole_replica_of_stages_the_job_grows_back_with_the_failure_free_bits(
    launcher, tmp_path: Path
) -> None:
    """Node 1 (replica 1: both stages) dies with one warm shadow and no zygote: replica 0 goes on
    alone, computing both replicas of the launch through its pipeline; once a replacement shadow
    started from scratch is warm, the two shadows join as a new pipeline and the job is back at
    4 ranks, every step's loss and the final digest those of the failure-free run."""
    job = with_flags(PP_JOB, zygotes="off", steps=60)
    run = tmp_path / "run"
    res, s = train(launcher, run, *job, "--inject", "node-kill:node=1:step=6")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rec = s["recoveries"][0]
    assert rec["world_size"] == 2 and rec["failed_ranks"] == [2, 3] and rec["tier"] == "tier2"
    assert [r["world_size"] for r in s["resizes"]] == [4], s["resizes"]
    check_resized_exactly(launcher, tmp_path, run, s, *job)
    assert not processes_left(run)


def test_tp_by_pp_a_rank_killed_while_activations_are_in_flight_is_adopted_in_place(launcher, tmp_path: Path) -> None:
    """TP 2 x PP 2 x DP 2: rank 5 is replica 1's first stage, TP rank 1; killed as it sends a
    micro-batch's activations to the next stage."""
    digest = reference_digest(launcher, tmp_path, *MESH_JOB)
    run = tmp_path / "run"
    res, s = train(launcher, run, *MESH_JOB, "--inject", "kill:rank=5:step=5:phase=pp-send")
    rec = check_recovered(res, s, digest, run)[0]
    assert rec["failed_ranks"] == [5] and rec["world_size"] == 8


@beyond_ci
def test_tp_by_pp_a_node_holding_one_stage_of_a_pipeline_is_lost(launcher, tmp_path: Path) -> None:
    """Node 1 holds the last stage of replica 0 (ranks 2 and 3, its TP pair): the other stage of
    that pipeline lives on node 0 and keeps its process and state. Three spares start on nodes
    0, 1 and 2, so two shadows outlive node 1 however far the zygotes have warmed up by step 5
    (with two, the second shadow must be forked at the loss, and a zygote not yet warm makes the
    job drop the replica instead)."""
    digest = reference_digest(launcher, tmp_path, *MESH_JOB)
    run = tmp_path / "run"
    res, s = train(launcher, run, *with_flags(MESH_JOB, spares=3), "--inject", "node-kill:node=1:step=5")
    rec = check_recovered(res, s, digest, run)[0]
    assert rec["failed_nodes"] == [1] and rec["failed_ranks"] == [2, 3] and rec["tier"] == "tier2"


@beyond_ci
@pytest.mark.parametrize(
    "rank, phase", [(0, "pp-warmup"), (3, "pp-recv"), (6, "pp-cooldown"), (7, "tied"), (4, "tp-backward")]
)
def test_tp_by_pp_any_coordinate_killed_in_any_phase(launcher, tmp_path: Path, rank: int, phase: str) -> None:
    digest = reference_digest(launcher, tmp_path, *MESH_JOB)
    run = tmp_path / "run"
    res, s = train(launcher, run, *MESH_JOB, "--inject", f"kill:rank={rank}:step=5:phase={phase}")
    rec = check_recovered(res, s, digest, run)[0]
    assert rec["failed_ranks"] == [rank]
