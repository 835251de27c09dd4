"""AdamW on flat fp32 chunks of (master weights, exp_avg, exp_avg_sq)."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

MASTER, EXP_AVG, EXP_AVG_SQ = 0, 1, 2


@dataclass(frozen=True)
class AdamW:
    """Decoupled-weight-decay Adam, the same math as `torch.optim.AdamW`."""

    lr: float | Callable[[int], float] = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1

    def lr_at(self, step: int) -> float:
        return self.lr(step) if callable(self.lr) else self.lr

    def update(self, src: torch.Tensor, grad: torch.Tensor, dst: torch.Tensor, step: int,
               scratch: torch.Tensor) -> None:
        """dst = one AdamW step (1-based `step`) of the chunk `src` ([3, E]); dst may be src."""
        b1, b2 = self.betas
        lr = self.lr_at(step)
        bc1 = 1.0 - b1 ** step
        bc2_sqrt = math.sqrt(1.0 - b2 ** step)
        torch.mul(src[EXP_AVG], b1, out=dst[EXP_AVG]).add_(grad, alpha=1.0 - b1)
        torch.mul(src[EXP_AVG_SQ], b2, out=dst[EXP_AVG_SQ]).addcmul_(grad, grad, value=1.0 - b2)
        torch.sqrt(dst[EXP_AVG_SQ], out=scratch).div_(bc2_sqrt).add_(self.eps)
        torch.mul(src[MASTER], 1.0 - lr * self.weight_decay, out=dst[MASTER])
        dst[MASTER].addcdiv_(dst[EXP_AVG], scratch, value=-lr / bc1)


def warmup_cosine(peak: float, warmup: int, total: int, floor: float = 0.1) -> Callable[[int], float]:
    """Linear warm-up to `peak`, then cosine decay to `floor * peak` at `total` steps."""
    def lr(step: int) -> float:
        if step <= warmup:
            return peak * step / max(1, warmup)
        frac = min(1.0, (step - warmup) / max(1, total - warmup))
        return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))
    return lr
