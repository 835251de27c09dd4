"""A host's membership of a multi-host job: its etcd lease, and the liveness socket its peers hold.

The lease is the authority: a host is in the job while its lease lives, and every write of its
processes is fenced by the lease-bound host key (`EtcdStore.fence`). A supervisor that cannot
refresh its lease within the lease time takes its host out of the job itself (`HostLease.lost`).

The liveness socket is the early evidence: the coordinator keeps a TCP connection to every
other host's supervisor (and every other supervisor one to the coordinator's host); the kernel
closes it the moment that process dies (a host's processes die with their supervisor), so a
killed host is known at once, not after the lease time.

A host that vanishes silently (power, a cut link, frozen) leaves the connection open: the lease
decides, as the host itself reports it. Over that connection every supervisor says, each BEAT_S,
how long ago the last refresh of its lease that etcd confirmed began. A watcher that has heard of
no refresh for one lease time plus one beat knows the lease is over by the host's own account,
and fences the host out (`EtcdStore.fence_out`, under the watcher's own fence) instead of waiting
for etcd to say so: etcd's lessor looks for expired leases every 0.5 s, and a new etcd leader
extends every lease by its TTL, which made a cut host's loss known 2-3.4 s after the cut. A
watcher judges only while its own lease is fresh: a watcher that is cut off itself hears from
no one, and must not take the others out.
"""

from __future__ import annotations

import errno
import math
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable

from leto.runtime import threads
from leto.runtime.etcd_store import EtcdStore, StoreUnavailable

