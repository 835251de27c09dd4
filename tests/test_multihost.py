"""A multi-host job on a cluster of network namespaces (tests/netns_cluster.py): three hosts, one
etcd member and one `leto train --rdzv` each, 2 workers per host, tier 2 across hosts. Every
fault is real (SIGKILL of a host's processes, a cut link, SIGSTOP of a whole host, etcd members
killed) and every job that goes on ends with the failure-free digest."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO, beyond_ci, leto_cmd, reference_digest, summary, wait_for, without_flags
from netns_cluster import Cluster, available

pytestmark = pytest.mark.skipif(available() is not None, reason=f"no namespace cluster here: {available()}")

STEPS = 10
# one warm shadow (on node 0) for a host's two ranks: every host loss needs a shadow forked from a
# surviving host's zygote during the recovery
JOB = ("--workers", "6", "--nodes", "3", "--spares", "1", "--steps", str(STEPS), "--seed", "0")
JOB_ID = ""  # a new one per job (`cluster`): ids are never reused
_JOBS = itertools.count()
# CI runs six of these jobs, ~15-30 s each on 2 cores: a worker host and the coordinator's host
# killed (a whole host's processes and its etcd member SIGKILLed; the fence, the takeover, a shadow
# forked on a survivor, tier 2 across hosts), a cut link, a frozen host, the coordinator's host cut
# off, and etcd below quorum. The failure-free job (which every other test's digest check covers)
# runs with LETO_ALL_TESTS=1 (conftest.beyond_ci), and so does the pipeline job (12 workers, ~135 s).


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    """Three hosts with one etcd member each; afterwards nothing of the job is left in /dev/shm
    (a killed host's keeper segments stay there, as on a real host, until a later start on that
    host removes them)."""
    global JOB_ID
    JOB_ID = f"mh{os.getpid()}-{next(_JOBS)}"
    try:
        with Cluster(hosts=3) as c:
            yield c
    finally:
        for leftover in Path("/dev/shm").glob(f"leto-{JOB_ID}-*"):
            leftover.unlink()


def start(cluster: Cluster, run_dir: Path, *extra: str, job_id: str = "") -> list[subprocess.Popen]:
    """The same `leto train --rdzv ...` on every host; host i's output goes to RUN_DIR.host{i}.*"""
    argv = leto_cmd(
        "train", "--rdzv", cluster.rdzv, "--job-id", job_id or JOB_ID, "--run-dir", str(run_dir), *JOB, *extra
    )
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    hosts = []
    for i in range(3):
        with open(f"{run_dir}.host{i}.out", "a") as out, open(f"{run_dir}.host{i}.err", "a") as err:
            hosts.append(cluster.popen(i, argv, env=env, cwd=REPO, stdout=out, stderr=err))
    return hosts


def finish(hosts: list[subprocess.Popen], run_dir: Path, timeout: float = 240) -> list[tuple[int, str]]:
    """Every host's exit code and stderr."""
    codes = [p.wait(timeout=timeout) for p in hosts]
    return [(code, Path(f"{run_dir}.host{i}.err").read_text()) for i, code in enumerate(codes)]


def failed(results: list[tuple[int, str]], victim: int | None = None) -> str:
    """The surviving hosts that did not exit 0: index, exit code and the end of their stderr."""
    return "\n".join(
        f"host {i} exited {code}:\n{err[-3000:]}" for i, (code, err) in enumerate(results) if code != 0 and i != victim
    )


def at_step(run_dir: Path, step: int, timeout: float = 180) -> None:
    def reached() -> bool:
        path = run_dir / "metrics.jsonl"
        return path.exists() and any(json.loads(line).get("step", -1) >= step for line in path.read_text().splitlines())

    wait_for(reached, timeout, f"step {step}")


def coordinator(cluster: Cluster) -> int:
    """The node (= host index: the hosts join in order here only by chance, so it is looked up)
    of the elected coordinator, and the host that is that node."""
    got = cluster.etcdctl(0, "get", f"/leto/{JOB_ID}/control/coordinator", "--print-value-only")
    return int(got.stdout.strip())


def host_of(cluster: Cluster, run_dir: Path, node: int) -> int:
    """Which namespace runs node `node`: the one whose supervisor's pid it holds."""
    sup = next(p for p in json.loads((run_dir / f"procs-host{node}.json").read_text()) if p["role"] == "controller")
    return next(i for i in range(3) if sup["pid"] in cluster.pids(i))


@pytest.fixture
def reference(launcher, tmp_path_factory) -> str:
    # spares change nothing
    return reference_digest(launcher, tmp_path_factory.mktemp("ref"), *without_flags(JOB, "spares"))


