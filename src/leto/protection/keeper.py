"""The keeper: one process per node that holds the node's protection data in shared memory.

It outlives worker crashes. Workers hand it chunks through staging slots; it folds them into
tier-1 XOR parity, ships tier-2 contributions to other nodes' keepers over its own gloo group,
folds the contributions it receives, and agrees with the other keepers, step by step, on what
is committed (see docs/protection.md).
"""
from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist

from leto.protection import doorbell
from leto.protection.codec import scale_into, xor_into
from leto.protection.layout import Layout
from leto.protection.shm import (
    H_BASE,
    H_DCOMMIT,
    H_GCOMMIT,
    H_GEN,
    H_MAGIC,
    H_PID,
    H_STATE,
    KIND_DELTA,
    KIND_GRAD,
    MAGIC,
    S_CHUNK,
    S_CRC,
    S_KIND,
    S_READY,
    S_STEP,
    STATE_DRAINED,
    STATE_RUNNING,
    Region,
    check_store_order,
)
from leto.errors import BadValue
from leto.protocol import keys
from leto.protocol.messages import Refusals
from leto.protocol.protection import (
    DONE,
    FAILED,
    IN_FLIGHT,
    NOT_ENTERED,
    BarrierState,
    BaseCommitted,
    Drain,
    KeeperReady,
    KeeperReport,
    SentCounts,
    StripeReport,
)
from leto.runtime import env as rt
from leto.runtime import linux, threads, trace
from leto.runtime.membership import Heartbeat, read_plan

HDR = 8           # int64 fields in a tier-2 message header
TAG = {KIND_GRAD: 1, KIND_DELTA: 2}
SEND_BUFFERS = 2  # tier-2 batches per link and kind (one filling, one in flight)
BATCH_BYTES = 1 << 20  # largest tier-2 message: memory per protected byte against gloo's cost per message
IDLE_WAIT_S = (0.01, 0.1)  # sleep between doorbells: 10 ms after work, doubling to 100 ms while idle
# (every event rings, so the timeout is a safety net; a wake-up with nothing to do costs ~0.3 ms of
# Python, which at 100 a second was most of a keeper's CPU in long steps)
CONTROL_EVERY_S = 0.25  # how often the keeper checks the store unasked: a fallback, the controller rings on a drain
T = TypeVar("T")
_refused = Refusals("leto keeper")  # malformed store values this keeper ignored (said once each)
KEEPALIVES_PER_TIMEOUT = 4  # an idle tier-2 link carries a keepalive this many times per timeout (docs/protection.md)


def kinds(layout: Layout) -> dict[int, int]:
    """Bytes of one chunk of each kind of data the keepers of this layout take."""
    g = layout.geometry
    return {KIND_GRAD: g.grad_bytes, KIND_DELTA: g.state_bytes} if layout.protects_grads else \
        {KIND_DELTA: g.state_bytes}


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


