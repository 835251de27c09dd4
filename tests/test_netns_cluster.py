"""Specification of tests/netns_cluster.py: hosts as network namespaces, an etcd member on each (or
on the first few), and hosts plugged in later."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import wait_for
from netns_cluster import Cluster, available, list_netns

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))

TCP_CONNECT = "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=0.5).close()"


def can_connect(c: Cluster, src: int, dst: int, port: int = 2379) -> bool:
    """A TCP connect from inside host src to host dst's port."""
    cp = c.run_in(src, [sys.executable, "-c", TCP_CONNECT, c.addr(dst), str(port)], timeout=10)
    return cp.returncode == 0


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(hosts=3) as c:
        yield c


def test_hosts_reach_each_other_and_nothing_touches_the_root_namespace(cluster: Cluster) -> None:
    assert [cluster.addr(i) for i in range(3)] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
    assert cluster.rdzv == "etcd://10.77.0.1:2379,10.77.0.2:2379,10.77.0.3:2379"
    assert can_connect(cluster, 0, 2) and can_connect(cluster, 2, 0)
    ip_in_host = cluster.run_in(0, ["ip", "-4", "addr", "show", "dev", cluster.iface], check=True)
    assert "10.77.0.1/24" in ip_in_host.stdout
    assert "default" not in cluster.run_in(0, ["ip", "route"], check=True).stdout

    root = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    root += subprocess.run(["ip", "route", "show", "table", "all"], capture_output=True, text=True, check=True).stdout
    assert "10.77." not in root
    # (A TCP connect from the root namespace proves nothing: a sandbox's egress proxy may accept
    # connections to any address.) From inside a host, everything off the subnet is unreachable:
    out = cluster.run_in(0, [sys.executable, "-c", TCP_CONNECT, "192.0.2.1", "80"], timeout=10)
    assert out.returncode != 0 and "unreachable" in out.stderr


def test_etcd_leadership_moves_to_the_member_asked_for(cluster: Cluster) -> None:
    """EtcdStore.lead_from: the coordinator's host keeps etcd's leader (control/hosts.py)."""
    move = (
        "import sys; from leto.runtime.etcd_store import EtcdStore, parse_endpoints; "
        "s = EtcdStore(parse_endpoints(sys.argv[1]), 't', 5.0); "
        "print(s.lead_from(parse_endpoints(sys.argv[1])[int(sys.argv[2])]))"
    )
    for target in ((cluster.etcd_leader() + 1) % 3, (cluster.etcd_leader() + 2) % 3):
        out = cluster.run_in(target, [sys.executable, "-c", move, cluster.rdzv, str(target)], timeout=20)
        assert out.stdout.strip() == "True", out.stderr[-2000:]
        wait_for(lambda t=target: cluster.etcd_leader() == t, 10, f"host {target}'s member to lead")
        again = cluster.run_in(0, [sys.executable, "-c", move, cluster.rdzv, str(target)], timeout=20)
        assert again.stdout.strip() == "False", again.stderr[-2000:]  # it leads already: nothing to do


def test_a_cut_link_loses_packets_until_restored(cluster: Cluster) -> None:
    cluster.cut_link(1)
    assert not can_connect(cluster, 0, 1)
    cluster.restore_link(1)
    assert can_connect(cluster, 0, 1)
    cluster.wait_healthy()


def test_etcd_survives_killing_one_host(cluster: Cluster) -> None:
    members = cluster.etcdctl(0, "member", "list")
    assert members.returncode == 0, members.stderr
    assert len(members.stdout.splitlines()) == 3
    health = cluster.etcdctl(0, "endpoint", "health")
    assert health.returncode == 0 and health.stderr.count("is healthy") == 3, health.stderr

    etcd2 = cluster.pids(2)
    assert etcd2, "host 2 runs its etcd member"
    cluster.kill_host(2)
    assert cluster.pids(2) == []

    # A write sent right after the leader died is forwarded to the dead leader and lost (its client
    # waits out its deadline); so first wait for the two survivors to have a leader between them
    # (about 1 s with a 500 ms election timeout).
    cluster.wait_healthy([0, 1], timeout=10)
    two = cluster.etcd_endpoints[:2]
    put = cluster.etcdctl(0, "put", "leto/k", "v", endpoints=two)
    assert put.returncode == 0, put.stderr
    get = cluster.etcdctl(0, "get", "--print-value-only", "leto/k", endpoints=two)
    assert get.stdout.strip() == "v", get.stderr


