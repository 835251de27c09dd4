"""The built-in GPT job plus checkpointing, for the checkpoint-restart baselines.

Same model presets, sampler, AdamW schedule and `Trainer` as `leto.training.train_gpt`; on top:

* `--ckpt-mode disk`: `torch.distributed.checkpoint` (DCP) of each rank's ZeRO-1 shard
  (`trainer.member.state`), the replicated parameters (with `--tp T` or `--pp P`, each slice's)
  and the step, to local disk every K steps
  (`--ckpt-every K`, or K from Young/Daly with `--mtbf-s` and the job's own measured checkpoint
  cost). A checkpoint counts once rank 0 has written `latest.json` after DCP finished it.
* `--ckpt-mode memory` (Gemini-like): every step, each rank copies its shard into a file under a
  tmpfs directory (`/dev/shm`) that outlives the process - it stands in for the CPU memory of
  the peer that Gemini would send the shard to. Two slots per rank, each with a commit marker
  written after its bytes, so a torn write is never loaded.

On start, if a checkpoint exists, every rank loads it and training resumes from its step; the
sampler and the learning-rate schedule are pure functions of the step, so resuming is exact. A
model-parallel job (`--tp T`, `--pp P`) restarts on the same mesh: each rank loads its own shard
of its slice (its stage's part for its TP coordinate).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import time
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

import leto
from leto.persistence.files import read_json as _read_json
from leto.persistence.files import write_json_atomic as _write_json_atomic
from leto.persistence.interval import daly_interval_s, steps_between
from leto.protocol import keys
from leto.runtime import runlog
from leto.runtime.env import Job
from leto.training import train_gpt
from leto.training.member import RankMember
from leto.training.optim import MASTER

POINTER = "latest.json"  # disk: the committed checkpoint
INTERVAL = "interval.json"  # disk: K once chosen by Young/Daly, kept across restarts
CALIBRATE_AFTER = 3  # steps timed before the calibration checkpoint
DEFAULT_SHM = Path("/dev/shm")


def write_whole(fd: int, data: memoryview) -> None:
    """Make the file `fd` exactly `data` (sized, then written from offset 0 to the end)."""
    os.ftruncate(fd, len(data))
    written = 0
    while written < len(data):
        written += os.pwrite(fd, data[written:], written)


class CheckpointMismatch(RuntimeError):
    """A checkpoint exists but was written by a job with another configuration."""


# ----- events (rank 0 appends them to the run's metrics.jsonl, like the controller's)
def emit(job: Job, kind: str, **fields: object) -> None:
    if job.rank == 0 and job.run_dir is not None:
        runlog.event(job.run_dir, kind, **fields)


def _max_over_ranks(member: RankMember, *values: float) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if member.comm is None:
        raise RuntimeError("not connected")
    member.comm.all_reduce(t, dist.ReduceOp.MAX)
    return t.tolist()


class Checkpointer(Protocol):
    """What the job needs from a checkpoint store (every method is called on every rank)."""

    def restore(self, member: RankMember) -> int | None:
        """Load the newest checkpoint every rank can load; its step, or None (start from scratch)."""
        ...

    def save(self, member: RankMember) -> float:
        """Checkpoint the trainer's current step; returns the seconds training was blocked."""
        ...

    def poll(self) -> None:
        """Commit a background save that has finished."""
        ...

    def close(self) -> None:
        """Finish (commit) what is in flight."""
        ...


