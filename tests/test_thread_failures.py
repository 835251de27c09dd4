"""A background thread that cannot go on ends its process at once, with exit code
THREAD_FAILED and one line naming the thread and the error, so the job recovers from it like
from any failure, instead of the process being fenced much later as hung (or never). And a
keeper whose peer goes silent says so within the job's timeout, not an hour later.

The failures are real exceptions raised inside the real threads of a real job
(`LETO_TEST_FAIL_THREAD`, runtime/threads.py), once the test creates the file it names."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from conftest import events, processes_left, read_procs, reference_digest, step_records, wait_for
from leto.protection import dataplane
from leto.runtime.threads import FAIL_ENV, THREAD_FAILED

JOB = ("--workers", "4", "--nodes", "2", "--spares", "1", "--seed", "0", "--steps", "14")


def _start(launcher, run_dir: Path, *extra: str, fail: dict | None = None):
    """`leto train` the job; returns its process once step 4 is recorded."""
    env = dict(os.environ, **({FAIL_ENV: json.dumps(fail)} if fail else {}))
    ctl = launcher.start("train", "--run-dir", str(run_dir), *JOB, *extra, run_dir=run_dir, env=env)
    wait_for(
        lambda: (
            ctl.poll() is not None
            or ((run_dir / "metrics.jsonl").exists() and any(r["step"] >= 4 for r in step_records(run_dir)))
        ),
        120,
        "step 4",
    )
    assert ctl.poll() is None, ctl.communicate()[1][-3000:]
    return ctl


def _proc(run_dir: Path, role: str, **match: int) -> dict:
    return next(p for p in read_procs(run_dir) if p["role"] == role and all(p[k] == v for k, v in match.items()))


def _finish(ctl, run_dir: Path, digest: str, pid: int) -> tuple[str, dict, dict]:
    """Once the job has ended with the failure-free digest and left no process behind: its
    stderr, its summary and the failure event of the process `pid`."""
    out, err = ctl.communicate(timeout=240)
    assert ctl.returncode == 0, out[-2000:] + err[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["digest"] == digest and not processes_left(run_dir)
    (failure,) = [f for f in events(run_dir, "failure") if f["pid"] == pid]
    return err, s, failure


@pytest.mark.parametrize("thread", ["leto-heartbeat", "leto-watch"])
def test_a_worker_thread_that_fails_ends_its_process_and_the_job_recovers(
    launcher, tmp_path: Path, thread: str
) -> None:
    """Rank 1's heartbeat thread (or its generation watch) raises. With a heartbeat timeout of
    10 minutes nothing but the process's own exit can bring the recovery in time."""
    digest = reference_digest(launcher, tmp_path, *JOB)
    run_dir, now = tmp_path / "run", tmp_path / "fail-now"
    ctl = _start(
        launcher,
        run_dir,
        "--heartbeat-timeout",
        "600",
        fail={"thread": thread, "role": "worker", "rank": 1, "when": str(now)},
    )
    victim = _proc(run_dir, "worker", rank=1)
    now.touch()
    err, s, failure = _finish(ctl, run_dir, digest, victim["pid"])
    assert failure["cause"] == f"exited with code {THREAD_FAILED}"
    assert [r["failed_ranks"] for r in s["recoveries"]] == [[1]]
    said = [line for line in err.splitlines() if " failed: " in line and "thread" in line]
    assert said == [f"leto: worker {victim['id']} thread {thread} failed: InjectedFailure"]


def test_a_keeper_receiver_that_fails_ends_the_keeper_and_nothing_waits_for_it(
    launcher, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node 0's keeper's tier-2 receiver raises while it folds a batch: the keeper ends at once,
    a new one takes its place, and the recovery loses no rank (no worker sat out a commit
    wait or a drain on the broken keeper). The Python data plane's receiver: the native one's
    threads raise nothing (a fault there ends the keeper's process, as a SIGKILL does)."""
    monkeypatch.setenv(dataplane.ENV_DATA_PLANE, "python")
    digest = reference_digest(launcher, tmp_path, *JOB)
    run_dir, now = tmp_path / "run", tmp_path / "fail-now"
    ctl = _start(launcher, run_dir, fail={"thread": "keeper-recv", "role": "keeper", "node": 0, "when": str(now)})
    victim = _proc(run_dir, "keeper", node=0)
    now.touch()
    err, s, failure = _finish(ctl, run_dir, digest, victim["pid"])
    assert failure["cause"] == f"exited with code {THREAD_FAILED}"
    assert [(r["failed_ranks"], r["tier"]) for r in s["recoveries"]] == [([], "none")]
    assert re.search(
        rf"^leto: keeper {re.escape(victim['id'])} thread keeper-recv-1 failed: InjectedFailure$", err, re.M
    ), err[-3000:]


def test_a_silent_keeper_peer_is_reported_within_the_jobs_timeout(launcher, tmp_path: Path) -> None:
    """Node 1's keeper is SIGSTOPped. Its peer's tier-2 waits run out the job's timeout (5 s,
    --timeout), and node 0's keeper says so, before the heartbeat timeout (7 s) fences the
    stopped keeper; the job then goes on with a new keeper for node 1."""
    digest = reference_digest(launcher, tmp_path, *JOB)
    run_dir = tmp_path / "run"
    ctl = _start(launcher, run_dir, "--timeout", "5", "--heartbeat-timeout", "7")
    stopped = _proc(run_dir, "keeper", node=1)
    os.kill(stopped["pid"], signal.SIGSTOP)
    err, s, failure = _finish(ctl, run_dir, digest, stopped["pid"])
    assert "stopped heartbeating" in failure["cause"]
    assert [(r["failed_ranks"], r["tier"]) for r in s["recoveries"]] == [([], "none")]
    assert re.search(
        r"^leto: keeper of node 0: a tier-2 wait of generation \d+ ran out its timeout of 5s ", err, re.M
    ), err[-3000:]
