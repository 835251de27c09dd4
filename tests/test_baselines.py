"""Checkpoint-restart baselines: a SIGKILLed worker, a restart with fresh processes, the same digest.

Real processes throughout: the restart supervisor (`python -m leto.baselines.restart`) runs as a
subprocess, and the test kills a worker from outside, by PID, with `leto.baselines.faults`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO, Launcher, alive, read_procs, summary, wait_for
from leto.baselines.ckpt_job import MemoryCheckpointer, steps_between
from leto.baselines.faults import ExternalInjector, kill_at_step
from leto.runtime.runlog import write_procs

STEPS = 12
CONFIG = ("--workers", "2", "--nodes", "1", "--steps", str(STEPS), "--seed", "5")
RUN_TIMEOUT_S = 120


def start_baseline(lx: Launcher, run_dir: Path, *args: str) -> subprocess.Popen:
    """Start the restart supervisor; output goes to a file (a full pipe would block it)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        popen = subprocess.Popen(
            [sys.executable, "-m", "leto.baselines.restart", *CONFIG, "--quiet", "--run-dir", str(run_dir), *args],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    lx.started.append((popen, run_dir))
    return popen


def finish(popen: subprocess.Popen, run_dir: Path) -> dict:
    try:
        code = popen.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"baseline did not finish in {RUN_TIMEOUT_S}s; see {run_dir}.log")
    log = (run_dir.parent / f"{run_dir.name}.log").read_text()
    assert code == 0, log[-3000:]
    return summary(run_dir)


