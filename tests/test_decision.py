"""The coordinator's decisions (`control/decision.py`): who adopts a lost rank, when the job
shrinks, and how it grows back. Pure functions: no processes, no store."""

from __future__ import annotations

import pytest

from leto.control.decision import Spare, grow_membership, next_membership
from leto.protocol.messages import Membership

# 4 ranks over 2 nodes, generation 3
MEMBERSHIP = Membership(3, (0, 0, 1, 1), ("w0", "w1", "w2", "w3"))


def test_a_lost_rank_is_adopted_by_a_shadow_on_its_own_node() -> None:
    new, adopted = next_membership(MEMBERSHIP, {2}, set(), [Spare("s0", 0), Spare("s1", 1)], "rank 2 died")
    assert adopted == {2: Spare("s1", 1)}
    assert new == Membership(4, (0, 0, 1, 1), ("w0", "w1", "s1", "w3"), (2,), (), "rank 2 died")


def test_without_a_shadow_on_its_node_the_least_loaded_node_adopts() -> None:
    """A lost node's shadows are not preferred for its ranks; ties go to the lower node."""
    membership = Membership(0, (0, 0, 0, 1), ("w0", "w1", "w2", "w3"))
    new, adopted = next_membership(
        membership, {0, 1}, {0}, [Spare("s0", 0), Spare("s2", 2), Spare("s1", 1)], "node 0 lost"
    )
    assert adopted == {0: Spare("s2", 2), 1: Spare("s1", 1)}
    assert new.node_of_rank == (2, 1, 0, 1) and new.proc_of_rank == ("s2", "s1", "w2", "w3")
    assert new.failed_ranks == (0, 1) and new.failed_nodes == (0,)


def test_ranks_left_without_a_shadow_are_dropped_and_the_ranks_after_them_move_down() -> None:
    new, adopted = next_membership(MEMBERSHIP, {1, 3}, set(), [Spare("s0", 0)], "two ranks died")
    assert adopted == {1: Spare("s0", 0)}
    assert new == Membership(4, (0, 0, 1), ("w0", "s0", "w2"), (1, 3), (), "two ranks died")


def test_with_no_shadow_the_survivors_shrink_the_job() -> None:
    new, adopted = next_membership(MEMBERSHIP, {0, 2}, set(), [], "two ranks died")
    assert adopted == {}
    assert new.generation == 4 and new.node_of_rank == (0, 1) and new.proc_of_rank == ("w1", "w3")


def test_losing_every_rank_with_no_shadow_left_cannot_be_decided() -> None:
    with pytest.raises(LookupError, match="every rank was lost"):
        next_membership(MEMBERSHIP, {0, 1, 2, 3}, {0, 1}, [], "all lost")


def test_after_a_shrink_shadows_grow_the_job_back_as_new_last_ranks() -> None:
    shrunk, _ = next_membership(MEMBERSHIP, {1, 3}, set(), [], "two ranks died")
    grown = grow_membership(shrunk, [Spare("s5", 1), Spare("s6", 0)])
    assert grown == Membership(5, (0, 1, 1, 0), ("w0", "w2", "s5", "s6"), (), (), "grow: s5, s6 joined")


def test_with_tensor_parallelism_a_replica_without_shadows_for_all_its_lost_ranks_is_dropped_whole() -> None:
    """TP 2: replica 0 is ranks 0-1, replica 1 ranks 2-3. One shadow for losses in both replicas:
    replica 0 (first) is adopted; replica 1 leaves, its live rank 3 demoted to a shadow."""
    new, adopted = next_membership(MEMBERSHIP, {1, 2}, set(), [Spare("s0", 0)], "two ranks died", replica_ranks=2)
    assert adopted == {1: Spare("s0", 0)}
    assert new.proc_of_rank == ("w0", "s0") and new.node_of_rank == (0, 0)
    assert new.demoted == ("w3",) and new.failed_ranks == (1, 2)


def test_with_tensor_parallelism_the_job_grows_back_by_whole_tp_groups_on_one_node() -> None:
    shrunk, _ = next_membership(MEMBERSHIP, {2, 3}, {1}, [], "node 1 lost", replica_ranks=2)
    assert shrunk.proc_of_rank == ("w0", "w1") and shrunk.demoted == ()
    assert grow_membership(shrunk, [Spare("s5", 1)], tp=2) is None  # half a TP group cannot join
    grown = grow_membership(shrunk, [Spare("s5", 1), Spare("s6", 0), Spare("s7", 0)], tp=2)
    assert grown.proc_of_rank == ("w0", "w1", "s6", "s7") and grown.node_of_rank == (0, 0, 0, 0)


def test_with_pipeline_parallelism_a_whole_replica_of_stages_is_dropped_and_grows_back_whole() -> None:
    """TP 2 x PP 2: a replica is 4 ranks (two stages of a TP pair). A lost rank without a shadow
    drops its whole replica; the job grows back only by a whole replica, each TP pair on one node."""
    eight = Membership(0, (0, 0, 1, 1, 2, 2, 3, 3), tuple(f"w{i}" for i in range(8)), (), (), "")
    shrunk, _ = next_membership(eight, {5}, set(), [], "rank 5 died", replica_ranks=4)
    assert shrunk.proc_of_rank == ("w0", "w1", "w2", "w3") and shrunk.demoted == ("w4", "w6", "w7")
    three = [Spare("a", 2), Spare("b", 2), Spare("c", 3)]
    assert grow_membership(shrunk, three, tp=2, replica_ranks=4) is None  # not a whole replica
    grown = grow_membership(shrunk, [*three, Spare("d", 3), Spare("e", 2)], tp=2, replica_ranks=4)
    assert grown.proc_of_rank[4:] == ("a", "b", "c", "d") and grown.node_of_rank[4:] == (2, 2, 3, 3)
