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
    """

    def __init__(self, addr: str, proc_id: str, generation: int, timeout_s: float) -> None:
        self._store = connect(addr, timeout_s)
        self.proc_id = proc_id
        self.generation = generation
        self._next: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="leto-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._store.set(heartbeat_key(self.proc_id), str(time.time()))
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

    def reason(self) -> str | None:
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
