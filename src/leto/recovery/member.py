"""What in-place recovery needs from a process that joins a generation, and from its state.

Implemented by `leto.training.member.RankMember` and `leto.training.shard.ShardedState`;
recovery sits below training and knows them only through these protocols.
"""

from __future__ import annotations

from typing import Protocol

import torch

from leto.protection.layout import Geometry
from leto.protocol.messages import Membership, RecoveryRecord
from leto.runtime.comm import Comm
from leto.runtime.env import Job
from leto.runtime.membership import GenerationWatch


class Shard(Protocol):
    """A rank's sharded state: parameters, its optimizer shard at `step`, its gradients."""

    numel: int
    step: int  # optimizer steps applied
    inplace: bool  # one shard updated in place (a step per chunk in `chunk_step`)
    chunk_step: list[int]
    grad_step: int | None  # the step whose whole reduced gradient is held (replicated gradients)

    @property
    def geometry(self) -> Geometry: ...
    @property
    def resharding(self) -> bool: ...
    def geometry_for(self, shards: int) -> Geometry: ...
    def allocate(self, shards: int) -> None: ...
    def chunk_at(self, step: int, c: int) -> torch.Tensor: ...
    def grad_at(self, step: int, c: int) -> torch.Tensor: ...
    def state_at(self, step: int) -> torch.Tensor: ...
    def reachable_steps(self) -> set[int]: ...
    def update_chunk(
        self, old: torch.Tensor, grad: torch.Tensor, dst: torch.Tensor, step: int, offset: int
    ) -> None: ...
    def bring_to(self, step: int) -> None: ...
    def install(self, shard: torch.Tensor, step: int, rank: int) -> None: ...
    def cut(self, full: torch.Tensor, shards: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def stage_reshard(
        self, generation: int, shards: int, rank: int, shard: torch.Tensor, params: torch.Tensor, step: int
    ) -> None: ...
    def settle_reshard(self, committed: int) -> None: ...
    def receive_grads(self, comm: Comm, geometry: Geometry, shards: int, step: int, source: int) -> torch.Tensor: ...
    def gather_params(self, comm: Comm) -> None: ...


class Member(Protocol):
    """A worker (or an adopting shadow) of the job."""

    job: Job
    watch: GenerationWatch | None
    comm: Comm | None
    recoveries: list[RecoveryRecord]  # the generations it joined, oldest first

    @property
    def sharded(self) -> Shard: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def replica_ranks(self) -> int:
        """Ranks per model replica (tp x pp); world rank r holds slice r % replica_ranks of the
        model, shard r // replica_ranks of that slice's state."""

    @property
    def dp_rank(self) -> int:
        """The shard of its slice this rank holds."""

    @property
    def dp_size(self) -> int:
        """The shards each slice is split into."""

    @property
    def dp_comm(self) -> Comm | None:
        """The group of the ranks holding this rank's slice (the world's without TP)."""

    def enter(self, generation: int, membership: Membership) -> None:
        """Become `membership`'s member: its rank and world size, a new process group (the old one
        parked); the process stops if the membership does not name it (it was declared lost)."""

    def fault(self, phase: str, step: int) -> None:
        """A fault injection point (tests)."""

    def restore_rank_state(self, step: int, lineage: list[str]) -> None:
        """Module buffers and registered state as at the end of `step` (a collective)."""

    def publish_layout(self, generation: int, base_step: int, state_chunks: int) -> None:
        """Rank 0: publish `generation`'s protection layout (its keepers set up from it)."""

    def protect(self, generation: int, base_step: int, state: torch.Tensor | None = None, wait: bool = True) -> None:
        """Start `generation`'s protection from the state at `base_step`."""
