"""A replacement host enters a running multi-host job (`--join`), and a host may wait for a lost
one as a standby (`--standby`).

The cheap checks run in CI: the flags and their one-line errors, and the admission protocol on one
etcd member (a joiner is admitted into a lost host's node and told its first command; one that
dies waiting is forgotten; a step that runs out its time fails with one line). The end-to-end job
on the namespace cluster (three hosts, one killed, a replacement joins, the job grows back to its
width with tier 2 restored, then survives the loss of another host with the failure-free digest)
takes minutes on 2 cores and runs with LETO_ALL_TESTS=1."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO, beyond_ci, leto_cmd, reference_digest, summary, wait_for, without_flags
from leto.cli import build_parser, main
from leto.config import JobConfig
from leto.control import join
from leto.control.lease import HostLease, Liveness
from leto.protocol import keys
from leto.protocol.messages import Admission, JoinRequest, Refusals
from leto.runtime.etcd_store import EtcdStore

RDZV = ("--rdzv", "etcd://127.0.0.1:2379", "--job-id", "j1")


# ----- the flags
@pytest.mark.parametrize("flag", ["--join", "--standby"])
def test_join_and_standby_need_a_rendezvous_and_say_so_in_one_line(flag: str, capsys) -> None:
    assert main(["run", flag, "train.py"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"leto run: error: {flag} is for a host of a multi-host job: it needs --rdzv and --job-id"


def test_join_and_resume_are_refused_together(tmp_path: Path, capsys) -> None:
    args = build_parser().parse_args(["train", *RDZV, "--join", "--resume", str(tmp_path)])
    from leto.cli import UsageError, _check_rdzv

    with pytest.raises(UsageError, match="--join enters a job that is running; --resume starts one"):
        _check_rdzv(args, "leto train")


def test_join_and_standby_reach_the_job_config_and_are_never_recorded_for_a_resume() -> None:
    from leto.cli import _ATTEMPT_ONLY, _config

    args = build_parser().parse_args(["train", *RDZV, "--join", "--standby"])
    r = _config(args, ["x"]).rendezvous
    assert (r.join, r.standby) == (True, True)
    assert JobConfig.from_json(_config(args, ["x"]).to_json()).rendezvous.join
    plain = _config(build_parser().parse_args(["train", *RDZV]), ["x"]).rendezvous
    assert (plain.join, plain.standby) == (False, False)
    assert {"join", "standby"} <= set(_ATTEMPT_ONLY)


# ----- admission, on one etcd member
@pytest.fixture(scope="module")
def etcd(tmp_path_factory) -> Iterator[tuple[str, int]]:
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (scripts/install.sh)")
    from test_etcd_store import _member

    with _member(tmp_path_factory.mktemp("etcd")) as (endpoint, _):
        yield endpoint


def _config(job_id: str, nodes: int = 3, timeout_s: float = 5.0) -> JobConfig:
    return JobConfig.from_dict(
        {
            "training": {"nodes": nodes, "workers": nodes},
            "rendezvous": {"url": "etcd://x:1", "job_id": job_id, "join": True},
            "timeouts": {"collective_s": timeout_s},
        }
    )


def _joiner(store: EtcdStore, cfg: JobConfig) -> tuple[HostLease, threading.Thread, dict]:
    """A joining host's lease and a thread waiting in `join.enter`; what it got lands in the dict."""
    lease, out = HostLease(store, 2), {}
    liveness = Liveness("127.0.0.1")

    def run() -> None:
        try:
            out["admission"] = join.enter(
                store, cfg, lease, "127.0.0.1", liveness, say=out.setdefault("said", []).append
            )
        except join.JoinError as e:
            out["error"] = str(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return lease, t, out


def test_a_joiner_is_admitted_into_a_lost_node_with_its_own_fence_and_first_command(etcd) -> None:
    store = EtcdStore([etcd], "join-admit", 5.0)
    cfg = _config("join-admit")
    store.set(keys.COORDINATOR, "0")
    for node in (0, 2):  # node 1's host was lost: its record is gone
        store.set(keys.host(node), "{}")
    lease, t, out = _joiner(store, cfg)
    wait_for(lambda: join.join_requests(store, Refusals()), 5, "the join request")
    [request] = join.join_requests(store, Refusals())
    assert request == JoinRequest("127.0.0.1", request.port, os.getpid(), lease.id)
    assert join.free_nodes(store, 3, Refusals()) == [1]
    record = join.admit(store, 1, request, first_command=17)
    t.join(5)
    assert out["admission"] == Admission(1, 17)
    value, _, bound_to = store.entry(keys.host(1))
    assert bound_to == lease.id and json.loads(value)["node"] == 1 and record is not None
    lease.close(revoke=True)  # the new host's lease ends: its record goes with it
    wait_for(lambda: store.value(keys.host(1)) is None, 5, "the record to go with the lease")


def test_a_joiner_that_dies_before_it_is_admitted_is_forgotten(etcd) -> None:
    store = EtcdStore([etcd], "join-dies", 5.0)
    store.set(keys.COORDINATOR, "0")
    lease, t, _ = _joiner(store, _config("join-dies"))
    wait_for(lambda: join.join_requests(store, Refusals()), 5, "the join request")
    [request] = join.join_requests(store, Refusals())
    lease.close(revoke=True)
    wait_for(lambda: not join.join_requests(store, Refusals()), 5, "the request to go with the lease")
    assert join.admit(store, 1, request, first_command=0) is None
    assert store.value(keys.host(1)) is None and store.value(keys.admission(request.lease)) is None
    store.set(keys.EXIT_CODE, "0")  # (the dead joiner's thread ends)
    t.join(5)


def test_a_full_job_keeps_a_joiner_as_a_standby_until_it_ends(etcd) -> None:
    store = EtcdStore([etcd], "join-standby", 5.0)
    store.set(keys.COORDINATOR, "0")
    for node in range(3):
        store.set(keys.host(node), "{}")
    lease, t, out = _joiner(store, _config("join-standby"))
    wait_for(lambda: out.get("said"), 5, "the standby line")
    assert out["said"] == ["leto: job 'join-standby' has its 3 hosts: this host waits as a standby until one is lost"]
    store.set(keys.EXIT_CODE, "0")
    t.join(5)
    assert out["admission"] is None and out["said"][-1] == "leto: job 'join-standby' ended before this host was needed"
    lease.close(revoke=True)


def test_a_join_step_that_runs_out_its_time_fails_with_one_line(etcd, monkeypatch) -> None:
    store = EtcdStore([etcd], "join-late", 5.0)
    monkeypatch.setattr(join, "FIND_S", 0.3)
    lease, t, out = _joiner(store, _config("join-late"))  # no job runs: nobody coordinates
    t.join(5)
    assert out["error"] == "no running job 'join-late' at etcd://x:1 within 0s (join find timeout)"
    store.set(keys.COORDINATOR, "0")  # a job with a free node (no host records) that admits no one
    monkeypatch.setattr(join, "ADMIT_MARGIN_S", -9.7)  # 2 x 5 s - 9.7 s
    lease2, t2, out2 = _joiner(store, _config("join-late"))
    t2.join(5)
    assert (
        out2["error"]
        == "job 'join-late' has a free node but did not admit this host within 0s (join admission timeout)"
    )
    lease.close(revoke=True)
    lease2.close(revoke=True)


@pytest.mark.parametrize("end", ["job-ends", "lease-lost"])
def test_a_standby_host_warms_its_processes_outside_the_job_and_stops_them_all_when_it_is_not_needed(
    etcd, tmp_path: Path, end: str
) -> None:
    """A real `leto train --standby` at a job whose three nodes have their hosts: it starts its fork
    server, keeper, zygote and shadow and writes nothing in the job but its join request. When the
    job ends it exits 0, and when its lease is lost 1; either way none of its processes is left,
    nor anything of its in /dev/shm."""
    job_id = f"warm-{end}-{os.getpid()}"
    store = EtcdStore([etcd], job_id, 5.0)
    store.set(keys.COORDINATOR, "0")
    for node in range(3):
        store.set(keys.host(node), "{}")
    rdzv = f"etcd://{etcd[0]}:{etcd[1]}"
    argv = leto_cmd("train", "--rdzv", rdzv, "--job-id", job_id, "--nodes", "3", "--workers", "3", "--spares", "1")
    argv += ["--steps", "3", "--run-dir", str(tmp_path / "run"), "--standby"]
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    with open(tmp_path / "err", "w") as err:
        host = subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
    try:
        # the host, its fork server, keeper, zygote and shadow
        wait_for(lambda: len(_descendants(host.pid)) >= 5, 60, "the standby's warm processes")
        wait_for(lambda: join.join_requests(store, Refusals()), 30, "the join request")
        procs = _descendants(host.pid)
        time.sleep(1.0)  # the warm processes build their models and wait
        written = set(store.under("").keys()) - {keys.COORDINATOR, *(keys.host(n) for n in range(3))}
        assert [k.startswith(keys.JOIN_PREFIX) for k in written] == [True], written
        if end == "job-ends":
            store.set(keys.EXIT_CODE, "0")
        else:
            [request] = join.join_requests(store, Refusals())
            store.revoke(request.lease)
        code = host.wait(timeout=60)
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
    assert code == (0 if end == "job-ends" else 1), (tmp_path / "err").read_text()[-2000:]
    wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in procs), 10, "the warm processes to end")
    assert not [f for f in os.listdir("/dev/shm") if job_id in f]


