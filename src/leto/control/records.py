"""The coordinator's record of a recovery (or a growth), from its decision to its first step.

Closed, it becomes a `recovery` or `resize` event of metrics.jsonl and summary.json, with rank
0's numbers (`messages.RecoveryRecord`) merged in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from leto.protocol.messages import RecoveryRecord


@dataclass
class Recovery:
    """A new generation the coordinator announced, waiting for its first step."""

    generation: int
    cause: str
    t_fail: float  # time.time() of the (first) failure
    t_detect: float  # time.time() the coordinator decided on it
    world_size: int
    failed_ranks: list[int] = field(default_factory=list)
    failed_nodes: list[int] = field(default_factory=list)
    adopted_by: dict[str, str] | None = None  # lost rank -> the shadow adopting it (None: a growth)
    interrupted: list[int] = field(default_factory=list)  # generations whose recovery this one cut short
    first_step: tuple[float, int, float] | None = None  # its first step: time, the max step before, monotonic

    @property
    def grow(self) -> bool:
        return self.adopted_by is None

    def absorb(self, old: Recovery) -> None:
        """This failure came during the recovery `old`: one record of both, from the first failure."""
        self.failed_ranks = sorted(set(self.failed_ranks) | set(old.failed_ranks))
        self.failed_nodes = sorted(set(self.failed_nodes) | set(old.failed_nodes))
        self.cause = f"{old.cause}; then during its recovery: {self.cause}"
        self.t_fail, self.t_detect = min(old.t_fail, self.t_fail), min(old.t_detect, self.t_detect)
        self.interrupted += old.interrupted + [old.generation]

    def to_dict(self, info: RecoveryRecord | None) -> dict:
        """The closed record (its first step seen), with rank 0's record `info` of it (None: none came)."""
        assert self.first_step is not None
        t_first, max_step = self.first_step[0], self.first_step[1]
        out: dict = {
            "generation": self.generation,
            "failed_ranks": self.failed_ranks,
            "failed_nodes": self.failed_nodes,
            "cause": self.cause,
            "world_size": self.world_size,
        }
        if self.adopted_by is not None:
            out["adopted_by"] = self.adopted_by
        step = None if info is None else info.step
        out.update(
            {
                "interrupted": self.interrupted,
                "tier": None if info is None else info.tier,
                "step": step,
                "repaired": [] if info is None else list(info.repaired),
                "detect_s": round(self.t_detect - self.t_fail, 4),
                "restore_s": None if info is None else info.restore_s,
                "join_s": None if info is None else info.join_s,
                "protect_s": None if info is None else info.protect_s,
                "join_phases_s": {} if info is None else info.phases_s,
                "total_s": round(t_first - self.t_fail, 4),
                "lost_steps": None if step is None else max(0, max_step - step),
            }
        )
        return out
