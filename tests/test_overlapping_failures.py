"""Overlapping failures across the tiers: a rank lost inside one node and a whole other node lost
at about the same time (or one during the other's recovery) are survived in one recovery, the
rank rebuilt from its node's tier 1 and the node decoded from tier 2, bit-exact. A loss beyond
what the tiers together tolerate stops the job with one line naming what was lost.

Three nodes of two ranks each (ranks 0-1 on node 0, 2-3 on node 1, 4-5 on node 2) under
`--ec 2+1`: tier 1 covers one rank per node, tier 2 one node of the three."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import beyond_ci, check_recovered, processes_left, reference_digest, train
from leto.protection.layout import Geometry, Layout
from leto.protocol.messages import Membership
from leto.protocol.protection import KeeperReport
from leto.recovery.rebuild import RebuildRecipe, RecoveryError, assign_roles, make_recipe

JOB = ("--workers", "6", "--nodes", "3", "--spares", "1", "--ec", "2+1", "--steps", "10", "--seed", "0")


def _recipe(nodes: tuple[int, ...], ec: tuple[int, int], lost: set[int], dead_keepers: set[int]) -> RebuildRecipe:
    """The recipe after losing old ranks `lost` and the keepers of `dead_keepers`, each lost rank
    adopted in place by a shadow on node 0 (two chunks a rank, every chunk at step 3)."""
    layout = Layout(0, 0, Geometry(2, 4), nodes, ec, replicated_grads=True)
    old = Membership(0, nodes, tuple(f"w{r}" for r in range(len(nodes))))
    new = Membership(
        1,
        tuple(0 if r in lost else n for r, n in enumerate(nodes)),
        tuple(f"s{r}" if r in lost else f"w{r}" for r in range(len(nodes))),
    )
    per_node = len(nodes) // len(set(nodes))
    reports = {
        n: KeeperReport(n, 0, 0, applied=3, v1=[[3, 3]] * per_node, crc1=[[0, 0]] * per_node, stripes={})
        for n in sorted(set(nodes) - dead_keepers)
    }
    return make_recipe(layout, new, reports, assign_roles(old, new))


def test_a_rank_rebuilt_from_tier_1_stands_in_for_its_node_in_tier_2() -> None:
    """3 nodes x 2 ranks, 2+1 (stripe 0: data 0, 1, parity 2; stripe 1: data 1, 2, parity 0;
    stripe 2: data 2, 0, parity 1; a node gives its first rank's chunks to the first stripe it
    is data in, its second rank's to the second). Rank 0 and node 1 lost: rank 0 from node 0's
    tier 1; node 1 from stripes 0 and 1, stripe 0 reading node 0's block, which is rank 0's
    chunks rebuilt first; stripe 2 lost only its parity, so it decodes nothing."""
    r = _recipe((0, 0, 1, 1, 2, 2), (2, 1), {0, 2, 3}, {1})
    assert r.tier == "tier1+tier2"
    assert [(j.node, j.lost_rank) for j in r.tier1] == [(0, 0)]
    assert {j.stripe.index: j.chosen for j in r.tier2} == {0: (0, 2), 1: (1, 2)}


def test_two_ranks_of_a_node_with_another_node_go_to_tier_2_where_it_covers_two_nodes() -> None:
    """4 nodes x 2 ranks, 2+2: node 0 lost both ranks (beyond its tier 1) and node 1 was lost
    whole; every stripe lost at most two blocks, so tier 2 rebuilds all four ranks."""
    r = _recipe((0, 0, 1, 1, 2, 2, 3, 3), (2, 2), {0, 1, 2, 3}, {1})
    assert r.tier == "tier2" and not r.tier1


@pytest.mark.parametrize(
    "lost, dead_keepers, named, stripes",
    [
        (
            {0, 1, 2, 3},
            {1},
            "lost ranks 0, 1 of node 0 and node 1 (ranks 2, 3, its keeper)",
            "stripe 0 lost nodes 0, 1; stripe 2 lost nodes 0, 1)",
        ),
        (
            {1, 2, 3},
            {0, 1},
            "lost rank 1 of node 0 and its keeper and node 1 (ranks 2, 3, its keeper)",
            "stripe 1 lost nodes 1, 0; stripe 2 lost nodes 0, 1)",
        ),
    ],
)
def test_a_loss_beyond_both_tiers_is_named_in_one_line(
    lost: set[int], dead_keepers: set[int], named: str, stripes: str
) -> None:
    with pytest.raises(RecoveryError) as e:
        _recipe((0, 0, 1, 1, 2, 2), (2, 1), lost, dead_keepers)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(named + ": more than the tiers together rebuild"), msg
    assert msg.endswith(stripes), msg


# (a) rank 0 (node 0) and every process of node 1 (workers, keeper, shadows) are SIGKILLed in the
# update of step 5: rank 0 from node 0's tier 1, ranks 2 and 3 from the tier-2 stripes, one of
# which reads rank 0's rebuilt chunks as its surviving data block. (b) Rank 1 dies in the
# all-gather of step 5 and node 1 while joining that recovery, which restarts from the same
# tables; rank 1's chunks are in stripe 2, whose parity was on node 1: only tier 1 has them.
@pytest.mark.parametrize(
    "rank_kill, node_kill, lost",
    [
        ("kill:rank=0:step=5:phase=update", "node-kill:node=1:step=5:phase=update", [0, 2, 3]),
        ("kill:rank=1:step=5:phase=all-gather", "node-kill:node=1:step=5:phase=recovery", [1, 2, 3]),
    ],
    ids=["at-the-same-step", "during-the-recovery"],
)
def test_a_rank_and_another_node_lost_together_are_rebuilt_in_one_recovery(
    launcher, tmp_path: Path, rank_kill: str, node_kill: str, lost: list[int]
) -> None:
    digest = reference_digest(launcher, tmp_path, *JOB)
    run = tmp_path / "run"
    res, s = train(launcher, run, *JOB, "--inject", rank_kill, "--inject", node_kill)
    rec = check_recovered(res, s, digest, run)[0]
    assert rec["failed_ranks"] == lost and rec["failed_nodes"] == [1] and rec["world_size"] == 6
    assert rec["tier"] == "tier1+tier2"
    assert bool(rec.get("interrupted")) == ("recovery" in node_kill)


def test_a_loss_beyond_both_tiers_stops_with_one_line_naming_it(launcher, tmp_path: Path) -> None:
    """Both ranks of node 0 and all of node 1: node 0's tier 1 cannot rebuild two ranks, and a
    2+1 stripe cannot rebuild two data blocks. The job stops at once, naming what was lost and
    the command that resumes it from its checkpoint."""
    run = tmp_path / "run"
    res, s = train(
        launcher,
        run,
        *JOB,
        "--persist",
        "on",
        "--persist-every",
        "2",
        "--inject",
        "kill:rank=0:step=5:phase=update",
        "--inject",
        "kill:rank=1:step=5:phase=update",
        "--inject",
        "node-kill:node=1:step=5:phase=update",
        timeout=120,
    )
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if "cannot recover" in ln]
    assert len(lines) == 1, res.stdout[-3000:]
    assert "ranks 0, 1 of node 0" in lines[0] and "node 1" in lines[0], lines[0]
    assert f"leto train --resume {run}" in res.stderr
    events = [e for e in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "event" in e]
    fatal = next(e["time"] for e in events if e["event"] == "fatal")
    assert fatal - min(e["time"] for e in events if e["event"] == "failure") < 10  # no timeout waited out
    assert not processes_left(run)


TP_JOB = ("--workers", "4", "--nodes", "2", "--spares", "3", "--tp", "2", "--steps", "10", "--seed", "0")


@beyond_ci
def test_a_tp_rank_and_the_other_node_lost_in_the_update(launcher, tmp_path: Path) -> None:
    """TP 2 x DP 2 on 2 nodes (1+1): rank 0 (slice 0) and node 1 (ranks 2, 3) killed while
    updating. With protected gradients the update is replayed from the decoded gradients of
    both slices, bit-exact. With gloo's replicated ones slice 0's gradient of the step died with
    ranks 0 and 2, the only ranks holding it, and rank 1 has already updated part of its
    shard: the job stops with one line saying so."""
    kills = ("--inject", "kill:rank=0:step=5:phase=update", "--inject", "node-kill:node=1:step=5:phase=update")
    digest = reference_digest(launcher, tmp_path, *TP_JOB)
    run = tmp_path / "run"
    res, s = train(launcher, run, *TP_JOB, "--protect-grads", "on", *kills)
    rec = check_recovered(res, s, digest, run)[0]
    assert rec["failed_ranks"] == [0, 2, 3] and rec["tier"] == "tier1+tier2"
    res, _ = train(launcher, tmp_path / "gloo", *TP_JOB, *kills, timeout=120)
    assert res.returncode == 1
    (line,) = [ln for ln in res.stdout.splitlines() if "cannot recover" in ln]
    assert "no member holds the gradient of step" in line and "--protect-grads on" in line, line