# ----- end to end, on the namespace cluster
STEPS = 120  # ~0.6 s each here: the join, the grow and the next loss all come before the end
NEW_ADDR = "10.77.0.4"  # the replacement machine: the cluster's fourth namespace, no etcd member
# no shadow: a host's loss shrinks the job to the two hosts left, and only the replacement's
# shadows can grow it back
JOB = ("--workers", "6", "--nodes", "3", "--spares", "0", "--steps", str(STEPS), "--seed", "0")


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [e for e in map(json.loads, path.read_text().splitlines()) if "event" in e]


def _descendants(pid: int) -> set[int]:
    """`pid` and every process below it."""
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        try:
            todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            pass
    return out


def _kill_leto(cluster, i: int) -> None:
    """SIGKILL every Leto process of host i (its etcd member lives on: the host is replaced by a
    new machine, the etcd cluster keeps its quorum), until none is left."""

    def gone() -> bool:
        left = [p for p in cluster.pids(i) if p not in cluster.etcd_pids()]
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return not left

    wait_for(gone, 10, f"host {i}'s Leto processes to die")


@beyond_ci
@pytest.mark.timeout(900)
@pytest.mark.parametrize("how", ["join", "standby"])
def test_a_replacement_host_joins_the_job_grows_back_and_the_next_host_loss_is_survived(
    tmp_path: Path, launcher, how: str
) -> None:
    """Three hosts, no shadow. A worker host's processes are SIGKILLed (its etcd member lives on):
    the job shrinks to four ranks on two hosts. A new machine (a fourth namespace, 10.77.0.4, no
    etcd member), started then with `--join` (or from the start with `--standby`), is admitted
    into the lost node (a new member: the old host's processes stay fenced), its shadows take the
    two missing ranks in one grow, and a `restored` event follows. Then another host is SIGKILLed
    with its etcd member, and the job still ends with the failure-free digest."""
    Cluster, reference, job_id, run_dir, env = _namespace_job(tmp_path, launcher, "join")
    argv = leto_cmd("train", "--rdzv", "", "--job-id", job_id, "--run-dir", str(run_dir), *JOB)
    with Cluster(hosts=3) as cluster:
        argv[argv.index("--rdzv") + 1] = cluster.rdzv
        hosts = {}
        for i in range(3):
            with open(f"{run_dir}.host{i}.out", "a") as out, open(f"{run_dir}.host{i}.err", "a") as err:
                hosts[i] = cluster.popen(i, argv, env=env, cwd=REPO, stdout=out, stderr=err)

        def new_host(flag: str) -> subprocess.Popen:
            """A new machine plugged in now, running the job's command with `flag`."""
            new = cluster.add_host()
            assert cluster.addr(new) == NEW_ADDR and new >= cluster.etcd_members
            return _host(cluster, new, [*argv, flag], env, f"{run_dir}.join")

        wait_for(lambda: any(r.get("step", -1) >= 3 for r in _steps(run_dir)), 180, "step 3")
        lead = int(
            cluster.etcdctl(0, "get", f"/leto/{job_id}/control/coordinator", "--print-value-only").stdout.strip()
        )
        node = (lead + 1) % 3
        victim = _host_of(cluster, run_dir, node)
        if how == "standby":
            joiner = new_host("--standby")
            wait_for(lambda: "waits as a standby" in Path(f"{run_dir}.join.err").read_text(), 60, "the standby")
        _kill_leto(cluster, victim)
        wait_for(lambda: any(e["event"] == "recovery" for e in _events(run_dir)), 60, "the shrink")
        t_join = time.time()
        if how == "join":
            joiner = new_host("--join")
        wait_for(lambda: any(e["event"] == "restored" for e in _events(run_dir)), 150, "the job restored")
        restored = next(e for e in _events(run_dir) if e["event"] == "restored")
        print(f"{how}: the shrink (or --join) to restored: {restored['time'] - t_join:.2f}s")
        other = next(i for i in range(3) if i not in (victim, _host_of(cluster, run_dir, lead)))
        cluster.kill_host(other)
        codes = {i: p.wait(timeout=240) for i, p in hosts.items() if i not in (victim, other)}
        joined = joiner.wait(timeout=60)
    errs = {i: Path(f"{run_dir}.host{i}.err").read_text()[-3000:] for i in codes}
    assert all(c == 0 for c in codes.values()) and joined == 0, (
        codes,
        joined,
        errs,
        Path(f"{run_dir}.join.err").read_text()[-3000:],
    )
    s = summary(run_dir)
    assert s["exit_code"] == 0 and s["digest"] == reference
    events = [
        e["event"]
        for e in _events(run_dir)
        if e["event"] in ("host_lost", "recovery", "host_joined", "resize", "restored")
    ]
    assert events[:5] == ["host_lost", "recovery", "host_joined", "resize", "restored"], events
    assert [(e["node"], e["addr"]) for e in s["hosts_joined"]] == [(node, NEW_ADDR)] and len(s["restored"]) == 1
    assert s["recoveries"][-1]["world_size"] == 4  # the second loss: shrunk again, no shadow
    assert "joined job" in Path(f"{run_dir}.join.err").read_text()


