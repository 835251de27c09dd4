"""A tier-2 link's receiver: it folds well-formed batches, skips keepalives, and ends the link
with an error that says what the peer did when the peer garbles a batch, names a place this
keeper holds no parity of, or goes away. Its sender sends each body from its staging slot and
hands the slot back only once the batch is sent."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from leto.protection.shm import KIND_DELTA
from leto.protection.transport import HDR, PREFIX, Link

TIMEOUT_S = 5.0
NBYTES = 48


class FakeParity:
    def __init__(self) -> None:
        self.folded: list[tuple[int, int, int, int, int, bytes]] = []

    def fold_remote(self, kind: int, step: int, stripe: int, p: int, i: int, crc: int, body: np.ndarray) -> None:
        if stripe != 0:
            raise KeyError(f"p2_{stripe}")
        self.folded.append((step, stripe, p, i, crc, body.tobytes()))


class FakeBarrier:
    def may_enter(self) -> bool:
        return False


class FakeKeeper:
    """What a Link uses of its keeper."""

    def __init__(self) -> None:
        self.nbytes = {KIND_DELTA: NBYTES}
        self.per_msg = {KIND_DELTA: 4}
        self.timeout_s = TIMEOUT_S
        self.closed = self.reported = self.dirty = self.wants_room = False
        self.lock = threading.Lock()
        self.parity = FakeParity()
        self.barrier = FakeBarrier()
        self.failures: list[str] = []
        self.handed_back: list[tuple[int, int]] = []

    def record_bytes(self, kind: int) -> int:
        return HDR * 8 + self.nbytes[kind]

    def link_failed(self, why: str, waited_s: float) -> None:
        self.failures.append(why)

    def hand_back(self, slots: list[tuple[int, int]]) -> None:
        self.handed_back += slots


@pytest.fixture
def pair() -> Iterator[tuple[FakeKeeper, Link, socket.socket]]:
    """A keeper's link to node 9 that receives on one end of a socket pair; the test is node 9."""
    mine, peer = socket.socketpair()
    mine.settimeout(TIMEOUT_S)
    keeper = FakeKeeper()
    link = Link(keeper, 9, None, mine)  # type: ignore[arg-type]
    try:
        yield keeper, link, peer
    finally:
        keeper.closed = True
        peer.close()


def _within(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(1e-3)


def _batch(records: list[tuple[int, int, int, int, int, bytes]], count: int | None = None) -> bytes:
    out = np.array([KIND_DELTA, len(records) if count is None else count], dtype=np.int64).tobytes()
    for step, stripe, p, i, crc, body in records:
        out += np.array([KIND_DELTA, step, 0, stripe, p, i, crc, 0], dtype=np.int64).tobytes() + body
    return out


def test_a_batch_is_folded_and_a_keepalive_skipped(pair: tuple[FakeKeeper, Link, socket.socket]) -> None:
    keeper, link, peer = pair
    body = bytes(range(NBYTES))
    peer.sendall(np.zeros(PREFIX, dtype=np.int64).tobytes())  # a keepalive
    peer.sendall(_batch([(3, 0, 0, 1, 77, body), (3, 0, 0, 2, 78, body[::-1])]))
    _within(lambda: link.received[KIND_DELTA] == 1)
    assert keeper.parity.folded == [(3, 0, 0, 1, 77, body), (3, 0, 0, 2, 78, body[::-1])]
    assert keeper.dirty and link.error is None


def test_a_batch_of_too_many_records_ends_the_link_naming_it(pair: tuple[FakeKeeper, Link, socket.socket]) -> None:
    keeper, link, peer = pair
    peer.sendall(_batch([], count=999))
    _within(lambda: link.error is not None)
    assert "node 9 sent a batch of 999 records" in str(link.error)
    assert keeper.parity.folded == []


def test_a_record_for_parity_not_held_here_ends_the_link(pair: tuple[FakeKeeper, Link, socket.socket]) -> None:
    keeper, link, peer = pair
    peer.sendall(_batch([(3, 5, 0, 1, 77, bytes(NBYTES))]))
    _within(lambda: link.error is not None)
    assert "node 9 sent a record for stripe 5" in str(link.error)


def test_a_peer_that_goes_away_ends_the_link(pair: tuple[FakeKeeper, Link, socket.socket]) -> None:
    keeper, link, peer = pair
    peer.sendall(_batch([(3, 0, 0, 1, 77, bytes(NBYTES))])[:30])  # half a batch, then gone
    peer.close()
    _within(lambda: link.error is not None)
    assert "receiving from node 9 failed" in str(link.error)
    assert keeper.failures == [link.error]


def test_the_sender_sends_bodies_from_their_slots_and_hands_them_back_once_sent() -> None:
    mine, peer = socket.socketpair()
    mine.settimeout(TIMEOUT_S)
    peer.settimeout(TIMEOUT_S)
    keeper = FakeKeeper()
    link = Link(keeper, 9, mine, None, scaled=False)  # type: ignore[arg-type]
    try:
        slots = np.arange(2 * NBYTES, dtype=np.uint8).reshape(2, NBYTES)
        for idx in (0, 1):
            header = link.record(KIND_DELTA, slots[idx], (0, idx))
            header[:] = (KIND_DELTA, 4, 0, 0, 0, idx, 100 + idx, 0)
        assert link.bufs[KIND_DELTA][0].size == PREFIX * 8 + 4 * HDR * 8  # headers only: no copy of a body
        assert keeper.handed_back == []
        link.flush(KIND_DELTA)
        want = _batch([(4, 0, 0, idx, 100 + idx, slots[idx].tobytes()) for idx in (0, 1)])
        got = b""
        while len(got) < len(want):
            got += peer.recv(len(want) - len(got))
        assert got == want
        _within(lambda: keeper.handed_back == [(0, 0), (0, 1)])
        assert link.sent[KIND_DELTA] == 1
    finally:
        link.outbox.put(None)
        peer.close()
