"""The failure vocabulary: what can be injected, how a failure shows itself, what happens to a process.

The values are the strings written to the store, metrics.jsonl and summary.json (`StrEnum`:
a member is its string). To add a failure kind: a `FailureKind` member, its `Detection` in
`DETECTION`, and its action in `recovery/inject.py` (`InProcessInjector._fire`).
"""

from __future__ import annotations

from enum import StrEnum


class FailureKind(StrEnum):
    """A failure `--inject` can cause (`recovery/inject.py`)."""

    KILL = "kill"  # SIGKILL the rank
    STOP = "stop"  # SIGSTOP the rank: the whole process hangs
    HANG = "hang"  # the training thread sleeps for ever; the heartbeat thread lives on
    NODE_KILL = "node-kill"  # SIGKILL every process of a node

    @property
    def detection(self) -> Detection:
        """How the coordinator comes to know of this failure."""
        return DETECTION[self]

    @property
    def targets_node(self) -> bool:
        """Whether it is aimed at a node (`node=N`) rather than a rank (`rank=R`)."""
        return self is FailureKind.NODE_KILL


class Detection(StrEnum):
    """How a failure shows itself (the simulator's detection classes)."""

    EXIT = "exit"  # the process exits
    NODE = "node"  # the host disappears
    HANG = "hang"  # a process hangs: only missing heartbeats or progress reveal it


DETECTION: dict[FailureKind, Detection] = {
    FailureKind.KILL: Detection.EXIT,
    FailureKind.STOP: Detection.HANG,
    FailureKind.HANG: Detection.HANG,
    FailureKind.NODE_KILL: Detection.NODE,
}


class ProcEventKind(StrEnum):
    """What a supervisor reports of one of its processes (`messages.ProcEvent`)."""

    STARTED = "started"
    EXITED = "exited"  # with its exit status
    FENCED = "fenced"  # stopped heartbeating or progressing, and was killed
    FORK_FAILED = "fork_failed"