REFRESHES_PER_LEASE = 4
# A host that cannot refresh gives etcd one more lease time before it takes itself out: a new etcd
# leader extends every lease (lessor promotion), so an election never expires one, and a host
# must not stop itself during one. Its lease may expire earlier at etcd; from then on etcd refuses
# its writes (the fence) and no later generation includes it, so waiting is safe.
SILENT_LEASES = 2
BEAT_S = 0.1  # how often a supervisor tells its watchers its lease's age
RETRY_S = 0.05  # the pause before a failed refresh is tried again
REACH_TIMEOUT_S = 0.1  # a connect that says whether this host reaches another
_BEAT = struct.Struct("!d")  # a beat: seconds since the last confirmed refresh began
# A watcher's first bytes: what it is, and the version of this protocol. A connection that has
# not sent them whole within HELLO_TIMEOUT_S is dropped; at most MAX_PENDING connections wait
# to (the oldest is dropped for a new one), and at most MAX_WATCHERS are served.
_HELLO = struct.Struct("!8sI")
_HELLO_BYTES = _HELLO.pack(b"leto-liv", 1)
HELLO_TIMEOUT_S = 1.0
MAX_PENDING = 64
MAX_WATCHERS = 256


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
        self._thread = threads.Thread(target=self._run, name="leto-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pause = self.ttl_s / REFRESHES_PER_LEASE
        while not self._stop.wait(pause):
            sent = time.monotonic()
            try:  # each try is short: a frozen member must not hold it past the lease time
                ttl = self._store.keepalive(self.id, deadline=sent + self.ttl_s / REFRESHES_PER_LEASE)
            except StoreUnavailable:
                # lost() decides once the lease time has passed; till then try again soon: after
                # an etcd election, the first refresh makes this host fresh (a judge) again
                pause = RETRY_S
                continue
            if ttl <= 0:
                self._expired = True
                return
            self._ok = sent
            pause = self.ttl_s / REFRESHES_PER_LEASE

    def age(self) -> float:
        """Seconds since the last refresh that etcd confirmed began (inf once it expired)."""
        return math.inf if self._expired else time.monotonic() - self._ok

    def fresh(self) -> bool:
        """Refreshed within the last two refresh periods: this host may judge others' silence."""
        return self.age() <= 2 * self.ttl_s / REFRESHES_PER_LEASE

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
    """The supervisor's side: a listening socket; every connection that says it is a watcher
    (`_HELLO`, within HELLO_TIMEOUT_S) gets this host's lease age each BEAT_S once `beat` has
    started, and closes only when this process dies. Anything else is dropped: a connection that
    says nothing in time, or something else, and the oldest unidentified one when MAX_PENDING
    wait already, so that idle connections never keep a watcher out."""

    def __init__(self, addr: str) -> None:
        """Listen on `addr` only (the job's network address)."""
        self._sock = socket.create_server((addr, 0))
        self.port = self._sock.getsockname()[1]
        self._peers: list[socket.socket] = []
        self._lock = threading.Lock()
        threads.Thread(target=self._accept, name="leto-liveness", daemon=True).start()

    def beat(self, age: Callable[[], float]) -> None:
        """Send `age()` (the lease's, `HostLease.age`) to every watcher each BEAT_S from now on."""
        threads.Thread(target=self._beat, args=(age,), name="leto-beat", daemon=True).start()

    def _accept(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ)
        pending: dict[socket.socket, tuple[float, bytes]] = {}  # oldest first: its deadline, bytes so far

        def settle(conn: socket.socket, watcher: bool) -> None:
            sel.unregister(conn)
            pending.pop(conn)
            if watcher:
                with self._lock:
                    if len(self._peers) < MAX_WATCHERS:
                        self._peers.append(conn)
                        return
            conn.close()

        while True:
            now = time.monotonic()
            wait = min((d for d, _ in pending.values()), default=now + HELLO_TIMEOUT_S) - now
            events = sel.select(max(0.0, wait))
            # what waiting connections said first, then at most one new connection: a flood of
            # new ones never keeps a watcher's hello from being read
            for key, _ in sorted(events, key=lambda e: e[0].fileobj is self._sock):
                conn = key.fileobj
                if conn is not self._sock:
                    if (verdict := self._hello(conn, pending)) is not None:
                        settle(conn, verdict)
                    continue
                try:
                    conn, _ = self._sock.accept()
                except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                    continue
                except OSError as e:
                    if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                        time.sleep(RETRY_S)  # out of descriptors or memory for now: not for ever
                        continue
                    return  # the socket is closed
                if len(pending) >= MAX_PENDING:
                    settle(next(iter(pending)), False)
                conn.setblocking(False)
                pending[conn] = (time.monotonic() + HELLO_TIMEOUT_S, b"")
                sel.register(conn, selectors.EVENT_READ)
            now = time.monotonic()
            for conn in [c for c, (deadline, _) in pending.items() if deadline <= now]:
                settle(conn, False)

    @staticmethod
    def _hello(conn: socket.socket, pending: dict[socket.socket, tuple[float, bytes]]) -> bool | None:
        """Read what a waiting connection sent: True once it has sent `_HELLO` whole, False if
        it sent anything else or closed, None while it may still."""
        deadline, got = pending[conn]
        try:
            chunk = conn.recv(_HELLO.size - len(got))
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            return False
        got += chunk
        if not chunk or _HELLO_BYTES[: len(got)] != got:
            return False
        pending[conn] = (deadline, got)
        return len(got) == _HELLO.size or None

    def _beat(self, age: Callable[[], float]) -> None:
        while True:
            frame = _BEAT.pack(min(age(), 1e9))
            with self._lock:
                for conn in list(self._peers):
                    try:
                        conn.send(frame)
                    except BlockingIOError:
                        pass  # its buffer is full (a cut link): the beat that matters is a later one
                    except OSError:  # the watcher went away
                        conn.close()
                        self._peers.remove(conn)
            time.sleep(BEAT_S)


class LivenessWatch:
    """A watcher's side: one connection to each watched host's supervisor. `dead()` names the
    hosts whose connection the kernel refused, or closed or reset after it served a beat, and
    (while `judge()` holds) the hosts that have reported no refresh of their lease for one lease
    time plus one beat. A connection closed before its first beat is no evidence (the host
    dropped it, a flood of others there): the next `watch` connects again, and a refusal then is."""

    def __init__(self, ttl_s: float, judge: Callable[[], bool], reaches: Callable[[], bool] | None = None) -> None:
        """`ttl_s`: the hosts' lease time; `judge`: whether this host may judge silence now
        (`HostLease.fresh`); `reaches`: whether this host's network reaches the others now
        (`reaches_any`; None: unknown)."""
        self.ttl_s, self._judge, self._reaches = ttl_s, judge, reaches
        self._reached: tuple[float, bool] = (-math.inf, False)  # the last probe: when, and its answer
        self._conns: dict[int, socket.socket] = {}
        self._pending: dict[int, bytes] = {}  # a beat's bytes received so far
        self._refreshed: dict[int, float] = {}  # when its last confirmed refresh began, at the latest
        self._heard: dict[int, float] = {}  # when it last sent anything (or was connected to)
        self._refused: set[int] = set()
        self._beaten: set[int] = set()  # whose connection has delivered a beat
        self.gone: set[int] = set()

    def watch(self, node: int, addr: str, port: int) -> None:
        if node in self._conns or node in self.gone:
            return
        try:
            conn = socket.create_connection((addr, port), timeout=0.2)
        except ConnectionRefusedError:  # nothing listens there any more
            self._refused.add(node)
            return
        except OSError:  # no answer in time (a loaded or silent host): the caller watches again later
            return
        try:
            conn.sendall(_HELLO_BYTES)
        except OSError:
            conn.close()
            return
        conn.setblocking(False)
        self._conns[node], self._pending[node] = conn, b""
        now = time.monotonic()  # the benefit of the doubt until it beats, once: not again at a reconnect
        self._refreshed.setdefault(node, now)
        self._heard.setdefault(node, now)
        self._beaten.discard(node)

    def forget(self, node: int) -> None:
        """`node` is another host now (a replacement admitted into a lost host's node): what
        was known of the old one no longer counts."""
        conn = self._conns.pop(node, None)
        if conn is not None:
            conn.close()
        for seen in (self._pending, self._refreshed, self._heard):
            seen.pop(node, None)
        self._refused.discard(node)
        self._beaten.discard(node)
        self.gone.discard(node)

    def dead(self) -> dict[int, str]:
        """Hosts newly found dead since the last call, with the evidence."""
        found = {n: "its supervisor's connection was refused (the host's processes died)" for n in self._refused}
        self._refused = set()
        for node, conn in list(self._conns.items()):
            if self._read(node, conn):
                continue
            if node in self._beaten:
                found[node] = "its supervisor's connection closed (the host's processes died)"
            else:  # closed before it served this watcher (a flood of connections there?): connect again
                self._conns.pop(node).close()
        now = time.monotonic()
        if self._judge():
            for node, refreshed in self._refreshed.items():
                if node in self._conns and node not in found and now - refreshed > self.ttl_s + BEAT_S:
                    found[node] = (
                        f"it reported no refresh of its etcd lease for {now - refreshed:.1f}s "
                        f"(cut off or frozen; lease {self.ttl_s:g}s)"
                    )
        else:
            # This host cannot refresh either. If it reaches no one, it is the one cut off: every
            # host's silence counts again from when its own refreshes go through. If it does, etcd
            # is electing a leader (a new leader extends every lease by its TTL): a host whose
            # connection still talks gets the same benefit of the doubt, but one that has said
            # nothing for two beats keeps its clock - its silence is its own, not etcd's.
            cut_off = not self._probe(now)
            for node in self._refreshed:
                if cut_off or now - self._heard[node] <= 2 * BEAT_S:
                    self._refreshed[node] = now
        for node in found:
            if node in self._conns:
                self._conns.pop(node).close()
        self.gone |= set(found)
        return found

    def _probe(self, now: float) -> bool:
        """Whether this host reaches the others (asked at most once a beat)."""
        if self._reaches is None:
            return False
        if now - self._reached[0] >= BEAT_S:
            self._reached = (now, self._reaches())
        return self._reached[1]

    def _read(self, node: int, conn: socket.socket) -> bool:
        """Take in every beat that arrived; False once the connection is closed or reset."""
        data = b""
        while True:
            try:
                chunk = conn.recv(4096)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # reset
                return False
            if not chunk:
                return False
            data += chunk
        if not data:
            return True
        self._beaten.add(node)
        now = self._heard[node] = time.monotonic()
        data = self._pending[node] + data
        whole = len(data) - len(data) % _BEAT.size
        self._pending[node] = data[whole:]
        if whole:
            (age,) = _BEAT.unpack_from(data, whole - _BEAT.size)  # the newest beat is all that counts
            if math.isfinite(age) and age >= 0:  # anything else is no evidence of a refresh
                self._refreshed[node] = max(self._refreshed[node], now - age)
        return True

    def last_heard(self, node: int) -> float | None:
        """When (time.time()) `node` last sent a beat, or was connected to; None if never watched."""
        heard = self._heard.get(node)
        return None if heard is None else time.time() - (time.monotonic() - heard)

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()


def reaches_any(addrs: list[tuple[str, int]]) -> Callable[[], bool]:
    """A probe: does a TCP connect to one of `addrs` (the other hosts' etcd members) succeed?"""

    def reaches() -> bool:
        for addr in addrs:
            try:
                socket.create_connection(addr, timeout=REACH_TIMEOUT_S).close()
                return True
            except OSError:
                continue
        return False

    return reaches
