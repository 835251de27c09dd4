"""Megatron-style tensor parallelism: parallel linears with explicit autograd collectives.

A column-parallel linear splits its output features over the TP ranks, a row-parallel one its
input features; a column-parallel layer followed by a row-parallel one (attention's QKV and
output projections, an MLP's two projections) needs one all-reduce in the forward (`g`, after
the row-parallel layer) and one in the backward (`f`, before the column-parallel one). Every
other parameter is replicated on each TP rank.

The collectives go through a group object (`TPGroup`: Leto's `runtime.comm.Comm` is one), held
by each parallel layer and swapped with `set_tp_group` when the group is rebuilt. A parallel
layer is built from a full `nn.Linear` by slicing it, so a TP model starts from exactly the
initialization of the model it was cut from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from leto.runtime.env import Job


class TPGroup(Protocol):
    """The tensor-parallel group: this rank's place in it and the collectives the layers use."""

    rank: int
    world_size: int

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` in place over the group."""
        ...

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """`out` = the concatenation of every rank's `inp` (1-D), in rank order."""
        ...


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: TPGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        ctx.group.all_reduce(grad)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: TPGroup) -> torch.Tensor:  # type: ignore[override]
        out = x.contiguous().clone()
        group.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def copy_to_tp(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Megatron's `f`: identity in the forward, all-reduce of the gradient in the backward."""
    return x if group.world_size == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Megatron's `g`: all-reduce in the forward, identity in the backward."""
    return x if group.world_size == 1 else _ReduceFromTP.apply(x, group)


@dataclass(frozen=True)
class Sharded:
    """How a parameter is split over the TP ranks: along `dim`, which is made of `parts` equal
    fused blocks (a fused [q; k; v] projection has 3), each split in `tp` contiguous pieces;
    rank r holds piece r of every block, concatenated in block order."""

    dim: int
    parts: int = 1


def shard(full: torch.Tensor, spec: Sharded, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s slice (a copy) of the full tensor `full`."""
    size = full.shape[spec.dim]
    if size % (spec.parts * tp):
        raise ValueError(f"dimension {spec.dim} of size {size} does not split into {spec.parts} x {tp} pieces")
    blocks = full.chunk(spec.parts, dim=spec.dim)
    return torch.cat([b.chunk(tp, dim=spec.dim)[rank] for b in blocks], dim=spec.dim).clone()


def unshard(slices: Sequence[torch.Tensor], spec: Sharded) -> torch.Tensor:
    """The full tensor from the slices of every TP rank, in rank order (inverse of `shard`)."""
    per_rank = [s.chunk(spec.parts, dim=spec.dim) for s in slices]
    return torch.cat([piece[j] for j in range(spec.parts) for piece in per_rank], dim=spec.dim)


class ColumnParallelLinear(nn.Module):
    """`y = x W^T + b` with W's rows (output features) and b split over the TP ranks: the input
    is replicated, the output stays split (this rank's features). `parts` > 1 for a fused
    projection whose output is `parts` equal blocks, each split on its own."""

    def __init__(self, full: nn.Linear, group: TPGroup, parts: int = 1) -> None:
        super().__init__()
        self.group = group
        self.weight_spec = self.bias_spec = Sharded(0, parts)
        self.weight = nn.Parameter(shard(full.weight.detach(), self.weight_spec, group.rank, group.world_size))
        self.bias = (
            None
            if full.bias is None
            else nn.Parameter(shard(full.bias.detach(), self.bias_spec, group.rank, group.world_size))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """`y = x W^T + b` with W's columns (input features) split over the TP ranks: the input is
    this rank's features, the partial products are all-reduced, and the replicated bias is
    added once, after the reduce."""

    def __init__(self, full: nn.Linear, group: TPGroup) -> None:
        super().__init__()
        self.group = group
        self.weight_spec, self.bias_spec = Sharded(1), None
        self.weight = nn.Parameter(shard(full.weight.detach(), self.weight_spec, group.rank, group.world_size))
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


_PARALLEL = (ColumnParallelLinear, RowParallelLinear)


def set_tp_group(model: nn.Module, group: TPGroup, adopt: bool = False) -> None:
    """Point every parallel layer of `model` at `group` (a rebuilt group of the same layout).
    With `adopt` the group may be another TP coordinate than the one the layers were cut for:
    a shadow adopting a rank, whose slice values all come from its recovery (every TP rank's
    slice has the same shapes)."""
    for m in model.modules():
        if isinstance(m, _PARALLEL):
            if group.world_size != m.group.world_size or (group.rank != m.group.rank and not adopt):
                raise ValueError(
                    f"TP group rank {group.rank} of {group.world_size} replaces rank {m.group.rank} "
                    f"of {m.group.world_size}: a model's slices belong to one TP coordinate"
                )
            m.group = group


def tp_layout(model: nn.Module) -> dict[str, Sharded | None]:
    """For each parameter of `model` (by `named_parameters` name and order): how it is split over
    the TP ranks, or None where it is replicated.

    After a backward, a replicated parameter's gradient is identical, bit for bit, on every TP
    rank (the activations it sees are replicated, and the gradients entering them from the
    parallel layers are all-reduced; on a GPU this takes deterministic kernels, which Leto's jobs
    run with), so it counts once in a global gradient norm and needs no
    reduction over TP; a sharded parameter's gradient is this rank's slice of the full one.
    """
    specs: dict[str, Sharded | None] = {}
    for mod_name, m in model.named_modules():
        if isinstance(m, _PARALLEL):
            prefix = f"{mod_name}." if mod_name else ""
            specs[prefix + "weight"] = m.weight_spec
            specs[prefix + "bias"] = m.bias_spec
    return {name: specs.get(name) for name, _ in model.named_parameters()}


def shard_state_dict(
    full: dict[str, torch.Tensor], layout: dict[str, Sharded | None], rank: int, tp: int
) -> dict[str, torch.Tensor]:
    """TP rank `rank`'s state dict cut from the full model's (inverse of `unshard_state_dicts`):
    what loads a full checkpoint into a TP model."""
    return {name: shard(value, spec, rank, tp) if (spec := layout.get(name)) else value for name, value in full.items()}


def unshard_state_dicts(
    states: Sequence[dict[str, torch.Tensor]], layout: dict[str, Sharded | None]
) -> dict[str, torch.Tensor]:
    """The full model's state dict from the state dicts of every TP rank, in rank order: sharded
    entries reassembled, the rest taken from rank 0."""
    return {
        name: unshard([s[name] for s in states], spec) if (spec := layout.get(name)) else value
        for name, value in states[0].items()
    }


def gather_full_state_dict(model: nn.Module, group: TPGroup) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict of `model`, loadable into the model it was cut from, on
    every rank of `group` (a collective: every TP rank calls it). One all-gather carries every
    sharded tensor, so they share one dtype."""
    layout = tp_layout(model)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    names = [n for n in state if layout.get(n)]
    if group.world_size == 1 or not names:
        return {k: v.clone() for k, v in state.items()}
    if len({state[n].dtype for n in names}) > 1:
        raise TypeError("the sharded tensors of a TP model must share one dtype")
    local = torch.cat([state[n].reshape(-1) for n in names])
    out = torch.empty(group.world_size * local.numel(), dtype=local.dtype, device=local.device)
    group.all_gather(out, local)
    states = []
    for flat in out.chunk(group.world_size):
        pieces = flat.split([state[n].numel() for n in names])
        states.append({**state, **{n: p.view_as(state[n]) for n, p in zip(names, pieces)}})
    return {k: v.clone() for k, v in unshard_state_dicts(states, layout).items()}


class PendingGroup:
    """A TP coordinate whose group is not connected yet: what a model is cut with before the
    job's communicators exist (`leto.Trainer` swaps in its TP Comm with `set_tp_group` when it
    connects). Its collectives refuse to run."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def all_reduce(self, t: torch.Tensor) -> None:
        raise RuntimeError("the TP group is not connected yet: run the model inside `trainer.steps()`")

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.all_reduce(out)


def pending_group(job: Job) -> PendingGroup:
    """What this process cuts its model with before the job's groups exist: its TP coordinate,
    or TP rank 0 for a shadow, which has none until it adopts a rank (every TP rank's slice has
    the same shapes, and an adopter's values come from its recovery)."""
    tp = job.config.mesh.tp
    return PendingGroup(0 if job.mesh is None else job.mesh.tp_rank, tp)
