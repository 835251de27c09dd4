"""The job's store on etcd: a torch.distributed Store that gloo rendezvous through, whose writes a
lost host can no longer make, and whose failures name the problem (one etcd member on 127.0.0.1)."""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import leto_cmd, wait_for
from leto.cli import main
from leto.runtime.etcd_mirror import FOLLOW_S, FRESH_S
from leto.runtime.etcd_store import EtcdStore, Fenced, StoreUnavailable, parse_endpoints

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed (scripts/install.sh)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _member(data: Path) -> Iterator[tuple[tuple[str, int], subprocess.Popen]]:
    """One etcd member on 127.0.0.1, up and answering: its endpoint and process."""
    client, peer = _free_port(), _free_port()
    log = open(data / "log", "w")  # noqa: SIM115 (closed with the member, below)
    proc = subprocess.Popen(
        [
            "etcd",
            "--name",
            "t",
            "--data-dir",
            str(data / "d"),
            "--listen-client-urls",
            f"http://127.0.0.1:{client}",
            "--advertise-client-urls",
            f"http://127.0.0.1:{client}",
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-cluster",
            f"t=http://127.0.0.1:{peer}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    try:
        store = EtcdStore([("127.0.0.1", client)], "probe", 10.0)
        deadline = time.monotonic() + 20
        while True:
            try:
                store.set("up", "1")
                break
            except StoreUnavailable:
                if time.monotonic() > deadline:
                    raise RuntimeError((data / "log").read_text()[-2000:]) from None
        yield ("127.0.0.1", client), proc
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()
        log.close()


@pytest.fixture(scope="module")
def etcd(tmp_path_factory) -> Iterator[tuple[str, int]]:
    with _member(tmp_path_factory.mktemp("etcd")) as (endpoint, _):
        yield endpoint


def test_it_keeps_the_store_contract(etcd: tuple[str, int]) -> None:
    s = EtcdStore([etcd], "contract", 5.0)
    s.set("a", b"\x00\xffbytes")
    assert s.get("a") == b"\x00\xffbytes" and s.check(["a"]) and not s.check(["a", "b"])
    assert [s.add("n", 1), s.add("n", 5), s.add("n", 0)] == [1, 6, 6]
    assert s.compare_set("c", "", "x") == b"x" and s.compare_set("c", "y", "z") == b"x"
    assert s.compare_set("c", "x", "w") == b"w" and s.get("c") == b"w"
    assert s.delete_key("a") and not s.check(["a"]) and not s.delete_key("a")
    s.multi_set(["m1", "m2"], ["1", "2"])
    assert s.multi_get(["m1", "m2"]) == [b"1", b"2"] and s.num_keys() == 4
    with pytest.raises(dist.DistStoreError, match="wait timeout"):
        s.wait(["never"], timedelta(seconds=0.2))
    threading.Timer(0.2, lambda: EtcdStore([etcd], "contract", 5.0).set("later", "v")).start()
    assert s.get("later") == b"v"  # get waits for the key, like TCPStore's


def test_a_mirrored_store_reads_what_etcd_holds_without_asking_it(etcd: tuple[str, int]) -> None:
    """A store that polls reads keys under its mirror's prefix from a local copy kept by one watch:
    what others write and delete shows there, and its own writes at once."""
    mirrored = EtcdStore([etcd], "mirror", 5.0, mirror="control/")
    other = EtcdStore([etcd], "mirror", 5.0)
    wait_for(lambda: mirrored._mirror.fresh(), 5, "the mirror to sync")
    mirrored.set("control/own", "1")
    assert mirrored._mirror.lookup("control/own") == b"1" and mirrored.check(["control/own"])
    other.set("control/cmd/0", "spawn")
    assert wait_for(lambda: mirrored._mirror.lookup("control/cmd/0"), 5, "the put to reach the mirror") == b"spawn"
    threading.Timer(0.2, lambda: other.set("control/cmd/1", "fork")).start()
    assert mirrored.get("control/cmd/1") == b"fork"  # a wait on the copy, woken by the watch
    lease = other.grant(1)
    other.create("control/host/0", "rec", lease)
    wait_for(lambda: mirrored.under("control/host/") == {"control/host/0": b"rec"}, 5, "the host record")
    wait_for(lambda: not mirrored.check(["control/host/0"]), 10, "the lease's end to reach the mirror")
    assert other.delete_key("control/cmd/0")
    wait_for(lambda: not mirrored.check(["control/cmd/0"]), 5, "the delete to reach the mirror")
    other.set("elsewhere", "x")  # outside the prefix: asked of etcd
    assert mirrored.check(["elsewhere"]) and mirrored._mirror.lookup("elsewhere") is None
    mirrored.close()


def test_a_mirror_whose_member_froze_is_not_read(tmp_path: Path) -> None:
    """A frozen member sends nothing and refuses nothing: the copy would silently stop changing.
    Within FRESH_S it is no longer used, and reads go to etcd (which here cannot answer)."""
    with _member(tmp_path) as (endpoint, proc):
        mirrored = EtcdStore([endpoint], "frozen", 2.0, mirror="control/")
        mirrored.set("control/x", "1")
        wait_for(lambda: mirrored._mirror.fresh(), 5, "the mirror to sync")
        proc.send_signal(signal.SIGSTOP)
        wait_for(lambda: not mirrored._mirror.fresh(), FRESH_S + FOLLOW_S + 2, "the mirror to go stale")
        with pytest.raises(StoreUnavailable):
            mirrored.check(["control/x"])
        proc.send_signal(signal.SIGCONT)
        wait_for(lambda: mirrored._mirror.fresh(), 10, "the mirror to be current again")
        assert mirrored.check(["control/x"])
        mirrored.close()


def test_a_rendezvous_reads_each_group_once(etcd: tuple[str, int]) -> None:
    """A rank of a group reads every other rank's key, one after the other: the first read of a
    write-once key brings its whole folder, so the others cost no request; a key not yet written
    is waited for, and a counter (add) is never kept."""
    writer, reader = EtcdStore([etcd], "once", 5.0), EtcdStore([etcd], "once", 5.0)
    for r in range(4):
        writer.set(f"pg/g1/world//0/{r}", f"addr{r}")
    calls: list[str] = []
    request = reader.request
    reader.request = lambda path, body, deadline=None: calls.append(path) or request(path, body, deadline)
    assert [reader.get(f"pg/g1/world//0/{r}") for r in range(4)] == [b"addr0", b"addr1", b"addr2", b"addr3"]
    assert calls == ["kv/range"]
    threading.Timer(0.2, lambda: writer.set("pg/g1/world//0/4", "addr4")).start()
    assert reader.get("pg/g1/world//0/4") == b"addr4"
    reader.wait(["pg/g1/world//0/2", "pg/g1/world//0/4"], timedelta(seconds=1))  # kept: no request
    assert reader.add("pg/g1/world/n", 2) == 2 and writer.add("pg/g1/world/n", 1) == 3
    assert reader.get("pg/g1/world/n") == b"3"
    with pytest.raises(dist.DistStoreError, match="wait timeout"):
        reader.wait(["pg/g2/never"], timedelta(seconds=0.2))
    outside = EtcdStore([etcd], "once", 5.0)
    writer.set("control/x", "1")
    assert outside.get("control/x") == b"1"
    writer.set("control/x", "2")
    assert outside.get("control/x") == b"2"  # not a write-once prefix: always read from etcd


def test_concurrent_adds_lose_no_increment(etcd: tuple[str, int]) -> None:
    def bump() -> None:
        s = EtcdStore([etcd], "adds", 10.0)
        for _ in range(20):
            s.add("n", 1)

    threads = [threading.Thread(target=bump) for _ in range(4)]
    [t.start() for t in threads]
    [t.join(timeout=60) for t in threads]
    assert EtcdStore([etcd], "adds", 5.0).add("n", 0) == 80


_RANK = """
import sys, torch, torch.distributed as dist
from datetime import timedelta
from leto.runtime.etcd_store import EtcdStore
rank, port = int(sys.argv[1]), int(sys.argv[2])
base = EtcdStore([("127.0.0.1", port)], "gloo", 30.0)  # held: a Python Store must outlive its users
pg = dist.ProcessGroupGloo(dist.PrefixStore("pg/", base), rank, 2, timedelta(seconds=30))
x = torch.full((3,), float(rank + 1))
pg.allreduce([x]).wait()
print(x.tolist())
"""


def test_gloo_rendezvous_through_it(etcd: tuple[str, int]) -> None:
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(r), str(etcd[1])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    results = [p.communicate(timeout=90) for p in ranks]
    assert [out.strip() for out, _ in results] == ["[3.0, 3.0, 3.0]"] * 2, [err[-2000:] for _, err in results]


def test_a_host_that_lost_its_lease_cannot_write(etcd: tuple[str, int]) -> None:
    s = EtcdStore([etcd], "fence", 5.0)
    lease = s.grant(5)
    rev = s.create("control/host/0", "me", lease)
    assert rev is not None and s.create("control/host/0", "again", lease) is None
    child = EtcdStore.from_url(s.url(fence=("control/host/0", rev)), 5.0)
    twin = child.clone()  # another client (a second concurrent rendezvous), under the same fence
    child.set("k", "1")
    assert child.add("n", 1) == 1
    s.revoke(lease)
    assert s.entry("control/host/0") is None
    writes = (lambda: child.set("k", "2"), lambda: child.add("n", 1), lambda: child.delete_key("k"))
    for write in (*writes, lambda: twin.set("k", "2")):
        with pytest.raises(Fenced, match="lost its lease"):
            write()
    assert s.get("k") == b"1" and s.add("n", 0) == 1
    s.revoke(lease)  # revoking twice is fine (several hosts may fence the same one)
    # a host record created again (a new incarnation) does not lift the old fence
    s.create("control/host/0", "new", s.grant(5))
    with pytest.raises(Fenced):
        child.set("k", "3")


def test_only_a_host_still_in_the_job_can_fence_another_out(etcd: tuple[str, int]) -> None:
    """`fence_out` deletes the other host's record under the caller's own fence, then ends its
    lease: a host that is out itself (a cut-off coordinator heard late) removes no one."""
    s = EtcdStore([etcd], "fence-out", 5.0)
    leases = [s.grant(5) for _ in range(3)]
    revs = [s.create(f"control/host/{n}", str(n), leases[n]) for n in range(3)]
    s.create("control/coordinator", "2", leases[2])
    hosts = [EtcdStore.from_url(s.url(fence=(f"control/host/{n}", revs[n])), 5.0) for n in range(3)]
    hosts[0].fence_out("control/host/2", leases[2])
    assert s.entry("control/host/2") is None and s.value("control/coordinator") is None  # the lease went too
    with pytest.raises(Fenced):
        hosts[2].fence_out("control/host/0", leases[0])  # the host taken out judges no one
    with pytest.raises(Fenced):
        hosts[2].confirm_fence()
    hosts[0].confirm_fence()
    assert s.entry("control/host/0") is not None and s.entry("control/host/1") is not None
    hosts[1].fence_out("control/host/2", leases[2])  # twice (two hosts judging the same one) is fine
    # a record of the same key bound to another lease (a new incarnation) is not removed
    rev = s.create("control/host/2", "again", s.grant(5))
    hosts[0].fence_out("control/host/2", leases[2])
    assert s.entry("control/host/2") is not None and s.entry("control/host/2")[1] == rev


def test_an_unreachable_etcd_is_a_clear_error_within_the_timeout() -> None:
    s = EtcdStore([("127.0.0.1", _free_port()), ("127.0.0.1", _free_port())], "gone", 0.5)
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match="etcd unreachable or without quorum"):
        s.set("a", "1")
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize(
    "url, why",
    [
        ("http://h:2379", "starts with etcd://"),
        ("etcd://h", "not HOST:PORT"),
        ("etcd://h:99999", "not HOST:PORT"),
        ("etcd://h:1,:2", "not HOST:PORT"),
    ],
)
def test_bad_endpoint_lists_are_refused_with_the_reason(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_endpoints(url)


@pytest.mark.parametrize(
    "args, why",
    [
        (["--rdzv", "etcd://127.0.0.1"], "--rdzv: "),
        (["--rdzv", "etcd://127.0.0.1:2379"], "needs --job-id"),
        (["--rdzv", "etcd://127.0.0.1:2379", "--job-id", "a b"], "needs --job-id"),
        (["--rdzv", "etcd://127.0.0.1:2379", "--job-id", "j", "--lease", "0"], "--lease must be at least 1"),
        (["--job-id", "j"], "it needs --rdzv"),
    ],
)
def test_bad_rendezvous_flags_are_refused(args: list[str], why: str, tmp_path: Path, capsys) -> None:
    assert main(["train", "--run-dir", str(tmp_path), *args]) == 2
    assert why in capsys.readouterr().err


def test_a_host_that_cannot_reach_etcd_says_so_and_exits(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("print('never runs')\n")
    res = subprocess.run(
        leto_cmd(
            "run",
            "--rdzv",
            f"etcd://127.0.0.1:{_free_port()}",
            "--job-id",
            "j",
            "--run-dir",
            str(tmp_path / "run"),
            str(script),
        ),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 1 and "cannot join job 'j'" in res.stderr and "etcd unreachable" in res.stderr
    assert "never runs" not in res.stdout


def test_a_command_whose_writer_died_between_its_two_writes_does_not_stop_the_stream(
    etcd: tuple[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A coordinator killed after reserving a command's number and before writing it: a
    supervisor reading through its mirror passes the hole after `HOLE_S` and carries out what
    the next coordinator writes; the hole is filled in etcd, for every reader."""
    from leto.control import stream
    from leto.protocol import keys

    monkeypatch.setattr(stream, "HOLE_S", 0.3)
    lost = EtcdStore([etcd], "hole", 5.0)
    supervisor = EtcdStore([etcd], "hole", 5.0, mirror="control/")
    reader = stream.Reader(supervisor, keys.COMMANDS, keys.command)
    stream.append(lost, keys.COMMANDS, keys.command, "first")
    lost.add(keys.COMMANDS, 1)  # killed here
    successor = EtcdStore([etcd], "hole", 5.0)
    stream.append(successor, keys.COMMANDS, keys.command, "after the takeover")
    got: list[bytes] = []

    def read() -> bool:
        while (entry := reader.take()) is not None:
            got.append(entry[1])
        return len(got) == 2

    wait_for(read, 10, "the stream past the hole")
    assert got == [b"first", b"after the takeover"]
    assert successor.get(keys.command(1)) == stream.TOMBSTONE
