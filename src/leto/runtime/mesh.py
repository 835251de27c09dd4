"""The job's mesh: world = DP x PP x TP, TP innermost, and the communicators of one generation.

Rank `r` is `(dp_rank, pp_rank, tp_rank)`, DP outermost: the `pp * tp` ranks of a model replica
(one pipeline) are contiguous, and so are the `tp` ranks of each of its stages, which lie inside
one node (`protocol.messages.node_of_rank` splits the ranks into contiguous nodes); a pipeline
spans nodes when a node holds fewer ranks than a replica. The ranks holding the same slice of
the model (the same stage and TP coordinate: `r % (pp * tp)`) form a DP group, over which that
slice's optimizer state is sharded. A shrink or a grow moves whole replicas, so every survivor
keeps its slice.
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
    """This rank's place in a DP x PP x TP mesh."""

    tp: int  # ranks per pipeline stage (a TP group)
    dp: int  # model replicas (ranks per DP group)
    tp_rank: int  # position in its TP group
    dp_rank: int  # position in its DP group: which replica it belongs to
    pp: int = 1  # pipeline stages per replica
    pp_rank: int = 0  # its stage

    def __post_init__(self) -> None:
        if self.tp < 1 or self.dp < 1 or self.pp < 1:
            raise ValueError(f"a mesh needs tp, pp and dp >= 1, got tp={self.tp}, pp={self.pp}, dp={self.dp}")
        if not (0 <= self.tp_rank < self.tp and 0 <= self.dp_rank < self.dp and 0 <= self.pp_rank < self.pp):
            raise ValueError(
                f"coordinates (dp {self.dp_rank}, pp {self.pp_rank}, tp {self.tp_rank}) outside a "
                f"{self.dp}x{self.pp}x{self.tp} mesh"
            )

    @staticmethod
    def of(rank: int, world_size: int, tp: int, pp: int = 1) -> Mesh:
        """The mesh of `world_size` ranks in replicas of `pp` stages of `tp` ranks, seen from `rank`."""
        if tp < 1 or pp < 1 or world_size < 1 or world_size % (tp * pp):
            raise ValueError(f"a world of {world_size} ranks cannot be split into replicas of {pp} x {tp} ranks")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        dp_rank, slice_ = divmod(rank, tp * pp)
        pp_rank, tp_rank = divmod(slice_, tp)
        return Mesh(tp=tp, dp=world_size // (tp * pp), tp_rank=tp_rank, dp_rank=dp_rank, pp=pp, pp_rank=pp_rank)

    @property
    def replica_ranks(self) -> int:
        """Ranks per model replica."""
        return self.tp * self.pp

    @property
    def slice(self) -> int:
        """Which slice of the model this rank holds (its stage and TP coordinate)."""
        return self.pp_rank * self.tp + self.tp_rank

    @property
    def rank(self) -> int:
        return self.dp_rank * self.replica_ranks + self.slice

    @property
    def world_size(self) -> int:
        return self.dp * self.replica_ranks

    @property
    def tp_group(self) -> tuple[int, ...]:
        """The world ranks of this rank's TP group (its stage of its replica), by TP rank."""
        first = self.rank - self.tp_rank
        return tuple(range(first, first + self.tp))

    @property
    def pp_group(self) -> tuple[int, ...]:
        """The world ranks of this rank's pipeline (its replica, its TP coordinate), by stage."""
        first = self.dp_rank * self.replica_ranks + self.tp_rank
        return tuple(range(first, first + self.replica_ranks, self.tp))

    @property
    def dp_group(self) -> tuple[int, ...]:
        """The world ranks holding the same model slice as this rank, by DP rank."""
        return tuple(range(self.slice, self.world_size, self.replica_ranks))


def layout_problem(workers: int, nodes: int, tp: int, pp: int = 1) -> str | None:
    """Why `workers` ranks over `nodes` nodes cannot form replicas of `pp` stages of `tp` ranks,
    or None if they can: `tp * pp` must divide `workers`, and every TP group must lie inside one
    node (a failure domain)."""
    if tp < 1:
        return f"--tp must be at least 1, got {tp}"
    if pp < 1:
        return f"--pp must be at least 1, got {pp}"
    if workers % (tp * pp):
        of = f"--tp ({tp})" if pp == 1 else f"--tp x --pp ({tp} x {pp} = {tp * pp})"
        return f"--workers ({workers}) must be a multiple of {of}"
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
    None when tp is 1), `pp` (its pipeline, by stage; None when pp is 1), `embedding` (its
    pipeline's first and last stage, which hold the tied embedding; None elsewhere), `dp` (its DP
    group; the world Comm itself when a replica is one rank) and, while the job runs with fewer
    DP ranks than the replicas of its launch, `replicas`: this rank's members of the group of all
    replicas, by the replica it hosts (`leto.runtime.ordered`). `side`: groups a recovery
    built beside these (the tier-1 decode's node groups); they live and are parked with the
    generation's, because destroying a gloo group blocks for ~20 ms, in the recovery's path."""

    world: Comm
    tp: Comm | None
    dp: Comm
    replicas: dict[int, Comm] = field(default_factory=dict)
    pp: Comm | None = None
    embedding: Comm | None = None
    side: list[Comm] = field(default_factory=list)

    def close(self, abandon: bool = False) -> None:
        for comm in (*self.side, *self.replicas.values(), self.dp, self.embedding, self.pp, self.tp, self.world):
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
    """Join generation `generation`'s groups: world, TP, pipeline, embedding, DP, then, with
    fewer DP ranks than `replicas`, the group of the replicas (`replicas{slice}`). A Comm's
    constructor blocks until every member of its group has joined, so every rank builds them in
    this one order; a group's members share its name (`tp{dp_rank}_{pp_rank}`, ...)."""
    world = Comm(store, generation, mesh.rank, mesh.world_size, timeout_s, abort_check, device, backend=backend)
    comms = MeshComms(world=world, tp=None, dp=world)
    first, last = mesh.pp_rank == 0, mesh.pp_rank == mesh.pp - 1
    wanted = (
        ("tp", f"tp{mesh.dp_rank}_{mesh.pp_rank}", mesh.tp_rank, mesh.tp, mesh.tp > 1),
        ("pp", f"pp{mesh.dp_rank}_{mesh.tp_rank}", mesh.pp_rank, mesh.pp, mesh.pp > 1),
        ("embedding", f"emb{mesh.dp_rank}_{mesh.tp_rank}", 0 if first else 1, 2, mesh.pp > 1 and (first or last)),
        ("dp", f"dp{mesh.slice}", mesh.dp_rank, mesh.dp, mesh.replica_ranks > 1),
    )
    try:
        for attr, name, rank, size, needed in wanted:
            if needed:
                # the world's backend: `backend_for` decides it by the job's world size, not the group's
                comm = Comm(store, generation, rank, size, timeout_s, abort_check, device, name, world.backend)
                setattr(comms, attr, comm)
        if replicas is not None and mesh.dp < replicas:
            mine = hosted(replicas, mesh.dp, mesh.dp_rank)
            comms.replicas = join_replicas(
                store,
                generation,
                f"replicas{mesh.slice}",
                mine,
                replicas,
                timeout_s,
                abort_check,
                device,
                world.backend,
            )
    except BaseException:
        comms.close(abandon=True)
        raise
    return comms
