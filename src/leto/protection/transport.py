"""Tier-2 transport: the batches of contributions keepers send each other over their gloo group,
one `Link` per peer keeper (docs/protection.md)."""

from __future__ import annotations

import queue
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from leto.protection import doorbell
from leto.protection.layout import Layout
from leto.protection.shm import KIND_DELTA, KIND_GRAD
from leto.runtime import linux, threads

if TYPE_CHECKING:
    from leto.protection.keeper import Keeper

HDR = 8  # int64 fields in a tier-2 message header
TAG = {KIND_GRAD: 1, KIND_DELTA: 2}
SEND_BUFFERS = 2  # tier-2 batches per link and kind (one filling, one in flight)
BATCH_BYTES = 1 << 20  # largest tier-2 message: memory per protected byte against gloo's cost per message
KEEPALIVES_PER_TIMEOUT = 4  # an idle tier-2 link carries a keepalive this many times per timeout (docs/protection.md)


def kinds(layout: Layout) -> dict[int, int]:
    """Bytes of one chunk of each kind of data the keepers of this layout take."""
    g = layout.geometry
    return (
        {KIND_GRAD: g.grad_bytes, KIND_DELTA: g.state_bytes} if layout.protects_grads else {KIND_DELTA: g.state_bytes}
    )


def records_per_batch(layout: Layout, nbytes: int) -> int:
    """Records of `nbytes` in one tier-2 batch: up to a step's chunks of the largest node, within
    BATCH_BYTES (the same for every keeper: receivers size their buffers by it)."""
    return max(1, min(layout.positions_per_node, BATCH_BYTES // (HDR * 8 + nbytes)))


def batch_buffer_bytes(layout: Layout, node: int) -> int:
    """Bytes of `node`'s keeper's tier-2 batch buffers: SEND_BUFFERS per kind on every link it
    ships over, one per kind on every link it receives from."""
    senders, receivers = set(layout.senders_to(node)), set(layout.receivers_from(node))
    total = 0
    for nb in kinds(layout).values():
        size = 8 + records_per_batch(layout, nb) * (HDR * 8 + nb)
        total += size * (SEND_BUFFERS * len(receivers - {node}) + len(senders - {node}))
    return total


class Link:
    """Tier-2 traffic with one other keeper: a sender thread and receiver threads.

    Contributions travel in batches: a message holds up to `per_msg[kind]` records (a header of
    HDR int64 and the chunk) after a leading record count; the keeper flushes a batch when it is
    full, when every local chunk of a step has been shipped, and before a drain. gloo costs about
    as much per message as per megabyte here, so one message a step instead of one a chunk
    halves the transport's CPU. gloo's send/recv work objects cannot be polled (`is_completed()`
    stays False until `wait()`), so each direction blocks in its own thread; the GIL is released
    while it waits. Every wait is bounded by the group's timeout (the job's); a link with nothing
    to send sends an empty batch (a keepalive) several times per timeout, so only a peer that is
    stuck or cut off lets a wait run out (docs/protection.md, "Timeouts").
    """

    def __init__(self, keeper: Keeper, node: int, send: bool, recv: bool) -> None:
        self.keeper, self.node = keeper, node
        self.peer_rank = keeper.layout.nodes.index(node)
        self.sent = {k: 0 for k in TAG}  # messages
        self.received = {k: 0 for k in TAG}
        self.free: dict[int, queue.SimpleQueue[int]] = {}
        self.bufs: dict[int, list[torch.Tensor]] = {}
        self.raw: dict[int, list[np.ndarray]] = {}  # the same buffers as numpy arrays
        self.open: dict[int, list[int]] = {}  # kind -> [buffer, records in it]
        self.outbox: queue.SimpleQueue[tuple[int, int, int] | None] = queue.SimpleQueue()
        self.error: str | None = None
        self.keepalive = torch.zeros(8, dtype=torch.uint8)  # a batch of no records
        if send:
            for kind in keeper.nbytes:
                size = 8 + keeper.per_msg[kind] * keeper.record_bytes(kind)
                self.bufs[kind] = [torch.zeros(size, dtype=torch.uint8) for _ in range(SEND_BUFFERS)]
                self.raw[kind] = [b.numpy() for b in self.bufs[kind]]
                self.free[kind] = queue.SimpleQueue()
                for i in range(SEND_BUFFERS):
                    self.free[kind].put(i)
            threads.start(self._send_loop, f"keeper-send-{node}")
        if recv:
            for kind in keeper.nbytes:
                threads.start(self._recv_loop, f"keeper-recv-{node}-{kind}", kind)

    def has_room(self, kind: int) -> bool:
        return kind in self.open or not self.free[kind].empty()

    def record(self, kind: int) -> tuple[np.ndarray, np.ndarray]:
        """The next record of this kind's open batch: its header (HDR int64) and its body (uint8)."""
        batch = self.open.get(kind)
        if batch is None:
            batch = self.open[kind] = [self.free[kind].get_nowait(), 0]
        i, n = batch
        batch[1] = n + 1
        rb = self.keeper.record_bytes(kind)
        rec = self.raw[kind][i][8 + n * rb : 8 + (n + 1) * rb]
        return rec[: HDR * 8].view(np.int64), rec[HDR * 8 :]

    def full(self, kind: int) -> bool:
        return self.open[kind][1] == self.keeper.per_msg[kind]

    def flush(self, kind: int) -> None:
        if kind not in self.open:
            return
        i, n = self.open.pop(kind)
        self.raw[kind][i][:8].view(np.int64)[0] = n
        self.outbox.put((kind, i, 8 + n * self.keeper.record_bytes(kind)))

    def idle(self) -> bool:
        return not self.open and all(q.qsize() == SEND_BUFFERS for q in self.free.values())

    def _send_loop(self) -> None:
        linux.name_thread("keeper-send")  # OS thread names: `leto bench overhead` reports CPU by thread
        while True:
            try:
                item = self.outbox.get(timeout=self.keeper.timeout_s / KEEPALIVES_PER_TIMEOUT)
            except queue.Empty:
                if not all(self._send(kind, self.keepalive, "a keepalive") for kind in self.keeper.nbytes):
                    return
                continue
            if item is None:
                return
            kind, i, used = item
            if not self._send(kind, self.bufs[kind][i][:used], "a batch"):
                return
            self.sent[kind] += 1
            self.free[kind].put(i)
            if self.keeper.wants_room:  # the main thread waits for a free buffer
                doorbell.ring_main()

    def _send(self, kind: int, data: torch.Tensor, what: str) -> bool:
        t0 = time.monotonic()
        try:
            self.keeper.pg.send([data], self.peer_rank, TAG[kind]).wait()
            return True
        except RuntimeError as e:
            self.fail(f"sending {what} to node {self.node} failed: {e}", time.monotonic() - t0)
            return False

    def fail(self, why: str, waited_s: float = 0.0) -> None:
        """This link is broken for the rest of its generation (a gloo error breaks the group)."""
        self.error = why
        self.keeper.link_failed(why, waited_s)

    def _recv_loop(self, kind: int) -> None:
        linux.name_thread("keeper-recv")
        rb, nbytes = self.keeper.record_bytes(kind), self.keeper.nbytes[kind]
        buf = torch.zeros(8 + self.keeper.per_msg[kind] * rb, dtype=torch.uint8)
        raw = buf.numpy()
        while not self.keeper.closed:
            t0 = time.monotonic()
            try:
                self.keeper.pg.recv([buf], self.peer_rank, TAG[kind]).wait()
            except RuntimeError as e:
                self.fail(f"receiving from node {self.node} failed: {e}", time.monotonic() - t0)
                return
            if self.keeper.closed:
                return
            n = int(raw[:8].view(np.int64)[0])
            if n == 0:  # a keepalive: the peer lives, it has nothing to send
                continue
            if not 0 < n <= self.keeper.per_msg[kind]:
                self.fail(f"node {self.node} sent a batch of {n} records (at most {self.keeper.per_msg[kind]})")
                return
            with self.keeper.lock:
                if not self.keeper.reported:  # after its report the region is what recovery reads
                    for r in range(n):
                        rec = raw[8 + r * rb : 8 + (r + 1) * rb]
                        _, step, _, stripe, p, i, crc, _ = rec[: HDR * 8].view(np.int64).tolist()
                        self.keeper.parity.fold_remote(kind, step, stripe, p, i, crc, rec[HDR * 8 : HDR * 8 + nbytes])
                    self.keeper.dirty = True
            self.received[kind] += 1
            doorbell.ring_main()