@beyond_ci
@pytest.mark.timeout(900)
def test_with_spares_a_standby_takes_the_lost_node_with_warm_spares_and_the_next_host_loss_never_shrinks(
    tmp_path: Path, launcher
) -> None:
    """Three hosts, one spare (zygotes fork the rest), and a standby (a new machine at 10.77.0.4)
    waiting from the start with its keeper, zygote and shadows warm. A worker host's processes are
    SIGKILLed: spares on the survivors adopt its ranks (the job stays at six), then the standby is
    admitted into the lost node, its warm processes (the same pids) bound to it: a keeper, a
    zygote and a spare. Then
    another worker host is SIGKILLed with its etcd member: no shrink again, the new node's spare
    among the adopters, and the failure-free digest."""
    Cluster, reference, job_id, run_dir, env = _namespace_job(tmp_path, launcher, "sjoin")
    with Cluster(hosts=3) as cluster:
        flags = ("--rdzv", cluster.rdzv, "--job-id", job_id, "--run-dir", str(run_dir))
        argv = leto_cmd("train", *flags, *without_flags(JOB, "spares"), "--spares", "1")
        hosts = {i: _host(cluster, i, argv, env, f"{run_dir}.host{i}") for i in range(3)}
        wait_for(lambda: any(r.get("step", -1) >= 3 for r in _steps(run_dir)), 180, "step 3")
        key = f"/leto/{job_id}/control/coordinator"
        lead = int(cluster.etcdctl(0, "get", key, "--print-value-only").stdout.strip())
        node = (lead + 1) % 3
        victim = _host_of(cluster, run_dir, node)
        joiner = _host(cluster, cluster.add_host(), [*argv, "--standby"], env, f"{run_dir}.join")  # a new machine
        wait_for(lambda: "waits as a standby" in Path(f"{run_dir}.join.err").read_text(), 60, "the standby")
        wait_for(lambda: len(_descendants(joiner.pid)) >= 6, 60, "the standby's warm processes")
        warm = _descendants(joiner.pid)
        _kill_leto(cluster, victim)
        wait_for(lambda: any(e["event"] == "host_joined" for e in _events(run_dir)), 90, "the admission")
        wait_for(lambda: {"keeper", "zygote", "shadow"} <= _roles(run_dir, node, warm), 30, "the new node's spare")
        new = [p for p in json.loads((run_dir / f"procs-host{node}.json").read_text()) if p["role"] != "controller"]
        other = next(i for i in range(3) if i not in (victim, _host_of(cluster, run_dir, lead)))
        cluster.kill_host(other)
        codes = {i: p.wait(timeout=240) for i, p in hosts.items() if i not in (victim, other)}
        joined = joiner.wait(timeout=60)
    assert all(c == 0 for c in codes.values()) and joined == 0, (codes, joined)
    s = summary(run_dir)
    assert s["exit_code"] == 0 and s["digest"] == reference
    assert [e["event"] for e in _events(run_dir) if e["event"] in ("recovery", "host_joined")] == [
        "recovery",
        "host_joined",
        "recovery",
    ]
    assert [r["world_size"] for r in s["recoveries"]] == [6, 6]  # never shrunk
    assert {p["pid"] for p in new} <= warm, (new, warm)  # the standby's warm processes, bound to the node
    adopters = set(s["recoveries"][-1]["adopted_by"].values())
    assert any(p["id"] in adopters for p in new if p["role"] == "shadow"), (adopters, new)


