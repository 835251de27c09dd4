"""The worker's side of protection: hand chunks to the node's keeper and wait for commits."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from leto.protection.dataplane import stager
from leto.protection.doorbell import Doorbell
from leto.protection.integrity import checksum
from leto.protection.layout import Layout
from leto.protection.shm import (
    H_DCOMMIT,
    H_GCOMMIT,
    H_PID,
    KIND_DELTA,
    KIND_GRAD,
    S_CHUNK,
    S_CRC,
    S_KIND,
    S_READY,
    S_STEP,
    SLOT_FREE,
    SLOT_STAGED,
    Region,
)
from leto.protection.staging import HostStaging
from leto.protocol import keys
from leto.runtime.comm import PeerFailure
from leto.runtime.env import await_keys


class Protector:
    """Stages one rank's gradients and state deltas into its keeper's shared memory."""

    def __init__(
        self,
        store,
        layout: Layout,
        rank: int,
        job_id: str,
        timeout_s: float,
        abort_check: Callable[[], str | None],
        device: torch.device = torch.device("cpu"),
        staging: HostStaging | None = None,
    ) -> None:
        self.layout, self.rank, self.timeout_s, self.abort_check = layout, rank, timeout_s, abort_check
        g = layout.geometry
        self.staging = staging or HostStaging(max(g.state_bytes, g.grad_bytes), device)
        # the training thread's time in protection, wall and its own CPU (thread_time), for metrics;
        # `wait_slot_s`: the part of `wait_s` spent waiting for a free staging slot
        self.spent = {"stage_s": 0.0, "wait_s": 0.0, "wait_slot_s": 0.0, "stage_cpu_s": 0.0, "wait_cpu_s": 0.0}
        self.node = layout.node_of_rank[rank]
        self.w = layout.local_index(rank)
        why = await_keys(store, [keys.ready(layout.generation, self.node)], timeout_s, abort_check)
        if why is not None:
            raise PeerFailure(f"waiting for keeper ready (generation {layout.generation}): {why}")
        self.region = Region(layout, job_id, self.node, create=False)
        self.hdr = self.region["slot_hdr"][self.w]
        self._rows = [memoryview(row) for row in self.hdr]  # a slot's header fields: cheaper than numpy's indexing
        self.data = self.region["slot_data"][self.w]
        self._stage = stager()  # the native staging copy, or None: numpy's
        self._slot_at = [int(self.data[i].ctypes.data) for i in range(len(self.data))]
        self.bell = Doorbell(int(self.region.header[H_PID]))  # the keeper sleeps until rung
        self.seq = 0
        self.ring_every = max(1, layout.ring_slots // 2)
        self.base = layout.base_step

    def _wait_until(self, pred: Callable[[], bool], what: str, also: str | None = None, poll: float = 1e-4) -> None:
        """Wait until `pred()`, its time counted as waiting (and in `spent[also]` too)."""
        if pred():
            return
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            self._poll(pred, what, poll)
        finally:
            waited = time.perf_counter() - t0
            self.spent["wait_s"] += waited
            self.spent["wait_cpu_s"] += time.thread_time() - c0
            if also is not None:
                self.spent[also] += waited

    def _poll(self, pred: Callable[[], bool], what: str, poll: float) -> None:
        deadline = time.monotonic() + self.timeout_s
        delay = 2e-5
        while not pred():
            reason = self.abort_check()
            if reason:
                raise PeerFailure(f"waiting for {what} aborted: {reason}")
            if time.monotonic() > deadline:
                raise PeerFailure(
                    f"timed out after {self.timeout_s:.0f}s waiting for {what} (generation {self.layout.generation})"
                )
            time.sleep(delay)
            delay = min(delay * 2, max(poll, 1e-3))

    def _slot(self) -> int:
        idx = self.seq % self.layout.ring_slots
        row = self._rows[idx]
        if row[S_READY] != SLOT_FREE:
            self.bell.ring()  # whatever it last heard, the keeper has a full ring to fold
            self._wait_until(lambda: row[S_READY] == SLOT_FREE, "a free staging slot", "wait_slot_s")
        return idx

    def _publish(self, idx: int, kind: int, step: int, chunk: int, crc: int, last: bool) -> None:
        h = self._rows[idx]
        h[S_KIND], h[S_STEP], h[S_CHUNK], h[S_CRC] = kind, step, chunk, crc
        h[S_READY] = SLOT_STAGED  # last: the keeper applies only complete slots (total store order: see shm.py)
        self.seq += 1
        # every half ring and at a step's last chunk: the keeper folds while the worker stages the
        # next ones, and wakes up half as often as there are chunks (a lost ring costs latency only)
        if last or self.seq % self.ring_every == 0:
            self.bell.ring()

    def stage_grads(self, step: int, grads: torch.Tensor, before_chunk: Callable[[int], None] = lambda c: None) -> None:
        """Hand over this rank's gradient shard of `step` ([n_chunks, chunk_elems])."""
        t0, c0, w0, wc0 = time.perf_counter(), time.thread_time(), self.spent["wait_s"], self.spent["wait_cpu_s"]
        for c in range(grads.shape[0]):
            before_chunk(c)
            src = self.staging.host(grads[c])
            idx = self._slot()
            self.data[idx, : src.size] = src
            self._publish(idx, KIND_GRAD, step, c, checksum(src), c == grads.shape[0] - 1)
        self._spent_staging(t0, c0, w0, wc0)

    def stage_deltas(
        self,
        step: int,
        old: torch.Tensor | None,
        new: torch.Tensor,
        before_chunk: Callable[[int], None] = lambda c: None,
    ) -> None:
        """Hand over `old XOR new` per chunk (the full chunk when `old` is None) at version `step`."""
        for c in range(new.shape[0]):
            before_chunk(c)
            self.stage_delta(step, c, None if old is None else old[c], new[c], c == new.shape[0] - 1)

    def stage_delta(self, step: int, c: int, old: torch.Tensor | None, new: torch.Tensor, last: bool) -> None:
        """Hand over chunk `c`'s `old XOR new` (`new` when `old` is None) at version `step`, with
        the checksum of `new`; `last`: the step's last chunk. Returns once the slot is published;
        only a wait for a free slot can raise (PeerFailure), and then nothing of this chunk was
        handed over."""
        t0, c0, w0, wc0 = time.perf_counter(), time.thread_time(), self.spent["wait_s"], self.spent["wait_cpu_s"]
        st = self.staging
        nb = st.host(new, 0)
        ob = None if old is None else st.host(old, 1)
        if (ob is not None and ob.size != nb.size) or nb.size > self.data.shape[1]:  # the copy writes by address
            raise ValueError(
                f"a delta of chunks of {nb.size} and {None if ob is None else ob.size} bytes "
                f"for a {self.data.shape[1]}-byte slot"
            )
        idx = self._slot()
        if self._stage is not None:
            self._stage(self._slot_at[idx], 0 if old is None else st.address(old, 1), st.address(new, 0), nb.size)
        elif ob is None:
            self.data[idx, : nb.size] = nb
        else:
            np.bitwise_xor(ob, nb, out=self.data[idx, : nb.size])
        self._publish(idx, KIND_DELTA, step, c, checksum(nb), last)
        self._spent_staging(t0, c0, w0, wc0)

    def charged(self, fn: Callable[..., object], *args: object) -> None:
        """Run `fn(*args)`, work done only because the state is protected (the in-place update's
        copy back from its scratch chunk), and count its time as staging."""
        t0, c0 = time.perf_counter(), time.thread_time()
        fn(*args)
        self.spent["stage_s"] += time.perf_counter() - t0
        self.spent["stage_cpu_s"] += time.thread_time() - c0

    def _spent_staging(self, t0: float, c0: float, w0: float, wc0: float) -> None:
        """Count the time since `t0` (wall) and `c0` (this thread's CPU) as staging, less the
        waits inside it (the wait counters were `w0`, `wc0` then)."""
        s = self.spent
        s["stage_s"] += time.perf_counter() - t0 - (s["wait_s"] - w0)
        s["stage_cpu_s"] += time.thread_time() - c0 - (s["wait_cpu_s"] - wc0)

    def wait_grad_commit(self, step: int) -> None:
        h = self.region.header
        self._wait_until(lambda: h[H_GCOMMIT] >= step, f"grad commit of step {step}")

    def wait_delta_commit(self, step: int) -> None:
        h = self.region.header
        self._wait_until(lambda: h[H_DCOMMIT] >= step, f"delta commit of step {step}")

    def close(self) -> None:
        for row in self._rows:
            row.release()
        self.hdr = self.data = self._rows = None  # type: ignore[assignment]
        self.bell.close()
        self.region.close()