class _Link:
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
        self.sent = {k: 0 for k in TAG}       # messages
        self.received = {k: 0 for k in TAG}
        self.free: dict[int, queue.SimpleQueue[int]] = {}
        self.bufs: dict[int, list[torch.Tensor]] = {}
        self.open: dict[int, list[int]] = {}  # kind -> [buffer, records in it]
        self.outbox: queue.SimpleQueue[tuple[int, int, int] | None] = queue.SimpleQueue()
        self.error: str | None = None
        self.keepalive = torch.zeros(8, dtype=torch.uint8)  # a batch of no records
        if send:
            for kind in keeper.nbytes:
                size = 8 + keeper.per_msg[kind] * keeper.record_bytes(kind)
                self.bufs[kind] = [torch.zeros(size, dtype=torch.uint8) for _ in range(SEND_BUFFERS)]
                self.free[kind] = queue.SimpleQueue()
                for i in range(SEND_BUFFERS):
                    self.free[kind].put(i)
            threads.start(self._send_loop, f"keeper-send-{node}")
        if recv:
            for kind in keeper.nbytes:
                threads.start(self._recv_loop, f"keeper-recv-{node}-{kind}", kind)

    def has_room(self, kind: int) -> bool:
        return kind in self.open or not self.free[kind].empty()

    def record(self, kind: int) -> np.ndarray:
        """The next record of this kind's open batch (header and body), as uint8."""
        if kind not in self.open:
            self.open[kind] = [self.free[kind].get_nowait(), 0]
        i, n = self.open[kind]
        rb = self.keeper.record_bytes(kind)
        self.open[kind][1] = n + 1
        return self.bufs[kind][i].numpy()[8 + n * rb:8 + (n + 1) * rb]

    def full(self, kind: int) -> bool:
        return self.open[kind][1] == self.keeper.per_msg[kind]

    def flush(self, kind: int) -> None:
        if kind not in self.open:
            return
        i, n = self.open.pop(kind)
        self.bufs[kind][i][:8].numpy().view(np.int64)[0] = n
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
            doorbell.ring_main()  # the main thread may be waiting for a free buffer

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
                        rec = raw[8 + r * rb:8 + (r + 1) * rb]
                        _, step, _, stripe, p, i, crc, _ = (int(x) for x in rec[:HDR * 8].view(np.int64))
                        self.keeper.fold_remote(kind, step, stripe, p, i, crc, rec[HDR * 8:HDR * 8 + nbytes])
                    self.keeper.dirty = True
            self.received[kind] += 1
            doorbell.ring_main()


