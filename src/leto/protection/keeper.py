"""The keeper: one process per node that holds the node's protection data in shared memory.

It outlives worker crashes. Workers hand it chunks through staging slots; it folds them into
tier-1 XOR parity, ships tier-2 contributions to other nodes' keepers over TCP connections of its own,
folds the contributions it receives, and agrees with the other keepers, step by step, on what
is committed (see docs/protection.md). Its parts: `parity.py` (folding), `transport.py` (the
tier-2 links), `barrier.py` (the agreement), `drain.py` (drains and reports), `group.py` (the
keepers' gloo group and connections), `dataplane.py` (the folds, the links and the main loop's
sleeps in native code, for the layouts it serves); this module runs them and is the keeper
process's main.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from leto.protection import dataplane, doorbell
from leto.protection.barrier import CommitBarrier
from leto.protection.codec import scale_into
from leto.protection.drain import drain_of, message, read_drain, report_for, superseded
from leto.protection.group import EarlyGroup, KeeperGroup, early_group, keeper_group
from leto.protection.layout import Layout
from leto.protection.parity import Parity
from leto.protection.shm import (
    H_BASE,
    H_DCOMMIT,
    H_GCOMMIT,
    H_GEN,
    H_MAGIC,
    H_PID,
    H_STATE,
    MAGIC,
    S_CHUNK,
    S_CRC,
    S_KIND,
    S_READY,
    S_STEP,
    SLOT_FREE,
    SLOT_HELD,
    SLOT_STAGED,
    STATE_RUNNING,
    Region,
    check_store_order,
)
from leto.protection.transport import HDR, RECORD, Link, kinds, records_per_batch, scaled_links
from leto.protocol import keys
from leto.protocol.protection import KeeperReady
from leto.runtime import env as rt
from leto.runtime import linux, standby, trace
from leto.runtime.membership import Heartbeat

IDLE_WAIT_S = (0.01, 0.1)  # sleep between doorbells: 10 ms after work, doubling to 100 ms while idle
# (every event rings, so the timeout is a safety net; a wake-up with nothing to do costs ~0.3 ms of
# Python, which at 100 a second was most of a keeper's CPU in long steps)
CONTROL_EVERY_S = 0.25  # how often the keeper checks the store unasked: a fallback, the controller rings on a drain


class Keeper:
    """Runs one generation's protection for one node: takes the chunks its workers stage, folds
    them into its `Parity` and ships their tier-2 contributions over its `Link`s, and takes the
    `CommitBarrier`'s steps; `drain.drain` reports it."""

    def __init__(
        self,
        store: dist.Store,
        job: str,
        node: int,
        layout: Layout,
        timeout_s: float,
        group: KeeperGroup | None = None,
    ) -> None:
        self.store, self.job, self.node, self.layout = store, job, node, layout
        self.timeout_s = timeout_s
        self.gen = layout.generation
        self.closed = False
        self._link_failure_told = False
        self.link_broken = False  # set once a tier-2 link of this generation broke (`Link.fail`)
        self.lock = threading.Lock()
        self.region = Region(layout, job, node, create=True)
        h = self.region.header
        h[H_MAGIC], h[H_GEN], h[H_BASE], h[H_PID] = MAGIC, self.gen, layout.base_step, os.getpid()
        h[H_GCOMMIT], h[H_DCOMMIT] = layout.base_step, layout.base_step - 1
        self.parity = Parity(self.region, layout, node)
        self.W = self.parity.W  # the node's workers
        self.next_slot = [0] * self.W
        ring = layout.ring_slots
        hdrs, data = self.region["slot_hdr"], self.region["slot_data"]
        # each slot's header fields, made once: a memoryview's item is cheaper than numpy's indexing
        # (kept after `close`: a sender may hand a slot back then)
        self._slot_rows = [[memoryview(hdrs[w, i]) for i in range(ring)] for w in range(self.W)]
        self._holds: dict[tuple[int, int], int] = {}  # staging slot (worker, index) -> holds on it
        self._slot_lock = threading.Lock()
        g = layout.geometry
        self.grads = layout.protects_grads  # else gradients are not staged (an interval, or gloo's replicas)
        self.nbytes = kinds(layout)
        self._payloads = {
            k: [[data[w, i, :nb] for i in range(ring)] for w in range(self.W)] for k, nb in self.nbytes.items()
        }
        self.idx = layout.nodes.index(node)
        self.per_msg = {k: records_per_batch(layout, nb) for k, nb in self.nbytes.items()}
        self.routes = [layout.routes(node, pos) for pos in range(self.W * g.n_chunks)]  # by data position
        trace.mark("keeper_region", generation=self.gen)
        group = group if group is not None else keeper_group(store, self.gen, layout.nodes, node, timeout_s)
        self.pg, self.sockets = group.pg, group.sockets
        senders, receivers = set(layout.senders_to(node)), set(layout.receivers_from(node))
        # set with the first report, under the lock: from then on nothing changes the region. A
        # peer cut off by a partition may deliver its queued contributions once the link is back,
        # while survivors decode from this region (they read the versions of the report).
        self.reported = False
        out, inbound = self.sockets.out, self.sockets.inbound
        for n in set(out) - receivers:  # connections this layout sends nothing over
            out.pop(n).close()
        for n in set(inbound) - senders:
            inbound.pop(n).close()
        self.barrier = CommitBarrier(self)  # before the links: their receivers ask it whether to ring
        # the data plane: native where it serves this layout (`dataplane.py`), else the links'
        # Python threads and `consume_slots`' loop
        self.native: dataplane.DataPlane | None = None
        self.links: dict[int, Link | dataplane.NativeLink]
        if dataplane.serves(layout):
            self.native = dataplane.DataPlane(self, out, inbound)
            self.links = dict(self.native.links)
            self.parity.applied_step = self.native.applied  # type: ignore[method-assign]
            self.native.want(self.barrier.next[1])
        else:
            scaled = scaled_links(layout, node)
            self.links = {
                n: Link(self, n, out.get(n), inbound.get(n), scaled=n in scaled)
                for n in sorted(senders | receivers)
                if n != node
            }
        # by data position (the Python plane's `_ship`): each tier-2 route with the link it goes
        # over, and how many of its records are sent from the slot itself (coefficient 1)
        self.route_links = [[(r, self.links[r.parity_node]) for r in routes] for routes in self.routes]
        self._from_slot = [sum(r.coef == 1 for r in routes) for routes in self.routes]
        self.wants_room = False  # the main thread found a link's send buffers full (the sender rings then)
        self.dirty = True
        h[H_STATE] = STATE_RUNNING
        store.set(keys.ready(self.gen, node), KeeperReady(os.getpid()).to_json())
        trace.mark("keeper_ready", generation=self.gen, data_plane="python" if self.native is None else "native")

    def record_bytes(self, kind: int) -> int:
        return HDR * 8 + self.nbytes[kind]

    def consume_slots(self) -> bool:
        """Fold and ship what the workers staged, slot by slot, then send the open batches
        (they hold their slots until sent); whether anything was staged."""
        if self.native is not None:
            taken = self.native.take()  # a link's full buffers are the plane's to wait for
            if taken > 0:
                self.dirty = True
            return taken > 0
        progress = False
        ring, nxt = self.layout.ring_slots, self.next_slot
        for w in range(self.W):
            rows = self._slot_rows[w]
            for _ in range(ring):
                idx = nxt[w] % ring
                h = rows[idx]
                if h[S_READY] != SLOT_STAGED:  # then read the slot: total store order is assumed (shm.py)
                    break
                f = h.tolist()
                kind, step, chunk, crc = f[S_KIND], f[S_STEP], f[S_CHUNK], f[S_CRC]
                payload = self._payloads[kind][w][idx]
                if not self._ship(kind, step, w, idx, chunk, crc, payload):
                    break  # tier-2 send buffers are full; come back later
                with self.lock:
                    self.parity.fold_local(kind, step, w, chunk, crc, payload)
                    self.dirty = True
                self.hand_back([(w, idx)])
                nxt[w] += 1
                progress = True
        if progress:
            for kind in self.nbytes:
                self.flush(kind)
        return progress

    def staged(self) -> bool:
        """Whether a worker's next slot is staged and not yet taken."""
        if self.native is not None:
            return self.native.staged()
        ring = self.layout.ring_slots
        return any(self._slot_rows[w][self.next_slot[w] % ring][S_READY] == SLOT_STAGED for w in range(self.W))

    def hand_back(self, slots: list[tuple[int, int]]) -> None:
        """Drop one hold on each of these staging slots; a slot nobody holds any more is the
        worker's again."""
        with self._slot_lock:
            for slot in slots:
                left = self._holds.pop(slot) - 1
                if left:
                    self._holds[slot] = left
                else:
                    self._slot_rows[slot[0]][slot[1]][S_READY] = SLOT_FREE

    def _ship(self, kind: int, step: int, w: int, idx: int, chunk: int, crc: int, payload: np.ndarray) -> bool:
        """Add this chunk's tier-2 contributions to the links' batches; False when a link has
        no free buffer (nothing is added then). The slot is held from then on, once by the
        caller and once by each batch that sends from it (`hand_back`). A broken link is
        passed over: its batches are never sent, and waiting for its buffers would keep a
        drain from folding what the workers staged into tier 1."""
        pos = w * self.layout.geometry.n_chunks + chunk
        route_links = self.route_links[pos]
        from_slot = self._from_slot[pos]
        if self.link_broken:
            route_links = [rl for rl in route_links if rl[1].error is None]
            from_slot = sum(r.coef == 1 for r, _ in route_links)
        self.wants_room = True  # before looking: a buffer freed after the look finds it set
        for _, link in route_links:
            if not link.has_room(kind):
                return False
        self.wants_room = False
        slot = (w, idx)
        with self._slot_lock:
            self._holds[slot] = 1 + from_slot
            self._slot_rows[w][idx][S_READY] = SLOT_HELD
        for r, link in route_links:
            if r.coef == 1:  # sent from the slot itself
                header = link.record(kind, payload, slot)
            else:
                header = link.record(kind)
                body = link.scratch(kind)
                body[...] = 0
                scale_into(body, r.coef, payload)
            RECORD.pack_into(header, 0, kind, step, self.idx, r.stripe, r.p, r.i, crc, self.gen)
            if link.full(kind):
                link.flush(kind)
        return True

    def flush(self, kind: int) -> None:
        """Send the open batches of `kind` on every link."""
        if self.native is not None:
            self.native.flush()
            return
        for link in self.links.values():
            if link.bufs:
                link.flush(kind)

    def link_failed(self, why: str, waited_s: float) -> None:
        """A wait on the keepers' group failed. One that ran out its timeout while this keeper
        still serves its generation is said once on stderr: a peer keeper that heartbeats but
        neither sends nor receives (stuck, or cut off) is seen nowhere else. A peer that died
        fails the wait at once and is reported by its supervisor; a wait of a drained or
        closed generation failing is expected."""
        if self.closed or self.reported or self._link_failure_told or waited_s < 0.9 * self.timeout_s:
            return
        self._link_failure_told = True
        print(
            f"leto: keeper of node {self.node}: a tier-2 wait of generation {self.gen} ran out its "
            f"timeout of {self.timeout_s:g}s ({why.splitlines()[0][:300]}); nothing more commits in "
            f"this generation",
            file=sys.stderr,
            flush=True,
        )

    def run(self, should_stop: Callable[[], str | None]) -> str:
        """Serve until `should_stop` returns a reason (drain, shutdown). Sleeps between
        doorbells (see `doorbell`) instead of polling."""
        next_control, asked = 0.0, False
        idle = IDLE_WAIT_S[0]
        while True:
            if self.native is not None:  # the pass and the sleeps run in it until Python is needed
                asked = self.native.serve(next_control, IDLE_WAIT_S) == dataplane.SERVE_CONTROL
                self._advance()
                if asked or time.monotonic() >= next_control:
                    next_control = time.monotonic() + CONTROL_EVERY_S
                    if reason := should_stop():
                        return reason
                continue
            folded = self.consume_slots()
            advanced = self._advance()
            idle = IDLE_WAIT_S[0] if folded or advanced else min(2 * idle, IDLE_WAIT_S[1])
            now = time.monotonic()
            if asked or now >= next_control:
                next_control, asked = now + CONTROL_EVERY_S, False
                reason = should_stop()
                if reason:
                    return reason
            # a pass that only folded sleeps too, as if it had found nothing: a ring that came
            # while it ran is pending and wakes it at once (a second pass at once found nothing
            # most of the time). A barrier that moved looks again: the next one may be complete,
            # and nobody rings for it
            if not advanced:
                asked = doorbell.wait(idle) == doorbell.CONTROL

    def _advance(self) -> bool:
        """The barrier's next move (`CommitBarrier.advance`); whether it took one, or one can be
        taken at once."""
        if self.native is None:
            return self.barrier.advance()
        self.dirty = True  # its receivers fold without a word: they ring once the barrier can be entered
        for link in self.native.failed_links():
            self.link_broken = True
            self.link_failed(link.error or "", link.waited_s())
        b = self.barrier
        advanced = b.advance()
        return self.native.want(b.next[1] if b.work is None and not b.broken else None) or advanced

    def freeze(self) -> None:
        """Nothing folds into the region any more (call under `lock`): it is what the report says."""
        self.reported = True
        if self.native is not None:
            self.native.freeze()

    def close(self, unlink: bool) -> None:
        self.closed = True
        self.barrier.close()
        if self.native is not None:
            self.native.stop()  # its threads end before the region goes
        for link in self.links.values():
            if isinstance(link, Link):
                link.outbox.put(None)
        self.sockets.shutdown()  # the receiver threads return
        self.region.close()
        if unlink:
            self.region.unlink()