@beyond_ci
@pytest.mark.timeout(900)
def test_the_coordinators_host_lost_right_after_an_admission_is_taken_over_and_the_new_host_is_used(
    tmp_path: Path, launcher
) -> None:
    """Three hosts, no shadow. A worker host's processes are SIGKILLed: the job shrinks to four
    ranks. A new machine (10.77.0.4) joins, and the moment it is admitted (its shadows still
    starting, the grow not yet made) the coordinator's host is SIGKILLed with its etcd member.
    The next coordinator finds the admitted host (a `join_resumed` event: it asks for what the
    admission had not yet, nothing twice), nobody is admitted twice, the new host's shadows take
    the lost coordinator host's ranks, and the job ends with the failure-free digest on the two
    hosts left."""
    Cluster, reference, job_id, run_dir, env = _namespace_job(tmp_path, launcher, "tjoin")
    with Cluster(hosts=3) as cluster:
        argv = leto_cmd("train", "--rdzv", cluster.rdzv, "--job-id", job_id, "--run-dir", str(run_dir), *JOB)
        hosts = {i: _host(cluster, i, argv, env, f"{run_dir}.host{i}") for i in range(3)}
        wait_for(lambda: any(r.get("step", -1) >= 3 for r in _steps(run_dir)), 180, "step 3")
        key = f"/leto/{job_id}/control/coordinator"
        lead = int(cluster.etcdctl(0, "get", key, "--print-value-only").stdout.strip())
        lead_host, victim = _host_of(cluster, run_dir, lead), _host_of(cluster, run_dir, (lead + 1) % 3)
        _kill_leto(cluster, victim)
        wait_for(lambda: any(e["event"] == "recovery" for e in _events(run_dir)), 60, "the shrink")
        new = cluster.add_host()
        joiner = _host(cluster, new, [*argv, "--join"], env, f"{run_dir}.join")
        wait_for(lambda: any(e["event"] == "host_joined" for e in _events(run_dir)), 90, "the admission", every=0.01)
        cluster.kill_host(lead_host)
        grown_first = any(e["event"] == "resize" for e in _events(run_dir))
        survivor = next(i for i in range(3) if i not in (victim, lead_host))
        codes = {"survivor": hosts[survivor].wait(timeout=300), "joiner": joiner.wait(timeout=60)}
    logs = {n: Path(f"{run_dir}.{n}.err").read_text()[-3000:] for n in (f"host{survivor}", "join")}
    assert codes == {"survivor": 0, "joiner": 0}, (codes, logs)
    assert not grown_first, "the grow came before the coordinator's host was killed: nothing tested"
    s = summary(run_dir)
    assert s["exit_code"] == 0 and s["digest"] == reference
    events = [e for e in _events(run_dir) if e["event"] in ("host_joined", "takeover", "join_resumed", "recovery")]
    assert [e["event"] for e in events] == ["recovery", "host_joined", "takeover", "join_resumed", "recovery"], events
    assert events[3]["node"] == events[1]["node"] and set(events[3]["asked"]) <= {"keeper", "shadow"}, events[3]
    # the new node's two shadows (asked for by one coordinator or the other) took the lost ranks
    assert set(s["recoveries"][-1]["adopted_by"].values()) == set(events[3]["shadows"]), (s["recoveries"], events[3])
    assert len(events[3]["shadows"]) == 2


