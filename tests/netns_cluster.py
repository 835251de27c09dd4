"""A cluster of "hosts" on one machine, made of Linux network namespaces (for tests and benchmarks).

Layout of one `Cluster(hosts=N)`::

    switch namespace  leto-<pid>-<n>-sw : bridge br0, veth ends lv<pid%10000>h<i> enslaved to it
    host namespace    leto-<pid>-<n>-h<i> : lo, eth0 = 10.77.0.(i+1)/24 (the other end of that veth)

There is no default route anywhere and nothing is added to the root namespace, so traffic between the
hosts never leaves these namespaces. With `etcd=True` the first `etcd_members` hosts (default: every
host) run one member each of an etcd cluster on 10.77.0.(i+1):2379 (clients) / :2380 (peers); the
others are plain hosts, as is one plugged in later with `add_host()` (a replacement machine).

Pure stdlib (no pytest): benchmarks import it too. Needs root (CAP_SYS_ADMIN + CAP_NET_ADMIN),
iproute2's `ip`, and for etcd the `etcd` and `etcdctl` binaries; `available()` says why not.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self, TypeVar

__all__ = ["SUBNET", "Cluster", "available", "remove_stale"]

SUBNET = "10.77.0"
PREFIX = "leto-"
CLIENT_PORT = 2379
PEER_PORT = 2380
# etcd's Raft timing. The lessor's minimum TTL is ceil(1.5 * election timeout) rounded up to whole
# seconds (3.4: minTTL = (3 * electionTicks / 2) * heartbeat): 1000 ms (the default) -> 2 s leases,
# 500 ms -> 1 s. 50/500 ms also makes a new leader get elected within ~0.5-1 s after one dies.
HEARTBEAT_MS = 50
ELECTION_MS = 500
ETCD_HEALTH_TIMEOUT = 20.0
# NB: a write sent just after the leader's host was killed is forwarded to the dead leader and lost;
# its client waits out its whole deadline. Call wait_healthy() first (or retry).
KILL_TIMEOUT = 5.0
MAX_HOSTS = 250  # 10.77.0.1 .. 10.77.0.250

_counter = itertools.count()
_STALE_RE = re.compile(rf"^{re.escape(PREFIX)}(\d+)-")
_STALE_DIR_RE = re.compile(r"^leto-netns-(\d+)-")
_T = TypeVar("_T")


# --------------------------------------------------------------------------------------------- helpers
def _ip(*args: str, timeout: float = 10.0) -> str:
    """Run `ip ARGS`; return stdout; raise RuntimeError with stderr on any failure."""
    argv = ["ip", *args]
    try:
        cp = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise RuntimeError("`ip` (iproute2) not found on PATH; install iproute2") from None
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"`{' '.join(argv)}` timed out after {timeout}s") from None
    if cp.returncode != 0:
        msg = f"`{' '.join(argv)}` failed (rc {cp.returncode}): {cp.stderr.strip() or cp.stdout.strip()}"
        if "Operation not permitted" in cp.stderr or "Permission denied" in cp.stderr:
            msg += " -- network namespaces need root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"
        raise RuntimeError(msg)
    return cp.stdout


def _wait(pred: Callable[[], _T], timeout: float, what: str, every: float = 0.05) -> _T:
    """Poll pred until it returns a truthy value; TimeoutError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def list_netns() -> list[str]:
    """Names of all named network namespaces (`ip netns list`)."""
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def netns_pids(ns: str) -> list[int]:
    """PIDs of every (non-zombie) process in namespace `ns`; [] if it does not exist."""
    try:
        out = _ip("netns", "pids", ns)
    except RuntimeError:
        if ns not in list_netns():
            return []
        raise
    me = os.getpid()
    return [int(p) for p in out.split() if p.strip().isdigit() and int(p) != me]