def _recovered(cluster: Cluster, run_dir: Path, node: int, reference: str) -> dict:
    """One recovery of node `node` at full strength, a shadow forked for it, the failure-free digest."""
    s = summary(run_dir)
    assert s["exit_code"] == 0 and s["digest"] == reference
    rec = s["recoveries"][0]
    assert rec["failed_nodes"] == [node] and rec["world_size"] == 6 and rec["tier"] == "tier2", rec
    survivor = next(i for i in range(3) if cluster.etcd_healthy(i))
    forked = [
        p
        for p in rec["adopted_by"].values()
        if cluster.etcdctl(survivor, "get", f"/leto/{JOB_ID}/control/forked/{p}", "--print-value-only").stdout.strip()
    ]
    assert forked, rec["adopted_by"]
    return rec


@beyond_ci
def test_three_hosts_train_to_the_single_host_digest_and_leave_nothing_behind(
    cluster: Cluster, tmp_path: Path, reference: str
) -> None:
    results = finish(start(cluster, tmp_path / "run"), tmp_path / "run")
    assert [code for code, _ in results] == [0, 0, 0], failed(results)
    s = summary(tmp_path / "run")
    assert s["digest"] == reference and s["steps"] == STEPS and s["recoveries"] == []
    assert [p for i in range(3) for p in cluster.pids(i) if p not in cluster.etcd_pids()] == []
    assert not list(Path("/dev/shm").glob(f"leto-{JOB_ID}-*"))


@pytest.mark.parametrize("which", ["worker_host", "coordinator_host"])
def test_sigkill_of_every_process_of_a_host_and_its_etcd_member(
    cluster: Cluster, tmp_path: Path, reference: str, which: str
) -> None:
    run_dir = tmp_path / "run"
    hosts = start(cluster, run_dir)
    at_step(run_dir, 4)
    lead = coordinator(cluster)
    # the coordinator's host keeps etcd's leader (only its loss waits for an etcd election)
    wait_for(lambda: cluster.etcd_leader() == host_of(cluster, run_dir, lead), 10, "the coordinator's member to lead")
    node = lead if which == "coordinator_host" else (lead + 1) % 3
    victim = host_of(cluster, run_dir, node)
    cluster.kill_host(victim)
    results = finish(hosts, run_dir)
    assert results[victim][0] != 0
    assert all(code == 0 for i, (code, _) in enumerate(results) if i != victim), failed(results, victim)
    _recovered(cluster, run_dir, node, reference)
    if which == "coordinator_host":
        events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert any(e.get("event") == "takeover" for e in events)


TP = ("--tp", "2", "--persist", "off")  # each host holds one TP group (a model replica)


def _kill_a_worker_host(cluster: Cluster, tmp_path: Path, *flags: str) -> tuple[Path, int]:
    """Run the job with `flags`, SIGKILL a worker host (not the coordinator's) at step 4 with its
    etcd member, and wait for the others to finish with code 0; the run folder and the lost node."""
    run_dir = tmp_path / "run"
    hosts = start(cluster, run_dir, *flags)
    at_step(run_dir, 4)
    node = (coordinator(cluster) + 1) % 3
    victim = host_of(cluster, run_dir, node)
    cluster.kill_host(victim)
    results = finish(hosts, run_dir)
    assert all(code == 0 for i, (code, _) in enumerate(results) if i != victim), failed(results, victim)
    return run_dir, node


def test_a_tensor_parallel_job_survives_the_sigkill_of_a_host(cluster: Cluster, tmp_path: Path, launcher) -> None:
    """TP 2 x DP 3 over three hosts: a worker host's processes and its etcd member are SIGKILLed,
    taking a whole TP group; shadows on the survivors adopt both of its ranks, and the job ends
    with the failure-free digest of the same layout."""
    reference = reference_digest(launcher, tmp_path, *without_flags(JOB, "spares"), *TP)
    run_dir, node = _kill_a_worker_host(cluster, tmp_path, *TP)
    rec = _recovered(cluster, run_dir, node, reference)
    assert sorted(rec["failed_ranks"]) == [2 * node, 2 * node + 1]


def test_a_tensor_parallel_job_with_no_shadow_shrinks_across_hosts_to_the_failure_free_digest(
    cluster: Cluster, tmp_path: Path, launcher
) -> None:
    """TP 2 x DP 3 over three hosts with no shadow: a worker host is SIGKILLed with its etcd
    member, the job goes on with two of its three replicas' processes, one rank of each slice
    hosting two of the launch's replicas (a member twice of the group of replicas, joined
    through two etcd clients), and still ends with the failure-free digest."""
    reference = reference_digest(launcher, tmp_path, *without_flags(JOB, "spares"), *TP)
    run_dir, node = _kill_a_worker_host(cluster, tmp_path, *TP, "--spares", "0")
    s = summary(run_dir)
    assert s["exit_code"] == 0 and s["digest"] == reference
    rec = s["recoveries"][0]
    assert rec["world_size"] == 4 and sorted(rec["failed_ranks"]) == [2 * node, 2 * node + 1], rec


# TP 2 x PP 2 x DP 3: each host holds one pipeline (two stages of a TP pair each); each stage's DP
# group spans the three hosts
PP = ("--workers", "12", "--tp", "2", "--pp", "2", "--microbatches", "2", "--persist", "off")


