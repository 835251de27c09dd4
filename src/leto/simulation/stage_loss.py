"""What losing one rank of one pipeline stage sets off under each policy, counted in ranks
(docs/simulation.md, "The mesh: what losing a stage costs").

The job is dp x pp x tp ranks: dp model replicas, each one pipeline of pp stages of tp ranks.
Stages are taken as balanced (the same state per GPU), so which stage the lost rank belongs to
changes nothing; which ranks restart and which communicators are built depends on the policy and
on the mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

from .assumptions import Assumptions
from .scaling import dp_degree


@dataclass(frozen=True)
class Mesh:
    """The projected job's parallel layout."""

    tp: int
    pp: int
    dp: int

    @property
    def replica_gpus(self) -> int:
        """GPUs of one model replica: one pipeline of pp stages of tp ranks."""
        return self.tp * self.pp

    @property
    def gpus(self) -> int:
        """GPUs in the job."""
        return self.dp * self.replica_gpus


def mesh_of(a: Assumptions, gpus: int) -> Mesh:
    """The mesh of a job of `gpus` GPUs with the assumptions' tp and pp."""
    return Mesh(a.tp, a.pp, dp_degree(a, gpus))


@dataclass(frozen=True)
class StageLoss:
    """One rank of one stage lost by a process failure (its node survives).

    Attributes:
        restarted_gpus: GPUs whose processes restart (or are adopted) and reload their state.
        restarted_stages: pipeline stages those GPUs span in the replica of the lost rank.
        stall_groups: sizes of the communicators built while every GPU of the job waits.
        out_gpus: GPUs that stay out after the others resume, until they rejoin.
        out_groups: sizes of the communicators each of those GPUs builds before rejoining.
    """

    restarted_gpus: int
    restarted_stages: int
    stall_groups: tuple[int, ...]
    out_gpus: int = 0
    out_groups: tuple[int, ...] = ()


def stage_loss(policy: str, m: Mesh) -> StageLoss:
    """What losing one rank of a stage sets off under `policy` on mesh `m`.

    checkpoint-restart, memory-restart: every rank of every stage restarts and the world
    communicator of all ranks is built again. torchft: the lost rank's replica (all pp stages
    of its pipeline, tp x pp GPUs) restarts and heals from a peer replica while the others
    reconfigure their replica group (dp ranks) and go on without it. leto: a shadow adopts the
    one lost rank in place; only its tensor-parallel (tp), pipeline (pp) and data-parallel (dp)
    groups are built again, while every rank waits.
    """
    if policy in ("checkpoint-restart", "memory-restart"):
        return StageLoss(m.gpus, m.pp, (m.gpus,))
    if policy == "torchft":
        return StageLoss(m.replica_gpus, m.pp, (m.dp,), m.replica_gpus, (m.tp, m.pp, m.dp))
    if policy == "leto":
        return StageLoss(1, 1, (m.tp, m.pp, m.dp))
    raise ValueError(f"unknown policy {policy!r}")
