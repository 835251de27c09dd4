"""The on-disk format of persistent checkpoints; plain files, read without torch.

    ROOT/step-00000120/rank0/          DCP checkpoint of rank 0's part (.metadata, *.distcp)
    ROOT/step-00000120/rank0.done      JSON: step, world size, fingerprint, size and XXH3 of every file
    ROOT/step-00000120/COMMIT          JSON: written once every rank's marker is there

A tensor-parallel job's markers also record its `tp` (absent: 1): part r then holds DP shard
r // tp of model slice r % tp, and only a job with the same `tp` can load it.

A checkpoint is complete when its COMMIT and all `world_size` part markers are present and
agree; anything else (a rank killed mid-write, a marker deleted) is torn and never loaded. The
file checksums catch a corrupt file before anything is loaded. Markers are written atomically
and durably (`leto.runtime.durable`), after the part's folder entries are synced, so a marker
that survives a power loss names files that survived it too.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import xxhash

from leto.persistence.files import read_json, write_json_atomic
from leto.runtime.durable import fsync_dir

COMMIT = "COMMIT"
COMMIT_CLAIM = ".commit-claimed"  # made exclusively by the one rank that reports a commit
KEEP = 2  # complete checkpoints kept
RESUME_FAILED = "cannot resume:"  # how a rank says the checkpoint it was to start from failed to load
_STEP_DIR = re.compile(r"step-(\d{8})")
_READ = 1 << 20


class CheckpointError(Exception):
    """A checkpoint (or a folder of them) that cannot be used; the message names the problem."""


@dataclass(frozen=True)
class Checkpoint:
    """One complete checkpoint."""

    path: Path
    step: int
    world_size: int
    fingerprint: str
    tp: int = 1  # ranks per TP group of the job that wrote it


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def part_dir(ckpt: Path, rank: int) -> Path:
    return ckpt / f"rank{rank}"


def part_marker(ckpt: Path, rank: int) -> Path:
    return ckpt / f"rank{rank}.done"


def _file_digest(path: Path) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(_READ):
            h.update(chunk)
    return h.hexdigest()


def file_digests(folder: Path) -> dict[str, list]:
    """{file name: [size, XXH3-64]} of every file in `folder`."""
    return {p.name: [p.stat().st_size, _file_digest(p)] for p in sorted(folder.iterdir()) if p.is_file()}


def _mesh(tp: int) -> dict:
    """What a marker records of the job's mesh: nothing without tensor parallelism (the format
    of a tp 1 job is unchanged)."""
    return {"tp": tp} if tp > 1 else {}


def mark_part(ckpt: Path, rank: int, step: int, world_size: int, fingerprint: str, tp: int = 1) -> bool:
    """Record that rank `rank`'s part is fully written; commit the checkpoint if it was the
    last part. True for exactly one rank: the one that commits it first (it reports and prunes)."""
    fsync_dir(part_dir(ckpt, rank))  # DCP syncs its files, not their names
    fsync_dir(ckpt.parent)  # the step folder's own name
    write_json_atomic(
        part_marker(ckpt, rank),
        {
            "step": step,
            "rank": rank,
            "world_size": world_size,
            "fingerprint": fingerprint,
            **_mesh(tp),
            "files": file_digests(part_dir(ckpt, rank)),
        },
    )
    if _torn_because(ckpt, step, world_size, fingerprint, need_commit=False, tp=tp) is not None:
        return False
    # the last ranks to finish may both get here: they write the same bytes, atomically, and
    # the one that claims the commit first reports it
    write_json_atomic(ckpt / COMMIT, {"step": step, "world_size": world_size, "fingerprint": fingerprint, **_mesh(tp)})
    try:
        os.close(os.open(ckpt / COMMIT_CLAIM, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    except FileExistsError:
        return False
    return True


def discard_part(ckpt: Path, rank: int) -> None:
    """Remove what rank `rank` wrote of a checkpoint it failed to finish (nothing else is touched)."""
    part_marker(ckpt, rank).unlink(missing_ok=True)
    shutil.rmtree(part_dir(ckpt, rank), ignore_errors=True)


def _torn_because(
    ckpt: Path, step: int, world_size: int, fingerprint: str, need_commit: bool = True, tp: int = 1
) -> str | None:
    """Why `ckpt` is not complete, or None."""
    if need_commit and read_json(ckpt / COMMIT) is None:
        return f"{ckpt.name} has no commit marker (torn)"
    for r in range(world_size):
        mark = read_json(part_marker(ckpt, r))
        if mark is None:
            return f"{ckpt.name} lacks rank {r}'s part marker (torn)"
        seen = (mark.get("step"), mark.get("world_size"), mark.get("fingerprint"), mark.get("tp", 1))
        if seen != (step, world_size, fingerprint, tp):
            return f"{ckpt.name}: rank {r}'s part marker disagrees with the commit marker"
    return None


def steps_on_disk(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every checkpoint folder under `root`, complete or not, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir()]
    return sorted(found)


def _complete(path: Path, step: int) -> tuple[Checkpoint | None, str | None]:
    commit = read_json(path / COMMIT)
    if commit is None:
        return None, f"{path.name} has no commit marker (torn)"
    world, fp, tp = commit.get("world_size"), commit.get("fingerprint"), commit.get("tp", 1)
    if (
        commit.get("step") != step
        or not isinstance(world, int)
        or world < 1
        or not isinstance(fp, str)
        or type(tp) is not int
        or tp < 1
        or world % tp
    ):
        return None, f"{path.name}: its commit marker is malformed"
    why = _torn_because(path, step, world, fp, tp=tp)
    return (Checkpoint(path, step, world, fp, tp), None) if why is None else (None, why)


def complete(root: Path) -> list[Checkpoint]:
    """The complete checkpoints under `root` (by their markers), newest first."""
    out = [ck for step, path in steps_on_disk(root) if (ck := _complete(path, step)[0]) is not None]
    return out[::-1]


def verify(ck: Checkpoint) -> None:
    """Raise CheckpointError unless every file of every part has its recorded size and checksum."""
    for r in range(ck.world_size):
        recorded = (read_json(part_marker(ck.path, r)) or {}).get("files") or {}
        folder = part_dir(ck.path, r)
        if ".metadata" not in recorded:
            raise CheckpointError(f"{folder} records no DCP .metadata file")
        for name, entry in recorded.items():
            if not _plain_name(name) or not _is_size_and_digest(entry):
                raise CheckpointError(
                    f"{part_marker(ck.path, r)} records {name!r} as {entry!r}: not a file of the part"
                )
            size, digest = entry
            f = folder / name
            if f.is_symlink():
                raise CheckpointError(f"{f} is a link; a checkpoint's files are plain files")
            try:
                actual = f.stat().st_size
            except FileNotFoundError:
                raise CheckpointError(f"{f} is missing") from None
            if actual != size:
                raise CheckpointError(f"{f} has {actual} bytes, {size} were written")
            if _file_digest(f) != digest:
                raise CheckpointError(f"{f} is corrupt (its checksum differs from the one written)")


def _plain_name(name: object) -> bool:
    """A file name inside a part folder: no folder, no way out of it."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


