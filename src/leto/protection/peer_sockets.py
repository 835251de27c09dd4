"""The keepers' TCP connections of a generation, over which tier-2 contributions travel.

Every keeper listens on its host's address (the interface `GLOO_SOCKET_IFNAME` names, loopback
otherwise), publishes where in the store, and connects once to every other keeper of the
generation; each connection carries one direction of traffic, from the keeper that opened it.
A connection opens with a hello (a magic number, the generation, the opener's node) that the
accepting keeper checks: a stray or stale connection, or one that speaks garbage, is closed and
the keeper goes on waiting for its peers until the timeout. Nothing read from a peer is ever
unpickled: the hello and every batch are fixed-layout int64 headers (`transport.py`).
"""

from __future__ import annotations

import os
import socket
import time

import numpy as np
import torch.distributed as dist

from leto.errors import BadValue
from leto.protocol import keys
from leto.protocol.protection import Tier2Address
from leto.runtime import env as rt
from leto.runtime import linux

HELLO_MAGIC = 0x4C45544F54325632  # "LETOT2V2"
HELLO = 3  # int64 fields: magic, generation, the opener's node
IOV_MAX = 1024  # buffers one sendmsg takes (Linux's UIO_MAXIOV)


def listen_address() -> str:
    """This host's address for tier-2 traffic: the one of the interface gloo is told to use
    (`GLOO_SOCKET_IFNAME`), else loopback."""
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    return (linux.address_of(iface) if iface else None) or rt.LOOPBACK


class PeerSockets:
    """Generation `gen`'s connections of `node`'s keeper: `out[n]` it sends to keeper `n` on,
    `inbound[n]` it receives from `n` on. Every operation on them is bounded by `timeout_s`."""

    def __init__(self, store: dist.Store, gen: int, nodes: list[int], node: int, timeout_s: float) -> None:
        self.gen, self.node, self.timeout_s = gen, node, timeout_s
        self.out: dict[int, socket.socket] = {}
        self.inbound: dict[int, socket.socket] = {}
        peers = [n for n in nodes if n != node]
        deadline = time.monotonic() + timeout_s
        addr = listen_address()
        try:
            with socket.create_server((addr, 0), backlog=max(8, 2 * len(peers))) as server:
                store.set(keys.tier2_address(gen, node), Tier2Address(addr, server.getsockname()[1]).to_json())
                for n in peers:  # a peer's listener takes the connection before it accepts it
                    self.out[n] = self._connect(store, n, deadline)
                while len(self.inbound) < len(peers):
                    self._accept(server, set(peers), deadline)
        except BaseException:
            self.close()
            raise

    def _connect(self, store: dist.Store, peer: int, deadline: float) -> socket.socket:
        key = keys.tier2_address(self.gen, peer)
        why = rt.await_keys(store, [key], _left(deadline, f"keeper of node {peer} to publish its tier-2 address"))
        if why is not None:
            raise RuntimeError(f"the keeper of node {peer} did not publish its tier-2 address: {why}")
        try:
            where = Tier2Address.from_json(store.get(key), key)
        except BadValue as e:
            raise RuntimeError(f"cannot connect to the keeper of node {peer}: malformed value of {e}") from None
        left = _left(deadline, f"a tier-2 connection to node {peer}")
        try:
            sock = socket.create_connection((where.addr, where.port), timeout=left)
        except OSError as e:
            raise RuntimeError(f"cannot connect to the keeper of node {peer} at {where.addr}:{where.port}: {e}") from e
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # keepalives must not wait for more data
        sock.settimeout(self.timeout_s)
        try:
            sock.sendall(np.array([HELLO_MAGIC, self.gen, self.node], dtype=np.uint64).view(np.uint8))
        except OSError as e:
            sock.close()
            raise RuntimeError(f"the keeper of node {peer} closed its tier-2 connection at once: {e}") from e
        return sock

    def _accept(self, server: socket.socket, peers: set[int], deadline: float) -> None:
        """Take one connection and keep it if it says hello from a peer not yet connected."""
        server.settimeout(_left(deadline, f"tier-2 connections from nodes {sorted(peers - set(self.inbound))}"))
        try:
            conn, _ = server.accept()
        except TimeoutError:
            raise RuntimeError(
                f"the keepers of nodes {sorted(peers - set(self.inbound))} did not connect within "
                f"{self.timeout_s:g}s (generation {self.gen})"
            ) from None
        hello = np.zeros(HELLO, dtype=np.uint64)
        conn.settimeout(min(self.timeout_s, max(1e-3, deadline - time.monotonic())))
        try:
            read_exactly(conn, hello.view(np.uint8))
        except OSError:  # silent, or gone: not a keeper of this generation
            conn.close()
            return
        magic, gen, peer = (int(v) for v in hello)
        if magic != HELLO_MAGIC or gen != self.gen or peer not in peers or peer in self.inbound:
            conn.close()  # a stray, stale or duplicate connection
            return
        conn.settimeout(self.timeout_s)
        self.inbound[peer] = conn

    def shutdown(self) -> None:
        """Shut every connection down: a thread blocked on one returns (and closes it)."""
        for sock in (*self.out.values(), *self.inbound.values()):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # not connected any more, or already closed by its thread
                pass

    def close(self) -> None:
        """Close every connection (none may be in a thread's use)."""
        for sock in (*self.out.values(), *self.inbound.values()):
            sock.close()


def send_all(sock: socket.socket, parts: list[np.ndarray], timeout_s: float) -> None:
    """Send the bytes of `parts` (uint8 arrays) in order, gathered by the kernel from where they
    are (no copy into one buffer); raises `TimeoutError` past `timeout_s` in all."""
    deadline = time.monotonic() + timeout_s
    views = [memoryview(p) for p in parts if p.size]
    while views:
        n = sock.sendmsg(views[:IOV_MAX])
        while views and n >= views[0].nbytes:
            n -= views.pop(0).nbytes
        if n:
            views[0] = views[0][n:]
        if views and time.monotonic() > deadline:
            raise TimeoutError(f"a send ran past {timeout_s:g}s")


def read_exactly(sock: socket.socket, view: np.ndarray) -> None:
    """Fill `view` (uint8) from `sock`; raises `ConnectionError` at the end of the stream and
    `TimeoutError` when a read waits past the socket's timeout."""
    mv, got, n = memoryview(view), 0, view.size
    while got < n:
        k = sock.recv_into(mv[got:], n - got)
        if k == 0:
            raise ConnectionError("the connection was closed")
        got += k


def _left(deadline: float, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise RuntimeError(f"timed out waiting for {what}")
    return left
