"""The controller's decision after a failure: the next generation's membership."""
from __future__ import annotations

from dataclasses import dataclass

from leto.control.membership import Plan


@dataclass(frozen=True)
class Spare:
    proc_id: str
    node: int


def next_plan(plan: Plan, failed_ranks: set[int], failed_nodes: set[int], spares: list[Spare],
              cause: str) -> tuple[Plan, dict[int, Spare]]:
    """Generation g+1: each failed rank is adopted by a shadow, one on the same node preferred
    (its keeper holds the tier-1 parity), else on the node with the fewest ranks.

    Raises LookupError when there are fewer spares than failed ranks.
    """
    free = list(spares)
    if len(free) < len(failed_ranks):
        raise LookupError(f"{len(failed_ranks)} ranks lost but only {len(free)} shadows available")
    node_of_rank, proc_of_rank = list(plan.node_of_rank), list(plan.proc_of_rank)
    adopted: dict[int, Spare] = {}
    for r in sorted(failed_ranks):
        load = {n: node_of_rank.count(n) for n in set(node_of_rank)}
        same = [s for s in free if s.node == plan.node_of_rank[r] and s.node not in failed_nodes]
        pick = same[0] if same else min(free, key=lambda s: (load.get(s.node, 0), s.node))
        free.remove(pick)
        adopted[r] = pick
        node_of_rank[r], proc_of_rank[r] = pick.node, pick.proc_id
    new = Plan(plan.generation + 1, tuple(node_of_rank), tuple(proc_of_rank), tuple(sorted(failed_ranks)),
               tuple(sorted(failed_nodes)), cause)
    return new, adopted
