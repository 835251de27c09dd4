"""The job's mesh: world = DP x TP, TP innermost, and the communicators of one generation.

Rank `r` is `(dp_rank, tp_rank) = divmod(r, tp)`: the `tp` ranks of a model replica are
contiguous, so they lie inside one node (`protocol.messages.node_of_rank` splits the ranks into
contiguous nodes), and the ranks holding the same slice of the model form a DP group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from leto.protocol.messages import node_of_rank
from leto.runtime.comm import Comm
from leto.runtime.ordered import hosted, join_replicas


@dataclass(frozen=True)
class Mesh:
    """This rank's place in a DP x TP mesh."""

    tp: int  # ranks per model replica (a TP group)
    dp: int  # model replicas (ranks per DP group)
    tp_rank: int  # position in its TP group: which slice of the model it holds
    dp_rank: int  # position in its DP group: which replica it belongs to

    def __post_init__(self) -> None:
        if self.tp < 1 or self.dp < 1:
            raise ValueError(f"a mesh needs tp >= 1 and dp >= 1, got tp={self.tp}, dp={self.dp}")
        if not (0 <= self.tp_rank < self.tp and 0 <= self.dp_rank < self.dp):
            raise ValueError(f"coordinates (dp {self.dp_rank}, tp {self.tp_rank}) outside a {self.dp}x{self.tp} mesh")

    @staticmethod
    def of(rank: int, world_size: int, tp: int) -> Mesh:
        """The mesh of `world_size` ranks with `tp` per TP group, seen from `rank`."""
        if tp < 1 or world_size < 1 or world_size % tp:
            raise ValueError(f"a world of {world_size} ranks cannot be split into TP groups of {tp}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        dp_rank, tp_rank = divmod(rank, tp)
        return Mesh(tp=tp, dp=world_size // tp, tp_rank=tp_rank, dp_rank=dp_rank)

    @property
    def rank(self) -> int:
        return self.dp_rank * self.tp + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    @property
    def tp_group(self) -> tuple[int, ...]:
        """The world ranks of this rank's TP group (its model replica), by TP rank."""
        return tuple(range(self.dp_rank * self.tp, (self.dp_rank + 1) * self.tp))

    @property
    def dp_group(self) -> tuple[int, ...]:
        """The world ranks holding the same model slice as this rank, by DP rank."""
        return tuple(range(self.tp_rank, self.world_size, self.tp))


def layout_problem(workers: int, nodes: int, tp: int) -> str | None:
    """Why `workers` ranks over `nodes` nodes cannot form TP groups of `tp`, or None if they can:
    `tp` must divide `workers`, and every TP group must lie inside one node (a failure domain)."""
    if tp < 1:
        return f"--tp must be at least 1, got {tp}"
    if workers % tp:
        return f"--workers ({workers}) must be a multiple of --tp ({tp})"
    for d in range(workers // tp):
        first, last = node_of_rank(d * tp, workers, nodes), node_of_rank((d + 1) * tp - 1, workers, nodes)
        if first != last:
            fits = [str(n) for n in range(1, workers + 1) if _groups_fit(workers, n, tp)]
            return (
                f"--tp {tp}: TP group {d} (ranks {d * tp}-{(d + 1) * tp - 1}) spans nodes {first}-{last} of "
                f"--nodes {nodes}, and a TP group must lie inside one node; valid --nodes for --workers "
                f"{workers} --tp {tp}: {', '.join(fits)}"
            )
    return None


def _groups_fit(workers: int, nodes: int, tp: int) -> bool:
    return all(
        node_of_rank(d * tp, workers, nodes) == node_of_rank((d + 1) * tp - 1, workers, nodes)
        for d in range(workers // tp)
    )


@dataclass
class MeshComms:
    """The communicators of one generation: `world` (every rank), `tp` (this rank's TP group;
    None when tp is 1), `dp` (its DP group; the world Comm itself when tp is 1) and, while the
    job runs with fewer DP ranks than the replicas of its launch, `replicas`: this rank's
    members of the group of all replicas, by the replica it hosts (`leto.runtime.ordered`)."""

    world: Comm
    tp: Comm | None
    dp: Comm
    replicas: dict[int, Comm] = field(default_factory=dict)

    def close(self, abandon: bool = False) -> None:
        for comm in (*self.replicas.values(), self.dp, self.tp, self.world):
            if comm is not None and comm.pg is not None:
                comm.close(abandon)


def make_comms(
    mesh: Mesh,
    store: dist.Store,
    generation: int,
    timeout_s: float,
    abort_check: Callable[[], str | None] = lambda: None,
    device: torch.device | None = None,
    backend: str | None = None,
    replicas: int | None = None,
) -> MeshComms:
    """Join generation `generation`'s groups: world, then the TP group, then the DP group, then,
    with fewer DP ranks than `replicas`, the group of the replicas (`replicas{tp_rank}`). A
    Comm's constructor blocks until every member of its group has joined, so every rank builds
    them in this one order; a group's members share its name (`tp{dp_rank}`, `dp{tp_rank}`)."""
    world = Comm(store, generation, mesh.rank, mesh.world_size, timeout_s, abort_check, device, backend=backend)
    comms = MeshComms(world=world, tp=None, dp=world)
    try:
        if mesh.tp > 1:
            for attr, name, rank, size in (
                ("tp", f"tp{mesh.dp_rank}", mesh.tp_rank, mesh.tp),
                ("dp", f"dp{mesh.tp_rank}", mesh.dp_rank, mesh.dp),
            ):
                # the world's backend: `backend_for` decides it by the job's world size, not the group's
                comm = Comm(store, generation, rank, size, timeout_s, abort_check, device, name, world.backend)
                setattr(comms, attr, comm)
        if replicas is not None and mesh.dp < replicas:
            mine = hosted(replicas, mesh.dp, mesh.dp_rank)
            name = f"replicas{mesh.tp_rank}"
            comms.replicas = join_replicas(
                store, generation, name, mine, replicas, timeout_s, abort_check, device, world.backend
            )
    except BaseException:
        comms.close(abandon=True)
        raise
    return comms