# ----- disk: torch.distributed.checkpoint
class DiskCheckpointer:
    """DCP save/load of {state/rank<r>: shard, flat_param, step} into `root/step-<n>/`.

    Each rank's shard is its own key (the ZeRO-1 layout depends on the world size, so there is
    nothing to reshard); the replicated parameters and step are deduplicated by DCP's planner.
    With model parallelism the parameters are replicated only within a DP group: each slice's
    (rank % ranks per replica: its stage and TP coordinate) are their own key,
    `flat_param/slice<s>`.
    DCP needs the default process group: a second gloo group beside the trainer's, which also
    keeps async-save collectives off the training group.
    """

    def __init__(self, root: Path, job: Job, fingerprint: str, async_save: bool, keep: int = 2) -> None:
        import torch.distributed.checkpoint as dcp
        import torch.distributed.checkpoint._fsspec_filesystem  # noqa: F401  (imported lazily by the first save otherwise)

        self.dcp = dcp
        self.root, self.job, self.fingerprint = root, job, fingerprint
        self.async_save, self.keep = async_save, keep
        self.pending: tuple[int, float, Future] | None = None  # (step, t0, future) of an async save
        root.mkdir(parents=True, exist_ok=True)
        if not dist.is_initialized():
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore(keys.CKPT_PG, job.store),
                rank=job.rank,
                world_size=job.world_size,
                timeout=timedelta(seconds=job.timeout_s),
            )

    def _state_dict(self, member: RankMember, step: int) -> dict[str, torch.Tensor]:
        k = member.replica_ranks
        params = "flat_param" if k == 1 else f"flat_param/slice{member.rank % k}"
        return {
            f"state/rank{member.rank}": member.state,
            params: member.flat_param,
            "step": torch.tensor(step, dtype=torch.int64),
        }

    def committed(self) -> dict | None:
        ptr = _read_json(self.root / POINTER)
        return ptr if ptr and "step" in ptr and "path" in ptr else None

    def restore(self, member: RankMember) -> int | None:
        ptr = self.committed()
        step = ptr["step"] if ptr else -1
        lo, hi = _max_over_ranks(member, -step, step)  # every rank must load the same checkpoint
        if -lo != hi:
            raise RuntimeError(f"ranks see different committed checkpoints ({-lo} vs {hi})")
        self._drop_uncommitted(ptr)
        if ptr is None:
            return None
        if ptr.get("fingerprint") != self.fingerprint:
            raise CheckpointMismatch(f"{self.root / POINTER} was written by another job configuration")
        member.set_step(step)  # first: `member.state` may be a buffer chosen by the step
        sd = self._state_dict(member, -1)
        from leto.persistence.safe_dcp import SafeReader, TensorsOnlyPlanner  # its files cannot run code

        self.dcp.load(sd, storage_reader=SafeReader(str(self.root / ptr["path"])), planner=TensorsOnlyPlanner())
        if int(sd["step"]) != step:
            raise RuntimeError(f"checkpoint {ptr['path']} holds step {int(sd['step'])}, expected {step}")
        return step

    def _drop_uncommitted(self, ptr: dict | None) -> None:
        # leftovers of a save a failure interrupted; no rank writes before the next save (after a step)
        if self.job.rank != 0:
            return
        for d in self.root.glob("step-*"):
            if ptr is None or d.name != ptr["path"]:
                shutil.rmtree(d, ignore_errors=True)

    def save(self, member: RankMember) -> float:
        """Checkpoint the current step; returns the seconds training was blocked."""
        t0 = time.perf_counter()
        step = member.step_count
        path = self.root / f"step-{step:08d}"
        writer = self.dcp.FileSystemWriter(str(path), overwrite=True)
        if self.async_save:
            self._wait_pending()  # DCP: one save in flight at a time
            fut = self.dcp.async_save(self._state_dict(member, step), storage_writer=writer)
            self.pending = (step, t0, fut)
        else:
            self.dcp.save(self._state_dict(member, step), storage_writer=writer)
            self._commit(step, time.perf_counter() - t0)
        return time.perf_counter() - t0

    def _commit(self, step: int, total_s: float) -> None:
        if self.job.rank != 0:
            return
        name = f"step-{step:08d}"
        _write_json_atomic(
            self.root / POINTER, {"step": step, "path": name, "fingerprint": self.fingerprint, "time": time.time()}
        )
        emit(self.job, "ckpt_commit", step=step, total_s=round(total_s, 6))
        done = sorted(d.name for d in self.root.glob("step-*") if d.name <= name)
        for old in done[: -self.keep]:
            shutil.rmtree(self.root / old, ignore_errors=True)

    def poll(self) -> None:
        if self.pending is not None and self.pending[2].done():
            self._wait_pending()

    def _wait_pending(self) -> None:
        if self.pending is None:
            return
        step, t0, fut = self.pending
        self.pending = None
        fut.result(timeout=2 * self.job.timeout_s)  # re-raises a failed save
        self._commit(step, time.perf_counter() - t0)

    def close(self) -> None:
        self._wait_pending()