class Keeper:
    """Runs one generation's protection for one node."""

    def __init__(self, store: dist.Store, job: str, node: int, layout: Layout, timeout_s: float,
                 pg: dist.ProcessGroup | None = None) -> None:
        self.store, self.job, self.node, self.layout = store, job, node, layout
        self.timeout_s = timeout_s
        self.gen = layout.generation
        self.closed = False
        self._link_failure_told = False
        self.lock = threading.Lock()
        self.region = Region(layout, job, node, create=True)
        h = self.region.header
        h[H_MAGIC], h[H_GEN], h[H_BASE], h[H_PID] = MAGIC, self.gen, layout.base_step, os.getpid()
        h[H_GCOMMIT], h[H_DCOMMIT] = layout.base_step, layout.base_step - 1
        self.W = len(layout.local_ranks(node))
        self.next_slot = [0] * self.W
        g = layout.geometry
        self.interval = layout.protect_every > 1  # docs/protection.md, "Protection interval"
        self.grads = layout.protects_grads  # else gradients are not staged (an interval, or gloo's replicas)
        self.nbytes = kinds(layout)
        self.idx = layout.nodes.index(node)
        self.per_msg = {k: records_per_batch(layout, nb) for k, nb in self.nbytes.items()}
        self.shipped: dict[tuple[int, int], int] = {}  # (kind, step) -> local chunks shipped
        self.routes = [layout.routes(node, pos) for pos in range(self.W * g.n_chunks)]  # by data position
        trace.mark("keeper_region", generation=self.gen)
        self.pg = pg if pg is not None else keeper_group(store, self.gen, layout.nodes, node, timeout_s)
        senders, receivers = set(layout.senders_to(node)), set(layout.receivers_from(node))
        self.parity = {s.index: (s, j) for s, j in layout.parity_stripes(node)}
        self.expected, self.real = self._expected_counts()
        # set with the first report, under the lock: from then on nothing changes the region. A
        # peer cut off by a partition may deliver its queued contributions once the link is back,
        # while survivors decode from this region (they read the versions of the report).
        self.reported = False
        self.links = {n: _Link(self, n, send=n in receivers, recv=n in senders)
                      for n in sorted(senders | receivers) if n != node}
        # barrier sequence: D(base), G(base+1), D(base+1), ...; without gradients D(base), D(P1), D(P2), ...
        # (P: the protected steps, every step unless an interval)
        self.next_barrier = (KIND_DELTA, layout.base_step)
        self.barrier_work: dist.Work | None = None
        self.barrier_done = threading.Event()
        self.barrier_failed = False
        self.barrier_buf = torch.zeros(1)
        self.broken = False
        self.dirty = True
        h[H_STATE] = STATE_RUNNING
        store.set(keys.ready(self.gen, node), KeeperReady(os.getpid()).to_json())
        trace.mark("keeper_ready", generation=self.gen)

    def record_bytes(self, kind: int) -> int:
        return HDR * 8 + self.nbytes[kind]

    def _expected_counts(self) -> tuple[dict[int, np.ndarray], dict[tuple[int, int], np.ndarray]]:
        """Per parity stripe: contributions expected at each offset, and which offsets of each
        data position hold real chunks (not padding)."""
        L = self.layout.segment_len
        expected, real = {}, {}
        for si, (s, _) in self.parity.items():
            cnt = np.zeros(L, dtype=np.int64)
            for p, dn in enumerate(s.data_nodes):
                node, seg = self.layout.nodes[dn], s.segment_of(dn)
                mask = np.array([self.layout.source_of(node, seg * L + i) is not None for i in range(L)], dtype=bool)
                real[(si, p)] = mask
                cnt += mask
            expected[si] = cnt
        return expected, real

    # ----- folding
    def _consume_slots(self) -> bool:
        progress = False
        hdrs, data = self.region["slot_hdr"], self.region["slot_data"]
        for w in range(self.W):
            for _ in range(self.layout.ring_slots):
                idx = self.next_slot[w] % self.layout.ring_slots
                h = hdrs[w, idx]
                if h[S_READY] != 1:  # then read the slot: total store order is assumed (shm.py)
                    break
                kind, step, chunk, crc = int(h[S_KIND]), int(h[S_STEP]), int(h[S_CHUNK]), int(h[S_CRC])
                payload = data[w, idx, :self.nbytes[kind]]
                if not self._ship(kind, step, w, chunk, crc, payload):
                    return progress  # tier-2 send buffers are full; come back later
                with self.lock:
                    self._fold_local(kind, step, w, chunk, crc, payload)
                    self.dirty = True
                h[S_READY] = 0
                self.next_slot[w] += 1
                progress = True
        return progress

    def _fold_local(self, kind: int, step: int, w: int, chunk: int, crc: int, payload: np.ndarray) -> None:
        r = self.region
        if kind == KIND_DELTA:
            if self.interval:
                self._keep_preimage("p1", "crc1", r["v1"][:, chunk], chunk, step)
            xor_into(r["p1"][chunk], payload)
            r["crc1"][w, chunk] = crc
            r["v1"][w, chunk] = step
            return
        b = step % 2
        if r["g1_step"][b, chunk] != step:
            r["g1"][b, chunk][...] = payload
            r["g1_step"][b, chunk] = step
            r["g1_count"][b, chunk] = 1
        else:
            xor_into(r["g1"][b, chunk], payload)
            r["g1_count"][b, chunk] += 1
        r["gcrc1"][w, b, chunk] = crc

    def _ship(self, kind: int, step: int, w: int, chunk: int, crc: int, payload: np.ndarray) -> bool:
        """Add this chunk's tier-2 contributions to the links' batches; False when a link has
        no free buffer (nothing is added then)."""
        routes = self.routes[w * self.layout.geometry.n_chunks + chunk]
        links = [self.links[r.parity_node] for r in routes]
        if not all(link.has_room(kind) for link in links):
            return False
        for r, link in zip(routes, links):
            rec = link.record(kind)
            rec[:HDR * 8].view(np.int64)[:] = (kind, step, self.idx, r.stripe, r.p, r.i, crc, self.gen)
            body = rec[HDR * 8:]
            if r.coef == 1:
                body[...] = payload
            else:
                body[...] = 0
                scale_into(body, r.coef, payload)
            if link.full(kind):
                link.flush(kind)
        key = (kind, step)
        self.shipped[key] = self.shipped.get(key, 0) + 1
        if self.shipped[key] == self.W * self.layout.geometry.n_chunks:  # the step's last local chunk
            del self.shipped[key]
            self._flush(kind)
        return True

    def _flush(self, kind: int) -> None:
        for link in self.links.values():
            if link.bufs:
                link.flush(kind)

    def fold_remote(self, kind: int, step: int, stripe: int, p: int, i: int, crc: int, body: np.ndarray) -> None:
        r = self.region
        if kind == KIND_DELTA:
            if self.layout.tier2_preimages:
                real = [p for p in range(r[f"v2_{stripe}"].shape[0]) if self.real[(stripe, p)][i]]
                self._keep_preimage(f"p2_{stripe}", f"crc2_{stripe}", r[f"v2_{stripe}"][real, i], i, step)
            xor_into(r[f"p2_{stripe}"][i], body)
            r[f"crc2_{stripe}"][p, i] = crc
            r[f"v2_{stripe}"][p, i] = step
            return
        b = step % 2
        if r[f"g2_step_{stripe}"][b, i] != step:
            r[f"g2_{stripe}"][b, i][...] = body
            r[f"g2_step_{stripe}"][b, i] = step
            r[f"g2_count_{stripe}"][b, i] = 1
        else:
            xor_into(r[f"g2_{stripe}"][b, i], body)
            r[f"g2_count_{stripe}"][b, i] += 1
        r[f"gcrc2_{stripe}"][p, b, i] = crc

    def _keep_preimage(self, parity: str, crc: str, versions: np.ndarray, i: int, step: int) -> None:
        """Before the first delta of a later protected step lands on parity row `i`, keep the
        row as it is while all its sources are at one step: recovery may have to decode at that
        step while the row is half-way to the next one."""
        r = self.region
        if versions.size and versions.min() == versions.max() < step:
            r[f"{parity}_pre"][i] = r[parity][i]
            r[f"{crc}_pre"][..., i] = r[crc][..., i]
            r[f"{parity}_pre_step"][i] = versions[0]

    # ----- completeness and agreement
    def grads_complete(self, step: int) -> bool:
        r, b = self.region, step % 2
        if not (np.all(r["g1_step"][b] == step) and np.all(r["g1_count"][b] == self.W)):
            return False
        for si, exp in self.expected.items():
            real = exp > 0
            if not np.all(r[f"g2_step_{si}"][b][real] == step):
                return False
            if not np.all(r[f"g2_count_{si}"][b][real] == exp[real]):
                return False
        return True

    def deltas_complete(self, step: int) -> bool:
        return self.applied_step() >= step

    def applied_step(self) -> int:
        """The last step at which every source chunk's delta is folded here (lowest version)."""
        r = self.region
        low = int(r["v1"].min())
        for (si, p), real in self.real.items():
            if real.any():
                low = min(low, int(r[f"v2_{si}"][p][real].min()))
        return low

    def _advance_barrier(self) -> bool:
        h = self.region.header
        kind, step = self.next_barrier
        if self.broken:
            return False
        if self.barrier_work is not None:
            if not self.barrier_done.is_set():
                return False
            if self.barrier_failed:  # another keeper died: nothing more commits in this generation
                self.broken = True
                return False
            self.barrier_work = None
            self.dirty = True  # the next barrier may already be complete
            if kind == KIND_DELTA:
                h[H_DCOMMIT] = step
                if step == self.layout.base_step:
                    self.store.set(keys.committed(self.gen, self.node), BaseCommitted().to_json())
                self.next_barrier = (KIND_GRAD, step + 1) if self.grads \
                    else (KIND_DELTA, self.layout.next_protected(step))
            else:
                h[H_GCOMMIT] = step
                self.next_barrier = (KIND_DELTA, step)
            return True
        if not self.dirty:  # nothing was folded since the last check
            return False
        with self.lock:
            self.dirty = False
            done = self.deltas_complete(step) if kind == KIND_DELTA else self.grads_complete(step)
        if done:
            self.barrier_done.clear()
            self.barrier_work = self.pg.allreduce([self.barrier_buf])
            threads.start(self._await_barrier, f"keeper-barrier-g{self.gen}", self.barrier_work)
            return True
        return False

    def settle_barrier(self, live_nodes: set[int], timeout_s: float, abandoned: Callable[[], bool]) -> None:
        """After a drain was read, before the commit is judged: finish the barrier in flight, so
        that every keeper reports the same committed step. A barrier completes for all keepers
        or for none, and its completion reaches the main loop only through `_await_barrier`'s
        thread; a keeper that saw the drain first would otherwise report the step as
        uncommitted while a peer that processed the completion reports it committed. Each
        keeper publishes where it stopped; one in flight waits until its barrier resolves,
        or a live peer says it never entered it or saw it fail (then it cannot complete here
        either: a peer that keeps waiting on a dead keeper is not told by gloo), or the timeout."""
        kind, step = self.next_barrier
        in_flight = self.barrier_work is not None
        mine = keys.barrier_state(self.gen, self.node)
        self.store.set(mine, BarrierState(kind, step, IN_FLIGHT if in_flight else NOT_ENTERED).to_json())
        if not in_flight:
            return
        deadline = time.monotonic() + timeout_s
        peers = [keys.barrier_state(self.gen, n) for n in sorted(live_nodes)
                 if n != self.node and n in self.layout.nodes]
        while not self.barrier_done.wait(1e-3):
            if time.monotonic() > deadline or abandoned():
                return
            if any(self._peer_hopeless(key, kind, step) for key in peers):
                return
        self._advance_barrier()  # record the completion (or the failure) like the main loop does
        self.store.set(mine, BarrierState(kind, step, FAILED if self.broken else DONE).to_json())

    def _peer_hopeless(self, key: str, kind: int, step: int) -> bool:
        """Whether the peer that publishes at `key` says barrier (kind, step) cannot complete."""
        if not self.store.check([key]):
            return False
        value = self.store.get(key)
        try:
            peer = BarrierState.from_json(value, key)
        except BadValue as e:  # no evidence either way: the barrier's own deadline decides
            _refused.refuse(e, value)
            return False
        return (peer.kind, peer.step) == (kind, step) and peer.hopeless()

    def _await_barrier(self, work: dist.Work) -> None:
        """Wait for the barrier in a thread (gloo work cannot be polled cheaply) and ring."""
        linux.name_thread("keeper-barrier")
        t0 = time.monotonic()
        try:
            work.wait()
        except RuntimeError as e:
            self.barrier_failed = True
            self.link_failed(f"the commit barrier failed: {e}", time.monotonic() - t0)
        self.barrier_done.set()
        doorbell.ring_main()

    def link_failed(self, why: str, waited_s: float) -> None:
        """A wait on the keepers' group failed. One that ran out its timeout while this keeper
        still serves its generation is said once on stderr: a peer keeper that heartbeats but
        neither sends nor receives (stuck, or cut off) is seen nowhere else. A peer that died
        fails the wait at once and is reported by its supervisor; a wait of a drained or
        closed generation failing is expected."""
        if self.closed or self.reported or self._link_failure_told or waited_s < 0.9 * self.timeout_s:
            return
        self._link_failure_told = True
        print(f"leto: keeper of node {self.node}: a tier-2 wait of generation {self.gen} ran out its "
              f"timeout of {self.timeout_s:g}s ({why.splitlines()[0][:300]}); nothing more commits in "
              f"this generation", file=sys.stderr, flush=True)

    # ----- the loop
    def run(self, should_stop: Callable[[], str | None]) -> str:
        """Serve until `should_stop` returns a reason (drain, shutdown). Sleeps between
        doorbells (see `doorbell`) instead of polling."""
        next_control, asked = 0.0, False
        idle = IDLE_WAIT_S[0]
        while True:
            progress = self._consume_slots()
            progress |= self._advance_barrier()
            idle = IDLE_WAIT_S[0] if progress else min(2 * idle, IDLE_WAIT_S[1])
            now = time.monotonic()
            if asked or now >= next_control:
                next_control, asked = now + CONTROL_EVERY_S, False
                reason = should_stop()
                if reason:
                    return reason
            if not progress:
                asked = doorbell.wait(idle) == doorbell.CONTROL

    def report(self) -> KeeperReport:
        """What recovery needs from this keeper (after draining)."""
        r, h = self.region, self.region.header
        g = int(h[H_GCOMMIT])
        base = {"node": self.node, "generation": self.gen, "d_commit": int(h[H_DCOMMIT]),
                "v1": r["v1"].tolist(), "crc1": r["crc1"].tolist()}
        if not self.grads:  # the step every delta is folded at (and an interval's pre-images)
            pre = {"crc_pre": r["crc1_pre"].tolist(), "pre_step": r["p1_pre_step"].tolist()} if self.interval else {}
            return KeeperReport(**base, **pre, applied=self.applied_step(),
                                stripes={si: self._stripe_report(si) for si in self.parity})
        return KeeperReport(**base, g_commit=g, grads_complete=[s for s in (g, g + 1) if self.grads_complete(s)],
                            gcrc1=r["gcrc1"].tolist(), g1_step=r["g1_step"].tolist(),
                            stripes={si: self._stripe_report(si) for si in self.parity})

    def _stripe_report(self, si: int) -> StripeReport:
        r = self.region
        pre = {"crc_pre": r[f"crc2_{si}_pre"].tolist(), "pre_step": r[f"p2_{si}_pre_step"].tolist()} \
            if self.layout.tier2_preimages else {}
        if self.grads:
            return StripeReport(**{k: r[f"{k}_{si}"].tolist() for k in ("v2", "crc2", "gcrc2", "g2_step")}, **pre)
        return StripeReport(r[f"v2_{si}"].tolist(), r[f"crc2_{si}"].tolist(), **pre)

    def drain(self, live_nodes: set[int], timeout_s: float,
              abandoned: Callable[[], bool] = lambda: False) -> KeeperReport:
        """Apply everything staged and everything live peers sent, then report. Waits for peers
        end early once `abandoned()`: a later membership change (a peer died meanwhile) makes
        this report moot, and the next drain must not sit out the timeout on a dead peer."""
        if self.reported:  # drained before (that recovery was cut short): the region is as then reported
            with self.lock:
                return self.report()
        deadline = time.monotonic() + timeout_s
        while self._consume_slots() and time.monotonic() < deadline:
            pass
        for kind in self.nbytes:  # batches a dead worker left unfinished
            self._flush(kind)
        for n, link in self.links.items():  # let our queued sends leave, then say how many
            if not link.bufs:
                continue
            while n in live_nodes and not link.idle() and link.error is None and time.monotonic() < deadline \
                    and not abandoned():
                time.sleep(1e-3)
            self.store.set(keys.sent(self.gen, self.node, n), SentCounts(dict(link.sent)).to_json())
        for n, link in self.links.items():  # wait for what live senders sent us
            key = keys.sent(self.gen, n, self.node)
            if n not in live_nodes or n not in self.layout.senders_to(self.node):
                continue
            left = max(0.0, deadline - time.monotonic())
            def stop(link: _Link = link) -> str | None:
                return str(link.error) if link.error is not None else "abandoned" if abandoned() else None

            if rt.await_keys(self.store, [key], left, stop):
                continue
            value = self.store.get(key)
            try:
                want = SentCounts.from_json(value, key).messages
            except BadValue as e:  # report what arrived: the recovery checks versions and checksums
                _refused.refuse(e, value)
                want = {}
            while not all(link.received[k] >= v for k, v in want.items()) and link.error is None \
                    and time.monotonic() < deadline and not abandoned():
                time.sleep(1e-3)  # what the receiver thread has not folded yet: local, no store
        self.region.header[H_STATE] = STATE_DRAINED
        with self.lock:
            self.reported = True
            return self.report()

    def close(self, unlink: bool) -> None:
        self.closed = True
        for link in self.links.values():
            link.outbox.put(None)
        self.region.close()
        if unlink:
            self.region.unlink()


