"""After its report a keeper's tier-2 region is frozen: a late batch is received, not folded.
A receiver rings its keeper only when the next barrier can be entered, and ends its link, saying
what the peer did, on a batch that does not fit or names a place it holds no parity of.

In a partition, a cut-off node's queued tier-2 sends can reach a survivor's keeper once the link
is back, after that keeper drained and reported; recovery decodes from the region at the versions
of the report, so nothing may change it from then on (`Keeper.reported`). Two keepers run in
threads of this process over their real gloo group and connections; node B's worker stages deltas as a worker
does (`Protector`), B's keeper ships them, and node A keeps the tier-2 parity of B's data.
Every test runs over both data planes (`dataplane.py`).
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
import torch.distributed as dist

from leto.protection import dataplane, doorbell
from leto.protection.client import Protector
from leto.protection.drain import drain
from leto.protection.integrity import checksum
from leto.protection.keeper import Keeper
from leto.protection.layout import Geometry, Layout
from leto.protection.shm import EMPTY, KIND_DELTA, S_READY, SHM_DIR, SLOT_FREE, region_name
from leto.protection.transport import HDR

A, B = 0, 1
TIMEOUT_S = 10.0
# ec 1+1 over two nodes: each node keeps the parity of the other's data. Replicated gradients:
# deltas only, so one kind of batch
LAYOUT = Layout(0, 0, Geometry(n_chunks=2, chunk_elems=16), (A, B), (1, 1), replicated_grads=True)
((STRIPE, _),) = LAYOUT.parity_stripes(A)
TIER2 = (f"p2_{STRIPE.index}", f"v2_{STRIPE.index}", f"crc2_{STRIPE.index}")


def _within(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {TIMEOUT_S:.0f}s waiting for {what}")
        time.sleep(1e-3)


class Cluster:
    """Keepers A and B, and B's one worker."""

    def __init__(self, store: dist.Store, job: str, keepers: dict[int, Keeper]) -> None:
        self.a, self.b = keepers[A], keepers[B]
        self.store, self.job = store, job
        self.worker = Protector(store, LAYOUT, B, job, TIMEOUT_S, lambda: None)  # rank 1 runs on node B

    def ship(self, step: int, old: torch.Tensor | None, new: torch.Tensor) -> None:
        """B's worker stages `old XOR new`, B's keeper folds and ships it; returns once A's link
        to B has received the batch (and folded it, or not: both happen before the count)."""
        link = self.a.links[B]
        before = link.received[KIND_DELTA]
        self.worker.stage_deltas(step, old, new)

        def received() -> bool:
            self.b.consume_slots()  # B's keeper loop: fold the staged slots, ship the step's batch
            return link.received[KIND_DELTA] > before or link.error is not None

        _within(received, f"node A to receive B's step-{step} batch")
        assert link.error is None, link.error

    def tier2(self) -> dict[str, np.ndarray]:
        return {name: self.a.region[name].copy() for name in TIER2}