def main() -> None:
    """Entry point of a keeper process (started by the controller)."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    doorbell.install()
    linux.name_thread("leto-keeper")
    torch.set_num_threads(1)
    # torch is imported (at idle priority, see the controller): serve at SCHED_BATCH, a fair share
    # of the CPU, but a doorbell waking the keeper never preempts a worker (docs/protection.md,
    # "Keepers' priority")
    linux.batch_priority()
    job = rt.init(device="cpu")
    if standby.pending() and not standby.bind(job):  # a standby host's: warm, it waits for its node
        return
    check_store_order()
    Heartbeat(os.environ[rt.ENV_STORE], job.proc_id, job.timeout_s)  # the controller fences a keeper that stops
    node = job.node
    committed: Keeper | None = None  # the last generation whose protection is complete
    gen = 0
    early: EarlyGroup | None = None
    while not job.shutdown_requested():
        if (request := drain_of(job, gen)) is not None:  # abandoned before it started: report the committed one
            job.store.set(keys.report(gen, node), report_for(committed, request, job).to_json())
            gen = request.next_generation
            continue
        if early is None or early.gen != gen:  # never for a drained generation (a new keeper passes
            early = early_group(job, gen, node)  # those): its group may have formed long ago
        if rt.await_keys(job.store, [keys.layout(gen)], 0.05) is not None:
            continue  # not yet: look for a drain and the shutdown again
        layout = message(job, Layout.from_json, keys.layout(gen))
        if layout is None:  # malformed: as if not yet published (the workers fail on it, a drain follows)
            time.sleep(0.05)
            continue
        trace.mark("keeper_layout", generation=gen)
        if node not in layout.nodes:
            gen += 1
            continue
        current = Keeper(
            job.store,
            job.job_id,
            node,
            layout,
            job.timeout_s,
            early.take(layout) if early is not None and early.gen == gen else None,
        )

        def should_stop(gen: int = gen) -> str | None:
            if drain_of(job, gen) is not None:
                return "drain"
            return "shutdown" if job.shutdown_requested() else None

        reason = current.run(should_stop)
        if reason == "drain":
            trace.mark("keeper_drain_seen", generation=gen)
            request = read_drain(job, gen)
            current.barrier.settle(set(request.live_nodes), job.timeout_s, superseded(request, job))
            trace.mark("keeper_settled", generation=gen)
        if current.region.header[H_DCOMMIT] >= layout.base_step:
            if committed is not None:
                committed.close(unlink=True)
            committed = current
        if reason == "shutdown":
            break
        request = read_drain(job, gen)
        job.store.set(keys.report(gen, node), report_for(committed, request, job).to_json())
        trace.mark("keeper_reported", generation=gen)
        if current is not committed:
            current.close(unlink=True)
        gen = request.next_generation
    if committed is not None:
        committed.close(unlink=True)


if __name__ == "__main__":
    main()
