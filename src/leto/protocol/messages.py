"""Typed messages written to the store (each with to/from JSON), and the heartbeat format.

Every value read from the store is parsed here and checked before it is used: each field has
its declared type (numbers finite, ints not bools), pids and counters are positive, names come
from their known sets. Anything else raises `BadValue` naming the key and what is wrong with it
(anyone who can reach the store can write any key: a reader never acts on what it did not check).
"""

from __future__ import annotations

import enum
import functools
import json
import math
import re
import signal
import sys
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from typing import Any, Self, TypeVar

from leto.errors import BadValue
from leto.protocol.failures import ProcEventKind

DONE = "done"  # the heartbeat of a process that left the job on purpose
PID_MAX = 1 << 22  # the kernel's largest pid_max
ROLES = ("worker", "shadow", "zygote", "keeper")
_PROC_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_INT = re.compile(r"-?\d{1,19}")

T = TypeVar("T")


def format_beat(t: float, progress: int = 0) -> str:
    """A heartbeat: the time and the training thread's progress counter."""
    return f"{t} {progress}"


def parse_beat(value: str | bytes, key: str = "") -> tuple[float, int] | None:
    """(time, progress) of a heartbeat, or None for a process that left the job on purpose;
    `BadValue` unless the time is a finite number and the progress a count."""
    text = _text(value, key)
    if text == DONE:
        return None
    t, _, progress = text.partition(" ")
    return parse_float(t, key), parse_int(progress or "0", key, minimum=0)


def parse_int(value: str | bytes, key: str = "", minimum: int | None = None, maximum: int | None = None) -> int:
    """A decimal integer within [minimum, maximum] (a counter, a pid, an exit code), else `BadValue`."""
    text = _text(value, key).strip()
    if not _INT.fullmatch(text):
        raise BadValue(key, f"{text[:40]!r} is not an integer")
    n = int(text)
    if minimum is not None and n < minimum:
        raise BadValue(key, f"{n} is below {minimum}")
    if maximum is not None and n > maximum:
        raise BadValue(key, f"{n} is above {maximum}")
    return n


def parse_pid(value: str | bytes, key: str = "") -> int:
    """A process id: a positive integer no larger than any pid_max (never 0 or -1, which
    `kill` and `waitpid` read as a process group or every process)."""
    return parse_int(value, key, minimum=1, maximum=PID_MAX)


def parse_float(value: str | bytes, key: str = "") -> float:
    """A finite number, else `BadValue`."""
    text = _text(value, key).strip()
    try:
        x = float(text)
    except ValueError:
        raise BadValue(key, f"{text[:40]!r} is not a number") from None
    if not math.isfinite(x):
        raise BadValue(key, f"{text[:40]!r} is not a finite number")
    return x


def parse(cls: type[T], value: str | bytes, key: str = "") -> T:
    """The message `cls` (a dataclass) from its JSON: every field of its declared type, fields it
    does not know ignored (a newer writer's), then its own `problem()` check; else `BadValue`."""
    return parse_data(cls, load_json(value, key), key)


def load_json(value: str | bytes, key: str = "") -> Any:
    """The JSON data of a store value, else `BadValue`."""
    try:
        return json.loads(value)
    except (ValueError, UnicodeDecodeError, TypeError) as e:
        raise BadValue(key, f"not JSON: {e}") from None


def parse_data(cls: type[T], data: Any, key: str = "") -> T:
    """The message `cls` from JSON data already loaded (a message whose wire format is not an
    object of its fields reshapes its data first), checked as `parse` does."""
    try:
        return _build(cls, data, cls.__name__)
    except _Invalid as e:
        raise BadValue(key, str(e)) from None


class _Invalid(Exception):
    pass