def test_a_killed_member_rejoins_after_restart(cluster: Cluster) -> None:
    cluster.kill_etcd(2)  # (host 2 may already be dead: a no-op then)
    cluster.start_etcd(2)
    cluster.wait_healthy([0, 1, 2])
    get = cluster.etcdctl(2, "get", "--print-value-only", "leto/k", endpoints=[cluster.etcd_endpoints[2]])
    assert get.stdout.strip() == "v", get.stderr


def assert_gone(names: list[str], tmpdir: Path, procs: list[subprocess.Popen]) -> None:
    left = set(list_netns())
    assert not left & set(names)
    assert not tmpdir.exists()
    assert all(p.poll() is not None for p in procs)


def test_close_removes_namespaces_processes_and_temp_dir() -> None:
    with Cluster(hosts=2) as c:
        names, tmpdir = c.names, c.tmpdir
        assert set(names) <= set(list_netns()) and tmpdir is not None and tmpdir.is_dir()
        sleeper = c.popen(1, ["sleep", "300"])
        c.freeze_host(1)  # stopped processes must die too
    assert_gone(names, tmpdir, [sleeper])
    c.close()  # idempotent


def test_close_cleans_up_when_the_body_raises() -> None:
    with pytest.raises(ValueError, match="the body failed"), Cluster(hosts=2, etcd=False) as c:
        names, tmpdir = c.names, c.tmpdir
        sleeper = c.popen(0, ["sleep", "300"])
        raise ValueError("the body failed")
    assert_gone(names, tmpdir, [sleeper])


def test_hosts_without_an_etcd_member_and_a_host_plugged_in_later() -> None:
    """A replacement machine: `etcd_members` hosts run the members, the others (and one added while
    the cluster runs) are plain hosts on the same bridge that reach the members; killing one leaves
    etcd alone, and close() removes the added host's namespace with the rest."""
    with Cluster(hosts=3, etcd_members=2) as c:
        assert c.rdzv == "etcd://10.77.0.1:2379,10.77.0.2:2379" and len(c.etcd_pids()) == 2
        assert not can_connect(c, 0, 2)  # nothing listens on host 2's 2379
        new = c.add_host()
        assert new == 3 and c.hosts == 4 and c.addr(new) == "10.77.0.4" and c.ns(new) in list_netns()
        assert "10.77.0.4/24" in c.run_in(new, ["ip", "-4", "addr", "show", "dev", c.iface], check=True).stdout
        assert can_connect(c, new, 0) and can_connect(c, 2, 1)
        put = c.etcdctl(new, "put", "leto/new", "4")
        assert put.returncode == 0, put.stderr
        sleeper = c.popen(new, ["sleep", "300"])
        etcd = c.etcd_pids()
        c.kill_host(new)
        assert sleeper.wait(5) == -9 and c.pids(new) == [] and c.etcd_pids() == etcd
        with pytest.raises(IndexError, match="runs no etcd member"):
            c.start_etcd(new)
        names, tmpdir = c.names, c.tmpdir
        assert len(names) == 5  # four hosts and the switch
    assert_gone(names, tmpdir, [sleeper])


def test_an_added_host_is_cleaned_up_when_the_body_raises() -> None:
    with pytest.raises(ValueError, match="the body failed"), Cluster(hosts=1, etcd=False) as c:
        c.add_host()
        names, tmpdir = c.names, c.tmpdir
        sleeper = c.popen(1, ["sleep", "300"])
        raise ValueError("the body failed")
    assert_gone(names, tmpdir, [sleeper])
    with pytest.raises(RuntimeError, match="is closed"):
        c.add_host()
