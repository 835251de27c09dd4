"""Checkpoint writes that fail or hang never stop training. The checkpoint folder (`--persist-dir`)
is a small tmpfs that the test fills up mid-run and frees again, or holds a named FIFO where a
rank's checkpoint file goes, so that the write blocks in `open()` as on a hung file system. The
job reports the failed or abandoned checkpoint (a `persist_failed` event and one console line
per rank), writes later checkpoints as usual, and ends with the failure-free digest."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO, Launcher, leto_cmd, reference_digest, summary, tmpfs, wait_for
from leto.persistence import ckpt_format

STEPS = 30
# the hung-write test: steps enough after the hung write for its timeout to run out and a later
# checkpoint to commit even at 30 ms a step (70 measured here on an idle machine)
LONG_STEPS = 80
HUNG_TIMEOUT_S = 1
JOB = ("--workers", "2", "--nodes", "1", "--spares", "0", "--steps", str(STEPS), "--seed", "0")
PERSIST = ("--protection", "off", "--persist", "on", "--persist-every", "2")
FAILED = (
    "checkpoint of step"  # the console line of a failed checkpoint: "leto: rank R: checkpoint of step N failed (...)"
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("ref")
    lx = Launcher(tmp)
    try:
        yield reference_digest(lx, tmp, *JOB)
    finally:
        lx.cleanup()


@pytest.fixture(scope="module")
def reference_long(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("ref-long")
    lx = Launcher(tmp)
    try:
        yield reference_digest(lx, tmp, *JOB, "--steps", str(LONG_STEPS))
    finally:
        lx.cleanup()


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 48 MiB tmpfs of its own (three checkpoints of this job fit)."""
    with tmpfs(tmp_path / "mnt", "48m") as mnt:
        yield mnt


def start(launcher: Launcher, run_dir: Path, persist_dir: Path, *extra: str) -> subprocess.Popen:
    """`leto train` with its output in files beside the run directory (read while it runs)."""
    with open(run_dir.with_suffix(".out"), "w") as o, open(run_dir.with_suffix(".err"), "w") as e:
        popen = subprocess.Popen(
            leto_cmd("train", "--run-dir", str(run_dir), *JOB, *PERSIST, "--persist-dir", str(persist_dir), *extra),
            cwd=REPO,
            stdout=o,
            stderr=e,
        )
    launcher.started.append((popen, run_dir))
    return popen


def events(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being appended
        if rec.get("event") == kind:
            out.append(rec)
    return out


def fill(folder: Path) -> Path:
    """Take every free block of the file system `folder` is on."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 16, 512):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def finished(popen: subprocess.Popen, run_dir: Path, reference: str, steps: int = STEPS) -> str:
    """Wait for the job; check it ended well, `steps` steps, with the failure-free digest; its stderr."""
    popen.wait(timeout=300)
    err = run_dir.with_suffix(".err").read_text()
    assert popen.returncode == 0, err[-3000:]
    s = summary(run_dir)
    assert s["digest"] == reference and s["steps"] == steps
    return err


def said_once_per_rank(err: str, text: str) -> set[int]:
    """The ranks whose console said `text`; each said it once."""
    lines = [line for line in err.splitlines() if text in line]
    ranks = [int(line.split("rank ")[1].split(":")[0]) for line in lines]
    assert len(ranks) == len(set(ranks)), lines
    return set(ranks)


def test_a_full_checkpoint_disk_is_reported_and_later_checkpoints_are_written(
    launcher: Launcher, tmp_path: Path, small_fs: Path, reference: str
) -> None:
    run_dir, ckpts = tmp_path / "run", small_fs / "checkpoints"
    popen = start(launcher, run_dir, ckpts)
    wait_for(lambda: events(run_dir, "persist_commit"), 180, "a first checkpoint")
    filler = fill(small_fs)
    wait_for(lambda: events(run_dir, "persist_failed") or popen.poll() is not None, 120, "a failed checkpoint")
    assert popen.poll() is None, "the job ended before a checkpoint found the disk full"
    filler.unlink()
    err = finished(popen, run_dir, reference)

    failed = events(run_dir, "persist_failed")
    # ENOSPC, as Python's OSError or through torch's stream writer (its C++ side words it)
    assert all("No space left on device" in f["error"] or "file write failed" in f["error"] for f in failed), failed
    last_failed = max(f["step"] for f in failed)
    # checkpoints are written again once there is space, and pruning kept the newest two
    assert any(c["step"] > last_failed for c in events(run_dir, "persist_commit"))
    kept = ckpt_format.complete(ckpts)
    assert (
        len(kept) == 2
        and kept[0].step > last_failed
        and [p for _, p in ckpt_format.steps_on_disk(ckpts)] == [ck.path for ck in reversed(kept)]
    )
    for ck in kept:
        ckpt_format.verify(ck)
    # one line per rank when its checkpoints start failing, and one when they are written again
    ranks = said_once_per_rank(err, FAILED)
    assert ranks and ranks == said_once_per_rank(err, "checkpoints are written again"), err[-3000:]


def test_a_hung_checkpoint_write_is_abandoned_and_later_checkpoints_are_written(
    launcher: Launcher, tmp_path: Path, reference_long: str
) -> None:
    """Rank 0's checkpoint file of step 8 is a FIFO nobody reads: DCP's `open()` blocks forever,
    as on a hung file server. After --persist-timeout it is reported and abandoned; the writes
    skipped meanwhile and the later ones go on, and the blocked thread does not hold the job at its end."""
    run_dir, ckpts = tmp_path / "run", tmp_path / "checkpoints"
    popen = start(launcher, run_dir, ckpts, "--persist-timeout", str(HUNG_TIMEOUT_S), "--steps", str(LONG_STEPS))
    wait_for(lambda: ckpts.is_dir() or popen.poll() is not None, 60, "the checkpoint folder")
    part = ckpt_format.part_dir(ckpt_format.step_dir(ckpts, 8), 0)
    part.mkdir(parents=True)
    os.mkfifo(part / "__0_0.distcp")
    assert not events(run_dir, "persist_commit"), "the job checkpointed before the FIFO was in place"
    err = finished(popen, run_dir, reference_long, LONG_STEPS)

    (hung,) = events(run_dir, "persist_failed")
    assert hung["step"] == 8 and hung["rank"] == 0
    assert hung["error"] == f"the write did not finish within {HUNG_TIMEOUT_S} s (persist_write_s); abandoned"
    assert said_once_per_rank(err, FAILED) == {0} and "checkpoint of step 8 failed" in err
    commits = [c["step"] for c in events(run_dir, "persist_commit")]
    assert 8 not in commits and max(commits) > 8
    kept = ckpt_format.complete(ckpts)
    assert kept[0].step > 8 and not ckpt_format.step_dir(ckpts, 8).exists()  # pruned once newer ones verified
    ckpt_format.verify(kept[0])
