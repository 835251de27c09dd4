"""What listens, and where: a one-host job listens on loopback only (every socket of every one of
its processes), so that no one on the network can reach its store; a multi-host job's processes
listen only on the job's network address (and loopback); a supervisor's liveness port serves the
coordinator's watcher however many idle connections are held open to it."""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import JOB, REPO, leto_cmd, read_procs, reference_digest, wait_for
from leto.control.lease import BEAT_S, HELLO_TIMEOUT_S, MAX_PENDING, LivenessWatch
from netns_cluster import Cluster, available, netns_pids

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
needs_netns = pytest.mark.skipif(available() is not None, reason=f"no namespace cluster here: {available()}")


# ----- what a process listens on, from /proc (its own network namespace's tables)
def _address(field: str) -> tuple[str, int]:
    """An address of /proc/net/tcp{,6} ("0100007F:1F90"): host-order 32-bit words in hex."""
    hexip, hexport = field.split(":")
    raw = bytes.fromhex(hexip)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, words), int(hexport, 16)


def listening(pid: int) -> set[tuple[str, int]]:
    """The addresses the TCP sockets that process `pid` holds listen on (empty once it is gone)."""
    try:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
        rows = []
        for table in ("tcp", "tcp6"):
            with open(f"/proc/{pid}/net/{table}") as f:
                rows += [line.split() for line in f.readlines()[1:]]
    except OSError:  # it exited meanwhile
        return set()
    return {_address(row[1]) for row in rows if row[3] == "0A" and row[9] in inodes}  # 0A: LISTEN


def _watch_listeners(pids: list[int], seen: dict[int, set[tuple[str, int]]]) -> None:
    for pid in pids:
        seen.setdefault(pid, set()).update(listening(pid))


# ----- a one-host job in a namespace with a network
@pytest.fixture
def host() -> Iterator[tuple[Cluster, int]]:
    """Two namespaces on one bridge: the job's host (10.77.0.1), and a stranger on its network
    (10.77.0.2). In the job's namespace the host name resolves to 10.77.0.1 (`ip netns exec`
    puts /etc/netns/NS/hosts in place of /etc/hosts), as on a host of a real network: a process
    that binds the address its host name resolves to (gloo's default) is reachable."""
    with Cluster(hosts=2, etcd=False) as c:
        etc = Path("/etc/netns") / c.ns(0)
        made_root = not etc.parent.exists()
        etc.mkdir(parents=True)
        try:
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{c.addr(0)} {socket.gethostname()}\n")
            yield c, 0
        finally:
            shutil.rmtree(etc, ignore_errors=True)
            if made_root:
                shutil.rmtree(etc.parent, ignore_errors=True)


# A stranger on the job host's network: it connects to the store's port (read from stdin) at the
# host's network address, and then tries to stop the job through it (the shutdown key).
STRANGER = """
import socket, sys
from datetime import timedelta
import torch.distributed as dist
from leto.protocol import keys
print("ready", flush=True)
addr, port = sys.stdin.readline().split()
try:
    socket.create_connection((addr, int(port)), timeout=3).close()
    print("connected", flush=True)
except OSError as e:
    print("connect:", type(e).__name__, flush=True)
try:
    store = dist.TCPStore(addr, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=3))
    store.set(keys.SHUTDOWN, "1")
    print("wrote", flush=True)
except Exception as e:
    print("write:", type(e).__name__, flush=True)
"""


