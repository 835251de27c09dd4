"""Rank 0's record of each completed step: the run's metrics file and the coordinator's progress."""

from __future__ import annotations

import json
import time

from leto.protection.client import Protector
from leto.protocol import keys
from leto.runtime import runlog
from leto.runtime.env import Job


class StepLog:
    """Times the steps and, on rank 0 of a run with a run folder, records each one."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self._t_last = time.perf_counter()

    def record(
        self, rank: int, step: int, loss: float, tokens: int, grad_norm: float | None, protector: Protector | None
    ) -> None:
        """Step `step` completed with global `loss` over `tokens` tokens (0: not counted);
        `grad_norm` when clipping; the training thread's time on protection since the last step."""
        now = time.perf_counter()
        dt, self._t_last = now - self._t_last, now
        if rank == 0 and self.job.run_dir is not None:
            rec = {
                "step": step,
                "loss": loss,
                "step_s": round(dt, 6),
                "tokens_per_s": round(tokens / dt, 1) if tokens else None,
                "time": time.time(),
            }
            if grad_norm is not None:
                rec["grad_norm"] = round(grad_norm, 6)
            if protector is not None:
                rec.update({k: round(v, 6) for k, v in protector.spent.items()})
                protector.spent = dict.fromkeys(protector.spent, 0.0)
            runlog.append(self.job.run_dir, rec)
            self.job.store.set(keys.PROGRESS, json.dumps(rec))  # the coordinator's view of progress
