"""The worker side of persistence: every K steps, an asynchronous DCP checkpoint of this rank's part.

In the step (after it completed) `dcp.async_save` stages a host copy of the part - a memcpy of
the shard and the parameters - and returns; DCP writes it to disk in its own thread, whose
completion callback records the part's checksums and commits the checkpoint if this rank was
the last to finish (`store.mark_part`). Each rank saves with `no_dist=True`, a one-process DCP
checkpoint of its own folder: DCP needs no process group, so nothing interferes with the
job's generations of gloo groups (docs/design.md, "Persistence").

K: `every` if given (`--persist-every`), else Young/Daly for `mtbf_s` with the measured cost of
one write (the whole background write: it runs on the same cores) and the measured step time,
decided by rank 0 after a calibration checkpoint `CALIBRATE_AFTER` steps after the start and
published in the store, so every rank (and a shadow that adopts one later) uses the same K.
"""
from __future__ import annotations

import io
import json
import math
import os
import pickle
import statistics
import sys
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from leto.persistence import store
from leto.persistence.interval import steps_between
from leto.protocol import keys
from leto.runtime import runlog
from leto.simulation.model import daly_interval_s

if TYPE_CHECKING:
    from leto.runtime.env import Job

ENV_PERSIST = "LETO_PERSIST"   # JSON PersistConfig, set by `leto train|run` (absent: persistence off)
ENV_RESUME = "LETO_RESUME"     # JSON {"path", "step"}: load this checkpoint at the start
CALIBRATE_AFTER = 5            # steps timed before the calibration checkpoint (the first is not used)
WRITE_TIMEOUT_S = 120.0        # the longest wait for the last write at the end of the job

# each rank writes a one-process DCP checkpoint on purpose: say so once, not at every save
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


