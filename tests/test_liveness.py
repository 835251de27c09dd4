"""A host's liveness connection (control/lease.py): a killed supervisor is known at once from its
closed connection; a silent one (frozen, cut off) once it has reported no lease refresh for one
lease time plus one beat - and only by a watcher whose own lease is fresh."""

from __future__ import annotations

import contextlib
import math
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from conftest import wait_for
from leto.control.lease import _BEAT, BEAT_S, LivenessWatch, reaches_any

TTL_S = 1.0  # short, to keep the tests short; long enough that a loaded machine does not starve a beat that long
# a supervisor whose lease is refreshed every TTL_S / 4, as HostLease does
SUPERVISOR = f"""
import time
from leto.control.lease import Liveness
live = Liveness("127.0.0.1")
t0 = time.monotonic()
live.beat(lambda: (time.monotonic() - t0) % {TTL_S / 4})
print(live.port, flush=True)
time.sleep(120)
"""


@pytest.fixture
def supervisor() -> Iterator[tuple[subprocess.Popen, int]]:
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR], stdout=subprocess.PIPE, text=True)
    try:
        yield proc, int(proc.stdout.readline())
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()


def _watch_for(watch: LivenessWatch, seconds: float) -> dict[int, str]:
    found: dict[int, str] = {}
    end = time.monotonic() + seconds
    while time.monotonic() < end and not found:
        found = watch.dead()
        time.sleep(0.01)
    return found


def test_a_beating_host_is_never_judged_and_a_killed_one_is_known_from_its_connection(supervisor) -> None:
    proc, port = supervisor
    watch = LivenessWatch(TTL_S, judge=lambda: True)
    watch.watch(1, "127.0.0.1", port)
    assert _watch_for(watch, 4 * TTL_S) == {}  # many lease times of beats: alive
    proc.kill()
    proc.wait()
    found: dict[int, str] = {}
    wait_for(lambda: found.update(watch.dead()) or found, 5, "the closed connection")
    assert list(found) == [1] and "connection closed" in found[1]
    assert watch.dead() == {} and watch.gone == {1}  # reported once


def test_a_frozen_host_is_judged_silent_after_one_lease_time_plus_a_beat(supervisor) -> None:
    proc, port = supervisor
    watch = LivenessWatch(TTL_S, judge=lambda: True)
    watch.watch(1, "127.0.0.1", port)
    assert _watch_for(watch, TTL_S) == {}
    proc.send_signal(signal.SIGSTOP)
    stopped, stopped_at = time.monotonic(), time.time()
    found: dict[int, str] = {}
    wait_for(lambda: found.update(watch.dead()) or found, 5 * TTL_S, "the silent host")
    # its last refresh began at most TTL_S / 4 before the stop: never judged before its lease ran out
    assert time.monotonic() - stopped >= TTL_S + BEAT_S - TTL_S / 4
    assert list(found) == [1] and "no refresh of its etcd lease" in found[1]
    # the failure time a recovery record starts from: its last beat, sent just before the stop
    # (and read by this watcher's next poll, 10 ms later at most)
    assert stopped_at - 2 * BEAT_S <= watch.last_heard(1) <= stopped_at + BEAT_S


@pytest.mark.parametrize("reaches", [None, lambda: False], ids=["unknown", "reaches_no_one"])
def test_a_watcher_whose_own_lease_is_stale_judges_no_one_and_counts_silence_from_its_recovery(
    supervisor, reaches
) -> None:
    """A watcher that cannot refresh and reaches no other host is the one cut off: what it did
    not hear meanwhile is no evidence (beats queued in a cut link arrive late)."""
    proc, port = supervisor
    fresh = [False]
    watch = LivenessWatch(TTL_S, judge=lambda: fresh[0], reaches=reaches)
    watch.watch(1, "127.0.0.1", port)
    proc.send_signal(signal.SIGSTOP)
    assert _watch_for(watch, 3 * TTL_S) == {}  # silent for three lease times, but this watcher may not judge
    fresh[0] = True
    recovered = time.monotonic()
    found: dict[int, str] = {}
    wait_for(lambda: found.update(watch.dead()) or found, 5 * TTL_S, "the silent host")
    assert time.monotonic() - recovered >= TTL_S and list(found) == [1]