# ----- memory: Gemini-like, every step, into files that outlive the process
class MemoryCheckpointer:
    """Two slots per rank under `root` (a tmpfs directory): `rank<r>.slot<s>` holds the raw shard,
    `rank<r>.slot<s>.commit` (JSON: step, fingerprint, nbytes) is written only after the bytes.

    Step n goes to slot n % 2, whose marker is removed first, so each rank always keeps its last
    committed step and the one before; ranks are in lock-step, so the newest step committed by
    every rank is one of them.
    """

    def __init__(self, root: Path, job: Job, fingerprint: str) -> None:
        self.root, self.job, self.fingerprint = root, job, fingerprint
        root.mkdir(parents=True, exist_ok=True)
        self._fds: dict[int, int] = {}

    @staticmethod
    def slot_path(root: Path, rank: int, slot: int) -> Path:
        return root / f"rank{rank}.slot{slot}"

    @staticmethod
    def committed(root: Path, rank: int, fingerprint: str, nbytes: int) -> dict[int, int]:
        """{step: slot} of the slots of `rank` whose commit marker is present and matches."""
        out: dict[int, int] = {}
        for slot in (0, 1):
            path = MemoryCheckpointer.slot_path(root, rank, slot)
            mark = _read_json(path.with_name(path.name + ".commit"))
            if not mark or mark.get("fingerprint") != fingerprint or mark.get("nbytes") != nbytes:
                continue
            if mark.get("slot") != slot or not isinstance(mark.get("step"), int):
                continue
            try:
                if path.stat().st_size != nbytes:
                    continue
            except FileNotFoundError:
                continue
            out[mark["step"]] = slot
        return out

    def restore(self, member: RankMember) -> int | None:
        nbytes = member.state.numel() * member.state.element_size()
        mine = self.committed(self.root, member.rank, self.fingerprint, nbytes)
        steps = sorted(mine, reverse=True)[:2] + [-1, -1]
        local = torch.tensor(steps[:2], dtype=torch.int64)
        everyone = torch.empty(member.world_size * 2, dtype=torch.int64)
        if member.comm is None:
            raise RuntimeError("not connected")
        member.comm.all_gather(everyone, local)
        common = set.intersection(*(set(everyone[2 * r : 2 * r + 2].tolist()) for r in range(member.world_size)))
        common.discard(-1)
        if not common:
            return None
        step = max(common)
        member.set_step(step)  # first: `member.state` may be a buffer chosen by the step
        path = self.slot_path(self.root, member.rank, mine[step])
        with open(path, "rb") as f:
            if f.readinto(memoryview(member.state.numpy()).cast("B")) != nbytes:
                raise RuntimeError(f"{path} is shorter than its commit marker says")
        # replicated parameters (of this rank's slice) are the all-gather of its DP group's master shards
        member.param_shard.copy_(member.state[:, MASTER, :].reshape(-1))
        if member.dp_comm is None:
            raise RuntimeError("not connected")
        member.dp_comm.all_gather(member.flat_param, member.param_shard)
        return step

    def save(self, member: RankMember) -> float:
        t0 = time.perf_counter()
        step = member.step_count
        slot = step % 2
        path = self.slot_path(self.root, member.rank, slot)
        marker = path.with_name(path.name + ".commit")
        marker.unlink(missing_ok=True)  # from here until the new marker, the slot is not loadable
        fd = self._fds.get(slot)
        if fd is None:
            fd = self._fds[slot] = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        data = memoryview(member.state.numpy()).cast("B")
        write_whole(fd, data)
        _write_json_atomic(marker, {"step": step, "slot": slot, "nbytes": len(data), "fingerprint": self.fingerprint})
        return time.perf_counter() - t0

    def poll(self) -> None:
        pass

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


# ----- the job
def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(checkpoint options, the built-in job's options)."""
    p = argparse.ArgumentParser(prog="leto.baselines.ckpt_job")
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--ckpt-mode", choices=["disk", "memory"], default="disk")
    p.add_argument(
        "--ckpt-every",
        type=int,
        default=None,
        help="disk: checkpoint every K steps (0: never); default: Young/Daly from --mtbf-s",
    )
    p.add_argument("--mtbf-s", type=float, default=None, help="disk: mean time between failures for Young/Daly")
    p.add_argument(
        "--async-save",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="disk: dcp.async_save (staging copy, then write in a background thread)",
    )
    ck, rest = p.parse_known_args(argv)
    if ck.ckpt_mode == "disk" and ck.ckpt_every is None and ck.mtbf_s is None:
        p.error("disk mode needs --ckpt-every or --mtbf-s")
    if ck.ckpt_every is not None and ck.ckpt_every < 0:
        p.error(f"--ckpt-every cannot be negative, got {ck.ckpt_every}")
    return ck, train_gpt.parse(rest)


def fingerprint(args: argparse.Namespace, world_size: int, tp: int = 1, pp: int = 1) -> str:
    """What a checkpoint must match to be resumed: everything that changes the trajectory (and,
    with model parallelism, which slice of the model each rank holds)."""
    cfg = {
        "model": args.model,
        "seed": args.seed,
        "lr": args.lr,
        "steps": args.steps,
        "chunk_bytes": args.chunk_bytes,
        "world_size": world_size,
        **({"tp": tp} if tp > 1 else {}),
        **({"pp": pp, "microbatches": args.microbatches} if pp > 1 else {}),
    }
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]


