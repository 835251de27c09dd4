"""How a rank's chunks reach host memory on their way to the keeper.

On the CPU a chunk's bytes are a view (no copy). On a GPU each chunk is copied device-to-host
into a pinned buffer on a side stream: the copy waits only for the work queued before it on
the compute stream, and the compute stream never waits for the copy, so the next kernels run
while the host XORs and checksums the bytes (docs/design.md, "The GPU path"). Two buffers, so
a delta's old and new chunk can be on the host at once.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A uint8 view of a contiguous tensor's bytes: no copy on the CPU; a device tensor is
    copied to the host first (recovery reads a chunk at a time; the step uses `HostStaging`)."""
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.detach() if t.requires_grad else t
    if not t.is_contiguous():  # a reshape would copy: a chunk's bytes are always a view
        raise ValueError(f"a non-contiguous tensor of shape {tuple(t.shape)} has no byte view")
    try:
        return t.numpy().view(np.uint8).reshape(-1)  # numpy's views cost a third of torch's
    except TypeError:  # a dtype numpy lacks (bfloat16)
        return t.view(-1).view(torch.uint8).numpy()


VIEWS_KEPT = 256  # byte views a CPU `HostStaging` keeps: every chunk of a shard's buffers, and then some


class HostStaging:
    """Host bytes of device chunks of at most `nbytes` bytes, through `slots` pinned buffers.

    On the CPU (no copy) the byte view of each chunk is made once and kept, by address and
    size: a step asks for the same chunks every step, and on a busy machine making a view costs
    as much as checksumming a chunk. `copy=True` on the CPU sends CPU tensors through the same
    (unpinned) buffers: the path a GPU job takes, testable without one."""

    def __init__(self, nbytes: int, device: torch.device, slots: int = 2, copy: bool | None = None) -> None:
        self.device = device
        self._views: dict[tuple[int, int], np.ndarray] = {}
        self.copy = device.type == "cuda" if copy is None else copy
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        pinned = device.type == "cuda"
        self.bufs = (
            [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(slots)] if self.copy else []
        )

    def host(self, t: torch.Tensor, slot: int = 0) -> np.ndarray:
        """The bytes of contiguous `t` on the host, valid until `slot` is used again."""
        if not self.copy:
            return self._view(t)
        src = t.detach().reshape(-1).view(torch.uint8)
        if src.numel() > self.bufs[slot].numel():
            raise ValueError(
                f"a chunk of {src.numel()} bytes does not fit the {self.bufs[slot].numel()}-byte staging buffer"
            )
        dst = self.bufs[slot][: src.numel()]
        if self.stream is None or src.device.type == "cpu":  # a host tensor (a resharded state): no device copy
            dst.copy_(src)
            return dst.numpy()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the chunk's producers first
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            src.record_stream(self.stream)  # the caching allocator must not reuse src before the copy
        self.stream.synchronize()  # the host needs the bytes; the compute stream goes on
        return dst.numpy()

    def address(self, t: torch.Tensor, slot: int = 0) -> int:
        """The address of the bytes `host(t, slot)` returned last (call that first)."""
        return self.bufs[slot].data_ptr() if self.copy else t.data_ptr()

    def _view(self, t: torch.Tensor) -> np.ndarray:
        """`as_bytes(t)`, made once per address and size. The table's views hold no memory
        alive (they are views of an address, not of a tensor), so a chunk freed and another
        allocated at its address with its size finds the right bytes, and a view is only
        handed out for a tensor the caller holds."""
        if not t.is_contiguous() or t.device.type != "cpu" or not t.nbytes:
            return as_bytes(t)
        key = (t.data_ptr(), t.nbytes)
        v = self._views.get(key)
        if v is None:
            if len(self._views) >= VIEWS_KEPT:
                self._views.clear()
            v = self._views[key] = np.frombuffer((ctypes.c_uint8 * key[1]).from_address(key[0]), dtype=np.uint8)
        return v