def _text(value: str | bytes, key: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            raise BadValue(key, "not UTF-8 text") from None
    return value


def _build(cls: type[T], d: Any, where: str) -> T:
    if not isinstance(d, dict):
        raise _Invalid(f"{where} is {_show(d)}, not an object")
    hints = _hints(cls)
    kw = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name in d:
            kw[f.name] = _value(d[f.name], hints[f.name], f"{where}.{f.name}", f.metadata.get("finite", True))
        elif f.default is MISSING and f.default_factory is MISSING:
            raise _Invalid(f"{where} has no {f.name!r}")
    try:
        obj = cls(**kw)
    except (TypeError, ValueError) as e:
        raise _Invalid(f"{where}: {e}") from None
    problem = obj.problem() if hasattr(obj, "problem") else None
    if problem:
        raise _Invalid(f"{where}: {problem}")
    return obj


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _value(v: Any, tp: Any, where: str, finite: bool = True) -> Any:
    """`v` as type `tp`, or `_Invalid`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        if v is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _value(v, inner, where, finite)
    if tp is bool and isinstance(v, bool):
        return v
    if tp is int and isinstance(v, int) and not isinstance(v, bool):
        return v
    if tp is float and isinstance(v, (int, float)) and not isinstance(v, bool):
        if finite and not math.isfinite(v):
            raise _Invalid(f"{where} is {v}, not a finite number")
        return float(v)
    if tp is str and isinstance(v, str):
        return v
    if isinstance(tp, type) and issubclass(tp, enum.Enum) and isinstance(v, str):
        try:
            return tp(v)
        except ValueError:
            raise _Invalid(f"{where} is {_show(v)}, not one of {', '.join(m.value for m in tp)}") from None
    if tp is Any:
        return _plain(v, where, finite)
    if origin in (tuple, list) and isinstance(v, (list, tuple)):
        return origin(_value(x, args[0], f"{where}[{i}]", finite) for i, x in enumerate(v))
    if origin is dict and isinstance(v, dict):
        return {_key(k, args[0], where): _value(x, args[1], f"{where}[{k!r}]", finite) for k, x in v.items()}
    if is_dataclass(tp) and isinstance(v, dict):
        return _build(tp, v, where)  # type: ignore[arg-type]
    raise _Invalid(f"{where} is {_show(v)}, not {getattr(tp, '__name__', tp)}")


def _key(k: Any, tp: Any, where: str) -> Any:
    """A dict's key as type `tp`: JSON writes an int key as a decimal string."""
    if tp is int and isinstance(k, str) and _INT.fullmatch(k):
        return int(k)
    return _value(k, tp, where)


def _plain(v: Any, where: str, finite: bool) -> Any:
    """`v` if it is plain JSON data (nested lists of numbers, say) with finite numbers, else `_Invalid`."""
    if isinstance(v, list):
        return [_plain(x, f"{where}[{i}]", finite) for i, x in enumerate(v)]
    if isinstance(v, dict):
        return {k: _plain(x, f"{where}[{k!r}]", finite) for k, x in v.items()}
    if finite and isinstance(v, float) and not math.isfinite(v):
        raise _Invalid(f"{where} is {v}, not a finite number")
    return v


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _proc_id_problem(proc_id: str, what: str = "proc_id") -> str | None:
    return None if _PROC_ID.fullmatch(proc_id) else f"{what} {_show(proc_id)} is not a process id"


def negative(**values: int | None) -> str | None:
    """The first of `values` that is negative, in words."""
    return next((f"{k} {v} is negative" for k, v in values.items() if v is not None and v < 0), None)


def node_of_rank(rank: int, workers: int, nodes: int) -> int:
    """Ranks are split into `nodes` contiguous, balanced groups (failure domains)."""
    return rank * nodes // workers


@dataclass(frozen=True)
class Membership:
    """Who is rank what in one generation (written by the coordinator)."""

    generation: int
    node_of_rank: tuple[int, ...]
    proc_of_rank: tuple[str, ...]
    failed_ranks: tuple[int, ...] = ()
    failed_nodes: tuple[int, ...] = ()
    cause: str = ""
    demoted: tuple[str, ...] = ()  # live members of the last generation that become shadows

    def to_json(self) -> str:
        return json.dumps(
            {
                "generation": self.generation,
                "node_of_rank": list(self.node_of_rank),
                "proc_of_rank": list(self.proc_of_rank),
                "failed_ranks": list(self.failed_ranks),
                "failed_nodes": list(self.failed_nodes),
                "cause": self.cause,
                "demoted": list(self.demoted),
            }
        )

    @staticmethod
    def from_json(text: str | bytes, key: str = "") -> Membership:
        return parse(Membership, text, key)

    def problem(self) -> str | None:
        if len(self.node_of_rank) != len(self.proc_of_rank) or not self.proc_of_rank:
            return "node_of_rank and proc_of_rank must name the same ranks, at least one"
        if len(set(self.proc_of_rank)) != len(self.proc_of_rank):
            return "a process holds two ranks"
        return negative(
            generation=self.generation,
            node=min(self.node_of_rank),
            failed_rank=min(self.failed_ranks, default=0),
            failed_node=min(self.failed_nodes, default=0),
        ) or next(filter(None, map(_proc_id_problem, self.proc_of_rank)), None)

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
    tier: str  # "tier1", "tier2", "none" (nothing lost: no decode), ...
    step: int  # the recovery step every rank's state is at
    world_size: int
    restore_s: float  # decode (or rebuild) and install
    protect_s: float  # re-protecting the new generation (overlaps the next step)
    join_s: float  # the whole join, from the membership to the first step
    decode_start_s: float  # from the membership until the decode began
    resharded: bool = False
    repaired: tuple[str, ...] = ()  # redundancy that failed its checks and what rebuilt it
    rebuilt_from: str = ""
    phases_s: dict[str, float] = field(default_factory=dict)  # rank 0's join, phase by phase, in order

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str | bytes, key: str = "") -> RecoveryRecord:
        return parse(RecoveryRecord, text, key)

    def problem(self) -> str | None:
        return negative(generation=self.generation, step=self.step, world_size=self.world_size)


