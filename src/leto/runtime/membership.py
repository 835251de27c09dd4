"""The worker's side of membership: heartbeats, reading a generation's membership, and the watch
that notices the next generation."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from leto.protocol import keys
from leto.protocol.messages import DONE, Membership, format_beat
from leto.runtime import threads
from leto.runtime.env import ENV_HOST_STORE, connect

CHECK_EVERY_S = 0.1  # how often a process heartbeats
WATCH_S = 1.0  # the longest single wait for the next generation in etcd (it returns at once when it comes;
# each wait there is a new watch)


def beat(store: dist.Store, proc_id: str, progress: int = 0) -> None:
    """One heartbeat: the time and the training thread's progress counter."""
    store.set(keys.heartbeat(proc_id), format_beat(time.time(), progress))


def host_store_addr(addr: str) -> str:
    """Where this process heartbeats: its host's own store in a multi-host job (heartbeats are
    for the host's supervisor only, and would be Raft writes in etcd), else the job's `addr`."""
    return os.environ.get(ENV_HOST_STORE) or addr


class StoreLost(RuntimeError):
    """The store's connection broke: its server (this host's supervisor) is gone, and a TCPStore
    client never reconnects, so the process has no one left to answer to."""


class Heartbeat:
    """A thread that heartbeats for a process: it proves that the process runs (a SIGSTOPped one
    stops beating); `progress` says what its training thread does. It never stops on its own
    while the process lives: a store that stops answering for a while (a timed-out write) is
    retried at the next beat; a store whose connection broke, or any other error, ends the
    process (runtime/threads.py), where a quiet end would get a healthy process fenced as hung."""

    def __init__(self, addr: str, proc_id: str, timeout_s: float, progress: Callable[[], int] = lambda: 0) -> None:
        self._addr = host_store_addr(addr)
        self._store = connect(self._addr, timeout_s)
        self.proc_id = proc_id
        self._progress = progress
        self._stop = threading.Event()
        self._thread = threads.start(self._run, "leto-heartbeat")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                beat(self._store, self.proc_id, self._progress())
            except dist.DistNetworkError as e:
                if self._stop.is_set():  # stopping anyway
                    return
                raise StoreLost(f"the store at {self._addr} is gone: {e}") from e
            except dist.DistStoreError:  # this write timed out: beat again
                pass
            self._stop.wait(CHECK_EVERY_S)

    def stop(self, done: bool = False) -> None:
        """Stop heartbeating; with `done`, tell the supervisor to stop watching the heartbeat."""
        self._stop.set()
        self._thread.join(timeout=1.0)
        if done:
            try:
                self._store.set(keys.heartbeat(self.proc_id), DONE)
            except Exception:  # the controller is gone already
                pass


def read_membership(store: dist.Store, gen: int) -> Membership:
    key = keys.membership(gen)
    return Membership.from_json(store.get(key), key)


class GenerationWatch:
    """Background threads that heartbeat and notice when a newer generation is announced.

    `reason()` is what every wait in the worker polls: once generation g+1 exists, the worker
    must stop what it is doing in generation g (collectives, staging) and join the recovery.

    `progress` counts what the training thread does: each step (`tick`) and each poll of a wait
    (`reason`); every heartbeat carries it, so the controller tells a live process whose
    training thread is stuck from one that waits (docs/design.md, "Progress, not liveness").
    """

    def __init__(self, addr: str, proc_id: str, generation: int, timeout_s: float) -> None:
        self._store = connect(addr, timeout_s)
        self.proc_id = proc_id
        self.generation = generation
        self._next: int | None = None
        self.progress = 0  # written by the training thread only, read by the heartbeat thread
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._heartbeat = Heartbeat(addr, proc_id, timeout_s, lambda: self.progress)
        # a TCPStore wait is cheap; and it must end before the process does (C++ aborts at exit otherwise)
        self._wait_s = CHECK_EVERY_S if isinstance(self._store, dist.TCPStore) else WATCH_S
        self._addr = addr
        self._thread = threads.start(self._run, "leto-watch")

    def _run(self) -> None:
        """Wait for the next generation until stopped. A wait that times out (or an etcd store
        that is unavailable for a while, or this host fenced, which the training thread sees
        itself) is waited again; a broken connection or any other error ends the process
        (see `Heartbeat`)."""
        while not self._stop.is_set():
            with self._lock:
                want = self.generation + 1
                pending = self._next is not None
            if pending:
                self._stop.wait(CHECK_EVERY_S)
                continue
            try:  # returns as soon as the next generation is announced
                self._store.wait([keys.membership(want)], timedelta(seconds=self._wait_s))
            except dist.DistNetworkError as e:
                if self._stop.is_set():
                    return
                raise StoreLost(f"the store at {self._addr} is gone: {e}") from e
            except RuntimeError:
                continue  # timed out: wait again (stop may have been asked)
            with self._lock:
                if want == self.generation + 1:
                    self._next = want

    def tick(self) -> None:
        """The training thread made progress (a step begins)."""
        self.progress += 1

    def reason(self) -> str | None:
        self.progress += 1  # the training thread polls: it is running, waiting with a timeout
        with self._lock:
            return f"generation {self._next} was announced" if self._next is not None else None

    def advance(self, generation: int) -> None:
        """This process now lives in `generation`."""
        with self._lock:
            self.generation = generation
            self._next = None

    def stop(self) -> None:
        """Stop heartbeating; the controller stops watching this process's heartbeat."""
        self._stop.set()
        self._heartbeat.stop(done=True)
        self._thread.join(timeout=self._wait_s + 1.0)