def _wait_until_in(p: subprocess.Popen, ns: str, timeout: float = KILL_TIMEOUT) -> None:
    """Wait until process `p` has entered network namespace `ns`, or ended."""
    want = os.stat(f"/run/netns/{ns}").st_ino

    def inside_or_ended() -> bool:
        try:
            return p.poll() is not None or os.stat(f"/proc/{p.pid}/ns/net").st_ino == want
        except FileNotFoundError:  # ended between poll and stat
            return True

    _wait(inside_or_ended, timeout, f"process {p.pid} to enter netns {ns}", every=0.005)


def _kill_ns_procs(ns: str, timeout: float = KILL_TIMEOUT) -> None:
    """SIGCONT then SIGKILL every process in `ns` until none is left."""
    deadline = time.monotonic() + timeout
    while True:
        pids = netns_pids(ns)
        if not pids:
            return
        for pid in pids:
            _signal(pid, signal.SIGCONT)
            _signal(pid, signal.SIGKILL)
        if time.monotonic() >= deadline:
            raise TimeoutError(f"processes {pids} in netns {ns} survived SIGKILL for {timeout}s")
        time.sleep(0.02)


def _scratch_root() -> str:
    """/dev/shm (tmpfs: etcd's fsyncs are free) if usable, else /tmp."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return tempfile.gettempdir()


def remove_stale() -> list[str]:
    """Delete namespaces `leto-<pid>-...` (and temp dirs `leto-netns-<pid>-...`) whose <pid> is dead.

    They are what a crashed or SIGKILLed run left behind. Returns the namespaces removed.
    """
    removed = []
    for ns in list_netns():
        m = _STALE_RE.match(ns)
        if not m or _pid_alive(int(m.group(1))):
            continue
        _kill_ns_procs(ns)
        _ip("netns", "del", ns)
        removed.append(ns)
    for root in {_scratch_root(), tempfile.gettempdir()}:
        try:
            entries = os.listdir(root)
        except OSError:
            continue
        for name in entries:
            m = _STALE_DIR_RE.match(name)
            if m and not _pid_alive(int(m.group(1))):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return removed


_available: str | None | bool = False  # False: not probed yet


def available() -> str | None:
    """None if network namespaces, veth/bridge and etcd can be used here, else the reason why not."""
    global _available
    if _available is not False:
        return _available  # type: ignore[return-value]
    reason: str | None = None
    if not sys.platform.startswith("linux"):
        reason = "network namespaces need Linux"
    elif shutil.which("ip") is None:
        reason = "`ip` (iproute2) not found on PATH"
    elif shutil.which("etcd") is None or shutil.which("etcdctl") is None:
        reason = "`etcd` / `etcdctl` not found on PATH (Debian: apt-get install etcd-server etcd-client)"
    else:
        probe = f"{PREFIX}{os.getpid()}-probe{next(_counter)}"
        try:
            _ip("netns", "add", probe)
            try:
                _ip("-n", probe, "link", "add", "br0", "type", "bridge")
                _ip("-n", probe, "link", "add", "va", "type", "veth", "peer", "name", "vb")
            finally:
                _ip("netns", "del", probe)
        except RuntimeError as e:
            reason = f"cannot create network namespaces / veth / bridge: {e}"
    _available = reason
    return reason


# --------------------------------------------------------------------------------------------- cluster
class Cluster:
    """N hosts as network namespaces on one bridge, optionally one etcd member on each of the first
    `etcd_members` (default: all of them); `add_host()` plugs in one more, without a member.

    Everything is set up in the constructor (so benchmarks can use it without `with`) and torn down
    by `close()` / `__exit__` / atexit, whichever comes first.
    """

    iface = "eth0"

    def __init__(
        self, hosts: int = 3, etcd: bool = True, tag: str | None = None, etcd_members: int | None = None
    ) -> None:
        if not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be in 1..{MAX_HOSTS}, got {hosts}")
        members = hosts if etcd_members is None else etcd_members
        if etcd and not 1 <= members <= hosts:
            raise ValueError(f"etcd_members must be in 1..{hosts} (the hosts), got {members}")
        self.hosts = hosts
        self.etcd = etcd
        self.etcd_members = members if etcd else 0
        self.tag = tag
        self._n = next(_counter)
        pid = os.getpid()
        self.prefix = f"{PREFIX}{pid}-{self._n}"
        self.switch = f"{self.prefix}-sw"
        self._host_ns = [self._ns_name(i) for i in range(hosts)]
        self._veth = [self._veth_name(i) for i in range(hosts)]  # in the switch ns; <= 15 chars
        self._created: list[str] = []  # namespaces that exist and are ours to delete
        self._procs: list[subprocess.Popen] = []  # every Popen, for cleanup
        self._etcd_procs: dict[int, subprocess.Popen] = {}
        self._closed = False
        self.token = f"{self.prefix}-{tag or 'c'}-{uuid.uuid4().hex[:8]}"
        self.tmpdir: Path | None = None
        atexit.register(self.close)
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------------------------- addressing
    def addr(self, i: int) -> str:
        """IPv4 address of host i (10.77.0.(i+1))."""
        self._check(i)
        return f"{SUBNET}.{i + 1}"

    def ns(self, i: int) -> str:
        """Network namespace name of host i."""
        self._check(i)
        return self._host_ns[i]

    @property
    def names(self) -> list[str]:
        """Every namespace this cluster creates (hosts and switch)."""
        return [*self._host_ns, self.switch]

    @property
    def etcd_endpoints(self) -> list[str]:
        """["10.77.0.1:2379", ...], one per etcd member (hosts 0 .. etcd_members-1)."""
        return [f"{self.addr(i)}:{CLIENT_PORT}" for i in range(self.etcd_members)]

    @property
    def rdzv(self) -> str:
        """Rendezvous URL: etcd://10.77.0.1:2379,10.77.0.2:2379,..."""
        return "etcd://" + ",".join(self.etcd_endpoints)

    def etcd_log(self, i: int) -> Path:
        """Log file of host i's etcd member (appended to across restarts)."""
        assert self.tmpdir is not None
        return self.tmpdir / f"etcd-h{i}.log"

    # ----------------------------------------------------------------------------------- processes
    def popen(self, i: int, argv: Sequence[str], env: dict[str, str] | None = None, **kw: Any) -> subprocess.Popen:
        """Start argv inside host i's namespace; `ip netns exec` execs, so the Popen's pid is argv's.
        Returns once the process is in the namespace (or has ended): until `ip` has entered it, a
        `kill_host` would not find the process, which would then start on a host already killed."""
        self._check(i)
        p = subprocess.Popen(["ip", "netns", "exec", self.ns(i), *argv], env=env, **kw)
        self._procs.append(p)
        _wait_until_in(p, self.ns(i))
        return p

    def run_in(
        self, i: int, argv: Sequence[str], timeout: float = 30.0, check: bool = False, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        """Run argv inside host i's namespace to completion; text output captured."""
        self._check(i)
        return subprocess.run(
            ["ip", "netns", "exec", self.ns(i), *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
            env=env,
        )

    def etcdctl(
        self, i: int, *args: str, endpoints: Sequence[str] | None = None, timeout: float = 10.0
    ) -> subprocess.CompletedProcess:
        """`etcdctl` (v3 API) run inside host i, against `endpoints` (default: all members)."""
        env = {**os.environ, "ETCDCTL_API": "3"}
        eps = ",".join(endpoints or self.etcd_endpoints)
        return self.run_in(
            i,
            ["etcdctl", f"--endpoints={eps}", "--dial-timeout=2s", "--command-timeout=5s", *args],
            timeout=timeout,
            env=env,
        )

    def pids(self, i: int) -> list[int]:
        """PIDs of every live process in host i's namespace."""
        self._reap()
        return netns_pids(self.ns(i))

    def kill_host(self, i: int, sig: int = signal.SIGKILL, timeout: float = KILL_TIMEOUT) -> None:
        """Send sig to every process of host i (its etcd member too); for SIGKILL, until none is left."""
        ns = self.ns(i)
        if sig == signal.SIGKILL:
            _kill_ns_procs(ns, timeout)
        else:
            for pid in netns_pids(ns):
                _signal(pid, sig)
        self._reap()

    def freeze_host(self, i: int) -> None:
        """SIGSTOP every process of host i (a hung host: its sockets stay open)."""
        for pid in netns_pids(self.ns(i)):
            _signal(pid, signal.SIGSTOP)

    def thaw_host(self, i: int) -> None:
        """SIGCONT every process of host i."""
        for pid in netns_pids(self.ns(i)):
            _signal(pid, signal.SIGCONT)

    # ----------------------------------------------------------------------------------- network
    def cut_link(self, i: int) -> None:
        """Unplug host i: its eth0 goes down (processes keep running, packets are lost)."""
        _ip("-n", self.ns(i), "link", "set", self.iface, "down")

    def restore_link(self, i: int, timeout: float = 5.0) -> None:
        """Plug host i back in and wait until its address and bridge port forward again."""
        _ip("-n", self.ns(i), "link", "set", self.iface, "up")
        self._wait_link(i, timeout)

    # ----------------------------------------------------------------------------------- etcd
    def start_etcd(self, i: int, state: str = "existing") -> subprocess.Popen:
        """Start host i's etcd member (a restart: `existing` state, same data dir)."""
        self._check(i)
        if i >= self.etcd_members:
            raise IndexError(f"host {i} runs no etcd member (members: hosts 0..{self.etcd_members - 1})")
        old = self._etcd_procs.get(i)
        if old is not None and old.poll() is None:
            raise RuntimeError(f"etcd member h{i} is still running (pid {old.pid})")
        assert self.tmpdir is not None
        a = self.addr(i)
        initial = ",".join(f"h{j}=http://{self.addr(j)}:{PEER_PORT}" for j in range(self.etcd_members))
        argv = [
            "etcd",
            f"--name=h{i}",
            f"--data-dir={self.tmpdir / f'h{i}.etcd'}",
            f"--listen-client-urls=http://{a}:{CLIENT_PORT},http://127.0.0.1:{CLIENT_PORT}",
            f"--advertise-client-urls=http://{a}:{CLIENT_PORT}",
            f"--listen-peer-urls=http://{a}:{PEER_PORT}",
            f"--initial-advertise-peer-urls=http://{a}:{PEER_PORT}",
            f"--initial-cluster={initial}",
            f"--initial-cluster-state={state}",
            f"--initial-cluster-token={self.token}",
            f"--heartbeat-interval={HEARTBEAT_MS}",
            f"--election-timeout={ELECTION_MS}",
            # As etcd 3.5+ does by default: a member cut off and plugged back in (cut_link) must
            # not depose a healthy leader by coming back with a higher term.
            "--pre-vote=true",
            "--logger=zap",
            "--log-outputs=stderr",
        ]
        # ETCD_* variables from the caller's environment would override these flags (or make etcd
        # refuse to start because a flag is set twice); the member gets a clean set.
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
        with open(self.etcd_log(i), "ab") as log:  # the child keeps its own copy of the fd
            p = self.popen(
                i, argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._etcd_procs[i] = p
        return p

    def etcd_pids(self) -> list[int]:
        """PIDs of the etcd members that run."""
        return [p.pid for p in self._etcd_procs.values() if p.poll() is None]

    def kill_etcd(self, i: int, sig: int = signal.SIGKILL, timeout: float = KILL_TIMEOUT) -> None:
        """Send sig to host i's etcd member; for SIGKILL/SIGTERM/SIGINT wait until it has exited."""
        p = self._etcd_procs.get(i)
        if p is None or p.poll() is not None:
            return
        p.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"etcd member h{i} (pid {p.pid}) survived {sig!r} for {timeout}s") from None

    def etcd_healthy(self, i: int) -> bool:
        """Whether host i's member answers GET /health with health true (asked from inside host i)."""
        url = f"http://{self.addr(i)}:{CLIENT_PORT}/health"
        if shutil.which("curl"):
            argv = ["curl", "-s", "-m", "1", url]
        else:
            argv = [
                sys.executable,
                "-c",
                (
                    "import sys,urllib.request;"
                    f"sys.stdout.write(urllib.request.urlopen({url!r},timeout=1).read().decode())"
                ),
            ]
        try:
            cp = self.run_in(i, argv, timeout=5)
        except subprocess.TimeoutExpired:
            return False
        return cp.returncode == 0 and '"health":"true"' in cp.stdout.replace(" ", "")

    def etcd_leader(self) -> int | None:
        """The host whose etcd member leads, if the members that answer (asked from inside host 0,
        or the first host with a running member) agree on one."""
        asker = next((i for i, p in sorted(self._etcd_procs.items()) if p.poll() is None), 0)
        out = self.etcdctl(asker, "endpoint", "status", "-w", "json")
        try:
            status = json.loads(out.stdout)
        except json.JSONDecodeError:
            return None
        leaders = {s["Status"]["leader"] for s in status}
        if len(leaders) != 1:
            return None
        by_id = {s["Status"]["header"]["member_id"]: s["Endpoint"] for s in status}
        endpoint = by_id.get(leaders.pop())
        return None if endpoint is None else self.etcd_endpoints.index(endpoint)

    def wait_healthy(self, members: Sequence[int] | None = None, timeout: float = ETCD_HEALTH_TIMEOUT) -> None:
        """Wait until every member in `members` (default: all running ones) reports healthy."""
        if members is None:
            members = [i for i, p in self._etcd_procs.items() if p.poll() is None]
        pending = set(members)
        deadline = time.monotonic() + timeout
        while pending:
            for i in sorted(pending):
                p = self._etcd_procs.get(i)
                if p is None or p.poll() is not None:
                    rc = None if p is None else p.returncode
                    raise RuntimeError(f"etcd member h{i} is not running (exit status {rc})\n" + self._log_tails([i]))
                if self.etcd_healthy(i):
                    pending.discard(i)
            if pending and time.monotonic() >= deadline:
                raise RuntimeError(
                    f"etcd members {sorted(pending)} not healthy after {timeout}s\n" + self._log_tails(members)
                )
            if pending:
                time.sleep(0.1)

    # ----------------------------------------------------------------------------------- lifecycle
    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Cluster {self.prefix} hosts={self.hosts} etcd_members={self.etcd_members}>"

    def close(self) -> None:
        """Kill every process, delete the namespaces and the temp dir. Idempotent; never leaks."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        errors: list[str] = []
        for ns in list(self._created):
            try:
                _kill_ns_procs(ns)
            except (RuntimeError, TimeoutError, OSError) as e:  # keep going: the rest must still be cleaned up
                errors.append(f"{ns}: {e}")
        for p in self._procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGCONT)
                    p.kill()
                except OSError:
                    pass
            try:
                p.wait(KILL_TIMEOUT)
            except subprocess.TimeoutExpired:
                errors.append(f"pid {p.pid} survived SIGKILL")
        for ns in reversed(self._created):
            try:
                _ip("netns", "del", ns)
                self._created.remove(ns)
            except (RuntimeError, TimeoutError, OSError) as e:
                errors.append(str(e))
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            if self.tmpdir.exists():
                errors.append(f"could not remove {self.tmpdir}")
        if errors:
            raise RuntimeError(f"{self!r}: cleanup incomplete: " + "; ".join(errors))

    def add_host(self) -> int:
        """Plug one more host into the running cluster (a replacement machine: a new namespace at
        the next address, no etcd member); its index. Cleaned up by `close()` like the others."""
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        i = self.hosts
        if i >= MAX_HOSTS:
            raise ValueError(f"a cluster has at most {MAX_HOSTS} hosts")
        self._host_ns.append(self._ns_name(i))
        self._veth.append(self._veth_name(i))
        self.hosts += 1
        self._plug(i)
        self._wait_link(i, 5.0)
        return i

    # ----------------------------------------------------------------------------------- internals
    def _check(self, i: int) -> None:
        if not 0 <= i < self.hosts:
            raise IndexError(f"host index {i} out of range 0..{self.hosts - 1}")

    def _ns_name(self, i: int) -> str:
        return f"{self.prefix}-h{i}"

    def _veth_name(self, i: int) -> str:
        return f"lv{os.getpid() % 10000}h{i}"

    def _reap(self) -> None:
        for p in self._procs:
            p.poll()

    def _add_ns(self, ns: str) -> None:
        if ns in list_netns():
            raise RuntimeError(f"network namespace {ns} already exists")
        _ip("netns", "add", ns)
        self._created.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def _setup(self) -> None:
        if shutil.which("ip") is None:
            raise RuntimeError("`ip` (iproute2) not found on PATH; install iproute2")
        if self.etcd and shutil.which("etcd") is None:
            raise RuntimeError("`etcd` not found on PATH (Debian: apt-get install etcd-server)")
        remove_stale()
        self.tmpdir = Path(tempfile.mkdtemp(prefix=f"leto-netns-{os.getpid()}-{self._n}-", dir=_scratch_root()))
        self._add_ns(self.switch)
        sw = self.switch
        # STP off and no forward delay: a port forwards as soon as it has carrier (also after
        # restore_link); no IP on the bridge, so the switch namespace is pure layer 2.
        _ip("-n", sw, "link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0")
        _ip("-n", sw, "link", "set", "br0", "up")
        for i in range(self.hosts):
            self._plug(i)
        for i in range(self.hosts):
            self._wait_link(i, 5.0)
        if self.etcd:
            for i in range(self.etcd_members):
                self.start_etcd(i, state="new")
            self.wait_healthy()

    def _plug(self, i: int) -> None:
        """Host i's namespace, its eth0 with its address, and its port on the switch's bridge."""
        ns, veth, sw = self._host_ns[i], self._veth[i], self.switch
        self._add_ns(ns)  # (recorded at once: close() deletes it, and the veth with it, if a step fails)
        # One end stays in the switch; the peer is created directly inside the host as eth0.
        _ip("-n", sw, "link", "add", veth, "type", "veth", "peer", "name", self.iface, "netns", ns)
        _ip("-n", sw, "link", "set", veth, "master", "br0")
        _ip("-n", sw, "link", "set", veth, "up")
        _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", self.iface)
        _ip("-n", ns, "link", "set", self.iface, "up")

    def _wait_link(self, i: int, timeout: float) -> None:
        ns, veth = self.ns(i), self._veth[i]

        def ready() -> bool:
            host = _ip("-n", ns, "-4", "route", "show", "dev", self.iface)
            port = _ip("-n", self.switch, "-d", "link", "show", "dev", veth)
            up = "state UP" in _ip("-n", ns, "link", "show", "dev", self.iface)
            return up and f"{SUBNET}.0/24" in host and "state forwarding" in port

        _wait(ready, timeout, f"{self.iface} of {ns} to be up and forwarding")

    def _log_tails(self, members: Sequence[int], lines: int = 15) -> str:
        out = []
        for i in members:
            try:
                tail = self.etcd_log(i).read_text(errors="replace").splitlines()[-lines:]
            except (OSError, AssertionError):
                tail = ["(no log)"]
            out.append(f"--- etcd h{i} log tail ({self.etcd_log(i)}):\n" + "\n".join(tail))
        return "\n".join(out)
