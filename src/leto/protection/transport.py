"""Tier-2 transport: the batches of contributions keepers send each other over TCP, one `Link`
per peer keeper (docs/protection.md)."""

from __future__ import annotations

import queue
import socket
import struct
import time
from typing import TYPE_CHECKING

import numpy as np

from leto.protection import doorbell
from leto.protection.layout import Layout
from leto.protection.peer_sockets import read_exactly, send_all
from leto.protection.shm import KIND_DELTA, KIND_GRAD
from leto.runtime import linux, threads

if TYPE_CHECKING:
    from leto.protection.keeper import Keeper

HDR = 8  # int64 fields in a tier-2 record header
RECORD = struct.Struct(f"={HDR}q")  # a record header's fields, packed in place (cheaper than numpy's assignment)
PREFIX = 2  # int64 fields before a batch's records: its kind, its record count
KINDS = (KIND_GRAD, KIND_DELTA)  # the kinds of tier-2 data
SEND_BUFFERS = 2  # tier-2 batches per link and kind (one filling, one in flight)
BATCH_BYTES = 1 << 20  # largest tier-2 message: memory per protected byte against the cost per message
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


def scaled_links(layout: Layout, node: int) -> set[int]:
    """The nodes `node`'s keeper sends some scaled contribution to (a Reed-Solomon coefficient
    other than 1): those batches carry the scaled bodies; every other body is sent from its
    staging slot."""
    positions = len(layout.local_ranks(node)) * layout.geometry.n_chunks
    return {r.parity_node for pos in range(positions) for r in layout.routes(node, pos) if r.coef != 1}


def batch_buffer_bytes(layout: Layout, node: int) -> int:
    """Bytes of `node`'s keeper's tier-2 batch buffers: SEND_BUFFERS per kind on every link it
    ships over (headers, and the bodies of scaled contributions), one per kind on every link
    it receives from (whole records)."""
    senders, receivers = set(layout.senders_to(node)) - {node}, set(layout.receivers_from(node)) - {node}
    scaled = scaled_links(layout, node)
    total = 0
    for nb in kinds(layout).values():
        per_msg = records_per_batch(layout, nb)
        for n in receivers:
            total += SEND_BUFFERS * (PREFIX * 8 + per_msg * (HDR * 8 + (nb if n in scaled else 0)))
        total += len(senders) * (PREFIX * 8 + per_msg * (HDR * 8 + nb))
    return total


