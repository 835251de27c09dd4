"""Values read from the store are checked before they are used. A client of the job's store (the
address procs.json publishes) writes hostile values: a forked shadow's pid of -1, of "abc", of a
process that is not the job's (a `sleep` of this test), and the heartbeat "nan" of a hung worker.
The job refuses each with a line naming the key, signals and reaps nothing it did not start,
fences the hung worker in time and ends with the failure-free digest. Processes named in
procs.json are signalled only while their pid and start time both match."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from conftest import alive, events, read_procs, reference_digest, step_records, wait_for
from leto.baselines.faults import inject_at_step
from leto.protocol import keys
from leto.runtime import linux
from leto.runtime.runlog import write_procs

JOB = (
    "--workers",
    "4",
    "--nodes",
    "2",
    "--spares",
    "1",
    "--seed",
    "0",
    "--steps",
    "14",
)  # test_supervision's reference


def _proc(run_dir: Path, role: str, rank: int) -> dict:
    return wait_for(
        lambda: next((p for p in read_procs(run_dir) if p["role"] == role and p["rank"] == rank), None),
        30,
        f"{role} {rank} in procs.json",
    )


def _recovered(run_dir: Path, n: int, ctl: subprocess.Popen) -> None:
    wait_for(lambda: len(events(run_dir, "recovery")) >= n or ctl.poll() is not None, 120, f"recovery {n}")
    assert ctl.poll() is None, f"the job ended before recovery {n}: {ctl.communicate()[1][-3000:]}"


def _client(run_dir: Path) -> dist.TCPStore:
    """A client of the job's store, at the address procs.json publishes."""
    addr = next(p for p in read_procs(run_dir) if p["role"] == "controller")["store"]
    host, port = addr.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))


def test_hostile_store_values_are_refused_and_touch_nothing_outside_the_job(launcher, tmp_path: Path) -> None:
    digest = reference_digest(launcher, tmp_path, *JOB)
    bystander = subprocess.Popen(["sleep", "600"])  # not the job's: it must outlive the job
    try:
        run_dir = tmp_path / "run"
        ctl = launcher.start("train", "--run-dir", str(run_dir), *JOB, "--heartbeat-timeout", "1.5", run_dir=run_dir)
        wait_for(
            lambda: ctl.poll() is not None or ((run_dir / "metrics.jsonl").exists() and step_records(run_dir)),
            120,
            "the first step",
        )
        store = _client(run_dir)
        # each recovery forks a shadow from the node's zygote, named by the next process number:
        # its pid is set to a hostile value before the zygote writes the real one
        hostile = ("-1", "abc", str(bystander.pid))
        for n, value in enumerate(hostile, 1):
            seq = store.add(keys.PROC_SEQ, 0)
            for k in range(seq + 1, seq + 4):
                store.set(keys.forked(f"shadow-{k}"), value)
            os.kill(_proc(run_dir, "worker", 1)["pid"], signal.SIGKILL)
            _recovered(run_dir, n, ctl)
        # a worker hangs (SIGSTOP) while its heartbeat key reads "nan" with a progress count that moves
        hung = _proc(run_dir, "worker", 2)
        os.kill(hung["pid"], signal.SIGSTOP)
        deadline, i = time.monotonic() + 60, 0
        while len(events(run_dir, "recovery")) < 4 and ctl.poll() is None and time.monotonic() < deadline:
            i += 1
            store.set(keys.heartbeat(hung["id"]), f"nan {i}")
            time.sleep(0.02)
        out, err = ctl.communicate(timeout=240)
        assert ctl.returncode == 0, out[-2000:] + err[-3000:]
        s = json.loads((run_dir / "summary.json").read_text())
        assert s["digest"] == digest
        assert [r["failed_ranks"] for r in s["recoveries"]] == [[1], [1], [1], [2]]
        assert "stopped heartbeating" in s["recoveries"][3]["cause"]
        refused = [line for line in err.splitlines() if line.startswith("leto: ignored a malformed value of ")]
        assert any("control/forked/shadow-" in line and "-1 is below 1" in line for line in refused), err[-3000:]
        assert any("control/forked/shadow-" in line and "'abc' is not an integer" in line for line in refused)
        assert any(f"pid {bystander.pid} is not a child of this supervisor" in line for line in refused)
        assert any(f"control/hb/{hung['id']}" in line and "not a finite number" in line for line in refused)
        assert bystander.poll() is None and alive(bystander.pid)  # neither signalled nor reaped
    finally:
        bystander.kill()
        bystander.wait()


def test_a_reused_pid_in_procs_json_is_never_signalled(tmp_path: Path) -> None:
    """procs.json names rank 1's worker by a pid that now belongs to another process (its start
    time differs): the fault injector, which kills by procs.json, leaves it alone; the same record
    with the right start time is killed."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 5, "time": time.time()}) + "\n")
        start = linux.start_time(other.pid)
        assert start is not None
        stale = str(int(start) - 1)  # the process that had this pid before
        write_procs(tmp_path, [{"role": "worker", "rank": 1, "node": 0, "pid": other.pid, "start": stale, "id": "w"}])
        try:
            inject_at_step(tmp_path, rank=1, step=5, timeout_s=1.0, since=0.0)
            raise AssertionError("a reused pid was signalled")
        except TimeoutError:
            pass
        assert other.poll() is None
        write_procs(tmp_path, [{"role": "worker", "rank": 1, "node": 0, "pid": other.pid, "id": "w"}])
        assert json.loads((tmp_path / "procs.json").read_text())[0]["start"] == start  # recorded when written
        kill = inject_at_step(tmp_path, rank=1, step=5, timeout_s=10.0, since=0.0)
        assert kill.pids == [other.pid] and other.wait(timeout=10) == -signal.SIGKILL
    finally:
        other.kill()
        other.wait()


def test_the_supervisor_signals_only_the_process_it_adopted(tmp_path: Path) -> None:
    """A supervisor's handle whose pid now names another process (start time changed) sends it
    nothing: not at a stop, not at a fence."""
    from leto.control.supervisor import Proc, _kill, _signal_quietly

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        proc = Proc("worker", 0, 0, "worker0-1", child, start="1")  # adopted as another process
        _signal_quietly(proc, signal.SIGTERM)
        assert _kill(proc, 0.2) == -signal.SIGKILL and child.poll() is None  # not sent: reported as stuck
        proc = Proc("worker", 0, 0, "worker0-1", child)  # its own start time
        assert _kill(proc, 10.0) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()
