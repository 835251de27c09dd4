"""A failure after the last step has nothing to recover: one rank of a real job lingers after its
training loop and is SIGKILLed once the others have exited; the job ends at once with exit code
0, its result recorded, and no recovery is tried (it would wait for ranks that have gone)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from conftest import REPO, Launcher, read_procs, summary, wait_for

JOB = ("--workers", "2", "--nodes", "2", "--spares", "1", "--persist", "off")


def script(marker: Path) -> tuple[str, ...]:
    return (str(REPO / "tests" / "scripts" / "lingering_rank.py"), "--marker", str(marker))


def test_a_failure_after_the_last_step_ends_the_job_without_a_recovery(launcher: Launcher, tmp_path: Path) -> None:
    run_dir, marker = tmp_path / "run", tmp_path / "done"
    popen = launcher.start("run", "--run-dir", str(run_dir), *JOB, "--timeout", "20", *script(marker), run_dir=run_dir)
    wait_for(marker.exists, 180, "the last rank's end of training")
    wait_for(
        lambda: not any(p["role"] == "worker" and p["rank"] == 0 for p in read_procs(run_dir)), 60, "rank 0's exit"
    )
    lingering = next(p for p in read_procs(run_dir) if p["role"] == "worker" and p["rank"] == 1)
    os.kill(lingering["pid"], signal.SIGKILL)
    try:
        out, err = popen.communicate(timeout=60)  # a recovery would wait out --timeout, and again
    except subprocess.TimeoutExpired:
        raise AssertionError("the job did not end after a failure that came after its last step") from None
    assert popen.returncode == 0, err[-3000:]
    assert "the failure came after the last step; nothing to recover" in out + err, (out + err)[-3000:]
    s = summary(run_dir)
    assert s["digest"] is not None and s["steps"] == 6
    assert s["recoveries"] == []


def test_a_script_error_after_the_last_step_fails_the_job(launcher: Launcher, tmp_path: Path) -> None:
    """The last rank's own code raises once its loop is done: the job's exit code says so
    (a kill from outside after the last step does not), and nothing is recovered."""
    run_dir = tmp_path / "run"
    res = launcher.run("run", "--run-dir", str(run_dir), *JOB, *script(tmp_path / "done"), "--fail", run_dir=run_dir)
    assert res.returncode == 1, res.stderr[-3000:]
    assert "a worker's script failed after the last step (exit code 1" in res.stdout + res.stderr
    assert summary(run_dir)["recoveries"] == []
