"""The coordinator's decision after a failure: the next generation's membership."""

from __future__ import annotations

from dataclasses import dataclass

from leto.protocol.messages import Membership


@dataclass(frozen=True)
class Spare:
    """A live shadow that can adopt a lost rank."""

    proc_id: str
    node: int


def next_membership(
    membership: Membership,
    failed_ranks: set[int],
    failed_nodes: set[int],
    spares: list[Spare],
    cause: str,
    replica_ranks: int = 1,
) -> tuple[Membership, dict[int, Spare]]:
    """Generation g+1 and the spare adopting each failed rank: a shadow on the same node preferred
    (its keeper holds the tier-1 parity), else on the node with the fewest ranks. Failed ranks
    left without a shadow are dropped (the survivors take over their shards and the ranks after
    them move down); with model parallelism (`replica_ranks` = tp x pp > 1) a whole model
    replica is adopted or dropped, and the dropped replica's live ranks become shadows (`demoted`).
    LookupError when no rank is left."""
    free = list(spares)
    node_of_rank, proc_of_rank = list(membership.node_of_rank), list(membership.proc_of_rank)
    adopted: dict[int, Spare] = {}
    dropped: list[int] = []
    k = replica_ranks
    for replica in sorted({r // k for r in failed_ranks}):
        lost = sorted(r for r in failed_ranks if r // k == replica)
        if len(free) < len(lost):
            dropped += lost if k == 1 else range(replica * k, (replica + 1) * k)
            continue
        for r in lost:
            load = {n: node_of_rank.count(n) for n in set(node_of_rank)}
            same = [s for s in free if s.node == membership.node_of_rank[r] and s.node not in failed_nodes]
            pick = same[0] if same else min(free, key=lambda s: (load.get(s.node, 0), s.node))
            free.remove(pick)
            adopted[r] = pick
            node_of_rank[r], proc_of_rank[r] = pick.node, pick.proc_id
    keep = [r for r in range(len(node_of_rank)) if r not in dropped]
    if not keep:
        raise LookupError("every rank was lost and no shadow is left")
    new = Membership(
        membership.generation + 1,
        tuple(node_of_rank[r] for r in keep),
        tuple(proc_of_rank[r] for r in keep),
        tuple(sorted(failed_ranks)),
        tuple(sorted(failed_nodes)),
        cause,
        tuple(proc_of_rank[r] for r in dropped if r not in failed_ranks),
    )
    return new, adopted


def grow_membership(
    membership: Membership, spares: list[Spare], tp: int = 1, replica_ranks: int | None = None
) -> Membership | None:
    """Generation g+1 with `spares` joining as new ranks at the end (after a shrink); with model
    parallelism in whole replicas of `replica_ranks` (default `tp`), each TP group on one node
    where the spares allow. None when too few spares to add one."""
    joining: list[Spare] = []
    unit = tp if replica_ranks is None else replica_ranks
    if unit == 1:
        joining = list(spares)
    else:
        by_node: dict[int, list[Spare]] = {}
        for s in spares:
            by_node.setdefault(s.node, []).append(s)
        rest: list[Spare] = []
        for node in sorted(by_node):
            group = by_node[node]
            whole = len(group) // tp * tp
            joining += group[:whole]
            rest += group[whole:]
        joining += rest[: len(rest) // tp * tp]
        joining = joining[: len(joining) // unit * unit]
    if not joining:
        return None
    return Membership(
        membership.generation + 1,
        membership.node_of_rank + tuple(s.node for s in joining),
        membership.proc_of_rank + tuple(s.proc_id for s in joining),
        (),
        (),
        f"grow: {', '.join(s.proc_id for s in joining)} joined",
    )