class Persisted(Protocol):
    """What a rank persists (implemented by `leto.training.trainer.Trainer`)."""

    @property
    def step_count(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def state(self) -> torch.Tensor: ...
    @property
    def flat_param(self) -> torch.Tensor: ...
    @property
    def numel(self) -> int: ...
    def extra_state(self) -> dict: ...


@dataclass(frozen=True)
class PersistConfig:
    """What the workers need to persist (passed in ENV_PERSIST)."""

    dir: str
    fingerprint: str
    mtbf_s: float
    every: int | None = None      # fixed K (--persist-every); None: Young/Daly
    start_step: int = 0           # the step the job started from (a resume's checkpoint)

    def to_env(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_env(cls) -> PersistConfig | None:
        text = os.environ.get(ENV_PERSIST)
        return cls(**json.loads(text)) if text else None


class Persister:
    """Schedules and writes this rank's checkpoint parts (one write in flight at a time)."""

    def __init__(self, cfg: PersistConfig, job: Job) -> None:
        self.cfg, self.job = cfg, job
        # DCP costs ~1.2 s of imports (DTensor, sympy): only a process that trains pays it, in a
        # background thread started after its first step (shadows and zygotes never do)
        self._importer: threading.Thread | None = None
        self.dcp = None
        self.stager = None
        self.root = Path(cfg.dir)
        self.every, self.first = (cfg.every, 0) if cfg.every else (None, 0)
        self.pending: tuple[int, float, Future] | None = None  # (step, t0, DCP future)
        self.step_times: list[float] = []
        self._t_last: float | None = None
        self.calibrated = cfg.every is not None
        self.skipped = 0
        self.failed = 0

    # ----- schedule
    def _due(self, step: int, rank: int) -> bool:
        if step <= self.cfg.start_step:
            return False
        if self.every is None and self.job.store.check([keys.PERSIST_EVERY]):
            plan = json.loads(self.job.store.get(keys.PERSIST_EVERY))
            self.every, self.first, self.calibrated = plan["every"], plan["first"], True
        if self.every is not None:
            return step >= self.first and (step - self.first) % self.every == 0
        # before K is known: the calibration checkpoint (rank 0 also calibrates late if it
        # adopted rank 0 after the calibration step, so K is chosen in any case)
        cal = self.cfg.start_step + CALIBRATE_AFTER
        return step == cal or (rank == 0 and step > cal and self.pending is None and not self.calibrated)

    def _choose_k(self, step: int, write_s: float) -> None:
        """Rank 0, after the calibration write: K from Young/Daly, published for every rank."""
        times = self.step_times[1:] or self.step_times  # the first step after a start is slow
        step_s = statistics.median(times[-20:]) if times else 0.0
        interval_s = daly_interval_s(write_s, self.cfg.mtbf_s)
        # never two writes in flight: K steps must outlast a write
        every = max(steps_between(interval_s, step_s), math.ceil(write_s / step_s) + 1 if step_s > 0 else 1)
        first = step + max(every, 2)  # every rank reads the plan before that step (lock-step)
        self.job.store.set(keys.PERSIST_EVERY, json.dumps({"every": every, "first": first}))
        self.every, self.first, self.calibrated = every, first, True
        self._event("persist_interval", every=every, first=first, write_s=round(write_s, 4),
                    step_s=round(step_s, 5), mtbf_s=self.cfg.mtbf_s, interval_s=round(interval_s, 3))

    def _import_dcp(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        self.dcp = dcp
        # one stager for the job: it keeps the host copies and reuses them (the copy in the step is
        # a memcpy, no allocation); safe because a part is staged only when no write is in flight
        self.stager = DefaultStager(StagingOptions(False, False, False, False))

    def _dcp_ready(self) -> None:
        if self._importer is None:
            self._importer = threading.Thread(target=self._import_dcp, name="leto-dcp-import", daemon=True)
            self._importer.start()

    # ----- the step hook
    def after_step(self, trainer: Persisted) -> None:
        """Called once a step has completed: maybe start this rank's part of a checkpoint."""
        self._dcp_ready()
        now = time.perf_counter()
        if self._t_last is not None:
            self.step_times.append(now - self._t_last)
        self._t_last = now
        step, rank = trainer.step_count, trainer.rank
        if self.pending is not None and self.pending[2].done():
            self._finish_pending(rank)
        if not self._due(step, rank):
            return
        if self.pending is not None:  # the previous write is still going: never block the step
            self.skipped += 1
            if rank == 0:
                self._event("persist_skipped", step=step, writing=self.pending[0])
            return
        path = store.part_dir(store.step_dir(self.root, step), rank)
        self._importer.join(timeout=self.job.timeout_s)  # started steps ago: done by now
        if self.dcp is None:
            self.failed += 1
            self._event("persist_failed", step=step, error="torch.distributed.checkpoint did not import")
            return
        t0 = time.perf_counter()
        done: Future = Future()
        self.pending = (step, t0, done)
        try:
            path.mkdir(parents=True, exist_ok=True)
            fut = self.dcp.async_save(part_state(trainer, step), no_dist=True, async_stager=self.stager,  # the copy,
                                      storage_writer=self.dcp.FileSystemWriter(str(path), overwrite=True))  # the write
        except Exception as e:  # noqa: BLE001 - reported by _finish_pending, like a failed write
            done.set_exception(e)
            return
        stage_s = time.perf_counter() - t0  # the whole cost in the step; the write is in DCP's thread
        world = trainer.world_size
        fut.add_done_callback(lambda f: self._on_written(f, done, step, rank, world, t0, stage_s))

    def _on_written(self, fut: Future, done: Future, step: int, rank: int, world: int, t0: float,
                    stage_s: float) -> None:
        """DCP's thread: the part's bytes are on disk; record them and maybe commit."""
        try:
            fut.result()
            ckpt = store.step_dir(self.root, step)
            if store.mark_part(ckpt, rank, step, world, self.cfg.fingerprint):
                store.prune(self.root)
                self._event("persist_commit", step=step, world_size=world, rank=rank, stage_s=round(stage_s, 6),
                            write_s=round(time.perf_counter() - t0, 4))
            done.set_result(time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 - handed to the training thread
            done.set_exception(e)

    def _finish_pending(self, rank: int) -> None:
        step, t0, done = self.pending
        self.pending = None
        try:
            write_s = done.result(timeout=WRITE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - a failed write (disk full...) must not stop training
            write_s = time.perf_counter() - t0  # K is still chosen, so a failing disk is retried every K steps
            self.failed += 1
            self._event("persist_failed", step=step, rank=rank, error=f"{type(e).__name__}: {e}")
            if self.failed == 1:
                print(f"leto: rank {rank}: checkpoint of step {step} failed ({type(e).__name__}: {e}); "
                      f"training goes on, the previous complete checkpoint stays", file=sys.stderr, flush=True)
        if rank == 0 and not self.calibrated:
            self._choose_k(step, write_s)

    def close(self) -> None:
        """Wait for the write in flight (the end of the job)."""
        if self.pending is not None:
            self._finish_pending(self.job.rank or 0)
        if self.stager is not None:
            self.stager.close()

    def _event(self, kind: str, **fields: object) -> None:
        if self.job.run_dir is not None:
            runlog.event(self.job.run_dir, kind, **fields)


# ----- what a part holds, and loading it back
def part_state(trainer: Persisted, step: int) -> dict:
    """This rank's part: its shard at `step`, the step, its extra state; rank 0 also the parameters."""
    sd: dict = {"state": trainer.state, "step": torch.tensor(step, dtype=torch.int64),
                "extra": io.BytesIO(pickle.dumps(trainer.extra_state()))}
    if trainer.rank == 0:
        sd["params"] = trainer.flat_param[:trainer.numel]
    return sd