def attempt_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def no_job_process_alive(run_dir: Path, recs: list[dict]) -> bool:
    pids = {p["pid"] for p in read_procs(run_dir) if p["role"] != "controller"}
    pids |= {r["pid"] for r in recs if r.get("event") == "failure"}
    return not [pid for pid in pids if alive(pid)]


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    path = Path("/dev/shm") / f"leto-test-{uuid.uuid4().hex[:12]}"
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A failure-free checkpoint-restart run of the test config (checkpoints every 4 steps)."""
    lx = Launcher(tmp_path_factory.mktemp("reference"))
    try:
        run_dir = lx.tmp / "run"
        return finish(start_baseline(lx, run_dir, "--ckpt-every", "4"), run_dir)
    finally:
        lx.cleanup()


def test_failure_free_baseline_is_the_built_in_job(reference: dict, launcher: Launcher, tmp_path: Path) -> None:
    assert reference["steps"] == STEPS and reference["restarts"] == 0 and reference["recoveries"] == []
    assert reference["ckpt"]["saves"] == 2  # steps 4 and 8; none at the last step
    run_dir = tmp_path / "train"
    res = launcher.run(
        "train", *CONFIG, "--spares", "0", "--protection", "off", "--run-dir", str(run_dir), run_dir=run_dir
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert summary(run_dir)["digest"] == reference["digest"]


def test_checkpoint_restart_after_sigkill_ends_with_the_failure_free_digest(
    reference: dict, launcher: Launcher, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    popen = start_baseline(launcher, run_dir, "--system", "checkpoint-restart", "--ckpt-every", "4")
    killed_at = kill_at_step(run_dir, rank=1, step=6, timeout_s=60)
    assert killed_at <= time.time()
    s = finish(popen, run_dir)
    assert s["digest"] == reference["digest"] and s["steps"] == STEPS
    assert s["restarts"] == 1 and s["system"] == "checkpoint-restart"
    (rec,) = s["recoveries"]
    assert "rank 1" in rec["cause"] and "SIGKILL" in rec["cause"]
    assert rec["failed_at_step"] in (6, 7) and rec["restored_step"] == 4
    assert rec["lost_steps"] == rec["failed_at_step"] - 4
    for key in ("restart_s", "restore_s", "first_step_s", "total_s"):
        assert rec[key] is not None and rec[key] >= 0, key
    assert rec["first_step_s"] > rec["restart_s"] and rec["total_s"] >= rec["first_step_s"]
    recs = attempt_records(run_dir)
    assert [r["step"] for r in recs if "event" not in r and r["attempt"] == 1][:1] == [5]  # resumed after 4
    kinds = [r.get("event") for r in recs]
    assert {"failure", "attempt_start", "restore", "ckpt_save"} <= set(kinds)
    assert no_job_process_alive(run_dir, recs)


def test_memory_restart_after_sigkill_ends_with_the_failure_free_digest(
    reference: dict, launcher: Launcher, tmp_path: Path, shm_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    popen = start_baseline(launcher, run_dir, "--system", "memory-restart", "--ckpt-dir", str(shm_dir))
    kill_at_step(run_dir, rank=0, step=6, timeout_s=60)
    s = finish(popen, run_dir)
    assert s["digest"] == reference["digest"] and s["restarts"] == 1
    (rec,) = s["recoveries"]
    assert "rank 0" in rec["cause"]
    # every step is checkpointed: at most the step the killed rank had not yet copied is lost
    assert rec["failed_at_step"] - rec["restored_step"] in (0, 1) and rec["lost_steps"] <= 1
    # and every step was saved: recorded, or (killed between its commit marker and its record) restored from
    recs = attempt_records(run_dir)
    saved = {r["step"] for r in recs if r.get("event") == "ckpt_save"} | {rec["restored_step"]}
    assert s["ckpt"]["every"] == 1 and saved >= set(range(1, STEPS + 1))
    assert no_job_process_alive(run_dir, recs)


def test_a_torn_memory_checkpoint_is_not_loaded(
    reference: dict, launcher: Launcher, tmp_path: Path, shm_dir: Path
) -> None:
    first = tmp_path / "first"
    finish(start_baseline(launcher, first, "--system", "memory-restart", "--ckpt-dir", str(shm_dir)), first)
    # rank 1's copy of the last step was "torn": its bytes are garbage and its commit marker is missing
    markers = {json.loads(p.read_text())["step"]: p for p in shm_dir.glob("rank1.slot*.commit")}
    assert sorted(markers) == [STEPS - 1, STEPS]
    torn = markers[STEPS]
    torn.unlink()
    data = torn.with_name(torn.name.removesuffix(".commit"))
    data.write_bytes(os.urandom(data.stat().st_size))
    again = tmp_path / "again"
    s = finish(start_baseline(launcher, again, "--system", "memory-restart", "--ckpt-dir", str(shm_dir)), again)
    restores = [r for r in attempt_records(again) if r.get("event") == "restore"]
    assert [r["step"] for r in restores] == [STEPS - 1]  # the step both ranks committed, not the torn one
    assert s["digest"] == reference["digest"]


def test_torchft_survivors_go_on_after_a_sigkill(launcher: Launcher, tmp_path: Path) -> None:
    run_dir, steps = tmp_path / "run", 40  # long enough for the replacement to start and heal
    popen = start_baseline(launcher, run_dir, "--system", "torchft", "--steps", str(steps))
    kill_at_step(run_dir, rank=1, step=5, timeout_s=60)
    s = finish(popen, run_dir)
    assert s["steps"] == steps and s["restarts"] == 1
    assert s["replicas_finished"] == 2 and s["replicas_agree"]  # the healed replacement holds the survivor's state
    (rec,) = s["recoveries"]
    assert rec["failed_at_step"] >= 5 and rec["lost_steps"] == 0  # no committed step is lost
    assert rec["first_step_s"] is not None and rec["rejoin_s"] is not None
    assert not [p["pid"] for p in read_procs(run_dir) if p["role"] != "controller" and alive(p["pid"])]


def test_memory_commit_markers_guard_every_slot(tmp_path: Path) -> None:
    nbytes, fp = 48, "abc"
    for slot, step in ((0, 8), (1, 9)):
        path = MemoryCheckpointer.slot_path(tmp_path, 3, slot)
        path.write_bytes(bytes(nbytes))
        path.with_name(path.name + ".commit").write_text(
            json.dumps({"step": step, "slot": slot, "nbytes": nbytes, "fingerprint": fp})
        )
    assert MemoryCheckpointer.committed(tmp_path, 3, fp, nbytes) == {8: 0, 9: 1}
    assert MemoryCheckpointer.committed(tmp_path, 3, "another job", nbytes) == {}
    MemoryCheckpointer.slot_path(tmp_path, 3, 1).write_bytes(bytes(nbytes // 2))  # short data
    assert MemoryCheckpointer.committed(tmp_path, 3, fp, nbytes) == {8: 0}
    (tmp_path / "rank3.slot0.commit").write_text('{"step": 8, "slot"')  # torn marker
    assert MemoryCheckpointer.committed(tmp_path, 3, fp, nbytes) == {}


def test_steps_between() -> None:
    assert steps_between(6.0, 0.1) == 60 and steps_between(0.0, 0.1) == 1


def _fake_job(tmp_path: Path) -> tuple[Path, list[subprocess.Popen]]:
    """A run folder with procs.json naming sleeping processes: worker ranks 0-1 on node 0, 2 on node 1."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(4)]
    roles = [("worker", 0, 0), ("worker", 1, 0), ("worker", 2, 1), ("shadow", None, 1)]
    records = [{"role": "controller", "rank": None, "node": None, "pid": os.getpid()}]
    records += [{"role": role, "rank": rank, "node": node, "pid": p.pid} for (role, rank, node), p in zip(roles, procs)]
    write_procs(run_dir, records)  # as a job writes it: each pid with its start time
    return run_dir, procs


def test_kill_at_step_signals_only_its_target_by_pid(tmp_path: Path) -> None:
    run_dir, procs = _fake_job(tmp_path)
    try:
        metrics = run_dir / "metrics.jsonl"
        with ExternalInjector(
            run_dir, [{"kind": "kill", "rank": 1, "step": 3}, {"kind": "node-kill", "node": 1, "step": 5}]
        ) as inj:
            for step in range(1, 7):
                with open(metrics, "a") as f:
                    f.write(json.dumps({"step": step, "time": time.time()}) + "\n")
                time.sleep(0.1)
                if step == 3:
                    wait_for(lambda: procs[1].poll() is not None, 5, "rank 1 to die")
                    assert procs[0].poll() is None and procs[2].poll() is None
            wait_for(lambda: len(inj.kills) == 2, 5, "both injections")
        assert procs[1].returncode == -signal.SIGKILL
        assert procs[2].wait(5) == -signal.SIGKILL and procs[3].wait(5) == -signal.SIGKILL
        assert procs[0].poll() is None  # a worker of node 0 that nobody targeted
        assert sorted(k.step for k in inj.kills) == [3, 5] and not inj.errors
        with pytest.raises(TimeoutError):
            kill_at_step(run_dir, rank=0, step=99, timeout_s=0.3)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
