"""A training script that raises is recovered once; raising again in the same step stops the job."""

from __future__ import annotations

from pathlib import Path

from conftest import REPO, Launcher, processes_left, summary

JOB = ("--workers", "2", "--nodes", "2", "--spares", "1", "--persist", "off")
SCRIPT = str(REPO / "tests" / "scripts" / "failing_step.py")


def test_a_script_that_raises_in_the_same_step_again_after_a_recovery_stops_the_job(
    launcher: Launcher, tmp_path: Path
) -> None:
    """Rank 1 raises in step 3 every time: the shadow that adopts it raises there too. The job
    stops after that second failure with one line saying it is the script's error, instead of
    recovering in a loop."""
    run_dir = tmp_path / "run"
    res = launcher.run("run", "--run-dir", str(run_dir), *JOB, SCRIPT, run_dir=run_dir, timeout=180)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out[-3000:]
    assert (
        "in step 4 again after a recovery, with no step completed in between: an error of the training script" in out
    ), out[-3000:]
    assert out.count("ValueError: the user's data loader broke in step 3") == 2  # rank 1, then its adopter
    assert summary(run_dir)["digest"] is None
    assert not processes_left(run_dir)


def test_a_script_error_that_does_not_recur_is_recovered(launcher: Launcher, tmp_path: Path) -> None:
    """Rank 1 raises in step 3 once only: one recovery, and the job trains to its end."""
    run_dir = tmp_path / "run"
    once = ("--once", str(tmp_path / "raised"))
    res = launcher.run("run", "--run-dir", str(run_dir), *JOB, SCRIPT, *once, run_dir=run_dir, timeout=180)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    s = summary(run_dir)
    assert s["steps"] == 8 and len(s["recoveries"]) == 1
    assert not processes_left(run_dir)