class _Flat:
    """to/from JSON for a message of plain fields (lists come back as they were written)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))  # type: ignore[call-overload]  (subclasses are dataclasses)

    @classmethod
    def from_json(cls, text: str | bytes, key: str = "") -> Self:
        return parse(cls, text, key)


# ----- supervisor <-> coordinator (keys.sup_report, keys.command)
@dataclass(frozen=True)
class ProcEvent:
    """What happened to one process of the supervisor's host."""

    kind: ProcEventKind
    proc_id: str
    role: str  # worker | shadow | zygote | keeper
    rank: int | None
    node: int
    pid: int = 0
    code: int | None = None  # the exit status (exited, fenced)
    cause: str = ""  # in words: "was killed by SIGKILL", "stopped heartbeating ...; fenced with SIGKILL"

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", ProcEventKind(self.kind))
        except ValueError:
            raise ValueError(f"unknown process event {self.kind!r}") from None

    def problem(self) -> str | None:
        if self.role not in ROLES:
            return f"unknown role {_show(self.role)}"
        return negative(rank=self.rank, node=self.node, pid=self.pid) or _proc_id_problem(self.proc_id)


@dataclass(frozen=True)
class SupervisorReport:
    """One entry of the supervisor's report stream. Processes that die together (a node) are
    one report, so the coordinator decides on them as one failure."""

    events: tuple[ProcEvent, ...] = ()
    signal: int | None = None  # SIGINT or SIGTERM reached the supervisor: stop the job
    shm_removed: tuple[str, ...] = ()  # dead jobs' /dev/shm segments removed at the start

    def to_json(self) -> str:
        return json.dumps(
            {"events": [asdict(e) for e in self.events], "signal": self.signal, "shm_removed": list(self.shm_removed)}
        )

    @staticmethod
    def from_json(text: str | bytes, key: str = "") -> SupervisorReport:
        return parse(SupervisorReport, text, key)

    def problem(self) -> str | None:
        if self.signal is not None and self.signal not in (signal.SIGINT, signal.SIGTERM):
            return f"signal {self.signal} is neither SIGINT nor SIGTERM"
        return None


COMMANDS = ("spawn", "fork", "boost", "wake_keepers", "stop")


@dataclass(frozen=True)
class Command(_Flat):
    """The coordinator asks a supervisor: spawn a process, fork a shadow from the node's zygote
    (answered by a `started` or `fork_failed` event), boost a shadow to normal priority, wake the
    keepers (a drain was written), or stop every process (answered by keys.STOPPED)."""

    kind: str  # one of COMMANDS
    proc_id: str = ""
    role: str = ""
    rank: int | None = None
    node: int = 0
    boost: bool = False  # spawn, or fork, at normal priority (a replacement keeper, an adopting shadow)

    def __post_init__(self) -> None:
        if self.kind not in COMMANDS:
            raise ValueError(f"unknown command {self.kind!r}")

    def problem(self) -> str | None:
        if self.kind in ("spawn", "fork", "boost"):
            if self.kind != "boost" and self.role not in ROLES:
                return f"unknown role {_show(self.role)}"
            return _proc_id_problem(self.proc_id) or negative(rank=self.rank, node=self.node)
        return None


