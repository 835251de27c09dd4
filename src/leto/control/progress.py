"""Progress, not liveness: the supervisor's check that a worker's training thread advances.

A worker's heartbeat comes from its own thread, so it proves only that the process runs. Each
heartbeat also carries a progress counter that the training thread advances at every step and
every poll of a wait (`GenerationWatch.progress`). A worker whose counter has not moved for
`timeout_s()` = max(floor, factor x median step time) is hung even though it heartbeats
(docs/design.md, "Progress, not liveness").
"""

from __future__ import annotations

import statistics
from collections import deque

STEP_WINDOW = 101  # step times the median is taken over (the latest ones)


class ProgressCheck:
    """Remembers each worker's last progress counter and when it last moved."""

    def __init__(self, floor_s: float, factor: float) -> None:
        self.floor_s, self.factor = floor_s, factor
        self.step_s: deque[float] = deque(maxlen=STEP_WINDOW)
        self.seen: dict[str, tuple[int, float]] = {}  # proc id -> (progress, when it last moved)

    def record_step(self, step_s: float) -> None:
        if not self.step_s:  # the timeout starts to apply: stalls count from now, not from start-up
            self.reset()
        self.step_s.append(step_s)

    def timeout_s(self) -> float | None:
        """The stall that makes a worker hung; None until a step was measured (start-up and
        the first step, which builds the process group and encodes the protection, can take
        any time: only liveness is checked then)."""
        if not self.step_s:
            return None
        return max(self.floor_s, self.factor * statistics.median(self.step_s))

    def reset(self) -> None:
        """Forget every worker's counter (a recovery or resize runs: its phases are not steps,
        and the next generation's counters start afresh when it is done)."""
        self.seen.clear()

    def stalled_for(self, proc_id: str, progress: int, now: float) -> float | None:
        """Seconds `proc_id`'s counter has stood still if that exceeds the timeout, else None."""
        last = self.seen.get(proc_id)
        if last is None or last[0] != progress:
            self.seen[proc_id] = (progress, now)
            return None
        timeout = self.timeout_s()
        stalled = now - last[1]
        return stalled if timeout is not None and stalled > timeout else None
