"""How a step hands its state to the keepers: one object per protection mode, one interface.

The step calls the same hooks in every mode, at fixed points between its fault-injection points
(docs/protection.md, "One step, in order"); `t` is the step the state is at when the step
starts (it computes step `t + 1`):

- `before_forward(t)`: protect the update of step `t`;
- `before_backward(t)`: wait for what a replay of `t` would read from the gradients about to be
  zeroed;
- `after_reduce(t, grads)`: protect step `t + 1`'s gradients, or keep the state the update is
  about to overwrite;
- `update_chunk(t, c, src, grads, dst)`: chunk `c`'s optimizer update to `t + 1`;
- `after_gather(t)`: the step counts as complete.

`Unprotected` is the null mode (no keepers, or before the first generation's protection);
`mode_for` picks the one a protector's layout asks for.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from leto.protection.client import Protector
from leto.training.shard import ShardedState

Fault = Callable[..., None]  # fault(phase, step, chunk=None): an injection point


class Unprotected:
    """No protection: the update writes the next state buffer; every hook does nothing."""

    protector: Protector | None = None

    def __init__(self, sharded: ShardedState) -> None:
        self.sharded = sharded

    def before_forward(self, t: int) -> None:
        """Before step `t + 1`'s forward pass."""

    def before_backward(self, t: int) -> None:
        """Before step `t + 1`'s gradients are zeroed."""

    def after_reduce(self, t: int, grads: torch.Tensor) -> None:
        """Step `t + 1`'s gradients (`grads`, this rank's shard) are reduced, clipped and held."""

    def update_chunk(self, t: int, c: int, src: torch.Tensor, grads: torch.Tensor, dst: torch.Tensor) -> None:
        """Chunk `c`'s update from `src` (step `t`) to `dst` (step `t + 1`)."""
        s = self.sharded
        s.update_chunk(src[c], grads[c], dst[c], t + 1, s.offset_of(c))

    def after_gather(self, t: int) -> None:
        """Step `t + 1`'s parameters are all-gathered."""

    def close(self) -> None:
        """Stop protecting."""


class Protected(Unprotected):
    """A mode with keepers: it holds this generation's `Protector`."""

    def __init__(self, sharded: ShardedState, protector: Protector, fault: Fault) -> None:
        super().__init__(sharded)
        self.protector, self.fault = protector, fault

    def _per_chunk(self, phase: str, t: int) -> Callable[[int], None]:
        """The injection point `phase` of step `t + 1`, before each chunk is handed over."""
        return lambda c: self.fault(phase, t + 1, c)

    def close(self) -> None:
        self.protector.close()


class EveryStep(Protected):
    """Every step protected, gradients reduce-scattered and protected too: two state buffers
    (ping-pong by step parity); a step's deltas are staged while the next step computes, and a
    step completes once its gradients are committed everywhere."""

    def before_forward(self, t: int) -> None:
        p, s = self.protector, self.sharded
        if t > p.base:  # protect the update of step t
            p.wait_grad_commit(t)
            p.stage_deltas(t, s.buf_for(t - 1), s.buf_for(t), self._per_chunk("parity", t))

    def after_reduce(self, t: int, grads: torch.Tensor) -> None:
        self.protector.stage_grads(t + 1, grads, self._per_chunk("grads", t))
        self.protector.wait_delta_commit(t)  # nobody needs step t-1 any more: its buffer may be overwritten

    def after_gather(self, t: int) -> None:
        self.protector.wait_grad_commit(t + 1)  # so a later failure loses at most the step in flight


class EveryStepInPlace(Protected):
    """Every step protected, gradients replicated (every rank holds the whole reduced gradient,
    so a replay takes them from a survivor): one state buffer updated in place, each chunk's delta
    handed over as it is computed, before the chunk is replaced."""

    def before_backward(self, t: int) -> None:
        self.protector.wait_delta_commit(t)  # until then a replay of step t takes its gradients from flat_grad
        self.sharded.release_kept()

    def update_chunk(self, t: int, c: int, src: torch.Tensor, grads: torch.Tensor, dst: torch.Tensor) -> None:
        s = self.sharded
        new = s.next_chunk(src[c], grads[c], t + 1, c)
        self.fault("parity", t + 1, c)
        self.protector.stage_delta(t + 1, c, src[c], new, c == s.n_chunks - 1)
        self.protector.charged(s.replace_chunk, c, t + 1)  # the copy back: protection's, not training's


class EveryNSteps(Protected):
    """Every N-th step protected (docs/protection.md, "Protection interval"): the deltas run from
    a snapshot of the last protected step; gradients are not protected (replicated or
    reduce-scattered)."""

    def before_forward(self, t: int) -> None:
        p, s = self.protector, self.sharded
        if t > p.base and p.layout.protects(t):
            p.stage_deltas(t, s.snap, s.buf_for(t), self._per_chunk("parity", t))

    def after_reduce(self, t: int, grads: torch.Tensor) -> None:
        p = self.protector
        if t - 1 > p.base and p.layout.protects(t - 1):
            p.wait_delta_commit(t - 1)  # the update overwrites protected step t-1: keep it
            self.sharded.keep_snapshot(t - 1)


def mode_for(sharded: ShardedState, protector: Protector, fault: Fault) -> Protected:
    """The mode `protector`'s layout asks for."""
    if protector.layout.protect_every > 1:
        return EveryNSteps(sharded, protector, fault)
    if sharded.inplace:
        return EveryStepInPlace(sharded, protector, fault)
    return EveryStep(sharded, protector, fault)
