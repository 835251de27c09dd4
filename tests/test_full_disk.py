"""A full disk under the run directory does not stop training: the run directory is a small
tmpfs that the test fills up mid-run (a filler file) and frees again. The job goes on to the
end with the failure-free digest, each process that cannot write says so once, the records it
could not append reach metrics.jsonl once space returns (after a `log_gap` event), and
summary.json is written. Also with a recovery while the disk is full: rank 0 is SIGKILLed, and
the coordinator's events and the replacement rank 0's records wait for space the same way."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO, Launcher, leto_cmd, read_procs, reference_digest, summary, tmpfs, wait_for, without_flags
from leto.console import read_jsonl

STEPS = 16
JOB = ("--workers", "4", "--nodes", "2", "--spares", "1", "--steps", str(STEPS), "--seed", "0", "--persist", "off")
FULL = "cannot write"  # the start of the one line a process says when the disk refuses its records


@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs of its own, unmounted afterwards."""
    with tmpfs(tmp_path / "mnt", "16m") as mnt:
        yield mnt / "run"


def steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "event" not in r and "step" in r]


def fill(run_dir: Path) -> Path:
    """Take every free block of the file system; then pad metrics.jsonl's last block with a blank
    line (a file's last block takes appends on a full disk), so that the next record needs space."""
    filler = run_dir.parent / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError:
        pass
    try:
        while True:
            os.write(fd, b"\0" * 512)
    except OSError:
        pass
    finally:
        os.close(fd)
    block = os.statvfs(run_dir).f_bsize
    fd = os.open(run_dir / "metrics.jsonl", os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, b" " * (block - 1 - os.fstat(fd).st_size % block) + b"\n")
    except OSError:
        pass  # rank 0 crossed into a new block first: it got ENOSPC itself
    finally:
        os.close(fd)
    return filler


def start(launcher: Launcher, run_dir: Path, out: Path) -> subprocess.Popen:
    """`leto train` with its stdout and stderr in files outside the tmpfs (read while it runs)."""
    with open(out.with_suffix(".out"), "w") as o, open(out.with_suffix(".err"), "w") as e:
        popen = subprocess.Popen(leto_cmd("train", "--run-dir", str(run_dir), *JOB), cwd=REPO, stdout=o, stderr=e)
    launcher.started.append((popen, run_dir))
    return popen


def shown_step(out: Path) -> int:
    """The last step the console showed (plain lines: `step N/TOTAL ...`)."""
    found = re.findall(r"^step (\d+)/", out.with_suffix(".out").read_text(), re.MULTILINE)
    return int(found[-1]) if found else 0


def said(out: Path, text: str) -> int:
    return out.with_suffix(".err").read_text().count(text) + out.with_suffix(".out").read_text().count(text)


@pytest.fixture
def reference(launcher: Launcher, tmp_path_factory) -> str:
    return reference_digest(launcher, tmp_path_factory.mktemp("ref"), *without_flags(JOB, "spares"))


@pytest.mark.parametrize("recovery", [False, True], ids=["steps", "rank0_killed"])
def test_training_goes_on_through_a_full_disk(
    launcher: Launcher, run_dir: Path, tmp_path: Path, reference: str, recovery: bool
) -> None:
    out = tmp_path / "job"
    popen = start(launcher, run_dir, out)
    wait_for(lambda: any(s >= 2 for s in steps(run_dir)), 180, "step 2")
    rank0 = next(p["pid"] for p in read_procs(run_dir) if p["role"] == "worker" and p["rank"] == 0)
    filler = fill(run_dir)
    wait_for(lambda: said(out, FULL), 60, "rank 0 to find the disk full")
    if recovery:
        os.kill(rank0, signal.SIGKILL)
        wait_for(lambda: said(out, "leto: recovered generation 1"), 120, "the recovery")
    else:  # two more steps with nowhere to write them (the console shows rank 0's progress)
        at = max(steps(run_dir))
        wait_for(lambda: shown_step(out) >= at + 2, 60, f"step {at + 2} on the console")
    assert popen.poll() is None, "the job ended before the disk was freed"
    filler.unlink()
    popen.wait(timeout=240)
    err = out.with_suffix(".err").read_text()
    assert popen.returncode == 0, err[-3000:]
    s = summary(run_dir)
    assert s["exit_code"] == 0 and s["digest"] == reference and s["steps"] == STEPS
    assert len(s["recoveries"]) == int(recovery)
    records = read_jsonl(run_dir / "metrics.jsonl")
    # the records of the full disk's time are there, late, after a gap event; none lost (a
    # killed rank 0 loses the records it held, which its replacement computes again)
    gaps = [r for r in records if r.get("event") == "log_gap"]
    assert gaps and all(g["lost"] == 0 and g["late"] >= 1 for g in gaps), gaps
    first = s["recoveries"][0]["step"] + 1 if recovery else 1
    assert set(range(first, STEPS + 1)) <= set(steps(run_dir))
    if recovery:  # the coordinator's events of the recovery, written late as well
        assert [r for r in records if r.get("event") == "failure"], records
    # each process that found the disk full said so once and (but the killed rank 0) said when
    # it could write again: rank 0; with a recovery also the coordinator and the new rank 0
    writers = {g["pid"] for g in gaps}
    assert len(writers) == (2 if recovery else 1), gaps
    assert said(out, f"{FULL} {run_dir / 'metrics.jsonl'}") == len(writers) + int(recovery), err[-3000:]
    assert said(out, f"{FULL} {run_dir / 'procs.json'}") <= 1, err[-3000:]  # the supervisor's, at a change
    assert said(out, "is written again:") == len(writers), err[-3000:]


def test_a_disk_full_to_the_end_costs_the_files_not_the_job(launcher: Launcher, run_dir: Path, tmp_path: Path) -> None:
    """The disk is never freed: the job still ends with exit code 0; rank 0 says how many records
    it could not write and that model.pt was not written, and the controller says once that
    summary.json could not be written."""
    out = tmp_path / "job"
    with open(out.with_suffix(".out"), "w") as o, open(out.with_suffix(".err"), "w") as e:
        popen = subprocess.Popen(leto_cmd("train", *JOB, "--run-dir", str(run_dir)), cwd=REPO, stdout=o, stderr=e)
    launcher.started.append((popen, run_dir))
    wait_for(lambda: any(s >= 2 for s in steps(run_dir)), 180, "step 2")
    fill(run_dir)
    assert popen.wait(timeout=240) == 0, out.with_suffix(".err").read_text()[-3000:]
    err = out.with_suffix(".err").read_text()
    assert said(out, f"{FULL} {run_dir / 'metrics.jsonl'}") == 1, err[-3000:]
    assert re.search(
        r"leto: \d+ records for \S+metrics.jsonl could not be written \(No space left on device\) "
        r"and are lost",
        err,
    ), err[-3000:]
    assert (
        said(
            out, f"could not write {run_dir / 'summary.json'} (No space left on device); the job ended with exit code 0"
        )
        == 1
    ), err[-3000:]
    assert not (run_dir / "summary.json").exists()
    assert f"leto: {run_dir / 'model.pt'} not written: No space left on device" in err, err[-3000:]
    assert not (run_dir / "model.pt").exists()
    assert "Traceback" not in err, err[-3000:]
