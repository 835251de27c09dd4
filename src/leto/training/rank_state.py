"""The small state beside the optimizer shard that shapes a rank's future arithmetic.

- **RNG streams** are reseeded at the start of every step as a pure function of (seed, step,
  rank): a replayed step, or the adopter of a lost rank, draws exactly what the failure-free run
  drew, and nothing has to be carried.
- **Module buffers** (persistent ones: those in `state_dict()`, e.g. BatchNorm statistics) follow
  DDP's rule: rank 0's values are everyone's. They travel with each step's gradient reduction.
- **Registered user state** (any object with `state_dict()`/`load_state_dict()`, e.g. a stateful
  data loader) is per rank; every rank's is replicated to all ranks with each step, so a
  survivor holds a lost rank's.

Each step's extra state is one small all-gather (sizes, then bytes) right after the gradients
are reduced: whoever holds a step's reduced gradients holds its extra state too, which is what
the recovery point needs (docs/design.md, "Exact recovery for any model").
"""

from __future__ import annotations

import hashlib
import random
import sys
from typing import Any, Protocol

import torch
import torch.nn as nn

from leto.runtime import plain
from leto.runtime.comm import Comm

KEEP_STEPS = 3  # tables kept behind the current step: a recovery rolls back at most one step


class Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any) -> None: ...


