"""Typed messages written to the store (each with to/from JSON), and the heartbeat format."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

DONE = "done"  # the heartbeat of a process that left the job on purpose


def format_beat(t: float, progress: int = 0) -> str:
    """A heartbeat: the time and the training thread's progress counter."""
    return f"{t} {progress}"


def parse_beat(value: str) -> tuple[float, int] | None:
    """(time, progress) of a heartbeat, or None for a process that left the job on purpose."""
    if value == DONE:
        return None
    t, _, progress = value.partition(" ")
    return float(t), int(progress or 0)


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


@dataclass(frozen=True)
class RecoveryRecord:
    """What rank 0 reports once generation `generation` has joined (`keys.recovery`): how the
    lost state came back and what each phase cost, in seconds."""

    generation: int
    failed_ranks: tuple[int, ...]
    failed_nodes: tuple[int, ...]
    cause: str
    tier: str                      # "tier1", "tier2", "none" (nothing lost: no decode), ...
    step: int                      # the recovery step every rank's state is at
    world_size: int
    restore_s: float               # decode (or rebuild) and install
    protect_s: float               # re-protecting the new generation (overlaps the next step)
    join_s: float                  # the whole join, from the plan to the first step
    decode_start_s: float          # from the plan until the decode began
    resharded: bool = False
    repaired: tuple[str, ...] = ()  # redundancy that failed its checks and what rebuilt it
    rebuilt_from: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str | bytes) -> RecoveryRecord:
        d = json.loads(text)
        for name in ("failed_ranks", "failed_nodes", "repaired"):
            d[name] = tuple(d.get(name, ()))
        return RecoveryRecord(**d)
