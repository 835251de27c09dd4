"""The worker side of persistence: every K steps, an asynchronous DCP checkpoint of this rank's part.

In the step (after it completed) DCP's stager takes a host copy of the part - a memcpy of the
shard and the parameters - and a daemon thread writes it with `dcp.save`, then records the
part's checksums and commits the checkpoint if this rank was the last to finish
(`ckpt_format.mark_part`). Each rank saves with `no_dist=True`, a one-process DCP checkpoint of its
own folder: DCP needs no process group, so nothing interferes with the job's generations of
gloo groups (docs/design.md, "Persistence").

A write that fails (a full disk: ENOSPC, EIO) or does not finish within `persist_write_s` (a
hung file system) is reported - a `persist_failed` event, and one console line when a run of
failures starts - and abandoned; training goes on and the next checkpoint is tried as usual. An
abandoned write's thread is left behind (it is a daemon: it never holds the process at exit),
it never commits, and the next write stages into fresh host buffers.

K: `every` if given (`--persist-every`), else Young/Daly for the MTBF (`--mtbf`) with the measured cost of
one write (the whole background write: it runs on the same cores) and the measured step time,
decided by rank 0 after a calibration checkpoint `CALIBRATE_AFTER` steps after the start and
published in the store, so every rank (and a shadow that adopts one later) uses the same K.
"""

from __future__ import annotations

import math
import statistics
import sys
import threading
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from leto.config import PersistenceConfig
from leto.console import say
from leto.errors import BadValue
from leto.persistence import ckpt_format
from leto.persistence.interval import daly_interval_s, parse_duration, steps_between
from leto.protocol import keys
from leto.protocol.messages import PersistSchedule, Refusals
from leto.runtime import linux, plain, runlog, threads

if TYPE_CHECKING:
    from leto.runtime.env import Job

CALIBRATE_AFTER = 5  # steps timed before the calibration checkpoint (the first is not used)
EXTRA = "extra"  # a part's extra state: the bytes of `leto.runtime.plain`, as a uint8 tensor

# each rank writes a one-process DCP checkpoint on purpose: say so once, not at every save
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