def _namespace_job(tmp_path: Path, launcher, name: str) -> tuple[type, str, str, Path, dict[str, str]]:
    """The namespace cluster's class (the test is skipped without one), the failure-free digest,
    and the job's id, run dir and environment."""
    from netns_cluster import Cluster, available

    if available() is not None:
        pytest.skip(f"no namespace cluster here: {available()}")
    reference = reference_digest(launcher, tmp_path, *without_flags(JOB, "spares"))
    return Cluster, reference, f"{name}{os.getpid()}", tmp_path / "run", dict(os.environ, PYTHONPATH=str(REPO / "src"))


def _host(cluster, i: int, argv: list[str], env: dict[str, str], logs: str) -> subprocess.Popen:
    """`argv` on namespace host i, its output in `logs`.out and .err."""
    with open(f"{logs}.out", "a") as out, open(f"{logs}.err", "a") as err:
        return cluster.popen(i, argv, env=env, cwd=REPO, stdout=out, stderr=err)


def _roles(run_dir: Path, node: int, supervisors: set[int]) -> set[str]:
    """The roles in node `node`'s process list, once one of `supervisors` wrote it (the lost
    host's list stays as it last wrote it)."""
    path = run_dir / f"procs-host{node}.json"
    try:
        procs = json.loads(path.read_text())
    except (OSError, ValueError):
        return set()
    if not any(p["role"] == "controller" and p["pid"] in supervisors for p in procs):
        return set()
    return {p["role"] for p in procs}


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "event" not in r]


def _host_of(cluster, run_dir: Path, node: int) -> int:
    """Which namespace runs node `node`: the one whose supervisor's pid it holds."""
    sup = next(p for p in json.loads((run_dir / f"procs-host{node}.json").read_text()) if p["role"] == "controller")
    return next(i for i in range(cluster.hosts) if sup["pid"] in cluster.pids(i))


# ----- the coordinator's side, on an in-memory store
class _Hosts:
    """One joiner asking for lost node 2; what was admitted."""

    def __init__(self) -> None:
        self.request = JoinRequest("10.0.0.9", 4000, 123, 77)
        self.admitted: list[tuple[int, int]] = []

    def up(self) -> list[int]:
        return [0, 1]

    def lost(self) -> dict:
        return {}

    def confirm(self) -> None:
        pass

    def joiners(self) -> list:
        return [] if self.admitted else [(2, self.request)]

    def admit(self, node: int, request: JoinRequest, first_command: int):
        from leto.protocol.messages import HostRecord

        self.admitted.append((node, first_command))
        return HostRecord(node, request.addr, request.port, request.pid, request.lease)

    def admissions(self, first_command: int) -> dict[int, int]:  # (a takeover's)
        return {}