def keeper_group(store: dist.Store, gen: int, nodes: list[int], node: int, timeout_s: float) -> dist.ProcessGroup:
    """The gloo group of generation `gen`'s keepers (one per node of its plan, in node order).
    Every wait on it ends within `timeout_s` (the job's collective timeout): idle links carry
    keepalives (`_Link`), and blocked waits of an abandoned generation end by that time too."""
    return dist.ProcessGroupGloo(dist.PrefixStore(keys.keeper_pg(gen), store), nodes.index(node), len(nodes),
                                 timedelta(seconds=timeout_s))


class EarlyGroup:
    """Generation `gen`'s keeper group, built in a thread as soon as its plan is out (its nodes
    are the plan's): its rendezvous through the store overlaps the workers' recovery instead of
    following rank 0's layout, which comes only once the state is rebuilt. A generation that is
    superseded before its layout leaves its thread blocked in the rendezvous, like the waits of
    an abandoned generation."""

    def __init__(self, store: dist.Store, gen: int, nodes: list[int], node: int, timeout_s: float) -> None:
        self.gen, self.nodes, self.timeout_s = gen, nodes, timeout_s
        self._box: list = []
        self._thread = threads.start(self._build, f"keeper-group-g{gen}", store, node)

    def _build(self, store: dist.Store, node: int) -> None:
        try:
            self._box.append(keeper_group(store, self.gen, self.nodes, node, self.timeout_s))
        except Exception as e:  # noqa: BLE001 (raised by `take`)
            self._box.append(e)

    def take(self, layout: Layout) -> dist.ProcessGroup:
        """The group, once built (bounded by the timeout); raises what the rendezvous raised."""
        if layout.nodes != self.nodes:
            raise RuntimeError(f"generation {self.gen}'s layout names nodes {layout.nodes}, its plan {self.nodes}")
        self._thread.join(self.timeout_s)
        if not self._box:
            raise RuntimeError(f"the keepers of generation {self.gen} did not form their group "
                               f"within {self.timeout_s:.0f}s")
        if isinstance(self._box[0], Exception):
            raise self._box[0]
        return self._box[0]


