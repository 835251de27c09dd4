"""Membership generations: the controller's plan for each generation, and the worker's watch on it."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from leto.control.runtime import connect

DONE = "done"  # the heartbeat of a process that left the job on purpose
CHECK_EVERY_S = 0.1  # how often a worker heartbeats (a new generation is noticed at once)


def plan_key(gen: int) -> str:
    return f"control/gen/{gen}"


def warm_key(proc_id: str) -> str:
    """Set by a shadow once it is fully initialized and waiting to adopt a rank."""
    return f"control/warm/{proc_id}"


def heartbeat_key(proc_id: str) -> str:
    return f"control/hb/{proc_id}"


def beat(store: dist.Store, proc_id: str, progress: int = 0) -> None:
    """One heartbeat: the time and the training thread's progress counter."""
    store.set(heartbeat_key(proc_id), f"{time.time()} {progress}")


def parse_beat(value: str) -> tuple[float, int] | None:
    """(time, progress) of a heartbeat, or None for a process that left the job on purpose."""
    if value == DONE:
        return None
    t, _, progress = value.partition(" ")
    return float(t), int(progress or 0)


class Heartbeat:
    """A thread that heartbeats for a process with no training thread (a keeper): it proves
    that the process runs (a SIGSTOPped one stops beating), not what its main loop does."""

    def __init__(self, addr: str, proc_id: str, timeout_s: float) -> None:
        self._store = connect(addr, timeout_s)
        self.proc_id = proc_id
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="leto-heartbeat", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                beat(self._store, self.proc_id)
            except Exception:  # the store is gone: the controller ended
                return
            self._stop.wait(CHECK_EVERY_S)

    def stop(self) -> None:
        self._stop.set()


@dataclass(frozen=True)
class Plan:
    """Who is rank what in one generation (written by the controller)."""

    generation: int
    node_of_rank: tuple[int, ...]
    proc_of_rank: tuple[str, ...]
    failed_ranks: tuple[int, ...] = ()
    failed_nodes: tuple[int, ...] = ()
    cause: str = ""

    def to_json(self) -> str:
        return json.dumps({"generation": self.generation, "node_of_rank": list(self.node_of_rank),
                           "proc_of_rank": list(self.proc_of_rank), "failed_ranks": list(self.failed_ranks),
                           "failed_nodes": list(self.failed_nodes), "cause": self.cause})

    @staticmethod
    def from_json(text: str | bytes) -> Plan:
        d = json.loads(text)
        return Plan(d["generation"], tuple(d["node_of_rank"]), tuple(d["proc_of_rank"]),
                    tuple(d["failed_ranks"]), tuple(d["failed_nodes"]), d["cause"])

    def rank_of(self, proc_id: str) -> int | None:
        return self.proc_of_rank.index(proc_id) if proc_id in self.proc_of_rank else None


def read_plan(store: dist.Store, gen: int) -> Plan:
    return Plan.from_json(store.get(plan_key(gen)))


class GenerationWatch:
    """A background thread that heartbeats and notices when a newer generation is announced.

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
        self._thread = threading.Thread(target=self._run, name="leto-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                beat(self._store, self.proc_id, self.progress)
                with self._lock:
                    want = self.generation + 1
                    pending = self._next is not None
                if pending:
                    self._stop.wait(CHECK_EVERY_S)
                    continue
                try:  # returns as soon as the next generation is announced
                    self._store.wait([plan_key(want)], timedelta(seconds=CHECK_EVERY_S))
                except RuntimeError:
                    continue  # timed out: heartbeat again
                with self._lock:
                    if want == self.generation + 1:
                        self._next = want
            except Exception:  # the store is gone: the controller ended
                return

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
        self._thread.join(timeout=1.0)
        try:
            self._store.set(heartbeat_key(self.proc_id), DONE)
        except Exception:  # the controller is gone already
            pass