@pytest.fixture(params=["native", "python", "mixed"])
def cluster(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """The keepers on the native data plane, on the Python one, or A on the native one and B on
    the Python one (hosts of a job where one could not build the library)."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    planes = {"native": ("native", "native"), "python": ("python", "python"), "mixed": ("native", "python")}
    plane = dict(zip((A, B), planes[request.param]))
    serves = dataplane.serves
    monkeypatch.setattr(
        dataplane, "serves", lambda layout: plane[int(threading.current_thread().name)] == "native" and serves(layout)
    )
    store, job = dist.HashStore(), f"spec-{uuid.uuid4().hex[:12]}"
    keepers: dict[int, Keeper] = {}
    errors: list[BaseException] = []

    def build(node: int) -> None:  # each constructor waits in gloo's rendezvous for the other
        try:
            keepers[node] = Keeper(store, job, node, LAYOUT, TIMEOUT_S)
        except BaseException as e:  # noqa: BLE001 (re-raised in the test's thread)
            errors.append(e)

    threads = [threading.Thread(target=build, args=(n,), name=str(n), daemon=True) for n in (A, B)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + TIMEOUT_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    c = None
    try:
        if errors:
            raise errors[0]
        if len(keepers) != 2:
            pytest.fail(f"the keepers did not form their gloo group within {TIMEOUT_S:.0f}s")
        assert all((keepers[n].native is not None) == (plane[n] == "native") for n in (A, B))
        c = Cluster(store, job, keepers)
        yield c
    finally:
        if c is not None:
            c.worker.close()
        for k in keepers.values():  # its connections shut down: its threads return
            k.close(unlink=True)
        for node in (A, B):  # also a region whose keeper never finished its constructor
            (SHM_DIR / region_name(job, LAYOUT.generation, node)).unlink(missing_ok=True)


def _state(step: int) -> torch.Tensor:
    """Rank 1's shard at `step`: [n_chunks, 3 rows of chunk_elems] (a chunk is state_bytes)."""
    g = LAYOUT.geometry
    return torch.arange(g.n_chunks * 3 * g.chunk_elems, dtype=torch.float32).reshape(g.n_chunks, -1) + step


def test_the_layout_sends_b_s_contributions_to_a() -> None:
    assert LAYOUT.senders_to(A) == [B] and STRIPE.data_nodes == (LAYOUT.nodes.index(B),)


def test_before_the_report_a_batch_is_folded_into_the_parity(cluster: Cluster) -> None:
    p2, v2, crc2 = TIER2
    assert (cluster.a.region[v2] == EMPTY).all()
    cluster.ship(0, None, _state(0))
    data = _state(0).view(torch.uint8).numpy()
    got = cluster.tier2()
    assert np.array_equal(got[p2], data)  # 1+1 is XOR over one data block: the parity is B's data
    assert got[v2].tolist() == [[0, 0]]
    assert got[crc2].tolist() == [[checksum(data[0]), checksum(data[1])]]


def test_a_chunk_larger_than_a_staging_slot_is_refused_and_nothing_is_staged(cluster: Cluster) -> None:
    """The staging copy writes by address: a chunk that does not fit its slot is an error before
    any byte is written, not a write into the next slot."""
    w = cluster.worker
    before = w.data.copy()
    big = torch.zeros(w.data.shape[1] // 4 + 1)
    with pytest.raises(ValueError, match="byte slot"):
        w.stage_delta(0, 0, None, big, last=True)
    assert np.array_equal(w.data, before) and all(row[S_READY] == SLOT_FREE for row in w._rows)


def test_after_its_report_a_keeper_receives_late_batches_but_folds_none(cluster: Cluster) -> None:
    cluster.ship(0, None, _state(0))  # B's data is protected at step 0
    report = drain(cluster.a, {A}, TIMEOUT_S)  # B declared lost: recovery reads A's report
    frozen = cluster.tier2()
    assert frozen[TIER2[1]].tolist() == [[0, 0]]
    cluster.ship(1, _state(0), _state(1))  # B, cut off, delivers step 1 once the link is back
    assert cluster.a.links[B].received[KIND_DELTA] == 2
    late = cluster.tier2()
    for name in TIER2:
        assert np.array_equal(late[name], frozen[name]), f"{name} changed after the report"
    t0 = time.monotonic()
    assert drain(cluster.a, {A, B}, TIMEOUT_S) == report  # at once: no wait for B's sent counts
    assert time.monotonic() - t0 < TIMEOUT_S / 2


def test_a_drain_folds_every_staged_chunk_into_tier_1_when_the_tier_2_peer_is_gone(cluster: Cluster) -> None:
    """B's worker updated each chunk in place once its slot was published, so B's report must
    show every staged delta folded, although B's only tier-2 peer died and its batches can
    never leave (they would fill B's send buffers and stop the drain's folding)."""
    cluster.a.close(unlink=False)  # node A is gone: its connections close
    for step in range(4):  # 8 slots, a whole ring, none taken yet: more batches than send buffers
        cluster.worker.stage_deltas(step, None if step == 0 else _state(step - 1), _state(step))
    report = drain(cluster.b, {B}, TIMEOUT_S)
    assert report.v1 == [[3, 3]]
    assert cluster.b.links[A].error is not None


def test_a_receiver_rings_the_main_loop_only_once_a_batch_completes_the_next_barrier_s_step(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ring per batch woke the keeper's main loop more often than it had anything to fold;
    the fold that leaves the next barrier's step complete still rings it. (The keepers run in
    this process: their threads ring its main thread, the test's; the workers' rings, which
    would reach it too, are silenced.)"""
    monkeypatch.setattr(doorbell.Doorbell, "ring", lambda self, sig=doorbell.DATA: None)
    rings: list[int] = []
    before = signal.signal(doorbell.DATA, lambda sig, _: rings.append(sig))
    rank0 = Protector(cluster.store, LAYOUT, A, cluster.job, TIMEOUT_S, lambda: None)
    try:
        cluster.ship(0, None, _state(0))  # at A, rank 0's own chunks of step 0 are still missing
        time.sleep(0.2)  # a ring would have come by now
        assert rings == []
        rank0.stage_deltas(0, None, _state(0))
        link = cluster.b.links[A]

        def received() -> bool:
            cluster.a.consume_slots()  # A folds rank 0's chunks and ships them to B
            return link.received[KIND_DELTA] > 0 or link.error is not None

        _within(received, "node B to receive A's step-0 batch")
        assert link.error is None, link.error
        _within(lambda: bool(rings), "B's receiver to ring")  # B held its own rank's step 0: A's batch completes it
        time.sleep(0.2)
        assert rings == [doorbell.DATA]
    finally:
        rank0.close()
        signal.signal(doorbell.DATA, before)


@pytest.mark.parametrize(("p", "i"), [(0, -1), (-1, 0), (0, LAYOUT.segment_len), (1, 0)])
def test_a_contribution_for_a_place_outside_the_stripe_is_refused_not_wrapped(cluster: Cluster, p: int, i: int) -> None:
    """A peer's position and offset index this keeper's parity: a negative one must not wrap to
    the last row (numpy would), nor one past the end fold anywhere."""
    before = cluster.tier2()
    body = np.full(LAYOUT.geometry.state_bytes, 7, dtype=np.uint8)
    with pytest.raises(IndexError, match=f"no position {p}, offset {i} in stripe {STRIPE.index}"):
        cluster.a.parity.fold_remote(KIND_DELTA, 0, STRIPE.index, p, i, 0, body)
    after = cluster.tier2()
    assert all(np.array_equal(before[k], after[k]) for k in TIER2)


def _send_raw(cluster: Cluster, *parts: np.ndarray) -> None:
    """Bytes on B's connection to A, as a peer that speaks garbage would send them."""
    cluster.b.sockets.out[A].sendall(b"".join(p.tobytes() for p in parts))


def test_a_batch_of_more_records_than_a_batch_holds_ends_the_link_naming_it(cluster: Cluster) -> None:
    n = cluster.a.per_msg[KIND_DELTA] + 1
    _send_raw(cluster, np.array([KIND_DELTA, n], dtype=np.int64))
    link = cluster.a.links[B]
    _within(lambda: link.error is not None, "A's link from B to fail")
    assert link.error == f"node {B} sent a batch of {n} records of kind {KIND_DELTA}"


@pytest.mark.parametrize(("stripe", "p", "i"), [(STRIPE.index, 0, -1), (STRIPE.index, 1, 0), (STRIPE.index + 7, 0, 0)])
def test_a_record_for_a_place_this_keeper_holds_no_parity_of_ends_the_link_and_folds_nothing(
    cluster: Cluster, stripe: int, p: int, i: int
) -> None:
    before = cluster.tier2()
    header = np.array([KIND_DELTA, 0, LAYOUT.nodes.index(B), stripe, p, i, 0, LAYOUT.generation], dtype=np.int64)
    assert header.size == HDR
    body = np.full(LAYOUT.geometry.state_bytes, 7, dtype=np.uint8)
    _send_raw(cluster, np.array([KIND_DELTA, 1], dtype=np.int64), header, body)
    link = cluster.a.links[B]
    _within(lambda: link.error is not None, "A's link from B to fail")
    assert link.error.startswith(f"node {B} sent a record for stripe {stripe}, position {p}, offset {i}"), link.error
    after = cluster.tier2()
    assert all(np.array_equal(before[k], after[k]) for k in TIER2)