def make_checkpointer(ck: argparse.Namespace, job: Job, fp: str) -> Checkpointer:
    if ck.ckpt_mode == "memory":
        return MemoryCheckpointer(ck.ckpt_dir, job, fp)
    return DiskCheckpointer(ck.ckpt_dir, job, fp, ck.async_save)


class Schedule:
    """When to checkpoint: every step (memory), every K steps, or K from Young/Daly after timing
    a few steps and one checkpoint (K is kept in `interval.json` so restarts reuse it)."""

    def __init__(self, ck: argparse.Namespace, job: Job) -> None:
        self.job, self.mtbf_s = job, ck.mtbf_s
        self.file = ck.ckpt_dir / INTERVAL
        self.every: int | None = 1 if ck.ckpt_mode == "memory" else ck.ckpt_every
        if self.every is None:
            saved = _read_json(self.file)
            if saved and saved.get("mtbf_s") == self.mtbf_s and isinstance(saved.get("every"), int):
                self.every = saved["every"]
        self.step_times: list[float] = []
        self.calibrate_at: int | None = None

    def due(self, step: int, total: int) -> bool:
        if self.every is not None:
            return self.every > 0 and step % self.every == 0 and (step < total or self.every == 1)
        if self.calibrate_at is None and len(self.step_times) >= CALIBRATE_AFTER:
            self.calibrate_at = step
        return step == self.calibrate_at and step < total

    def calibrated(self, member: RankMember, save_s: float) -> None:
        """After the calibration checkpoint: K = Young/Daly interval / step time (max over ranks)."""
        if self.every is not None or self.mtbf_s is None:
            return
        cost_s, step_s = _max_over_ranks(member, save_s, statistics.median(self.step_times[1:]))
        interval_s = daly_interval_s(cost_s, self.mtbf_s)
        self.every = steps_between(interval_s, step_s)
        rec = {
            "every": self.every,
            "ckpt_cost_s": round(cost_s, 6),
            "step_s": round(step_s, 6),
            "mtbf_s": self.mtbf_s,
            "interval_s": round(interval_s, 3),
        }
        if member.rank == 0:
            _write_json_atomic(self.file, rec)
        emit(self.job, "ckpt_interval", **rec)


def main(argv: list[str] | None = None) -> None:
    ck, args = parse(argv)
    torch.set_num_threads(1)  # workers share the machine's cores
    job = leto.init()
    trainer, model, sampler, tokens = train_gpt.build(args, job)
    if job.is_shadow:  # the baselines run without shadows; one would just idle
        for _ in trainer.steps(args.steps):
            pass
        return
    mesh = job.config.mesh
    ckpt = make_checkpointer(ck, job, fingerprint(args, job.world_size, mesh.tp, mesh.pp))
    trainer.member.connect()  # join the process group now, so a checkpoint can be loaded before step 0
    emit(job, "job_up", mode=ck.ckpt_mode)
    t0 = time.perf_counter()
    restored = ckpt.restore(trainer.member)
    (restore_s,) = _max_over_ranks(trainer.member, time.perf_counter() - t0)
    if restored is not None:
        emit(job, "restore", step=restored, restore_s=round(restore_s, 6), mode=ck.ckpt_mode)
    schedule = Schedule(ck, job)
    # with pipeline stages the trainer runs the stages on the batch; without, the model computes the loss
    pipeline = trainer.pipeline is not None
    for step in trainer.steps(args.steps):
        x, y, weight = sampler.batch(step, trainer.dp_rank, trainer.dp_size)  # a replica's ranks: one batch
        t_step = time.perf_counter()
        trainer.step((lambda: (x, y)) if pipeline else (lambda: model(x, y)), weight=weight, tokens=tokens)
        schedule.step_times.append(time.perf_counter() - t_step)
        ckpt.poll()
        if schedule.due(trainer.step_count, args.steps):
            save_s = ckpt.save(trainer.member)
            emit(job, "ckpt_save", step=trainer.step_count, save_s=round(save_s, 6), mode=ck.ckpt_mode)
            schedule.calibrated(trainer.member, save_s)
    ckpt.close()


if __name__ == "__main__":
    main()