def _coordinator(tmp_path: Path, hosts: _Hosts | None = None, ec: tuple[int, int] = (2, 1), spares: int = 0):
    """A coordinator of a 6-rank, 3-node job shrunk to 4 ranks on nodes 0 and 1 (node 2 lost)."""
    import torch.distributed as dist

    from leto.control.coordinator import Coordinator
    from leto.control.procs import ProcView
    from leto.protocol.messages import Membership

    cfg = JobConfig.from_dict(
        {
            "training": {"workers": 6, "nodes": 3},
            "protection": {"ec": list(ec)},
            "recovery": {"spares": spares},
            "run_dir": str(tmp_path),
            "quiet": True,
        }
    )
    store = dist.HashStore()
    store.add(keys.COMMANDS, 0)
    c = Coordinator(store, cfg, hosts=hosts)
    c.membership = Membership(1, (0, 0, 0, 1, 1, 1)[:4], tuple(f"worker{r}-{r}" for r in range(4)))
    c.members = {
        r: ProcView(p, "worker", r, n) for r, (p, n) in enumerate(zip(c.membership.proc_of_rank, (0, 0, 1, 1)))
    }
    c.procs.update({p.proc_id: p for p in c.members.values()})
    c.dead_keeper_nodes = {2}
    return c, store


def _commands(store) -> list[dict]:
    return [json.loads(store.get(keys.command(i))) for i in range(int(store.add(keys.COMMANDS, 0)))]


def test_a_join_during_a_recovery_waits_for_it_then_gets_a_keeper_and_a_shadow_per_missing_rank(tmp_path) -> None:
    hosts = _Hosts()
    c, store = _coordinator(tmp_path, hosts)
    c.pending = [object()]  # a recovery in progress
    c._maybe_admit()
    assert hosts.admitted == [] and _commands(store) == []
    c.pending = []
    c._maybe_admit()
    assert hosts.admitted == [(2, 0)]  # its commands start where the stream stood
    spawned = [(cmd["role"], cmd["node"]) for cmd in _commands(store) if cmd["kind"] == "spawn"]
    assert spawned == [("keeper", 2), ("shadow", 2), ("shadow", 2)]
    assert 2 not in c.dead_keeper_nodes
    assert [e["event"] for e in c.events] == ["host_joined"] and c.events[0]["node"] == 2


