"""Pipeline parallelism of the built-in GPT: stages of whole blocks and a 1F1B schedule.

`GPTStage` is stage s of P cut from a full `GPT`: stage 0 holds the token and position
embeddings, the last stage the final LayerNorm, the LM head and the loss, and every stage a
contiguous, balanced run of blocks (`stage_layers`). Parameter names are those of the full model
(a block keeps its index: stage 1 of 2 of a 4-layer model holds `blocks.2.*` and `blocks.3.*`),
in the full model's order, so a stage's state dict is a subset of the full one and the stages'
state dicts together are the whole. With P = 1 the stage is the whole model.

The tied LM head: the full model uses `wte.weight` both as the token embedding (stage 0) and as
the LM head (the last stage). With P > 1 the last stage holds its own copy, also named
`wte.weight`, initialized equal; each copy's gradient is one part of the tied weight's gradient.
Every step, after the backward and before clipping and the update, the first and last stage of a
pipeline sum the two parts over an "embedding group" of those two ranks (Megatron's layout):
`tied_grads_all_reduce`. Both copies then hold the same gradient, take the same update and stay
equal, bit for bit (a sum of two is commutative). In a global gradient norm the tied weight
counts once (`TIED` on stage 0).

`one_f_one_b` runs the non-interleaved 1F1B schedule (PipeDream-Flush, as in Megatron) over M
micro-batches, with activations sent forward and their gradients backward between neighbouring
stages through `Comm.exchange`; a dead neighbour is a `PeerFailure` like any collective's.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from leto.runtime.comm import Comm
from leto.runtime.ordered import contiguous_part
from leto.training.model import GPT

TIED = "wte.weight"  # the token embedding, also the LM head: a copy on the first and the last stage
PHASES = ("pp-warmup", "pp-steady", "pp-cooldown", "pp-send", "pp-recv")  # what `point` is called with
_FORWARD, _BACKWARD = 0, 1  # the direction bit of a message's tag


def stage_layers(n_layer: int, stages: int, stage: int) -> range:
    """The blocks of stage `stage` of `stages`: contiguous and balanced, the first
    `n_layer % stages` stages one block more than the others."""
    if not 1 <= stages <= n_layer:
        raise ValueError(f"{n_layer} blocks do not split into {stages} pipeline stages")
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is not one of {stages} pipeline stages")
    return contiguous_part(n_layer, stages, stage)


class GPTStage(nn.Module):
    """Stage `stage` of `stages` of `model` (see the module's docstring). It takes the model's
    own modules, as `tensor_parallel_gpt` does (cut a TP model first, then its stage), except the
    last stage's copy of the tied weight, which is its own: one model can give every stage."""

    def __init__(self, model: GPT, stage: int, stages: int) -> None:
        super().__init__()
        self.cfg, self.stage, self.stages = model.cfg, stage, stages
        self.first, self.last = stage == 0, stage == stages - 1
        layers = stage_layers(model.cfg.n_layer, stages, stage)
        if self.first:
            self.wte, self.wpe = model.wte, model.wpe
        elif self.last:
            self.wte = copy.deepcopy(model.wte)  # the LM head's copy of the tied weight
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if self.last:
            self.ln_f = model.ln_f

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Stage 0 takes token ids [b, t], the others the activations [b, t, n_embd] of the stage
        before; the last stage returns the logits, or the mean cross-entropy given `targets`, the
        others their activations."""
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if not self.last:
            return x
        logits = self.ln_f(x) @ self.wte.weight.T
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def tied_grads_all_reduce(stage: GPTStage, group: Comm) -> None:
    """Sum the tied weight's gradient over the embedding group (this pipeline's first and last
    stage, in that rank order): both copies then hold the whole gradient. Nothing with P = 1."""
    if stage.stages == 1:
        return
    if not (stage.first or stage.last):
        raise ValueError(f"stage {stage.stage} of {stage.stages} holds no copy of the tied weight")
    grad = stage.wte.weight.grad
    if grad is None:
        raise RuntimeError("the tied weight has no gradient: run the backward first")
    group.all_reduce(grad)


def _nowhere(phase: str, microbatch: int) -> None:
    return None


class _Neighbours:
    """One stage's messages to and from the stages before and after it, over the pipeline's
    Comm (stage index = rank). A message's tag is its micro-batch and direction."""

    def __init__(
        self,
        comm: Comm,
        s: int,
        stages: int,
        empty: Callable[[int], torch.Tensor],
        point: Callable[[str, int], None],
    ):
        self.comm, self.s, self.stages, self.empty, self.point = comm, s, stages, empty, point

    def __call__(
        self,
        fwd_out: tuple[torch.Tensor, int] | None = None,
        bwd_out: tuple[torch.Tensor, int] | None = None,
        fwd_in: int | None = None,
        bwd_in: int | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Send `fwd_out` = (activations, micro-batch) to the next stage and `bwd_out` =
        (gradients, micro-batch) to the one before; receive micro-batch `fwd_in`'s activations
        from the stage before and `bwd_in`'s gradients from the next one: all posted at once,
        then waited for. What has no stage to go to or come from is dropped."""
        first, last = self.s == 0, self.s == self.stages - 1
        sends, recvs, got = [], [], {}
        for out, peer, direction, edge in (
            (fwd_out, self.s + 1, _FORWARD, last),
            (bwd_out, self.s - 1, _BACKWARD, first),
        ):
            if out is not None and not edge:
                self.point("pp-send", out[1])
                sends.append((out[0].detach().contiguous(), peer, 2 * out[1] + direction))
        for mb, peer, direction, edge in ((fwd_in, self.s - 1, _FORWARD, first), (bwd_in, self.s + 1, _BACKWARD, last)):
            if mb is not None and not edge:
                self.point("pp-recv", mb)
                got[direction] = self.empty(mb)
                recvs.append((got[direction], peer, 2 * mb + direction))
        self.comm.exchange(sends, recvs, f"pipeline stage {self.s} send/receive")
        return got.get(_FORWARD), got.get(_BACKWARD)


def one_f_one_b(
    stage: nn.Module,
    comm: Comm,
    stage_index: int,
    stages: int,
    micro_inputs: Sequence[torch.Tensor],
    micro_targets: Sequence[torch.Tensor],
    act_shape: Sequence[int] | Callable[[int], Sequence[int]],
    point: Callable[[str, int], None] = _nowhere,
    weights: Sequence[float] | None = None,
) -> float | None:
    """Forward and backward M = len(micro_inputs) micro-batches through this stage, 1F1B: warm-up
    (P - s - 1 forwards), steady state (one forward, one backward), cool-down (the backwards
    left). Stage 0 reads `micro_inputs`, the last stage `micro_targets`; activations (and their
    gradients) between stages have shape `act_shape` (or `act_shape(micro-batch)`) and the
    stage's parameters' dtype. Micro-batch i's loss counts `weights[i]` (default 1/M), so the
    gradients accumulate (into `.grad`) to those of the weighted sum. Returns that weighted sum
    of the losses on the last stage, None elsewhere. `point(phase, micro-batch)` is called as
    each phase starts (every phase, even an empty one, with the first micro-batch it would
    forward or backward) and before each send and receive (see `PHASES`)."""
    s, M = stage_index, len(micro_inputs)
    first, last = s == 0, s == stages - 1
    warmup = min(stages - s - 1, M)
    weights = [1.0 / M] * M if weights is None else list(weights)
    param = next(stage.parameters())
    shape_of = act_shape if callable(act_shape) else lambda mb: act_shape
    talk = _Neighbours(
        comm, s, stages, lambda mb: torch.empty(shape_of(mb), dtype=param.dtype, device=param.device), point
    )
    in_flight: deque[tuple[torch.Tensor | None, torch.Tensor]] = deque()  # (input, output) per micro-batch
    losses: list[float] = []

    def forward(mb: int, x: torch.Tensor | None) -> torch.Tensor:
        x = None if first else x.requires_grad_()  # type: ignore[union-attr]
        inp = micro_inputs[mb] if x is None else x
        y = stage(inp, micro_targets[mb]) if last else stage(inp)
        if last:
            losses.append(y.item() * weights[mb])
            y = y * weights[mb]
        in_flight.append((x, y))
        return y

    def backward(dy: torch.Tensor | None) -> torch.Tensor | None:
        x, y = in_flight.popleft()
        torch.autograd.backward(y, dy)
        return None if x is None else x.grad

    point("pp-warmup", 0)
    for mb in range(warmup):
        x, _ = talk(fwd_in=mb)
        talk(fwd_out=(forward(mb, x), mb))
    point("pp-steady", warmup)
    x, _ = talk(fwd_in=warmup) if warmup < M else (None, None)
    for b in range(M - warmup):  # forward micro-batch f, backward micro-batch b
        f = warmup + b
        _, dy = talk(fwd_out=(forward(f, x), f), bwd_in=b)
        x, _ = talk(bwd_out=(backward(dy), b), fwd_in=f + 1 if f + 1 < M else None)
    point("pp-cooldown", M - warmup)
    for b in range(M - warmup, M):
        _, dy = talk(bwd_in=b)
        talk(bwd_out=(backward(dy), b))
    return sum(losses) if last else None


@dataclass(frozen=True)
class Pipeline:
    """A model in `stages` pipeline stages, as `leto.Trainer` takes it (instead of a module):

    >>> pipe = Pipeline(lambda s: MyStage(s), stages=job.config.mesh.pp, microbatches=8,
    ...                 act_shape=lambda x: (x.shape[0], seq, hidden))
    >>> trainer = Trainer(pipe, job, AdamW(lr=1e-3))
    >>> trainer.step(lambda replica: (inputs, targets))   # the replica's whole batch

    `build(s)` returns stage s, the same (same parameter values) every time it is called in any
    process: a process builds its own stage, and a shadow builds the stage of the rank it
    adopts. Stage 0 takes the inputs, the last stage returns the loss given the targets
    (`stage(x, targets)`), every other stage maps activations to activations. `act_shape(x)`:
    the shape of the activations between stages for a micro-batch of inputs `x`. `tied`: the
    name of a parameter held by the first and the last stage as one tied weight (summed
    gradients, counted once), or None."""

    build: Callable[[int], nn.Module]
    stages: int
    microbatches: int
    act_shape: Callable[[torch.Tensor], Sequence[int]]
    tied: str | None = None

    def __post_init__(self) -> None:
        if self.stages < 1 or self.microbatches < 1:
            raise ValueError(f"a pipeline needs stages and microbatches >= 1, got {self.stages}, {self.microbatches}")

    def largest_stage(self) -> int:
        """Trainable elements of the largest stage (built on the meta device: shapes only)."""
        with torch.device("meta"):
            return max(
                sum(p.numel() for p in self.build(s).parameters() if p.requires_grad) for s in range(self.stages)
            )


def tied_range(module: nn.Module, params: Sequence[torch.Tensor], name: str | None) -> range | None:
    """Where parameter `name` of `module` lies among `params` laid end to end (a flat buffer's
    elements), or None if the module has no such trainable parameter."""
    if name is None:
        return None
    target = dict(module.named_parameters()).get(name)
    offset = 0
    for p in params:
        if p is target:
            return range(offset, offset + p.numel())
        offset += p.numel()
    return None


def gpt_pipeline(make: Callable[[], GPT], stages: int, microbatches: int) -> Pipeline:
    """The built-in GPT in `stages` stages: `make()` returns the full (TP-cut) model, seeded, so
    every stage is cut from the same initialization."""

    def build(s: int) -> GPTStage:
        return GPTStage(make(), s, stages)

    def act_shape(x: torch.Tensor) -> tuple[int, ...]:
        cfg = probe.cfg
        return (x.shape[0], x.shape[1], cfg.n_embd)

    with torch.device("meta"):
        probe = make()
    return Pipeline(build, stages, microbatches, act_shape, tied=TIED)


def stages_gather(state: dict[str, torch.Tensor], group: Comm, tied: range | None) -> dict[str, torch.Tensor]:
    """The whole model's flat state from this stage's `state` (flat tensors of one size, each
    over the stage's parameters in order) and the other stages' (a collective of the pipeline):
    the stages' tensors end to end, in stage order, without the last stage's copy of the tied
    weight (`tied`: where it lies in this stage's tensors, on the last stage)."""
    local = torch.stack([t.reshape(-1) for t in state.values()])
    ends = (-1, -1) if tied is None else (tied.start, tied.stop)
    me = torch.tensor([local.shape[1], *ends], device=local.device)
    sizes = torch.empty(group.world_size * 3, dtype=torch.int64, device=local.device)
    group.all_gather(sizes, me)
    meta = sizes.view(group.world_size, 3).tolist()
    width = max(n for n, _, _ in meta)
    padded = torch.zeros(local.shape[0], width, dtype=local.dtype, device=local.device)
    padded[:, : local.shape[1]] = local
    out = torch.empty(group.world_size, *padded.shape, dtype=local.dtype, device=local.device)
    group.all_gather(out.view(-1), padded.view(-1))
    parts = []
    for s, (n, lo, hi) in enumerate(meta):
        keep = out[s, :, :n]
        if s == group.world_size - 1 and s > 0 and lo >= 0:
            keep = torch.cat([keep[:, :lo], keep[:, hi:]], dim=1)
        parts.append(keep)
    whole = torch.cat(parts, dim=1)
    return {name: whole[i].clone() for i, name in enumerate(state)}