@dataclass(frozen=True)
class JobState(_Flat):
    """The coordinator's view the supervisor needs for its hang checks (keys.JOB_STATE): the
    current generation (its membership names the members) and whether a recovery or resize runs."""

    generation: int
    recovering: bool

    def problem(self) -> str | None:
        return negative(generation=self.generation)


@dataclass(frozen=True)
class HostRecord(_Flat):
    """A live host of a multi-host job (keys.host, bound to its lease): where its supervisor
    listens for the coordinator's liveness connection, and the lease to revoke to fence it."""

    node: int
    addr: str
    port: int
    pid: int
    lease: int

    def problem(self) -> str | None:
        return _listener_problem(self.addr, self.port, self.pid) or negative(node=self.node)


def _listener_problem(addr: str, port: int, pid: int) -> str | None:
    """What is wrong with a host supervisor's liveness address, port and pid, if anything."""
    if not 0 < port < 65536 or not 0 < pid <= PID_MAX or not addr:
        return f"port {port}, pid {pid} or address {_show(addr)} is not one"
    return None


@dataclass(frozen=True)
class JoinRequest(_Flat):
    """A host asking to enter a running job (keys.join_request, bound to its lease): where its
    supervisor listens for liveness connections, and its lease (the host record's, once admitted)."""

    addr: str
    port: int
    pid: int
    lease: int

    def problem(self) -> str | None:
        return _listener_problem(self.addr, self.port, self.pid) or negative(lease=self.lease)


@dataclass(frozen=True)
class Admission(_Flat):
    """The coordinator admitted a joining host (keys.admission): the node it is now, and the
    first command of the stream that is its (the ones before were for the host it replaces)."""

    node: int
    first_command: int

    def problem(self) -> str | None:
        return negative(node=self.node, first_command=self.first_command)


@dataclass(frozen=True)
class StepProgress(_Flat):
    """Rank 0's latest completed step (keys.PROGRESS, the step record of metrics.jsonl)."""

    step: int
    time: float
    loss: float | None = field(metadata={"finite": False})  # a diverged run's loss is reported as it is
    step_s: float | None = None
    tokens_per_s: float | None = None

    def problem(self) -> str | None:
        return negative(step=self.step) or (
            f"step_s {self.step_s} is negative" if self.step_s is not None and self.step_s < 0 else None
        )

    def record(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ForkRequest(_Flat):
    """A supervisor's request to its node's zygote (keys.fork): fork a shadow named `proc_id`."""

    proc_id: str
    node: int

    def problem(self) -> str | None:
        return _proc_id_problem(self.proc_id) or negative(node=self.node)


@dataclass(frozen=True)
class JobResult(_Flat):
    """Rank 0's result at the job's end (keys.RESULT): its steps, last loss and state digest."""

    steps: int
    final_loss: float | None = field(metadata={"finite": False})  # a diverged run's loss is reported as it is
    digest: str

    def problem(self) -> str | None:
        return negative(steps=self.steps)


@dataclass(frozen=True)
class PersistSchedule(_Flat):
    """Rank 0's checkpoint schedule (keys.PERSIST_EVERY): every `every` steps from step `first`."""

    every: int
    first: int

    def problem(self) -> str | None:
        return f"every {self.every} is not positive" if self.every < 1 else negative(first=self.first)


class Refusals:
    """The malformed store values a reader has refused: each (key, value) is said once on stderr,
    so a value read every round is not said every round."""

    def __init__(self, who: str = "leto") -> None:
        self.who = who
        self._seen: dict[str, bytes | str | None] = {}

    def known(self, key: str, value: bytes | str | None) -> bool:
        """Whether `value` of `key` was refused already (the reader need not parse it again)."""
        return key in self._seen and self._seen[key] == value

    def refuse(self, e: BadValue, value: bytes | str | None = None) -> None:
        if not self.known(e.key, value):
            print(f"{self.who}: ignored a malformed value of {e}", file=sys.stderr, flush=True)
        if len(self._seen) < 10_000:
            self._seen[e.key] = value