def test_with_spares_a_joiner_that_no_rank_is_missing_for_brings_spares_that_cover_the_next_host_loss(
    tmp_path,
) -> None:
    """Spares on the survivors adopted the lost host's ranks: the job runs all six on nodes 0 and 1.
    The joiner gets a keeper, a zygote and `--spares` shadows, none of them waited for by a grow;
    when node 1 is lost next, its ranks go to the new node's shadows first (node 1's own spares
    die with it)."""
    from leto.control.procs import ProcView
    from leto.protocol.messages import Membership

    hosts = _Hosts()
    c, store = _coordinator(tmp_path, hosts, spares=2)
    c.membership = Membership(1, (0, 0, 0, 1, 1, 1), tuple(f"worker{r}-{r}" for r in range(6)))
    c.members = {r: ProcView(p, "worker", r, r // 3) for r, p in enumerate(c.membership.proc_of_rank)}
    c.procs.update({p.proc_id: p for p in c.members.values()})
    c.procs["shadow-20"] = ProcView("shadow-20", "shadow", None, 1, pid=20)  # a survivor's spare
    c._maybe_admit()
    spawned = [(cmd["role"], cmd["node"]) for cmd in _commands(store) if cmd["kind"] == "spawn"]
    assert spawned == [("keeper", 2), ("zygote", 2), ("shadow", 2), ("shadow", 2)]
    assert c._joined_shadows == [] and 2 not in c.dead_keeper_nodes
    for p in c.procs.values():
        p.pid = p.pid or 100
    spares = c.spares.for_ranks(3, down={1}, cold_down={1})
    assert [s.node for s in spares] == [2, 2]  # two of node 1's three ranks; the third waits (shrink)


@pytest.mark.parametrize("ec", [(2, 1), (1, 2)])
def test_a_restored_event_follows_a_shrink_once_the_job_runs_its_ranks_with_the_code_it_asked_for(
    tmp_path, ec: tuple[int, int]
) -> None:
    """2+1 over three nodes fits as 1+1 over two (it still survives a node's loss); 1+2 does not."""
    from leto.protocol.messages import Membership

    c, _ = _coordinator(tmp_path, ec=ec)
    c.event("recovery", generation=1, world_size=4)
    c._note_restored(Membership(2, (0, 0, 1, 1, 2), tuple("abcde")))  # a rank short
    assert [e["event"] for e in c.events] == ["recovery"]
    c._note_restored(Membership(2, (0, 0, 1, 1, 0, 1), tuple("abcdef")))  # full width over two nodes
    assert [e["event"] for e in c.events] == ["recovery"] + (["restored"] if ec == (2, 1) else [])
    c._note_restored(Membership(3, (0, 0, 1, 1, 2, 2), tuple("abcdef")))
    assert [e["event"] for e in c.events] == ["recovery", "restored"]  # once per loss
    nodes = 2 if ec == (2, 1) else 3
    assert (
        c.events[-1]["what"]
        == f"6 ranks over {nodes} nodes, tier 2 {ec[0]}+{ec[1]} survives {ec[1]} node loss(es) again"
    )
    s = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [e["event"] for e in s] == ["recovery", "restored"]


def test_no_restored_event_without_a_loss_before_it(tmp_path) -> None:
    from leto.protocol.messages import Membership

    c, _ = _coordinator(tmp_path)
    c._note_restored(Membership(2, (0, 0, 1, 1, 2, 2), tuple("abcdef")))
    assert c.events == []


def test_a_lost_host_that_holds_no_rank_costs_no_recovery(tmp_path) -> None:
    from leto.control.procs import ProcView

    c, _ = _coordinator(tmp_path)
    c.procs["keeper-9"] = ProcView("keeper-9", "keeper", None, 2, pid=5)  # the joined host's, not grown onto
    c.procs["shadow-10"] = ProcView("shadow-10", "shadow", None, 2, pid=6)
    c.dead_keeper_nodes = set()
    c._on_lost_hosts({2: ("its supervisor's connection closed", time.time())})
    assert c._take_failures() == []
    assert not c.procs["keeper-9"].alive and not c.procs["shadow-10"].alive and 2 in c.dead_keeper_nodes
    c._on_lost_hosts({1: ("its supervisor's connection closed", time.time())})  # one with ranks: a recovery
    assert sorted(p.rank for p, _ in c._take_failures()) == [2, 3]


# ----- the coordinator lost between an admission and the grow
class _Successor(_Hosts):
    """The hosts as the next coordinator finds them: node 2's joiner admitted at `first`."""

    def __init__(self, first: int) -> None:
        super().__init__()
        self.first = first

    def joiners(self) -> list:
        return []

    def admissions(self, first_command: int) -> dict[int, int]:
        return {2: self.first}


def _shrunk_then_admitted(tmp_path: Path, spawns: bool):
    """A 6-rank job on 3 nodes whose node 2 was lost (shrunk to 4 ranks), then node 2's joiner
    admitted: its keeper and shadows asked for (`spawns`) or not yet. The store, the admission's
    first command and the stream as the next coordinator reads it."""
    import torch.distributed as dist

    from leto.control.coordinator import Coordinator

    cfg = JobConfig.from_dict(
        {"training": {"workers": 6, "nodes": 3}, "recovery": {"spares": 0}, "run_dir": str(tmp_path), "quiet": True}
    )
    store = dist.HashStore()
    old = Coordinator(store, cfg, hosts=_Hosts())
    old.start()
    for n in range(3):
        store.set(keys.committed(0, n), "1")
    old._on_lost_hosts({2: ("its supervisor's connection closed", time.time())})
    assert old._on_failures(old._take_failures()) is None and len(old.members) == 4
    old.pending = []  # the shrink's first step came
    first = int(store.add(keys.COMMANDS, 0))
    if spawns:
        old._maybe_admit()
    old.release()  # the coordinator's host is lost here
    commands = {keys.command(i): store.get(keys.command(i)) for i in range(int(store.add(keys.COMMANDS, 0)))}
    return cfg, store, first, commands


@pytest.mark.parametrize("spawns", [True, False], ids=["spawns-written", "admission-only"])
def test_a_coordinator_lost_between_an_admission_and_the_grow_is_succeeded_by_one_that_grows_onto_the_new_host(
    tmp_path: Path, spawns: bool
) -> None:
    """The next coordinator finds node 2's admitted host: the processes the lost host had there
    are dead (commands before the admission's first), node 2 is live, what the admission had not
    asked for yet (its keeper and two shadows) is asked for once, and the grow waits for exactly
    those shadows, then takes them for ranks 4 and 5. Nothing is admitted twice."""
    from leto.control.coordinator import Coordinator

    cfg, store, first, commands = _shrunk_then_admitted(tmp_path, spawns)
    hosts = _Successor(first)
    new = Coordinator(store, cfg, hosts=hosts)
    new.restore(commands, {})
    before = [p for p in new.procs.values() if p.node == 2 and int(p.proc_id.rsplit("-", 1)[1]) <= 9]
    assert before and not any(p.alive for p in before)  # generation 0's worker4, worker5, keeper of node 2
    assert 2 not in new.dead_keeper_nodes and new.membership.generation == 1
    spawned = [(c["role"], c["node"]) for c in _commands(store)[first:] if c["kind"] == "spawn"]
    assert spawned == [("keeper", 2), ("shadow", 2), ("shadow", 2)]  # by one coordinator or the other
    [resumed] = [e for e in new.events if e["event"] == "join_resumed"]
    assert resumed["node"] == 2 and resumed["first_command"] == first
    assert resumed["asked"] == ([] if spawns else ["keeper", "shadow", "shadow"])
    shadows = [p for p in new.procs.values() if p.node == 2 and p.role == "shadow"]
    assert sorted(resumed["shadows"]) == sorted(p.proc_id for p in shadows)
    assert sorted(new._joined_shadows) == sorted(p.proc_id for p in shadows) and len(shadows) == 2
    for i, p in enumerate(new.procs.values()):
        p.pid = p.pid or 100 + i
    store.set(keys.warm(shadows[0].proc_id), "1")
    new._maybe_grow()
    assert new.membership.generation == 1  # one shadow is not warm yet: the grow waits for both
    store.set(keys.warm(shadows[1].proc_id), "1")
    new._last_grow_check = 0.0
    new._maybe_grow()
    assert new.membership.generation == 2 and new.membership.node_of_rank[4:] == (2, 2)
    assert set(new.membership.proc_of_rank[4:]) == {p.proc_id for p in shadows}
    new._maybe_admit()
    assert hosts.admitted == []
    new.release()


def test_a_takeover_with_no_admitted_host_leaves_a_lost_node_lost(tmp_path: Path) -> None:
    from leto.control.coordinator import Coordinator

    cfg, store, _, commands = _shrunk_then_admitted(tmp_path, spawns=False)
    new = Coordinator(store, cfg, hosts=_Hosts())
    new.restore(commands, {})
    assert new.dead_keeper_nodes == {2} and new._joined_shadows == []
    assert not [e for e in new.events if e["event"] == "join_resumed"]
    new.release()


def test_the_next_coordinator_finds_the_admitted_hosts_and_writes_an_admission_its_predecessor_did_not(
    etcd,
) -> None:
    """On etcd: node 0 a host of the job's start (no join request), node 1 a joiner admitted at
    command 7, node 2 a joiner whose record was created but not its admission (the coordinator
    was lost between the two): it is admitted now at the stream's length, bound to its lease, and
    its waiting `join.enter` returns it. An admission that names another node is refused."""
    from leto.control import takeover
    from leto.protocol.messages import HostRecord

    store = EtcdStore([etcd], "join-takeover", 5.0)
    store.set(keys.COORDINATOR, "0")
    leases = [HostLease(store, 5) for _ in range(4)]  # (node 2's is the joiner's own, below)
    records = {n: HostRecord(n, "127.0.0.1", 4000 + n, 100 + n, leases[n].id) for n in range(3)}
    for n, rec in records.items():
        store.create(keys.host(n), rec.to_json(), rec.lease)
    request = JoinRequest("127.0.0.1", 4001, 101, leases[1].id)
    store.create(keys.join_request(leases[1].id), request.to_json(), leases[1].id)
    store.create(keys.admission(leases[1].id), Admission(1, 7).to_json(), leases[1].id)
    joiner, t, out = _joiner(store, _config("join-takeover"))
    wait_for(lambda: join.join_requests(store, Refusals()), 5, "the join request")
    [waiting] = join.join_requests(store, Refusals())
    records[2] = HostRecord(2, "127.0.0.1", waiting.port, waiting.pid, waiting.lease)
    store.delete_key(keys.host(2))
    store.create(keys.host(2), records[2].to_json(), waiting.lease)
    refused = Refusals()
    assert takeover.admissions(store, records, 12, refused) == {1: 7, 2: 12}
    t.join(5)
    assert out["admission"] == Admission(2, 12)
    assert store.entry(keys.admission(waiting.lease))[2] == waiting.lease
    assert takeover.admissions(store, records, 30, refused) == {1: 7, 2: 12}  # written once
    records[3] = HostRecord(3, "127.0.0.1", 4003, 103, leases[3].id)
    store.create(keys.admission(leases[3].id), Admission(0, 1).to_json(), leases[3].id)
    assert takeover.admissions(store, records, 30, refused) == {1: 7, 2: 12}
    for lease in [*leases, joiner]:
        lease.close(revoke=True)
