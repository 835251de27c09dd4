"""`leto run`: supervision, procs.json, signals, crashes; never a process left behind."""

from __future__ import annotations

import os
import re
import signal
import textwrap
from pathlib import Path

from conftest import REPO, alive, read_procs, summary, wait_for


def test_procs_json_lists_every_process_by_role(launcher, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ctl = launcher.start(
        "train",
        "--workers",
        "4",
        "--spares",
        "2",
        "--nodes",
        "2",
        "--steps",
        "100000",
        "--run-dir",
        str(run_dir),
        run_dir=run_dir,
    )
    procs = wait_for(lambda: len(read_procs(run_dir)) == 12 and read_procs(run_dir), 30, "12 processes")
    roles = sorted(p["role"] for p in procs)
    assert roles == ["controller", "fork-server"] + ["keeper"] * 2 + ["shadow"] * 2 + ["worker"] * 4 + ["zygote"] * 2
    assert {p["node"] for p in procs if p["role"] == "keeper"} == {0, 1}
    assert {p["node"] for p in procs if p["role"] == "zygote"} == {0, 1}
    workers = {p["rank"]: p["node"] for p in procs if p["role"] == "worker"}
    assert workers == {0: 0, 1: 0, 2: 1, 3: 1}
    assert {p["node"] for p in procs if p["role"] == "shadow"} == {0, 1}
    assert next(p for p in procs if p["role"] == "controller")["pid"] == ctl.pid
    ctl.send_signal(signal.SIGTERM)
    ctl.wait(timeout=30)


def _policies(pid: int) -> set[int]:
    policies = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            policies.add(os.sched_getscheduler(int(tid)))
        except (ProcessLookupError, PermissionError):
            pass  # a thread that ended meanwhile
    return policies


def test_keepers_serve_at_sched_batch_and_workers_at_normal_priority(launcher, tmp_path: Path) -> None:
    """A keeper woken by a doorbell must never preempt a worker, yet get its fair share."""
    run_dir = tmp_path / "run"
    ctl = launcher.start("train", "--workers", "4", "--nodes", "2", "--steps", "100000", "--run-dir", str(run_dir))
    wait_for(lambda: (run_dir / "metrics.jsonl").exists(), 60, "training to start")
    procs = read_procs(run_dir)
    keepers = [p["pid"] for p in procs if p["role"] == "keeper"]
    workers = [p["pid"] for p in procs if p["role"] == "worker"]
    assert len(keepers) == 2 and len(workers) == 4
    for pid in keepers:
        assert _policies(pid) == {os.SCHED_BATCH}, f"keeper {pid}"
    for pid in workers:
        assert _policies(pid) == {os.SCHED_OTHER}, f"worker {pid}"
    ctl.send_signal(signal.SIGTERM)
    ctl.wait(timeout=30)


def test_sigint_mid_run_stops_everything(launcher, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ctl = launcher.start(
        "train",
        "--workers",
        "4",
        "--spares",
        "1",
        "--nodes",
        "2",
        "--steps",
        "100000",
        "--run-dir",
        str(run_dir),
        run_dir=run_dir,
    )
    wait_for(lambda: (run_dir / "metrics.jsonl").exists(), 60, "training to start")
    pids = [p["pid"] for p in read_procs(run_dir)]
    assert len(pids) == 11  # controller, fork server, 4 workers, 1 shadow, 2 zygotes, 2 keepers
    ctl.send_signal(signal.SIGINT)
    assert ctl.wait(timeout=30) == 128 + signal.SIGINT
    assert not [pid for pid in pids if alive(pid)]
    assert summary(run_dir)["exit_code"] == 130


def test_a_crashing_worker_ends_the_job_with_a_clear_message(launcher, tmp_path: Path) -> None:
    script = tmp_path / "crash.py"
    script.write_text(
        textwrap.dedent("""
        import sys, time, leto
        job = leto.init()
        if job.rank == 1:
            sys.exit(3)
        time.sleep(60)
    """)
    )
    run_dir = tmp_path / "run"
    res = launcher.run(
        "run", "--workers", "3", "--spares", "1", "--run-dir", str(run_dir), str(script), run_dir=run_dir, timeout=60
    )
    assert res.returncode == 1
    assert "worker rank 1" in res.stdout and "exited with code 3" in res.stdout
    assert "before any state was protected" in res.stdout
    assert not [p["pid"] for p in read_procs(run_dir) if p["role"] != "controller" and alive(p["pid"])]


def test_the_job_exit_code_is_zero_when_all_workers_finish(launcher, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    res = launcher.run(
        "run",
        "--workers",
        "2",
        "--spares",
        "1",
        "--run-dir",
        str(run_dir),
        str(REPO / "examples" / "minimal.py"),
        "--steps",
        "30",
        run_dir=run_dir,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    # the example's own lines ("step 10 loss 5.6479"), not the console's ("step 1  loss ...  recoveries 0")
    losses = [
        float(m.group(1)) for line in res.stdout.splitlines() if (m := re.fullmatch(r"step \d+ loss ([0-9.]+)", line))
    ]
    assert losses[0] > 5 * losses[-1]  # the example's regression loss falls
    assert len(summary(run_dir)["digest"]) == 64