def step_seed(seed: int, step: int, rank: int) -> int:
    """A 63-bit seed, a pure function of (seed, step, rank)."""
    h = hashlib.blake2b(f"{seed}:{step}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


def reseed(seed: int, step: int, rank: int) -> None:
    """Seed torch's generators (CPU and every CUDA device), Python's and NumPy's global ones."""
    s = step_seed(seed, step, rank)
    torch.manual_seed(s)
    random.seed(s)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(s % 2**32)


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers that are state (in `state_dict()`); non-persistent ones are derived constants."""
    keys = set(model.state_dict().keys())
    return {name: b for name, b in model.named_buffers() if name in keys}


def user_state(name: str, obj: Stateful) -> Any:
    """`obj.state_dict()`, checked to be tensors and plain data (NotPlainData, naming `name`,
    otherwise): what other ranks receive is decoded without running code."""
    state = obj.state_dict()
    plain.check(state, f"state {name!r}: state_dict()")
    return state


class RankState:
    """Buffers and registered user state of one rank, and the per-step tables that replicate them.

    `tables[step] = {"buffers": bytes | None, "user": {proc_id: bytes}}`: what every rank held at
    the end of `step` (before the optimizer update of step+1 fetched its batch).
    """

    def __init__(self, model: nn.Module) -> None:
        self.buffers = persistent_buffers(model)
        self.stateful: dict[str, Stateful] = {}
        self.tables: dict[int, dict[str, Any]] = {}
        self.pending: dict[str, Any] = {}  # recovered user state of objects not registered yet

    @property
    def active(self) -> bool:
        return bool(self.buffers or self.stateful)

    def register(self, name: str, obj: Stateful) -> None:
        """Carry `obj` from now on; TypeError (NotPlainData) if its `state_dict()` holds anything
        but tensors and plain data."""
        if not callable(getattr(obj, "state_dict", None)) or not callable(getattr(obj, "load_state_dict", None)):
            raise TypeError(f"state {name!r} must have state_dict() and load_state_dict()")
        if name in self.stateful:
            raise ValueError(f"state {name!r} is registered already")
        user_state(name, obj)  # a state that cannot travel fails here, not at a recovery
        self.stateful[name] = obj
        if name in self.pending:  # registered after the recovery that restored it (an adopter)
            obj.load_state_dict(self.pending.pop(name))

    # ----- this rank's live state
    def state(self) -> dict[str, Any]:
        """This rank's buffers and user state now (a copy)."""
        return {
            "buffers": {k: b.detach().clone() for k, b in self.buffers.items()},
            "user": {k: user_state(k, obj) for k, obj in self.stateful.items()},
        }

    def load(self, state: dict[str, Any]) -> None:
        self._load_buffers(state.get("buffers") or {})
        for k, v in (state.get("user") or {}).items():
            if k in self.stateful:
                self.stateful[k].load_state_dict(v)
            else:  # registered later (a resumed job registers its loader in the loop)
                self.pending[k] = v

    def _load_buffers(self, values: dict[str, torch.Tensor]) -> None:
        for k, v in values.items():
            if k not in self.buffers:
                raise KeyError(f"buffer {k!r} is not one of the model's")
            with torch.no_grad():
                self.buffers[k].copy_(v)

    # ----- collectives
    def gather(self, comm: Comm, step: int, rank: int, procs: list[str]) -> None:
        """Replicate this step's extra state (a collective): rank 0's buffers become every rank's,
        and every rank's user state is recorded in `tables[step]`."""
        # state loaded for an object not registered yet travels on until it is registered
        user = {**self.pending, **{k: user_state(k, obj) for k, obj in self.stateful.items()}}
        mine = plain.dumps(
            {"buffers": {k: b.detach() for k, b in self.buffers.items()} if rank == 0 else None, "user": user}
        )
        parts = _all_gather_bytes(comm, mine, rank, len(procs))
        decoded = [plain.loads(p, f"the state rank {q} sent at step {step}") for q, p in enumerate(parts)]
        if rank != 0:
            self._load_buffers(decoded[0]["buffers"])
        self.tables[step] = {"buffers": parts[0], "user": {procs[q]: p for q, p in enumerate(parts)}}
        for s in [s for s in self.tables if s < step - KEEP_STEPS]:
            del self.tables[s]

    def restore(self, comm: Comm, step: int, rank: int, world: int, lineage: list[str]) -> bool:
        """At a recovery to `step` (a collective): the lowest member holding the step's table
        sends it; everyone loads rank 0's buffers and the user state of the first process of
        `lineage` (itself, or the lost processes it continues) found in it. False when no member
        holds the table (then nothing changes)."""
        key = torch.tensor([world - 1 - rank if step in self.tables else -1], dtype=torch.int64)
        comm.all_reduce(key, torch.distributed.ReduceOp.MAX)
        if int(key.item()) < 0:
            return False
        src = world - 1 - int(key.item())
        data = plain.dumps(self.tables[step]) if rank == src else b""
        table = plain.loads(_broadcast_bytes(comm, data, src), f"the state table rank {src} sent for step {step}")
        self.tables[step] = table
        self._load_buffers(plain.loads(table["buffers"], f"rank 0's buffers of step {step}")["buffers"])
        for proc in lineage:
            if proc in table["user"]:
                user = plain.loads(table["user"][proc], f"the state of process {proc} at step {step}")["user"]
                self.load({"user": user})
                self.pending = {k: v for k, v in user.items() if k not in self.stateful}
                break
        for s in [s for s in self.tables if s > step]:  # the steps after it are redone
            del self.tables[s]
        return True

    def update_digest(self, h: hashlib._Hash) -> None:
        for k, b in self.buffers.items():
            h.update(f"buffer:{k}".encode())
            h.update(b.detach().to("cpu").reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())


def _all_gather_bytes(comm: Comm, data: bytes, rank: int, world: int) -> list[bytes]:
    sizes = torch.zeros(world, dtype=torch.int64)
    sizes[rank] = len(data)
    comm.all_reduce(sizes)
    width = int(sizes.max().item())
    mine = torch.zeros(width, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = torch.zeros(world * width, dtype=torch.uint8)
    comm.all_gather(out, mine)
    return [out[q * width : q * width + int(sizes[q])].numpy().tobytes() for q in range(world)]


def _broadcast_bytes(comm: Comm, data: bytes, src: int) -> bytes:
    size = torch.tensor([len(data)], dtype=torch.int64)
    comm.broadcast(size, src)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8)
    if data:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    comm.broadcast(buf, src)
    return buf.numpy().tobytes()
