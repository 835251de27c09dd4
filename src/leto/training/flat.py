"""Parameters on one flat buffer, and the state digest: shared by the trainer and the baselines."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping

import torch

DIGEST_TAG = b"leto-state-v1"


def flatten(params: list[torch.Tensor], size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed flat buffer of `size` elements (at least the parameters') holding the parameters'
    values in order; every parameter becomes a view of it."""
    flat = torch.zeros(size, device=device)
    offset = 0
    for p in params:
        n = p.numel()
        flat[offset : offset + n].copy_(p.data.view(-1))
        p.data = flat[offset : offset + n].view_as(p)
        offset += n
    return flat


def bind_grads(params: list[torch.Tensor], flat_grad: torch.Tensor) -> None:
    """Make every parameter's gradient a view of `flat_grad`, in the parameters' order."""
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat_grad[offset : offset + n].view_as(p)
        offset += n


def state_digest(
    step: int,
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    extra: Callable[[hashlib._Hash], None] | None = None,
) -> str:
    """sha256 of the step and the named tensors (as float32 bytes, in the given order), then
    whatever `extra` adds (the module buffers): independent of sharding when the tensors are
    the unsharded, unpadded state (params, master, exp_avg, exp_avg_sq)."""
    h = hashlib.sha256(DIGEST_TAG)
    h.update(step.to_bytes(8, "little"))
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    for name, t in items:
        h.update(name.encode())
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    if extra is not None:
        extra(h)
    return h.hexdigest()