@needs_netns
def test_a_one_host_job_listens_on_loopback_only_and_a_stranger_cannot_stop_it(host, launcher, tmp_path: Path) -> None:
    cluster, me = host
    digest = reference_digest(launcher, tmp_path, *JOB)
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    stranger = cluster.popen(
        1, [sys.executable, "-c", STRANGER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    with open(tmp_path / "job.out", "w") as out, open(tmp_path / "job.err", "w") as err:
        job = cluster.popen(
            me, leto_cmd("train", "--run-dir", str(run_dir), *JOB), env=env, cwd=REPO, stdout=out, stderr=err
        )
    try:
        assert stranger.stdout.readline().strip() == "ready"
        procs = wait_for(lambda: read_procs(run_dir), 120, "procs.json")
        store_port = procs[0]["store"].rsplit(":", 1)[1]
        seen: dict[int, set[tuple[str, int]]] = {}
        roles: dict[int, str] = {}
        stranger.stdin.write(f"{cluster.addr(me)} {store_port}\n")
        stranger.stdin.flush()
        while job.poll() is None:  # every process of the namespace, the fork server's included
            _watch_listeners(netns_pids(cluster.ns(me)), seen)
            roles.update({p["pid"]: p["role"] for p in read_procs(run_dir)})
            time.sleep(0.05)
        told = stranger.communicate(timeout=60)[0]
        assert job.returncode == 0, (tmp_path / "job.err").read_text()[-3000:]
    finally:
        for p in (job, stranger):
            if p.poll() is None:
                p.kill()
                p.wait()
    connect, write = told.splitlines()[:2]
    assert connect == "connect: ConnectionRefusedError" and write.startswith("write:"), told  # not "wrote"
    assert json.loads((run_dir / "summary.json").read_text())["digest"] == digest
    outside = [(roles.get(pid, "?"), pid, a) for pid, addrs in seen.items() for a in addrs if a[0] not in LOOPBACK]
    assert not outside, f"listening beyond loopback: {list(outside)}"
    # what was seen: the store, and a gloo listener in every worker and keeper
    assert ("127.0.0.1", int(store_port)) in set().union(*seen.values())
    gloo = {pid for pid, addrs in seen.items() if addrs and roles.get(pid) in ("worker", "keeper")}
    assert len(gloo) >= 6, {pid: (roles.get(pid), a) for pid, a in seen.items()}


# ----- a multi-host host's listeners
HOST_PART = """
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from leto.control.lease import Liveness
from leto.runtime.env import loopback_store, network_env
addr = sys.argv[1]
live = Liveness(addr)
host_store = loopback_store(10)
os.environ.update(network_env(addr))  # what run_host gives its children
pg = dist.ProcessGroupGloo(dist.PrefixStore("g", host_store), 0, 1, timedelta(seconds=10))
pg.allreduce([torch.ones(1)]).wait()
print(live.port, host_store.port, flush=True)
time.sleep(60)
"""


@needs_netns
def test_a_hosts_listeners_are_on_the_jobs_network_address_or_loopback() -> None:
    """The liveness socket and gloo (as `run_host` sets them up) listen on the address given for
    the job's network, the host's own store on loopback: a stranger reaches the liveness port
    only, and nothing listens on every interface."""
    with Cluster(hosts=2, etcd=False) as c:
        env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
        part = c.popen(0, [sys.executable, "-c", HOST_PART, c.addr(0)], env=env, stdout=subprocess.PIPE, text=True)
        live_port, store_port = map(int, part.stdout.readline().split())
        addrs = listening(part.pid)
        assert {a for a, _ in addrs} == {c.addr(0), "127.0.0.1"}, addrs
        assert (c.addr(0), live_port) in addrs and ("127.0.0.1", store_port) in addrs
        assert len([p for a, p in addrs if a == c.addr(0)]) >= 2  # the liveness socket and gloo's

        def reach(port: int) -> bool:
            probe = "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()"
            return c.run_in(1, [sys.executable, "-c", probe, c.addr(0), str(port)], timeout=20).returncode == 0

        assert reach(live_port) and not reach(store_port)


@needs_netns
def test_a_multi_host_jobs_processes_listen_on_the_jobs_network_address_or_loopback(tmp_path: Path) -> None:
    """Two hosts, one etcd member each, one `leto train --rdzv` each: every socket that any
    process of the job listens on (supervisors, fork servers, workers, keepers, zygotes) is bound
    to its host's address on the job's network or to 127.0.0.1; nothing to every interface."""
    with Cluster(hosts=2) as c:
        run_dir = tmp_path / "run"
        argv = leto_cmd(
            "train",
            "--rdzv",
            c.rdzv,
            "--job-id",
            f"listen{os.getpid()}",
            "--run-dir",
            str(run_dir),
            "--workers",
            "2",
            "--nodes",
            "2",
            "--spares",
            "0",
            "--steps",
            "10",
            "--seed",
            "0",
        )
        env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
        hosts = []
        for i in range(2):
            with open(tmp_path / f"host{i}.err", "w") as err:
                hosts.append(c.popen(i, argv, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err))
        seen: list[dict[int, set[tuple[str, int]]]] = [{}, {}]
        deadline = time.monotonic() + 240
        while any(h.poll() is None for h in hosts) and time.monotonic() < deadline:
            for i in range(2):
                _watch_listeners([p for p in c.pids(i) if p not in c.etcd_pids()], seen[i])
            time.sleep(0.05)
        codes = [h.poll() for h in hosts]
        assert codes == [0, 0], [(tmp_path / f"host{i}.err").read_text()[-2000:] for i in range(2)]
    for i in range(2):
        addrs = set().union(*seen[i].values())
        assert {a for a, _ in addrs} == {c.addr(i), "127.0.0.1"}, (i, seen[i])
        # the supervisor's liveness socket, and gloo in its worker and its keeper
        assert len([pid for pid, a in seen[i].items() if any(x == c.addr(i) for x, _ in a)]) >= 3, seen[i]


# ----- the liveness port under a flood of idle connections
SUPERVISOR = """
import resource, time
resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))  # fewer descriptors than the flood's connections
from leto.control.lease import Liveness
live = Liveness("127.0.0.1")
live.beat(lambda: 0.0)
print(live.port, flush=True)
time.sleep(120)
"""


@pytest.fixture
def liveness_port() -> Iterator[int]:
    """The liveness port of a supervisor process with few descriptors."""
    with subprocess.Popen([sys.executable, "-c", SUPERVISOR], stdout=subprocess.PIPE, text=True) as proc:
        try:
            yield int(proc.stdout.readline())
        finally:
            proc.kill()  # (and the with waits for it)


def test_a_liveness_port_flooded_with_idle_connections_still_serves_the_coordinators_watcher(
    liveness_port: int,
) -> None:
    """More idle connections than the supervisor has descriptors: those that never say they are a
    watcher are dropped (the oldest at once beyond MAX_PENDING, the rest after HELLO_TIMEOUT_S),
    and a real watcher that connects in the middle of the flood gets its beats."""
    port = liveness_port
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    flood = 300
    assert soft > flood + 100, "this test needs descriptors for its own flood"
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(flood)]
    try:
        watch = LivenessWatch(1.0, judge=lambda: True)
        connected = time.monotonic()
        watch.watch(1, "127.0.0.1", port)
        end = connected + 3.0  # three lease times: long enough to be judged silent if it were not served
        while time.monotonic() < end:
            assert watch.dead() == {}
            time.sleep(BEAT_S / 2)
        heard = watch.last_heard(1)
        assert heard is not None and time.time() - heard < 2 * BEAT_S + 0.5  # it beats still
        # every idle connection was closed by the supervisor (it reads as end of stream)
        for conn in idle:
            conn.settimeout(HELLO_TIMEOUT_S + 5)
            try:
                assert conn.recv(64) == b""
            except ConnectionResetError:
                pass
        assert MAX_PENDING < flood
        watch.close()
    finally:
        for conn in idle:
            conn.close()


def test_a_connection_that_says_something_else_is_dropped_at_once(liveness_port: int) -> None:
    port = liveness_port
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"GET / HTTP/1.0\r\n\r\n")
        conn.settimeout(HELLO_TIMEOUT_S / 2)  # sooner than a silent one would be
        try:
            assert conn.recv(64) == b""  # no beat: closed
        except ConnectionResetError:
            pass
