"""An error local to one host takes only that host out. On the namespace cluster of
test_multihost (three hosts, one etcd member each), the coordinator's host finds its procs file
replaced by a folder, so its controller's next write of it raises an OSError that is no disk's
doing. That host is fenced out like a lost host (its processes killed, its lease ended), never
with the job-wide shutdown key; another host takes over as coordinator, reading a metrics.jsonl
that ends in a torn line (an appender that died mid-write), and the job ends on the other two
hosts with the failure-free digest. A one-host job stops on such an error with one line, its
processes stopped, its summary written."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

import test_multihost as mh
from conftest import JOB, Launcher, alive, read_procs, summary, wait_for
from leto.console import read_jsonl
from netns_cluster import Cluster, available
from test_multihost import cluster, coordinator, failed, finish, host_of, reference, start  # noqa: F401 (fixtures)

TORN = b'{"event": "failure", "role": "wor\xe2\x82\n'  # cut inside a field and inside a UTF-8 character


def at_step(run_dir: Path, step: int, timeout: float = 180) -> None:
    wait_for(
        lambda: any(r.get("step", -1) >= step for r in read_jsonl(run_dir / "metrics.jsonl") if "event" not in r),
        timeout,
        f"step {step}",
    )


def shutdown_set(cluster: Cluster, survivor: int) -> bool:
    got = cluster.etcdctl(survivor, "get", f"/leto/{mh.JOB_ID}/control/shutdown", "--print-value-only")
    return bool(got.stdout.strip())


@pytest.mark.skipif(available() is not None, reason=f"no namespace cluster here: {available()}")
def test_an_unexpected_error_of_the_coordinators_host_takes_out_that_host_alone(
    cluster: Cluster, tmp_path: Path, reference: str
) -> None:
    run_dir = tmp_path / "run"
    hosts = start(cluster, run_dir)
    at_step(run_dir, 3)
    node = coordinator(cluster)
    victim = host_of(cluster, run_dir, node)
    procs_file = run_dir / f"procs-host{node}.json"
    zygote = next(p["pid"] for p in json.loads(procs_file.read_text()) if p["role"] == "zygote")
    with open(run_dir / "metrics.jsonl", "ab") as f:
        f.write(TORN)
    procs_file.unlink()
    procs_file.mkdir()  # the host's next write of its procs file raises IsADirectoryError
    os.kill(zygote, signal.SIGKILL)  # its exit is written to the procs file
    assert hosts[victim].wait(timeout=60) == 1
    survivor = next(i for i in range(3) if i != victim)
    others = [p for i, p in enumerate(hosts) if i != victim]
    assert all(p.poll() is None for p in others), "the job ended with the host"
    assert not shutdown_set(cluster, survivor), "one host's error stopped the job"
    results = finish(hosts, run_dir)
    code, err = results[victim]
    assert "leaves the job: unexpected error: IsADirectoryError" in err, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert all(c == 0 for i, (c, _) in enumerate(results) if i != victim), failed(results, victim)
    s = summary(run_dir)
    assert s["exit_code"] == 0 and s["digest"] == reference, s
    assert [r["failed_nodes"] for r in s["recoveries"]] == [[node]], s["recoveries"]
    events = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "event" in r]
    assert [e["node"] for e in events if e["event"] == "host_lost"] == [node]
    assert any(e["event"] == "takeover" for e in events)


def test_an_unexpected_error_of_a_one_host_job_stops_it_with_one_line(launcher: Launcher, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    popen = launcher.start("train", "--run-dir", str(run_dir), *JOB, run_dir=run_dir)
    at_step(run_dir, 2)
    procs = read_procs(run_dir)
    (run_dir / "procs.json").unlink()
    (run_dir / "procs.json").mkdir()  # the supervisor's next write of it raises IsADirectoryError
    try:
        os.kill(next(p["pid"] for p in procs if p["role"] == "zygote"), signal.SIGKILL)
        out, err = popen.communicate(timeout=120)
    finally:
        (run_dir / "procs.json").rmdir()  # (the launcher's clean-up reads the file)
        (run_dir / "procs.json").write_text(json.dumps(procs))
    assert popen.returncode == 1, err[-3000:]
    assert "stopping the job after an unexpected error in its controller: IsADirectoryError" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert [p["pid"] for p in procs if p["role"] != "controller" and alive(p["pid"])] == []
    assert summary(run_dir)["exit_code"] == 1