@contextlib.contextmanager
def _peer(watch: LivenessWatch, node: int) -> Iterator[socket.socket]:
    """A hand-made supervisor: its end of `watch`'s connection to `node`, to send beats on."""
    server = socket.create_server(("127.0.0.1", 0))
    watch.watch(node, "127.0.0.1", server.getsockname()[1])
    conn, _ = server.accept()
    try:
        yield conn
    finally:
        conn.close()
        server.close()


def _beat_until_judged(watch: LivenessWatch, conn: socket.socket, beat: float, limit_s: float) -> dict[int, str]:
    """Send `beat` every half beat (each in two pieces) until `watch` judges a host, or `limit_s`."""
    end = time.monotonic() + limit_s
    found: dict[int, str] = {}
    while not found and time.monotonic() < end:
        frame = _BEAT.pack(beat)
        conn.send(frame[:5])  # beats split across reads are put together
        conn.send(frame[5:])
        found = watch.dead()
        time.sleep(BEAT_S / 2)
    return found


@pytest.mark.parametrize("beat", [math.nan, -1.0, 5 * TTL_S], ids=["nan", "negative", "stale"])
def test_beats_that_claim_no_recent_refresh_do_not_keep_a_host_in(beat: float) -> None:
    """A peer that speaks garbage (or whose lease is old) gets no benefit from it: only a beat
    reporting a refresh within the lease time counts."""
    watch = LivenessWatch(TTL_S, judge=lambda: True)
    with _peer(watch, 1) as conn:
        connected = time.monotonic()
        found = _beat_until_judged(watch, conn, beat, 5 * TTL_S)
        assert list(found) == [1] and "no refresh" in found[1]
        assert time.monotonic() - connected >= TTL_S + BEAT_S  # the benefit of the doubt from the connection


def test_a_supervisor_that_is_gone_is_refused_at_once() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    server.close()
    watch = LivenessWatch(TTL_S, judge=lambda: True)
    watch.watch(2, "127.0.0.1", port)
    found = watch.dead()
    assert list(found) == [2] and "refused" in found[2]


def test_liveness_serves_every_watcher(supervisor) -> None:
    _, port = supervisor
    watches = [LivenessWatch(TTL_S, judge=lambda: True) for _ in range(3)]
    for w in watches:
        w.watch(0, "127.0.0.1", port)
    assert all(_watch_for(w, TTL_S) == {} for w in watches)


def test_during_an_etcd_election_a_host_that_says_nothing_keeps_its_clock(supervisor) -> None:
    """The watcher cannot refresh but reaches the others: etcd is electing a leader. A host whose
    connection is silent all along is judged as soon as the watcher may judge again; it does
    not get another lease time."""
    proc, port = supervisor
    fresh = [True]
    watch = LivenessWatch(TTL_S, judge=lambda: fresh[0], reaches=lambda: True)
    watch.watch(1, "127.0.0.1", port)
    assert _watch_for(watch, TTL_S) == {}
    proc.send_signal(signal.SIGSTOP)
    fresh[0] = False
    assert _watch_for(watch, 3 * TTL_S) == {}  # no judgment while this watcher is stale
    fresh[0] = True
    found = watch.dead()
    assert list(found) == [1] and "no refresh" in found[1]


def test_during_an_etcd_election_a_host_that_still_talks_gets_the_benefit_of_the_doubt() -> None:
    """Its beats report no refresh (etcd has no leader for it either): its silence counts again
    from when the watcher's own refreshes go through."""
    fresh = [False]
    watch = LivenessWatch(TTL_S, judge=lambda: fresh[0], reaches=lambda: True)
    with _peer(watch, 1) as conn:
        assert _beat_until_judged(watch, conn, 5 * TTL_S, 3 * TTL_S) == {}
        fresh[0] = True
        recovered = time.monotonic()
        found = _beat_until_judged(watch, conn, 5 * TTL_S, 5 * TTL_S)
        assert list(found) == [1] and time.monotonic() - recovered >= TTL_S


def test_reaches_any_tells_whether_one_of_the_addresses_answers() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    open_port = server.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    try:
        assert reaches_any([("127.0.0.1", closed_port), ("127.0.0.1", open_port)])()
        assert not reaches_any([("127.0.0.1", closed_port)])()
        assert not reaches_any([])()
    finally:
        server.close()