class Persisted(Protocol):
    """What a rank persists (implemented by `leto.training.member.RankMember`)."""

    @property
    def step_count(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def dp_rank(self) -> int: ...
    @property
    def state(self) -> torch.Tensor: ...
    @property
    def flat_param(self) -> torch.Tensor: ...
    @property
    def numel(self) -> int: ...
    def extra_state(self) -> dict: ...


class _Write:
    """One checkpoint write of this rank, in flight until `done` holds its seconds or its error."""

    def __init__(self, step: int) -> None:
        self.step, self.t0 = step, time.perf_counter()
        self.done: Future = Future()
        self.abandoned = False  # the training thread gave up on it: it must never commit


class Persister:
    """Schedules and writes this rank's checkpoint parts (one write in flight at a time)."""

    def __init__(self, cfg: PersistenceConfig, job: Job) -> None:
        self.cfg, self.job = cfg, job
        self.mtbf_s = parse_duration(cfg.mtbf)
        # DCP costs ~1.2 s of imports (DTensor, sympy): only a process that trains pays it, in a
        # background thread started after its first step (shadows and zygotes never do)
        self._importer: threading.Thread | None = None
        self.dcp = None
        self.stager = None
        self.unwrap = None
        self.root = Path(cfg.dir)
        self.every, self.first = (cfg.every, 0) if cfg.every else (None, 0)
        self.write_s = job.config.timeouts.persist_write_s
        # recorded in the markers: a part holds a slice of the model (one of tp x pp per replica)
        self.tp = job.config.mesh.replica_ranks
        self.pending: _Write | None = None
        self.step_times: list[float] = []
        self._t_last: float | None = None
        self.calibrated = cfg.every is not None
        self.skipped = 0
        self.failed = 0
        self.verified: set[Path] = set()  # checkpoints verified by their checksums before pruning
        self.failing = False  # the last checkpoint failed (the console hears once per run of failures)
        self._refused = Refusals()

    # ----- schedule
    def _due(self, step: int, rank: int) -> bool:
        if step <= self.cfg.start_step:
            return False
        if self.every is None and self.job.store.check([keys.PERSIST_EVERY]):
            value = self.job.store.get(keys.PERSIST_EVERY)
            try:
                schedule = PersistSchedule.from_json(value, keys.PERSIST_EVERY)
                self.every, self.first, self.calibrated = schedule.every, schedule.first, True
            except BadValue as e:  # as if K were not chosen yet: read again at the next step
                self._refused.refuse(e, value)
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
        interval_s = daly_interval_s(write_s, self.mtbf_s)
        # never two writes in flight: K steps must outlast a write
        every = max(steps_between(interval_s, step_s), math.ceil(write_s / step_s) + 1 if step_s > 0 else 1)
        first = step + max(every, 2)  # every rank reads the schedule before that step (lock-step)
        self.job.store.set(keys.PERSIST_EVERY, PersistSchedule(every, first).to_json())
        self.every, self.first, self.calibrated = every, first, True
        self._event(
            "persist_interval",
            every=every,
            first=first,
            write_s=round(write_s, 4),
            step_s=round(step_s, 5),
            mtbf_s=self.mtbf_s,
            interval_s=round(interval_s, 3),
        )

    def _import_dcp(self) -> None:
        linux.name_thread("leto-dcp-import")  # OS thread names: `leto bench overhead` charges them to persistence
        import torch.distributed.checkpoint as dcp

        from leto.persistence.safe_dcp import unwrap

        self.unwrap = unwrap
        self.stager = self._new_stager()
        self.dcp = dcp

    @staticmethod
    def _new_stager() -> object:
        """A stager keeps the host copies and reuses them (the copy in the step is a memcpy, no
        allocation); safe because a part is staged only when no write is in flight, and an
        abandoned write keeps its stager to itself."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        return DefaultStager(StagingOptions(False, False, False, False))

    def _dcp_ready(self) -> None:
        if self._importer is None:
            self._importer = threads.Thread(target=self._import_dcp, name="leto-dcp-import", daemon=True)
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
        if self.pending is not None and (self.pending.done.done() or now - self.pending.t0 > self.write_s):
            self._finish_pending(rank)
        if not self._due(step, rank):
            return
        if self.pending is not None:  # the previous write is still going: never block the step
            self.skipped += 1
            if rank == 0:
                self._event("persist_skipped", step=step, writing=self.pending.step)
            return
        path = ckpt_format.part_dir(ckpt_format.step_dir(self.root, step), rank)
        self._importer.join(timeout=self.job.timeout_s)  # started steps ago: done by now
        if self.dcp is None:
            self.failed += 1
            self._event("persist_failed", step=step, error="torch.distributed.checkpoint did not import")
            return
        w = self.pending = _Write(step)
        try:
            path.mkdir(parents=True, exist_ok=True)
            staged = self.stager.stage(part_state(trainer, step))  # the copy
        except Exception as e:  # noqa: BLE001 - reported by _finish_pending, like a failed write
            w.done.set_exception(e)
            return
        stage_s = time.perf_counter() - w.t0  # the whole cost in the step; the write is in its thread
        threads.Thread(
            target=self._write,
            args=(w, staged, path, rank, trainer.world_size, stage_s),
            name=f"leto-persist-{step}",
            daemon=True,
        ).start()

    def _write(self, w: _Write, staged: dict, path: Path, rank: int, world: int, stage_s: float) -> None:
        """The write's thread: the part's bytes to disk, then its marker, and maybe the commit."""
        linux.name_thread("leto-persist")
        ckpt = ckpt_format.step_dir(self.root, w.step)
        try:
            self.dcp.save(staged, storage_writer=self.dcp.FileSystemWriter(str(path), overwrite=True), no_dist=True)
            if w.abandoned:  # reported as hung already; the folder is left to pruning
                return
            if ckpt_format.mark_part(ckpt, rank, w.step, world, self.cfg.fingerprint, self.tp):
                ckpt_format.prune(self.root, verified=self.verified)
                self._event(
                    "persist_commit",
                    step=w.step,
                    world_size=world,
                    rank=rank,
                    stage_s=round(stage_s, 6),
                    write_s=round(time.perf_counter() - w.t0, 4),
                )
            w.done.set_result(time.perf_counter() - w.t0)
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is one; handed to the training thread
            if not w.abandoned:
                ckpt_format.discard_part(ckpt, rank)  # a torn part only takes space (a full disk wants it back)
            w.done.set_exception(self.unwrap(e))

    def _finish_pending(self, rank: int) -> None:
        w, self.pending = self.pending, None
        error = None
        if not w.done.done():  # hung: give up on it, so that the next checkpoints are written
            w.abandoned = True
            self.stager = self._new_stager()  # its thread may still read the old host copies
            error = f"the write did not finish within {self.write_s:g} s (persist_write_s); abandoned"
        elif w.done.exception() is not None:
            e = w.done.exception()
            error = f"{type(e).__name__}: {e}"
        write_s = w.done.result() if error is None else time.perf_counter() - w.t0
        if error is not None:  # training goes on; K is still chosen, so a failing disk is retried every K steps
            self.failed += 1
            self._event("persist_failed", step=w.step, rank=rank, error=error)
            if not self.failing:
                say(
                    f"leto: rank {rank}: checkpoint of step {w.step} failed ({error}); training goes on, "
                    f"the previous complete checkpoint stays",
                    err=True,
                )
        elif self.failing:
            say(f"leto: rank {rank}: checkpoints are written again (step {w.step})", err=True)
        self.failing = error is not None
        if rank == 0 and not self.calibrated:
            self._choose_k(w.step, write_s)

    def close(self) -> None:
        """Wait for the write in flight (the end of the job), at most until its persist_write_s."""
        if self.pending is not None:
            try:
                self.pending.done.exception(timeout=max(0.0, self.pending.t0 + self.write_s - time.perf_counter()))
            except TimeoutError:
                pass
            self._finish_pending(self.job.rank or 0)
        if self.stager is not None:
            self.stager.close()

    def _event(self, kind: str, **fields: object) -> None:
        if self.job.run_dir is None:
            return
        try:
            runlog.event(self.job.run_dir, kind, **fields)
        except OSError as e:  # a full disk must not stop training (nor a write's thread)
            print(f"leto: cannot record {kind} in the run directory ({e})", file=sys.stderr, flush=True)


# ----- what a part holds
def part_state(trainer: Persisted, step: int) -> dict:
    """This rank's part: its shard at `step`, the step, its extra state; the first rank of its DP
    group (rank 0, or with tensor parallelism each TP slice's) also its flat parameters. Tensors
    only: what is not a tensor travels as the bytes of `plain.dumps` (decoded without running
    code; DCP itself would pickle it, and unpickle it unrestricted)."""
    extra = bytearray(plain.dumps(trainer.extra_state()))
    sd: dict = {
        "state": trainer.state,
        "step": torch.tensor(step, dtype=torch.int64),
        EXTRA: torch.frombuffer(extra, dtype=torch.uint8),
    }
    if trainer.dp_rank == 0:
        sd["params"] = trainer.flat_param[: trainer.numel]
    return sd


def persister_for(job: Job) -> Persister | None:
    """The job's persister, where its configuration names a checkpoint folder; None otherwise."""
    cfg = job.config.persistence
    return Persister(cfg, job) if cfg.dir is not None else None
