"""What the coordinator tells a person, as typed notices, and their lines on the console.

The coordinator emits notices (`StepDisplay.show`); the words are here, in `render`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConfigNotWritten:
    """config.json could not be written (the job goes on)."""

    path: str
    why: str


@dataclass(frozen=True)
class SegmentsRemoved:
    """Shared-memory segments of dead jobs were removed at the start."""

    count: int


@dataclass(frozen=True)
class TookOver:
    """This host's coordinator took over the job."""

    generation: int


@dataclass(frozen=True)
class Stopping:
    """A signal reached a supervisor: the job stops."""

    signal: str


@dataclass(frozen=True)
class ProcessFailed:
    """A process of the job failed."""

    who: str
    pid: int
    node: int
    cause: str


@dataclass(frozen=True)
class CannotRecover:
    """No recovery is possible: the job stops."""

    why: str


@dataclass(frozen=True)
class ProtectionOff:
    """A rank was lost with protection off: the job stops."""


@dataclass(frozen=True)
class RecoveringInALoop:
    """The job reached its most recoveries: the job stops."""

    limit: int


@dataclass(frozen=True)
class ScriptFailsAgain:
    """A rank's process ended by its own error (an error exit, or a signal it raised itself) again
    before any step completed since the last such failure: an error of the training script, not
    a lost process. The job stops."""

    what: str  # the process, e.g. "worker rank 1"
    how: str  # "exited with code 1", "was killed by SIGABRT"
    step: int  # the step in flight both times


@dataclass(frozen=True)
class NothingProtected:
    """A rank was lost before any state was protected: the job stops."""


@dataclass(frozen=True)
class AfterLastStep:
    """A failure once training was over; `recorded`: rank 0 recorded the result; `errors`: the
    exit codes of workers that ended with an error of their own (not a signal) after it."""

    recorded: bool
    errors: tuple[int, ...] = ()


@dataclass(frozen=True)
class Shrinking:
    """`lost` ranks had no shadow to adopt them: the job goes on with `ranks` ranks."""

    lost: int
    ranks: int


@dataclass(frozen=True)
class Degraded:
    """What the redundancy no longer covers after a loss."""

    what: str


@dataclass(frozen=True)
class Restored:
    """What a loss had degraded is covered again (a grow onto a new host)."""

    what: str


@dataclass(frozen=True)
class HostJoined:
    """A new host entered the running job, in a lost host's node."""

    node: int
    addr: str


@dataclass(frozen=True)
class NotWarm:
    """An admitted host's shadows were not all warm in time: the job grows onto those that are."""

    waiting: int
    timeout_s: float


@dataclass(frozen=True)
class Growing:
    """Warm shadows join a shrunk job."""

    cause: str
    ranks: int


@dataclass(frozen=True)
class Resized:
    """A grown generation ran its first step."""

    generation: int
    ranks: int
    step: int | None
    total_s: float


@dataclass(frozen=True)
class Recovered:
    """A recovered generation ran its first step."""

    generation: int
    cause: str
    tier: str | None
    step: int | None
    detect_s: float
    restore_s: float | None
    total_s: float


Notice = (
    ConfigNotWritten
    | SegmentsRemoved
    | TookOver
    | Stopping
    | ProcessFailed
    | CannotRecover
    | ProtectionOff
    | RecoveringInALoop
    | ScriptFailsAgain
    | NothingProtected
    | AfterLastStep
    | Shrinking
    | Degraded
    | Restored
    | HostJoined
    | NotWarm
    | Growing
    | Resized
    | Recovered
)
TO_STDERR = (ConfigNotWritten, SegmentsRemoved)  # said at once on stderr, past the progress bar


def render(n: Notice) -> str:
    """The console line of a notice."""
    match n:
        case ConfigNotWritten(path, why):
            return (
                f"leto: cannot write {path} ({why}); the job goes on without it "
                f"(a --resume of this run then needs the job's flags)"
            )
        case SegmentsRemoved(count):
            return f"leto: removed {count} shared-memory segment(s) left behind by dead jobs"
        case TookOver(generation):
            return f"leto: this host took over as coordinator at generation {generation}"
        case Stopping(signal):
            return f"leto: received {signal}, stopping all processes"
        case ProcessFailed(who, pid, node, cause):
            return f"leto: {who} (pid {pid}, node {node}) {cause}"
        case CannotRecover(why):
            return f"leto: cannot recover: {why}; stopping the job"
        case ProtectionOff():
            return "leto: protection is off, so the lost state cannot be rebuilt; stopping the job"
        case RecoveringInALoop(limit):
            return (
                f"leto: {limit} recoveries in one job: something fails over and over; stopping the job rather than loop"
            )
        case ScriptFailsAgain(what, how, step):
            return (
                f"leto: {what} {how} in step {step} again after a recovery, with no step "
                "completed in between: an error of the training script (its output is above), not a lost "
                "process; stopping the job rather than recover in a loop"
            )
        case NothingProtected():
            return (
                "leto: the failure came before any state was protected (the script does not use "
                "leto.Trainer, or protection had not started); stopping the job"
            )
        case AfterLastStep(recorded, errors):
            if errors:
                return (
                    "leto: a worker's script failed after the last step (exit code "
                    f"{', '.join(map(str, errors))}; see its stderr): the job fails"
                )
            return "leto: the failure came after the last step; nothing to recover" + (
                "" if recorded else " (rank 0 did not record the result)"
            )
        case Shrinking(lost, ranks):
            return f"leto: no shadow left for {lost} lost rank(s): shrinking to {ranks} ranks (same global batch)"
        case Degraded(what):
            return f"leto: degraded: {what}"
        case Restored(what):
            return f"leto: restored: {what}"
        case HostJoined(node, addr):
            return f"leto: host {addr} joined the job as node {node}"
        case NotWarm(waiting, timeout_s):
            return (
                f"leto: {waiting} shadow(s) of the joined host not warm within {timeout_s:.0f}s (join warm "
                f"timeout): growing onto those that are"
            )
        case Growing(cause, ranks):
            return f"leto: {cause}: growing back to {ranks} ranks"
        case Resized(generation, ranks, step, total_s):
            return f"leto: generation {generation} runs {ranks} ranks again (step {step}, {total_s:.3f}s)"
        case Recovered(generation, cause, tier, step, detect_s, restore_s, total_s):
            return (
                f"leto: recovered generation {generation} ({cause}) via {tier} at step {step}: "
                f"detect {detect_s:.3f}s, restore {restore_s}s, total {total_s:.3f}s"
            )
    raise TypeError(f"not a notice: {n!r}")
