"""Elementwise optimizers on flat fp32 chunks of state rows `[3, E]`: (master weights, state A,
state B). Each gives the same bits as its `torch.optim` counterpart with `foreach=False,
fused=False` on the same gradients (tests/test_optim.py).

Any elementwise optimizer plugs in: a frozen dataclass with `lr` (a float or a function of the
1-based step) and `update(src, grad, dst, step, scratch)` that writes `dst` from `src` (`dst` may
be `src`) using at most the two state rows; see docs/optimizers.md for a worked example (Lion).
The trainer applies it per chunk, also to replay a chunk after a recovery, so it must be a pure
function of its arguments.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

MASTER, EXP_AVG, EXP_AVG_SQ = 0, 1, 2
MOMENTUM = 1  # SGD's momentum buffer is state row A


class Optimizer(Protocol):
    lr: float | Callable[[int], float]

    def update(
        self, src: torch.Tensor, grad: torch.Tensor, dst: torch.Tensor, step: int, scratch: torch.Tensor
    ) -> None: ...


def lr_at(opt: Optimizer, step: int) -> float:
    """The learning rate of 1-based `step` (a schedule is a pure function of the step)."""
    return opt.lr(step) if callable(opt.lr) else opt.lr


def _adam(
    src: torch.Tensor,
    grad: torch.Tensor,
    dst: torch.Tensor,
    step: int,
    scratch: torch.Tensor,
    lr: float,
    betas: tuple[float, float],
    eps: float,
) -> None:
    """The moments and the step of `torch.optim.adam._single_tensor_adam` (dst[MASTER] already
    holds the decayed weights); dst may be src."""
    b1, b2 = betas
    torch.lerp(src[EXP_AVG], grad, 1 - b1, out=dst[EXP_AVG])
    torch.mul(src[EXP_AVG_SQ], b2, out=dst[EXP_AVG_SQ]).addcmul_(grad, grad, value=1 - b2)
    bias_correction1 = 1 - b1**step
    bias_correction2_sqrt = (1 - b2**step) ** 0.5
    torch.sqrt(dst[EXP_AVG_SQ], out=scratch).div_(bias_correction2_sqrt).add_(eps)
    dst[MASTER].addcdiv_(dst[EXP_AVG], scratch, value=-(lr / bias_correction1))


@dataclass(frozen=True)
class AdamW:
    """Decoupled weight decay Adam: the bits of `torch.optim.AdamW(foreach=False, fused=False)`."""

    lr: float | Callable[[int], float] = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1

    def lr_at(self, step: int) -> float:
        return lr_at(self, step)

    def update(
        self, src: torch.Tensor, grad: torch.Tensor, dst: torch.Tensor, step: int, scratch: torch.Tensor
    ) -> None:
        """dst = one AdamW step (1-based `step`) of the chunk `src` ([3, E]); dst may be src."""
        lr = self.lr_at(step)
        if self.weight_decay != 0:
            torch.mul(src[MASTER], 1 - lr * self.weight_decay, out=dst[MASTER])
        elif dst is not src:
            dst[MASTER].copy_(src[MASTER])
        _adam(src, grad, dst, step, scratch, lr, self.betas, self.eps)


@dataclass(frozen=True)
class Adam:
    """Adam with L2 weight decay added to the gradient: the bits of `torch.optim.Adam`."""

    lr: float | Callable[[int], float] = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def update(
        self, src: torch.Tensor, grad: torch.Tensor, dst: torch.Tensor, step: int, scratch: torch.Tensor
    ) -> None:
        if self.weight_decay != 0:
            grad = grad.add(src[MASTER], alpha=self.weight_decay)
        if dst is not src:
            dst[MASTER].copy_(src[MASTER])
        _adam(src, grad, dst, step, scratch, lr_at(self, step), self.betas, self.eps)


@dataclass(frozen=True)
class SGD:
    """SGD with momentum, dampening, Nesterov and L2 weight decay: the bits of `torch.optim.SGD`
    (state row A is the momentum buffer; row B is unused)."""

    lr: float | Callable[[int], float] = 1e-2
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    def update(
        self, src: torch.Tensor, grad: torch.Tensor, dst: torch.Tensor, step: int, scratch: torch.Tensor
    ) -> None:
        if self.weight_decay != 0:
            grad = grad.add(src[MASTER], alpha=self.weight_decay)
        if self.momentum != 0:
            buf = dst[MOMENTUM]
            if step == 1:  # torch starts the buffer as a copy of the first gradient
                buf.copy_(grad)
            else:
                torch.mul(src[MOMENTUM], self.momentum, out=buf).add_(grad, alpha=1 - self.dampening)
            grad = grad.add(buf, alpha=self.momentum) if self.nesterov else buf
        elif dst is not src:
            dst[MOMENTUM].copy_(src[MOMENTUM])
        torch.add(src[MASTER], grad, alpha=-lr_at(self, step), out=dst[MASTER])
        if dst is not src:
            dst[EXP_AVG_SQ].copy_(src[EXP_AVG_SQ])


def warmup_cosine(peak: float, warmup: int, total: int, floor: float = 0.1) -> Callable[[int], float]:
    """Linear warm-up to `peak`, then cosine decay to `floor * peak` at `total` steps."""

    def lr(step: int) -> float:
        if step <= warmup:
            return peak * step / max(1, warmup)
        frac = min(1.0, (step - warmup) / max(1, total - warmup))
        return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))

    return lr
