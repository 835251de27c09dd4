"""The command-line side of persistence: turn it on for a start, or resume a run (`--resume`).

A run that persists records `RUN_DIR/persist.json`: the checkpoint folder, the training
command that identifies its trajectory and the command-line flags it was started with (the
CLI continues a run with them). `--resume RUN_DIR` checks that the command is the same (the
checkpoints of another configuration would not continue the same trajectory), picks the newest
complete, intact checkpoint (saying why newer ones are passed over), moves the previous
attempt's metrics and summary aside and starts a new job in RUN_DIR from that checkpoint.

Resume reads and deletes checkpoints only inside the run folder, or in the `--persist-dir`
given with `--resume`: a recorded folder that leads elsewhere (an absolute path, `..`, a
symbolic link) is refused, since the record is a file anyone who can write the run folder
may have changed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shlex
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO

from leto.config import PersistenceConfig
from leto.console import read_jsonl
from leto.persistence import ckpt_format
from leto.persistence.files import read_json, write_json_atomic
from leto.persistence.interval import parse_duration
from leto.runtime import linux

RECORD = "persist.json"
CLAIM = "resume-claim.json"  # which attempt of a multi-host run has been resumed (by its first host)
DEFAULT_DIR = "checkpoints"  # under RUN_DIR
DEFAULT_MTBF = PersistenceConfig.mtbf  # --mtbf: a failure every few minutes of training (docs/design.md)
CLAIM_TIMEOUT_S = 60.0  # the longest one host waits for another's claim of a resumed attempt (a few file reads)
EARLIER_RUN = ("metrics.jsonl", "summary.json")  # what a new job in a used run folder would overwrite


@dataclass
class Start:
    """What one start of a job adds to its configuration: its persistence section whole, and
    fields of its summary."""

    persistence: PersistenceConfig
    summary: dict = field(default_factory=dict)

    @property
    def persist_dir(self) -> Path | None:
        """Where the job writes its checkpoints; None: nowhere."""
        return None if self.persistence.dir is None else Path(self.persistence.dir)


def fingerprint(command: list[str]) -> str:
    return hashlib.sha256(json.dumps(command).encode()).hexdigest()[:16]


def check_flags(persist: str, mtbf: str, every: int | None) -> float:
    """Validate the persistence flags; the MTBF in seconds. ValueError names the bad flag."""
    if every is not None and every < 1:
        raise ValueError(f"--persist-every must be at least 1, got {every}")
    try:
        return parse_duration(mtbf)
    except ValueError as e:
        raise ValueError(f"--mtbf: {e}") from None


def fresh(
    run_dir: Path,
    command: list[str],
    settings: PersistenceConfig,
    *,
    persist: bool,
    persist_dir: Path | None = None,
    flags: dict | None = None,
) -> Start:
    """A new job: with `persist`, it persists into `persist_dir` (default RUN_DIR/checkpoints),
    which must hold no checkpoints yet, as `settings` (mtbf, every) say; `flags` (the CLI's,
    JSON) are recorded for `--resume`. CheckpointError names the problem."""
    if not persist:
        return Start(settings)
    root = (persist_dir or run_dir / DEFAULT_DIR).resolve()
    if ckpt_format.steps_on_disk(root):
        raise ckpt_format.CheckpointError(
            f"{root} already holds checkpoints: continue that run with --resume, "
            f"or choose another --persist-dir / --run-dir"
        )
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ckpt_format.CheckpointError(f"cannot create the checkpoint folder {root}: {e.strerror or e}") from e
    _record(run_dir, root, command, flags)
    return Start(replace(settings, dir=str(root), fingerprint=fingerprint(command)))


def read_record(run_dir: Path) -> dict:
    """The run's persist.json (`dir`, `command`, and `flags` where recorded); CheckpointError
    names why there is none to resume from."""
    if not run_dir.is_dir():
        raise ckpt_format.CheckpointError(f"{run_dir} is not a folder")
    path = run_dir / RECORD
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise ckpt_format.CheckpointError(
            f"{run_dir} has no {RECORD}: it is not a run that persisted checkpoints "
            f"(was it started with --persist off?)"
        ) from None
    except OSError as e:
        raise ckpt_format.CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ckpt_format.CheckpointError(f"{path} is corrupt (not JSON)") from None
    if (
        not isinstance(record, dict)
        or not isinstance(record.get("dir"), str)
        or not isinstance(record.get("command"), list)
        or not all(isinstance(a, str) for a in record["command"])
        or not isinstance(record.get("flags") or {}, dict)
    ):
        raise ckpt_format.CheckpointError(f"{path} is corrupt (it needs a folder `dir` and a `command` list)")
    return record


def resume(
    run_dir: Path,
    command: list[str],
    settings: PersistenceConfig,
    *,
    persist: bool,
    attempt: str | None = None,
    persist_dir: Path | None = None,
    steps: int | None = None,
    flags: dict | None = None,
    tp: int = 1,
) -> Start:
    """Resume the run in `run_dir` from its newest complete checkpoint, and with `persist` go on
    persisting as `settings` (mtbf, every) say. CheckpointError names what is wrong with the
    folder. `attempt`: where the hosts of a multi-host job resume it together, the new job's id:
    only the first of them checks that the old run is over and sets its records aside (the
    others would find this attempt's own). `persist_dir`: the checkpoint folder given on the
    command line (else the record's, which must be inside `run_dir`); `steps`: the last step of
    the resumed job, not before the checkpoint's; `flags`: the flags to record for the next
    resume (else the record's are kept); `tp`: the new job's ranks per TP group, which must be
    the checkpoint's."""
    record = read_record(run_dir)
    with _claim(run_dir, attempt) as claim:
        if claim.first:
            _not_running(run_dir)
        root = checkpoint_root(run_dir, record["dir"], persist_dir)
        if record["command"] != command:
            raise ckpt_format.CheckpointError(
                f"its checkpoints belong to another configuration: recorded `{shlex.join(record['command'])}`, "
                f"now `{shlex.join(command)}`"
            )
        ck = ckpt_format.choose(root, fingerprint(command), lambda msg: print(f"leto: {msg}", file=sys.stderr), tp)
        if not ck.path.resolve().is_relative_to(root):
            raise ckpt_format.CheckpointError(f"{ck.path} leads out of the checkpoint folder {root} (a symbolic link)")
        if steps is not None and ck.step > steps:
            raise ckpt_format.CheckpointError(f"its newest complete checkpoint is step {ck.step}, past --steps {steps}")
        if claim.first:
            for step, path in ckpt_format.steps_on_disk(root):  # newer ones are torn or corrupt: this run rewrites them
                if step > ck.step and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
            claim.last = _last_step(run_dir / "metrics.jsonl")
            _set_aside(run_dir)
            _record(run_dir, root, command, record.get("flags") if flags is None else flags)
    last = claim.last
    persistence = replace(settings, start_step=ck.step, resume_from=str(ck.path))
    if persist:
        persistence = replace(persistence, dir=str(root), fingerprint=fingerprint(command))
    start = Start(
        persistence,
        {
            "resumed_from_step": ck.step,
            "steps_lost": None if last is None else max(0, last - ck.step),
            "resumed_from": str(ck.path),
        },
    )
    print(
        f"leto: resuming from step {ck.step} ({ck.path})"
        + (f", {start.summary['steps_lost']} completed step(s) to redo" if last is not None else ""),
        file=sys.stderr,
    )
    return start


def checkpoint_root(run_dir: Path, recorded: str, given: Path | None) -> Path:
    """The folder resume reads and prunes: `given` (--persist-dir on the command line), else the
    recorded one, which must lead to a folder inside the run folder (symbolic links resolved).
    CheckpointError otherwise."""
    if given is not None:
        return given.resolve()
    inside = run_dir.resolve()
    root = (inside / recorded).resolve()  # an absolute `recorded` replaces `inside`
    if not root.is_relative_to(inside):
        raise ckpt_format.CheckpointError(
            f"{RECORD} names the checkpoint folder {recorded!r}, which leads out of the run folder to {root}; "
            f"resume reads and deletes checkpoints only inside it: give --persist-dir {root} if they are this run's"
        )
    return root


def _record(run_dir: Path, root: Path, command: list[str], flags: dict | None) -> None:
    """(Re)write persist.json (relative where inside the run folder, so it can be moved whole)."""
    inside = run_dir.resolve()
    where = root.relative_to(inside) if root.is_relative_to(inside) else root
    write_json_atomic(run_dir / RECORD, {"dir": str(where), "command": command, "flags": flags})


def earlier_run(run_dir: Path, job_id: str | None) -> list[str]:
    """The files of an earlier run a new job in `run_dir` would overwrite (metrics, summary):
    none when the folder's config.json names `job_id`, a multi-host job whose other hosts
    started first."""
    found = [name for name in EARLIER_RUN if (run_dir / name).exists()]
    if found and job_id:
        config = read_json(run_dir / "config.json") or {}
        if (config.get("rendezvous") or {}).get("job_id") == job_id:
            return []
    return found


@dataclass
class _Claim:
    first: bool
    last: int | None = None


@contextmanager
def _claim(run_dir: Path, attempt: str | None, timeout_s: float = CLAIM_TIMEOUT_S) -> Iterator[_Claim]:
    """Whether this process is the first to resume `attempt` (always, for one host), under a
    lock on the run folder; the first one records what the others need (`last`)."""
    if attempt is None:
        yield _Claim(True)
        return
    path = run_dir / ".resume.lock"
    try:  # never through a link: it could name any file
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise ckpt_format.CheckpointError(f"cannot lock {path}: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as lock:
        _lock(lock, path, timeout_s)
        seen = read_json(run_dir / CLAIM)
        if isinstance(seen, dict) and seen.get("attempt") == attempt:
            yield _Claim(False, seen.get("last"))
            return
        claim = _Claim(True)
        yield claim
        write_json_atomic(run_dir / CLAIM, {"attempt": attempt, "last": claim.last})


def _lock(lock: IO[bytes], path: Path, timeout_s: float) -> None:
    """flock `lock` exclusively, or CheckpointError after `timeout_s` (a host stuck holding it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise ckpt_format.CheckpointError(
                    f"{path} stayed locked by another host for {timeout_s:.0f} s"
                ) from None
            time.sleep(0.05)


def _not_running(run_dir: Path) -> None:
    """The run being resumed must be over: its controller (procs.json) is gone. A process is
    named by its pid and start time, so a pid reused since (after a reboot, say) is not taken
    for the run's controller."""
    for path in sorted(run_dir.glob("procs*.json")):  # one host, or each
        for p in read_json_list(path):
            pid = p.get("pid")
            if p.get("role") == "controller" and _alive(pid, p.get("start"), path):
                raise ckpt_format.CheckpointError(f"the run is still going (its controller, pid {pid}, is alive)")


def _alive(pid: object, start: object, record: Path) -> bool:
    """Whether the process `record` lists as (`pid`, `start`) still runs. A record without a
    start time: whether `pid` runs a process that started before the record was last written."""
    now = linux.start_time(pid)  # type: ignore[arg-type]  # None unless a positive int that runs
    if now is None:
        return False
    if start is not None:
        return str(start) == now
    try:
        written = record.stat().st_mtime
        with open("/proc/stat") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, StopIteration, ValueError, IndexError):
        return True  # cannot tell: keep the old answer, alive
    # btime has whole seconds: a second of slack
    return boot + int(now) / os.sysconf("SC_CLK_TCK") <= written + 1.0


def read_json_list(path: Path) -> list[dict]:
    try:
        obj = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return []
    return [p for p in obj if isinstance(p, dict)] if isinstance(obj, list) else []


def _last_step(metrics: Path) -> int | None:
    """The last step the previous attempt completed (its step records in metrics.jsonl)."""
    steps = []
    for rec in read_jsonl(metrics):  # skips torn lines: the last one of a killed run may be
        if isinstance(rec, dict) and "event" not in rec and isinstance(rec.get("step"), int):
            steps.append(rec["step"])
    return max(steps, default=None)


def _set_aside(run_dir: Path) -> None:
    """Keep the previous attempt's metrics and summary as `<name>.attempt<k>` (the new job
    starts them afresh)."""
    for name in ("metrics.jsonl", "summary.json"):
        path = run_dir / name
        if path.exists():
            k = 1 + sum(1 for _ in run_dir.glob(f"{name}.attempt*"))
            path.rename(run_dir / f"{name}.attempt{k}")


def after_failure(run_dir: Path, persist_dir: Path | None, prog: str) -> None:
    """A job that stopped (a loss beyond the codes, a signal): name the checkpoint to resume
    from, on the console and in summary.json."""
    if persist_dir is None:
        return
    done = ckpt_format.complete(persist_dir)
    if not done:
        return
    ck = done[0]
    summary_path = run_dir / "summary.json"
    summary = read_json(summary_path)
    if summary is not None and ckpt_format.RESUME_FAILED in str(summary.get("fatal")):
        return  # the checkpoint itself is what failed: naming it again would send the user in a circle
    outside = "" if persist_dir.resolve().is_relative_to(run_dir.resolve()) else f" --persist-dir {persist_dir}"
    print(
        f"leto: the newest complete checkpoint is step {ck.step} ({ck.path}); continue from it with "
        f"`{prog} --resume {run_dir}{outside}` (it continues with the run's flags)",
        file=sys.stderr,
    )
    if summary is not None:
        summary["resume_from"] = {"step": ck.step, "path": str(ck.path)}
        write_json_atomic(summary_path, summary)