def _is_size_and_digest(entry: object) -> bool:
    return (
        isinstance(entry, list)
        and len(entry) == 2
        and type(entry[0]) is int
        and entry[0] >= 0
        and isinstance(entry[1], str)
    )


def tp_mismatch(ck: Checkpoint, tp: int) -> str:
    """Why a job with `tp` ranks per TP group (not `ck.tp`) cannot load `ck`."""
    return (
        f"{ck.path.name} was written by a job with --tp {ck.tp} and this job has --tp {tp}: its parts hold "
        f"the model sliced over {ck.tp} tensor-parallel ranks; resume with --tp {ck.tp}"
    )


def choose(root: Path, fingerprint: str, warn: Callable[[str], None], tp: int = 1) -> Checkpoint:
    """The newest complete, intact checkpoint of this job (`tp` ranks per TP group) under `root`;
    `warn` hears why each newer one was passed over. CheckpointError if there is none, or if the
    newest complete one of this job was written with another `tp` (the older ones were too)."""
    for step, path in reversed(steps_on_disk(root)):
        ck, why = _complete(path, step)
        if ck is not None and ck.fingerprint != fingerprint:
            why = f"{path.name} was written by another job configuration"
        elif ck is not None and ck.tp != tp:
            raise CheckpointError(tp_mismatch(ck, tp))
        elif ck is not None:
            try:
                verify(ck)
                return ck
            except CheckpointError as e:
                why = str(e)
        warn(f"checkpoint {why}; passed over")
    raise CheckpointError(f"no complete checkpoint of this job in {root}")


def prune(root: Path, keep: int = KEEP, verified: set[Path] | None = None) -> None:
    """Remove every checkpoint folder older than the `keep` newest complete ones that verify by
    their checksums (a folder newer than the newest such one may still be being written, or be
    corrupt, and is left alone; nothing is removed until `keep` checkpoints verify). `verified`:
    checkpoints this caller verified before (not read again), updated."""
    verified = set() if verified is None else verified
    kept = []
    for ck in complete(root):
        if ck.path not in verified:
            try:
                verify(ck)
            except CheckpointError:
                continue
            verified.add(ck.path)
        kept.append(ck)
        if len(kept) == keep:
            break
    else:
        return
    for step, path in steps_on_disk(root):
        if step < kept[-1].step:
            shutil.rmtree(path, ignore_errors=True)