class Link:
    """Tier-2 traffic with one other keeper: a sender thread and a receiver thread, each on a
    TCP connection of its own (`peer_sockets.PeerSockets`), which it closes when it ends.

    Contributions travel in batches: a message is a prefix (PREFIX int64: kind, record count)
    and that many records (a header of HDR int64 and the chunk); the keeper flushes a batch
    when it is full, when it has taken every slot its workers staged (a batch holds the slots
    it sends from until it is sent, so one left open could hold the slot a worker waits for),
    and before a drain.
    Every read and write is bounded by the generation's timeout (the job's); a link with
    nothing to send sends an empty batch (a keepalive) several times per timeout, so only a
    peer that is stuck or cut off lets a read run out (docs/protection.md, "Timeouts"); a
    peer that dies closes its connections, which ends the link at once.
    """

    def __init__(
        self,
        keeper: Keeper,
        node: int,
        out: socket.socket | None,
        inbound: socket.socket | None,
        scaled: bool = True,
    ) -> None:
        self.keeper, self.node = keeper, node
        self.sent = {k: 0 for k in KINDS}  # messages
        self.received = {k: 0 for k in KINDS}
        self.free: dict[int, queue.SimpleQueue[int]] = {}
        self.bufs: dict[int, list[np.ndarray]] = {}
        self._records: dict[int, list[list[tuple[np.ndarray, np.ndarray]]]] = {}
        # per kind and buffer: where each record's body is sent from, and the staging slots the
        # batch holds (handed back once it is sent)
        self.bodies: dict[int, list[list[np.ndarray]]] = {}
        self.slots: dict[int, list[list[tuple[int, int]]]] = {}
        self.open: dict[int, list[int]] = {}  # kind -> [buffer, records in it]
        self.outbox: queue.SimpleQueue[tuple[int, int, int] | None] = queue.SimpleQueue()
        self.error: str | None = None
        self.scaled = scaled  # whether some contribution over this link is scaled (not sent from its slot)
        if out is not None:
            for kind, nb in keeper.nbytes.items():
                size = PREFIX * 8 + keeper.per_msg[kind] * (HDR * 8 + (nb if scaled else 0))
                self.bufs[kind] = [np.zeros(size, dtype=np.uint8) for _ in range(SEND_BUFFERS)]
                rb = HDR * 8 + (nb if scaled else 0)
                self._records[kind] = [  # each record's header (int64) and scratch body, as views made once
                    [
                        (buf[at : at + HDR * 8].view(np.int64), buf[at + HDR * 8 : at + rb])
                        for at in range(PREFIX * 8, size, rb)
                    ]
                    for buf in self.bufs[kind]
                ]
                self.bodies[kind] = [[] for _ in range(SEND_BUFFERS)]
                self.slots[kind] = [[] for _ in range(SEND_BUFFERS)]
                self.free[kind] = queue.SimpleQueue()
                for i in range(SEND_BUFFERS):
                    self.free[kind].put(i)
            threads.start(self._send_loop, f"keeper-send-{node}", out)
        if inbound is not None:
            threads.start(self._recv_loop, f"keeper-recv-{node}", inbound)

    def has_room(self, kind: int) -> bool:
        return kind in self.open or not self.free[kind].empty()

    def record(self, kind: int, body: np.ndarray | None = None, slot: tuple[int, int] | None = None) -> np.ndarray:
        """Add a record to this kind's open batch; returns its header (HDR int64) to fill. Its
        body is `body`, sent from where it is (staging slot `slot`, handed back to the keeper
        once the batch is sent), else a buffer of the batch's to fill (`scratch`)."""
        batch = self.open.get(kind)
        if batch is None:
            batch = self.open[kind] = [self.free[kind].get_nowait(), 0]
        i, n = batch
        batch[1] = n + 1
        header, scratch = self._records[kind][i][n]
        self.bodies[kind][i].append(scratch if body is None else body)
        if slot is not None:
            self.slots[kind][i].append(slot)
        return header

    def scratch(self, kind: int) -> np.ndarray:
        """The body of the record last added without one (`record`), to fill."""
        i, _ = self.open[kind]
        return self.bodies[kind][i][-1]

    def full(self, kind: int) -> bool:
        return self.open[kind][1] == self.keeper.per_msg[kind]

    def flush(self, kind: int) -> None:
        if kind not in self.open:
            return
        i, n = self.open.pop(kind)
        self.bufs[kind][i][: PREFIX * 8].view(np.int64)[:] = (kind, n)
        self.outbox.put((kind, i, n))

    def idle(self) -> bool:
        return not self.open and all(q.qsize() == SEND_BUFFERS for q in self.free.values())

    def _send_loop(self, sock: socket.socket) -> None:
        linux.name_thread("keeper-send")  # OS thread names: `leto bench overhead` reports CPU by thread
        keepalive = np.zeros(PREFIX, dtype=np.int64).view(np.uint8)  # a batch of no records
        with sock:
            while True:
                try:
                    item = self.outbox.get(timeout=self.keeper.timeout_s / KEEPALIVES_PER_TIMEOUT)
                except queue.Empty:
                    if not self._send(sock, [keepalive], "a keepalive"):
                        return
                    continue
                if item is None:
                    return
                kind, i, n = item
                buf, bodies, slots = self.bufs[kind][i], self.bodies[kind][i], self.slots[kind][i]
                rb = HDR * 8 + (self.keeper.nbytes[kind] if self.scaled else 0)
                parts = [buf[: PREFIX * 8]]
                for r in range(n):
                    at = PREFIX * 8 + r * rb
                    parts += (buf[at : at + HDR * 8], bodies[r])
                if not self._send(sock, parts, "a batch"):
                    return
                self.keeper.hand_back(slots)
                bodies.clear()
                slots.clear()
                self.sent[kind] += 1
                self.free[kind].put(i)
                if self.keeper.wants_room:  # the main thread waits for a free buffer
                    doorbell.ring_main()

    def _send(self, sock: socket.socket, parts: list[np.ndarray], what: str) -> bool:
        t0 = time.monotonic()
        try:
            send_all(sock, parts, self.keeper.timeout_s)
            return True
        except OSError as e:  # a timeout too
            if not self.keeper.closed:
                self.fail(f"sending {what} to node {self.node} failed: {e or type(e).__name__}", time.monotonic() - t0)
            return False

    def fail(self, why: str, waited_s: float = 0.0) -> None:
        """This link is broken for the rest of its generation."""
        self.error = why
        self.keeper.link_broken = True
        self.keeper.link_failed(why, waited_s)

    def _recv_loop(self, sock: socket.socket) -> None:
        linux.name_thread("keeper-recv")
        k = self.keeper
        prefix = np.zeros(PREFIX, dtype=np.int64)
        size = {kind: PREFIX * 8 + k.per_msg[kind] * k.record_bytes(kind) for kind in k.nbytes}  # as a sent batch
        bufs = {kind: np.zeros(nb, dtype=np.uint8) for kind, nb in size.items()}
        with sock:
            while not k.closed:
                t0 = time.monotonic()
                try:
                    read_exactly(sock, prefix.view(np.uint8))
                    kind, n = int(prefix[0]), int(prefix[1])
                    if n == 0:  # a keepalive: the peer lives, it has nothing to send
                        continue
                    if kind not in bufs or not 0 < n <= k.per_msg[kind]:
                        self.fail(f"node {self.node} sent a batch of {n} records of kind {kind}")
                        return
                    rb = k.record_bytes(kind)
                    raw = bufs[kind][PREFIX * 8 : PREFIX * 8 + n * rb]
                    read_exactly(sock, raw)
                except OSError as e:  # a timeout, or the peer closed its end
                    if not k.closed:
                        self.fail(
                            f"receiving from node {self.node} failed: {e or type(e).__name__}", time.monotonic() - t0
                        )
                    return
                folded = self._fold(kind, n, raw)
                if folded is None:
                    return
                self.received[kind] += 1
                if folded:
                    doorbell.ring_main()

    def _fold(self, kind: int, n: int, raw: np.ndarray) -> bool | None:
        """Fold a batch's `n` records into the parity (none once the keeper reported); whether
        the keeper's next barrier can be entered now (its main loop is rung then: a wake-up for
        every batch cost it more than the fold); None if a record names a place this keeper
        holds no parity of."""
        k = self.keeper
        rb, nbytes = k.record_bytes(kind), k.nbytes[kind]
        with k.lock:
            if k.reported:  # after its report the region is what recovery reads
                return False
            for r in range(n):
                rec = raw[r * rb : (r + 1) * rb]
                _, step, _, stripe, p, i, crc, _ = rec[: HDR * 8].view(np.int64).tolist()
                try:
                    k.parity.fold_remote(kind, step, stripe, p, i, crc, rec[HDR * 8 : HDR * 8 + nbytes])
                except (KeyError, IndexError, ValueError) as e:
                    self.fail(f"node {self.node} sent a record for stripe {stripe}, position {p}, offset {i}: {e!r}")
                    return None
            k.dirty = True
            return k.barrier.may_enter()