def _early_group(job: rt.Job, gen: int, node: int) -> EarlyGroup | None:
    """Start generation `gen`'s keeper group if its plan is out and names this node."""
    if not job.store.check([keys.plan(gen)]):
        return None
    try:
        nodes = sorted(set(read_plan(job.store, gen).node_of_rank))
    except BadValue as e:  # no early group: the generation's group forms once its layout is out
        _refused.refuse(e)
        return None
    return EarlyGroup(job.store, gen, nodes, node, job.timeout_s) if node in nodes else None


def _superseded(plan: Drain, job: rt.Job) -> Callable[[], bool]:
    """Whether the drain `plan` became moot: the job shuts down or a later drain was announced."""
    later = keys.drain(plan.next_generation)
    return lambda: job.shutdown_requested() or job.store.check([later])


def _report(committed: Keeper | None, plan: Drain, job: rt.Job) -> KeeperReport:
    """Drain and describe the last committed generation for the drain `plan`; a keeper with none
    says so."""
    if committed is None:
        return KeeperReport(job.node, empty=True)
    report = committed.drain(set(plan.live_nodes), job.timeout_s, _superseded(plan, job))
    return replace(report, generation_used=committed.gen)


def _read_drain(job: rt.Job, gen: int) -> Drain:
    """The drain this keeper saw a moment ago (`_drain`): malformed since, it ends the keeper
    with one line (the coordinator replaces it like any failed keeper)."""
    key = keys.drain(gen)
    try:
        return Drain.from_json(job.store.get(key), key)
    except BadValue as e:
        raise SystemExit(f"leto: keeper of node {job.node}: cannot go on: malformed value of {e}") from None


