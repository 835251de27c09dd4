"""Typed messages written to the store (each with to/from JSON), and the heartbeat format."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Self

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


def node_of_rank(rank: int, workers: int, nodes: int) -> int:
    """Ranks are split into `nodes` contiguous, balanced groups (failure domains)."""
    return rank * nodes // workers


@dataclass(frozen=True)
class Plan:
    """Who is rank what in one generation (written by the coordinator)."""

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
    phases_s: dict[str, float] = field(default_factory=dict)  # rank 0's join, phase by phase, in order

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str | bytes) -> RecoveryRecord:
        d = json.loads(text)
        for name in ("failed_ranks", "failed_nodes", "repaired"):
            d[name] = tuple(d.get(name, ()))
        return RecoveryRecord(**d)


def _known(cls: type, d: dict) -> dict:
    """The fields of `cls` in `d` (a newer writer's extra fields are ignored)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in d.items() if k in names}


class _Flat:
    """to/from JSON for a message of plain fields (lists come back as they were written)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))  # type: ignore[call-overload]  (subclasses are dataclasses)

    @classmethod
    def from_json(cls, text: str | bytes) -> Self:
        return cls(**_known(cls, json.loads(text)))


# ----- supervisor <-> coordinator (keys.sup_report, keys.command)
PROC_EVENTS = ("started", "exited", "fenced", "fork_failed")


@dataclass(frozen=True)
class ProcEvent:
    """What happened to one process of the supervisor's host."""

    kind: str                # one of PROC_EVENTS
    proc_id: str
    role: str                # worker | shadow | zygote | keeper
    rank: int | None
    node: int
    pid: int = 0
    code: int | None = None  # the exit status (exited, fenced)
    cause: str = ""          # in words: "was killed by SIGKILL", "stopped heartbeating ...; fenced with SIGKILL"

    def __post_init__(self) -> None:
        if self.kind not in PROC_EVENTS:
            raise ValueError(f"unknown process event {self.kind!r}")


@dataclass(frozen=True)
class SupervisorReport:
    """One entry of the supervisor's report stream. Processes that die together (a node) are
    one report, so the coordinator decides on them as one failure."""

    events: tuple[ProcEvent, ...] = ()
    signal: int | None = None         # SIGINT or SIGTERM reached the supervisor: stop the job
    shm_removed: tuple[str, ...] = ()  # dead jobs' /dev/shm segments removed at the start

    def to_json(self) -> str:
        return json.dumps({"events": [asdict(e) for e in self.events], "signal": self.signal,
                           "shm_removed": list(self.shm_removed)})

    @staticmethod
    def from_json(text: str | bytes) -> SupervisorReport:
        d = json.loads(text)
        return SupervisorReport(tuple(ProcEvent(**_known(ProcEvent, e)) for e in d.get("events", ())),
                                d.get("signal"), tuple(d.get("shm_removed", ())))


COMMANDS = ("spawn", "fork", "boost", "wake_keepers", "stop")


@dataclass(frozen=True)
class Command(_Flat):
    """The coordinator asks a supervisor: spawn a process, fork a shadow from the node's zygote
    (answered by a `started` or `fork_failed` event), boost a shadow to normal priority, wake the
    keepers (a drain was written), or stop every process (answered by keys.STOPPED)."""

    kind: str                # one of COMMANDS
    proc_id: str = ""
    role: str = ""
    rank: int | None = None
    node: int = 0
    boost: bool = False      # spawn, or fork, at normal priority (a replacement keeper, an adopting shadow)

    def __post_init__(self) -> None:
        if self.kind not in COMMANDS:
            raise ValueError(f"unknown command {self.kind!r}")


@dataclass(frozen=True)
class JobState(_Flat):
    """The coordinator's view the supervisor needs for its hang checks (keys.JOB_STATE): the
    current generation (its plan names the members) and whether a recovery or resize runs."""

    generation: int
    recovering: bool


@dataclass(frozen=True)
class HostRecord(_Flat):
    """A live host of a multi-host job (keys.host, bound to its lease): where its supervisor
    listens for the coordinator's liveness connection, and the lease to revoke to fence it."""

    node: int
    addr: str
    port: int
    pid: int
    lease: int


@dataclass(frozen=True)
class StepProgress(_Flat):
    """Rank 0's latest completed step (keys.PROGRESS, the step record of metrics.jsonl)."""

    step: int
    time: float
    loss: float
    step_s: float | None = None
    tokens_per_s: float | None = None

    def record(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ForkRequest(_Flat):
    """A supervisor's request to its node's zygote (keys.fork): fork a shadow named `proc_id`."""

    proc_id: str
    node: int
