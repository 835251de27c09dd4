"""A host's membership of a multi-host job: its etcd lease, and the liveness socket its peers hold.

The lease is the authority: a host is in the job while its lease lives, and every write of its
processes is fenced by the lease-bound host key (`EtcdStore.fence`). A supervisor that cannot
refresh its lease within the lease time takes its host out of the job itself (`HostLease.lost`).

The liveness socket is the early evidence: the coordinator keeps a TCP connection to every
other host's supervisor; the kernel closes it the moment that process dies (a host's processes
die with their supervisor), so a killed host is known at once, not after the lease time. A host
that vanishes silently (power, a cut link, frozen) leaves the connection open: the lease decides.
"""
from __future__ import annotations

import select
import socket
import threading
import time

from leto.runtime.etcd_store import EtcdStore, StoreUnavailable

REFRESHES_PER_LEASE = 4
# A host that cannot refresh gives etcd one more lease time before it takes itself out: a new etcd
# leader extends every lease (lessor promotion), so an election never expires one, and a host
# must not stop itself during one. Its lease may expire earlier at etcd; from then on etcd refuses
# its writes (the fence) and no later generation includes it, so waiting is safe.
SILENT_LEASES = 2


class HostLease:
    """This host's lease, refreshed by a thread of its own (with its own etcd client)."""

    def __init__(self, store: EtcdStore, ttl_s: int) -> None:
        """`store`: its endpoints in the order to try them (the host's own member first)."""
        self.ttl_s = ttl_s
        self._store = store.client(timeout_s=float(ttl_s))
        self.id = self._store.grant(ttl_s)
        self._ok = time.monotonic()  # the start of the last refresh that etcd confirmed
        self._expired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="leto-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.ttl_s / REFRESHES_PER_LEASE):
            sent = time.monotonic()
            try:  # each try is short: a frozen member must not hold it past the lease time
                ttl = self._store.keepalive(self.id, deadline=sent + self.ttl_s / REFRESHES_PER_LEASE)
            except StoreUnavailable:
                continue  # lost() decides once the lease time has passed
            if ttl <= 0:
                self._expired = True
                return
            self._ok = sent

    def lost(self) -> str | None:
        """Why this host is out of the job (None while its lease is sure to live)."""
        if self._expired:
            return "its etcd lease expired (the other hosts declared it lost)"
        silent = time.monotonic() - self._ok
        if silent >= SILENT_LEASES * self.ttl_s:
            return f"it could not refresh its etcd lease for {silent:.1f}s (cut off from the etcd quorum)"
        return None

    def close(self, revoke: bool) -> None:
        """Stop refreshing; `revoke`: end the lease now (a host leaving a finished job)."""
        self._stop.set()
        self._thread.join(timeout=self.ttl_s)
        if revoke and not self._expired:
            try:
                self._store.revoke(self.id)
            except StoreUnavailable:
                pass  # it expires by itself


class Liveness:
    """The supervisor's side: a listening socket whose accepted connections it never answers;
    they close only when this process dies."""

    def __init__(self, addr: str) -> None:
        self._sock = socket.create_server((addr, 0))
        self.port = self._sock.getsockname()[1]
        self._peers: list[socket.socket] = []
        threading.Thread(target=self._accept, name="leto-liveness", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._peers.append(conn)


class LivenessWatch:
    """The coordinator's side: one connection to every other host's supervisor; `dead()`
    names the hosts whose connection the kernel closed or reset."""

    def __init__(self) -> None:
        self._conns: dict[int, socket.socket] = {}
        self._refused: set[int] = set()
        self.gone: set[int] = set()

    def watch(self, node: int, addr: str, port: int) -> None:
        if node in self._conns or node in self.gone:
            return
        try:
            self._conns[node] = socket.create_connection((addr, port), timeout=0.2)
        except OSError:  # refused: nothing listens there any more
            self._refused.add(node)

    def dead(self) -> set[int]:
        """Hosts newly found dead since the last call."""
        found, self._refused = self._refused, set()
        if not self._conns:
            self.gone |= found
            return found
        readable, _, broken = select.select(list(self._conns.values()), [], list(self._conns.values()), 0)
        for node, conn in list(self._conns.items()):
            if conn in broken or conn in readable and _closed(conn):
                conn.close()
                del self._conns[node]
                found.add(node)
        self.gone |= found
        return found

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()


def _closed(conn: socket.socket) -> bool:
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:  # reset
        return True
