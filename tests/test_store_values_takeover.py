"""Values a new coordinator reads at a takeover are checked before they are used. On the
namespace cluster of test_multihost, a client of the job's etcd writes hostile values under the
job's keys while it trains: a job state that is not JSON, a supervisor report past the report
counter that says SIGTERM (taken as written, the new coordinator would stop the job), a command
that is not one, a command key that is not numbered, a host record of a node the job does not
have. Then the coordinator's host is killed. The new coordinator refuses each value with one line
naming its key, takes over from the plans and streams as they are, and the job ends on the other
two hosts with the failure-free digest. In a one-host job, a malformed drain of the running
generation (which keepers once crashed on, one replacement after another) and a malformed
checkpoint schedule are ignored the same way: no keeper fails, the checkpoints go on, the digest
is the failure-free one. The store messages' own checks are specified here too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import test_multihost as mh
from conftest import JOB, Launcher, read_procs, reference_digest, summary, wait_for
from leto.errors import BadValue
from leto.protocol import keys
from leto.protocol.messages import JobResult, PersistSchedule, SupervisorReport
from netns_cluster import Cluster, available
from test_host_errors import at_step
from test_multihost import cluster, coordinator, failed, finish, host_of, reference, start  # noqa: F401 (fixtures)
from test_store_values import _client

HOSTILE = {
    keys.JOB_STATE: "{not json",
    keys.sup_report(999_999): SupervisorReport(signal=15).to_json(),
    keys.command(999_999): json.dumps({"kind": "spawn", "proc_id": "../../x", "role": "worker", "node": 0}),
    f"{keys.COMMAND_PREFIX}abc": "{}",
    keys.host(7): json.dumps({"node": 7, "addr": "10.0.0.1", "port": 1, "pid": 1, "lease": 1}),
}


@pytest.mark.skipif(available() is not None, reason=f"no namespace cluster here: {available()}")
def test_a_takeover_refuses_hostile_values_and_the_job_ends_with_the_failure_free_digest(
    cluster: Cluster, tmp_path: Path, reference: str
) -> None:
    run_dir = tmp_path / "run"
    hosts = start(cluster, run_dir)
    # written once the coordinator has started the job (its job state is out), while the workers
    # start: a job of 10 short steps would be over before a few etcdctl runs were
    wait_for(lambda: _get(cluster, keys.JOB_STATE), 120, "the job state")
    node = coordinator(cluster)
    wait_for(lambda: _host_of(cluster, run_dir, node) is not None, 30, "the coordinator's supervisor")
    victim = host_of(cluster, run_dir, node)
    survivor = next(i for i in range(3) if i != victim)
    for key, value in HOSTILE.items():
        assert cluster.etcdctl(survivor, "put", f"/leto/{mh.JOB_ID}/{key}", value).returncode == 0
    at_step(run_dir, 2)
    cluster.kill_host(victim)
    results = finish(hosts, run_dir)
    assert all(code == 0 for i, (code, _) in enumerate(results) if i != victim), failed(results, victim)
    s = summary(run_dir)
    assert s["exit_code"] == 0 and s["digest"] == reference, s
    assert [r["failed_nodes"] for r in s["recoveries"]] == [[node]], s["recoveries"]
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "takeover" for e in events)
    new = next(
        i
        for i, (_, err) in enumerate(results)
        if i != victim and "took over as coordinator" in Path(f"{run_dir}.host{i}.out").read_text() + err
    )
    err = results[new][1]
    for key in HOSTILE:
        assert f"ignored a malformed value of {key}:" in err, (key, err[-3000:])
        # said once by each reader (the supervisor reads the job state too), not every round
        assert err.count(f"malformed value of {key}:") <= 2, err[-3000:]
    assert "Traceback" not in "".join(e for _, e in results)


def _get(cluster: Cluster, key: str) -> str:
    return cluster.etcdctl(0, "get", f"/leto/{mh.JOB_ID}/{key}", "--print-value-only").stdout.strip()


def _host_of(cluster: Cluster, run_dir: Path, node: int) -> int | None:
    """The namespace of node `node`, None until its supervisor's procs file names it."""
    try:
        return host_of(cluster, run_dir, node)
    except (FileNotFoundError, StopIteration, json.JSONDecodeError):
        return None


def test_a_malformed_drain_and_checkpoint_schedule_are_ignored_in_a_one_host_job(
    launcher: Launcher, tmp_path: Path
) -> None:
    digest = reference_digest(launcher, tmp_path, *JOB)
    run_dir = tmp_path / "run"
    ctl = launcher.start("train", "--run-dir", str(run_dir), *JOB, "--persist", "on", run_dir=run_dir)
    wait_for(
        lambda: ctl.poll() is not None or any(p["role"] == "controller" for p in read_procs(run_dir)),
        60,
        "the job's store",
    )
    store = _client(run_dir)
    hostile = {keys.drain(0): "{", keys.PERSIST_EVERY: PersistSchedule(0, 1).to_json()}
    for key, value in hostile.items():
        store.set(key, value)
    out, err = ctl.communicate(timeout=240)
    assert ctl.returncode == 0, err[-3000:]
    for key in hostile:
        assert f"ignored a malformed value of {key}:" in err, (key, err[-3000:])
    s = summary(run_dir)
    assert s["digest"] == digest and s["recoveries"] == [], s
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not [e for e in events if e.get("event") == "failure"], "a keeper failed on the drain"
    assert [e for e in events if e.get("event") == "persist_interval"], "no checkpoint schedule was chosen"
    assert "Traceback" not in err, err[-3000:]


def test_store_messages_refuse_values_no_writer_writes() -> None:
    assert PersistSchedule.from_json(PersistSchedule(4, 10).to_json()) == PersistSchedule(4, 10)
    assert JobResult.from_json(JobResult(5, float("nan"), "ab").to_json()).steps == 5  # a diverged loss is data
    for cls, value, why in [
        (PersistSchedule, '{"every": 0, "first": 3}', "not positive"),
        (PersistSchedule, '{"every": 2.5, "first": 3}', "not int"),
        (PersistSchedule, '{"every": 2, "first": -1}', "negative"),
        (JobResult, '{"steps": 3, "final_loss": 1.0, "digest": 7}', "not str"),
        (JobResult, "[1, 2]", "not an object"),
    ]:
        with pytest.raises(BadValue, match=why) as e:
            cls.from_json(value, keys.PERSIST_EVERY)
        assert e.value.key == keys.PERSIST_EVERY
