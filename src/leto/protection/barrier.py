"""The keepers' commit barrier: step by step, the keepers agree on what is committed (one
allreduce over their group once a step is complete here), and at a drain they settle the
barrier in flight so that every keeper reports the same committed step (docs/protection.md)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from leto.errors import BadValue
from leto.protection import doorbell
from leto.protection.shm import H_DCOMMIT, H_GCOMMIT, KIND_DELTA, KIND_GRAD
from leto.protocol import keys
from leto.protocol.messages import Refusals
from leto.protocol.protection import DONE, FAILED, IN_FLIGHT, NOT_ENTERED, BarrierState, BaseCommitted
from leto.runtime import linux, threads

if TYPE_CHECKING:
    from leto.protection.keeper import Keeper

_refused = Refusals("leto keeper")  # malformed store values this keeper ignored (said once each)


class CommitBarrier:
    """The sequence of barriers of one keeper's generation: D(base), G(base+1), D(base+1), ...;
    without gradients D(base), D(P1), D(P2), ... (P: the protected steps, every step unless an
    interval). D(s) commits the deltas of step s (`H_DCOMMIT`), G(s) its gradients (`H_GCOMMIT`)."""

    def __init__(self, keeper: Keeper) -> None:
        self.keeper = keeper
        self.next = (KIND_DELTA, keeper.layout.base_step)
        self.work: dist.Work | None = None
        self.done = threading.Event()
        self.failed = False
        self.buf = torch.zeros(1)
        self.broken = False
        self._works: queue.SimpleQueue[dist.Work | None] | None = None  # to `_await`'s thread, started once

    def advance(self) -> bool:
        """Take the next step of the sequence when there is one to take; whether it took one."""
        k = self.keeper
        h = k.region.header
        kind, step = self.next
        if self.broken:
            return False
        if self.work is not None:
            if not self.done.is_set():
                return False
            if self.failed:  # another keeper died: nothing more commits in this generation
                self.broken = True
                return False
            self.work = None
            k.dirty = True  # the next barrier may already be complete
            if kind == KIND_DELTA:
                h[H_DCOMMIT] = step
                if step == k.layout.base_step:
                    k.store.set(keys.committed(k.gen, k.node), BaseCommitted().to_json())
                self.next = (KIND_GRAD, step + 1) if k.grads else (KIND_DELTA, k.layout.next_protected(step))
            else:
                h[H_GCOMMIT] = step
                self.next = (KIND_DELTA, step)
            return True
        if not k.dirty:  # nothing was folded since the last check
            return False
        with k.lock:
            k.dirty = False
            done = self._complete(kind, step)
        if done:
            self.done.clear()
            self.work = k.pg.allreduce([self.buf])
            if self._works is None:
                self._works = queue.SimpleQueue()
                threads.start(self._await, f"keeper-barrier-g{k.gen}", self._works)
            self._works.put(self.work)
            return True
        return False

    def may_enter(self) -> bool:
        """Whether the next barrier is not in flight and its step is complete here (call under
        the keeper's lock): a thread that folded something rings the main loop only then (a
        barrier in flight rings it itself when it ends, and the main loop looks again)."""
        if self.work is not None or self.broken:
            return False
        return self._complete(*self.next)

    def _complete(self, kind: int, step: int) -> bool:
        """Whether barrier (kind, step) has everything it waits for folded here."""
        parity = self.keeper.parity
        return parity.deltas_complete(step) if kind == KIND_DELTA else parity.grads_complete(step)

    def close(self) -> None:
        """End `_await`'s thread (a barrier still in flight is waited out first)."""
        if self._works is not None:
            self._works.put(None)

    def settle(self, live_nodes: set[int], timeout_s: float, abandoned: Callable[[], bool]) -> None:
        """After a drain was read, before the commit is judged: finish the barrier in flight, so
        that every keeper reports the same committed step. A barrier completes for all keepers
        or for none, and its completion reaches the main loop only through `_await`'s
        thread; a keeper that saw the drain first would otherwise report the step as
        uncommitted while a peer that processed the completion reports it committed. Each
        keeper publishes where it stopped; one in flight waits until its barrier resolves,
        or a live peer says it never entered it or saw it fail (then it cannot complete here
        either: a peer that keeps waiting on a dead keeper is not told by gloo), or the timeout."""
        k = self.keeper
        kind, step = self.next
        in_flight = self.work is not None
        mine = keys.barrier_state(k.gen, k.node)
        k.store.set(mine, BarrierState(kind, step, IN_FLIGHT if in_flight else NOT_ENTERED).to_json())
        if not in_flight:
            return
        deadline = time.monotonic() + timeout_s
        peers = [keys.barrier_state(k.gen, n) for n in sorted(live_nodes) if n != k.node and n in k.layout.nodes]
        while not self.done.wait(1e-3):
            if time.monotonic() > deadline or abandoned():
                return
            if any(self._peer_hopeless(key, kind, step) for key in peers):
                return
        self.advance()  # record the completion (or the failure) like the main loop does
        k.store.set(mine, BarrierState(kind, step, FAILED if self.broken else DONE).to_json())

    def _peer_hopeless(self, key: str, kind: int, step: int) -> bool:
        """Whether the peer that publishes at `key` says barrier (kind, step) cannot complete."""
        if not self.keeper.store.check([key]):
            return False
        value = self.keeper.store.get(key)
        try:
            peer = BarrierState.from_json(value, key)
        except BadValue as e:  # no evidence either way: the barrier's own deadline decides
            _refused.refuse(e, value)
            return False
        return (peer.kind, peer.step) == (kind, step) and peer.hopeless()

    def _await(self, works: queue.SimpleQueue[dist.Work | None]) -> None:
        """Wait for each barrier in turn in one thread (gloo work cannot be polled cheaply; one
        thread for the generation, not one a barrier) and ring."""
        linux.name_thread("keeper-barrier")
        while (work := works.get()) is not None:
            t0 = time.monotonic()
            try:
                work.wait()
            except RuntimeError as e:
                self.failed = True
                self.keeper.link_failed(f"the commit barrier failed: {e}", time.monotonic() - t0)
            self.done.set()
            doorbell.ring_main()