@beyond_ci
def test_a_pipeline_job_survives_the_sigkill_of_a_host(cluster: Cluster, tmp_path: Path, launcher) -> None:
    """TP 2 x PP 2 x DP 3 over three hosts: a worker host's processes and its etcd member are
    SIGKILLed, taking a whole pipeline (both stages); shadows on the survivors, one warm and the
    others forked during the recovery, build and adopt its four ranks, their shards decoded from
    tier 2 across hosts, and the job ends with the failure-free digest of the same layout."""
    reference = reference_digest(launcher, tmp_path, *without_flags(JOB, "spares"), *PP)
    run_dir, node = _kill_a_worker_host(cluster, tmp_path, *PP)
    s = summary(run_dir)
    assert s["exit_code"] == 0 and s["digest"] == reference
    rec = s["recoveries"][0]
    assert sorted(rec["failed_ranks"]) == list(range(4 * node, 4 * node + 4)), rec
    assert rec["failed_nodes"] == [node] and rec["world_size"] == 12 and rec["tier"] == "tier2", rec


@pytest.mark.parametrize("fault", ["cut_link", "freeze"])
def test_a_host_cut_off_or_frozen_is_fenced_and_never_comes_back(
    cluster: Cluster, tmp_path: Path, reference: str, fault: str
) -> None:
    """The host's lease expires: the others go on without it; when it comes back, its supervisor
    finds its lease gone and stops its processes (whose writes etcd refuses by then)."""
    run_dir = tmp_path / "run"
    hosts = start(cluster, run_dir)
    at_step(run_dir, 4)
    node = (coordinator(cluster) + 1) % 3
    victim = host_of(cluster, run_dir, node)
    if fault == "cut_link":
        cluster.cut_link(victim)
    else:
        cluster.freeze_host(victim)
    wait_for(lambda: "host_lost" in (run_dir / "metrics.jsonl").read_text(), 30, "the host declared lost")
    if fault == "cut_link":
        cluster.restore_link(victim)
    else:
        cluster.thaw_host(victim)
    results = finish(hosts, run_dir)
    code, err = results[victim]
    assert code == 1 and "leaves the job" in err and "lease" in err, err[-2000:]
    assert all(c == 0 for i, (c, _) in enumerate(results) if i != victim), failed(results, victim)
    _recovered(cluster, run_dir, node, reference)


def test_a_cut_off_coordinator_is_replaced_and_takes_no_host_out_when_its_link_returns(
    cluster: Cluster, tmp_path: Path, reference: str
) -> None:
    """The coordinator's host (which holds etcd's leader too) is cut off: the others hear no lease
    refresh from it, fence it out, elect a new coordinator and recover its ranks. Cut off, it hears
    from no one, and judges no one: when the link returns, it leaves, and the others finish."""
    run_dir = tmp_path / "run"
    hosts = start(cluster, run_dir)
    at_step(run_dir, 4)
    lead = coordinator(cluster)
    victim = host_of(cluster, run_dir, lead)
    wait_for(lambda: cluster.etcd_leader() == victim, 10, "the coordinator's member to lead")
    cluster.cut_link(victim)
    wait_for(lambda: "takeover" in (run_dir / "metrics.jsonl").read_text(), 30, "another host to take over")
    cluster.restore_link(victim)
    results = finish(hosts, run_dir)
    code, err = results[victim]
    assert code == 1 and "leaves the job" in err, err[-2000:]
    assert all(c == 0 for i, (c, _) in enumerate(results) if i != victim), failed(results, victim)
    _recovered(cluster, run_dir, lead, reference)
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e["node"] for e in events if e.get("event") == "host_lost"] == [lead]


def test_etcd_below_quorum_stops_the_job_and_its_checkpoints_resume_it_on_the_same_hosts(
    cluster: Cluster, tmp_path: Path, reference: str
) -> None:
    run_dir = tmp_path / "run"
    hosts = start(cluster, run_dir, "--persist", "on", "--persist-every", "4")
    at_step(run_dir, 9)
    cluster.kill_etcd(1)
    cluster.kill_etcd(2)
    results = finish(hosts, run_dir, timeout=60)
    assert all(code == 1 and "leaves the job" in err for code, err in results), [e[-2000:] for _, e in results]
    # etcd back, the same hosts resume the run under a new job id (ids are never reused)
    cluster.start_etcd(1)
    cluster.start_etcd(2)
    cluster.wait_healthy()
    results = finish(
        start(
            cluster,
            run_dir,
            "--resume",
            str(run_dir),
            "--persist",
            "on",
            "--persist-every",
            "4",
            job_id=f"{JOB_ID}-resumed",
        ),
        run_dir,
    )
    assert [code for code, _ in results] == [0, 0, 0], failed(results)
    s = summary(run_dir)
    assert s["digest"] == reference and s["resumed_from_step"] >= 8