def _drain(job: rt.Job, gen: int) -> Drain | None:
    """Generation `gen`'s drain once written; a malformed one is ignored (said once) as if none
    were written yet: the coordinator's own drain replaces it."""
    return _message(job, Drain.from_json, keys.drain(gen))


def _message(job: rt.Job, parse: Callable[[bytes, str], T], key: str) -> T | None:
    """The message at `key` if it is there and well-formed (a malformed one is said once)."""
    if not job.store.check([key]):
        return None
    value = job.store.get(key)
    try:
        return parse(value, key)
    except BadValue as e:
        _refused.refuse(e, value)
        return None


def main() -> None:
    """Entry point of a keeper process (started by the controller)."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    doorbell.install()
    linux.name_thread("leto-keeper")
    torch.set_num_threads(1)
    linux.normal_priority()  # torch is imported (at idle priority, see the controller): serve at normal priority
    job = rt.init(device="cpu")
    check_store_order()
    Heartbeat(os.environ[rt.ENV_STORE], job.proc_id, job.timeout_s)  # the controller fences a keeper that stops
    node = job.node
    committed: Keeper | None = None   # the last generation whose protection is complete
    gen = 0
    early: EarlyGroup | None = None
    while not job.shutdown_requested():
        if (plan := _drain(job, gen)) is not None:  # abandoned before it started: report the committed one
            job.store.set(keys.report(gen, node), _report(committed, plan, job).to_json())
            gen = plan.next_generation
            continue
        if early is None or early.gen != gen:  # never for a drained generation (a new keeper passes
            early = _early_group(job, gen, node)  # those): its group may have formed long ago
        if rt.await_keys(job.store, [keys.layout(gen)], 0.05) is not None:
            continue  # not yet: look for a drain and the shutdown again
        layout = _message(job, Layout.from_json, keys.layout(gen))
        if layout is None:  # malformed: as if not yet published (the workers fail on it, a drain follows)
            time.sleep(0.05)
            continue
        trace.mark("keeper_layout", generation=gen)
        if node not in layout.nodes:
            gen += 1
            continue
        current = Keeper(job.store, job.job_id, node, layout, job.timeout_s,
                         early.take(layout) if early is not None and early.gen == gen else None)

        def should_stop(gen: int = gen) -> str | None:
            if _drain(job, gen) is not None:
                return "drain"
            return "shutdown" if job.shutdown_requested() else None

        reason = current.run(should_stop)
        if reason == "drain":
            trace.mark("keeper_drain_seen", generation=gen)
            plan = _read_drain(job, gen)
            current.settle_barrier(set(plan.live_nodes), job.timeout_s, _superseded(plan, job))
            trace.mark("keeper_settled", generation=gen)
        if current.region.header[H_DCOMMIT] >= layout.base_step:
            if committed is not None:
                committed.close(unlink=True)
            committed = current
        if reason == "shutdown":
            break
        plan = _read_drain(job, gen)
        job.store.set(keys.report(gen, node), _report(committed, plan, job).to_json())
        trace.mark("keeper_reported", generation=gen)
        if current is not committed:
            current.close(unlink=True)
        gen = plan.next_generation
    if committed is not None:
        committed.close(unlink=True)


if __name__ == "__main__":
    main()
