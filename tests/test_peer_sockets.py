"""The keepers' tier-2 connections: each keeper connects to every other one of its generation;
a connection that does not say a well-formed hello of a peer of that generation is closed, a
malformed address in the store and a peer that never comes are errors that name them, and
a batch that a peer garbles ends the link with an error that says what it sent."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch.distributed as dist

from leto.protection.peer_sockets import HELLO_MAGIC, PeerSockets, listen_address, read_exactly, send_all
from leto.protocol import keys

TIMEOUT_S = 5.0


def _build(store: dist.Store, gen: int, nodes: list[int]) -> dict[int, PeerSockets | BaseException]:
    out: dict[int, PeerSockets | BaseException] = {}

    def one(node: int) -> None:
        try:
            out[node] = PeerSockets(store, gen, nodes, node, TIMEOUT_S)
        except BaseException as e:  # noqa: BLE001 (the test looks at it)
            out[node] = e

    threads = [threading.Thread(target=one, args=(n,), daemon=True) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3 * TIMEOUT_S)
    return out


@pytest.fixture
def store() -> Iterator[dist.Store]:
    yield dist.HashStore()


def _close(built: dict[int, PeerSockets | BaseException]) -> None:
    for s in built.values():
        if isinstance(s, PeerSockets):
            s.close()


def test_every_keeper_connects_to_every_other_one_way_per_connection(store: dist.Store) -> None:
    built = _build(store, 3, [0, 1, 2])
    try:
        assert all(isinstance(s, PeerSockets) for s in built.values()), built
        for node, s in built.items():
            assert isinstance(s, PeerSockets)
            assert sorted(s.out) == sorted(s.inbound) == [n for n in (0, 1, 2) if n != node]
        a, b = built[0], built[2]
        assert isinstance(a, PeerSockets) and isinstance(b, PeerSockets)
        payload = np.arange(1000, dtype=np.int64).view(np.uint8)
        send_all(a.out[2], [payload[:10], payload[10:]], TIMEOUT_S)
        got = np.zeros_like(payload)
        read_exactly(b.inbound[0], got)
        assert np.array_equal(got, payload)
    finally:
        _close(built)


def test_a_one_host_job_listens_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert listen_address() == "127.0.0.1"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert listen_address() == "127.0.0.1"


def test_a_stray_connection_and_a_wrong_hello_are_closed_and_the_peers_still_connect(store: dist.Store) -> None:
    """Node 0 listens first; before node 1 comes, two strangers connect to it: one says garbage,
    one says the hello of another generation. Both are dropped, node 1's connection is kept."""
    result: dict[int, PeerSockets | BaseException] = {}

    def node0() -> None:
        try:
            result[0] = PeerSockets(store, 7, [0, 1], 0, TIMEOUT_S)
        except BaseException as e:  # noqa: BLE001
            result[0] = e

    t0 = threading.Thread(target=node0, daemon=True)
    t0.start()
    key = keys.tier2_address(7, 0)
    deadline = time.monotonic() + TIMEOUT_S
    while not store.check([key]):
        assert time.monotonic() < deadline, "node 0 never published its address"
        time.sleep(0.01)
    where = json.loads(store.get(key))
    strangers = []
    for hello in (b"GET / HTTP/1.0\r\n\r\n\0\0\0\0\0\0", np.array([HELLO_MAGIC, 6, 1], dtype=np.uint64).tobytes()):
        s = socket.create_connection((where["addr"], where["port"]), timeout=TIMEOUT_S)
        s.sendall(hello)
        strangers.append(s)
    try:
        PeerSockets(store, 7, [0, 1], 1, TIMEOUT_S).close()  # node 1 connects (and goes)
        t0.join(2 * TIMEOUT_S)
        ok = result[0]
        assert isinstance(ok, PeerSockets), ok
        assert sorted(ok.inbound) == [1]
        ok.close()
        for s in strangers:  # node 0 closed both
            s.settimeout(TIMEOUT_S)
            assert s.recv(1) == b""
    finally:
        for s in strangers:
            s.close()


def test_a_malformed_address_in_the_store_is_an_error_naming_it(store: dist.Store) -> None:
    store.set(keys.tier2_address(4, 1), "not json")
    with pytest.raises(RuntimeError, match=r"malformed value of .*kpg/g4/tier2/1"):
        PeerSockets(store, 4, [0, 1], 0, TIMEOUT_S)


def test_a_peer_that_never_comes_is_an_error_within_the_timeout(store: dist.Store) -> None:
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="node 1"):
        PeerSockets(store, 5, [0, 1], 0, 1.0)
    assert time.monotonic() - t0 < 1.0 + TIMEOUT_S
