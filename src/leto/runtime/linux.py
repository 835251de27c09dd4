"""The few Linux process controls Leto needs (prctl through libc, /proc)."""

from __future__ import annotations

import ctypes
import fcntl
import os
import platform
import select
import signal
import socket
import struct
import time

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL("libc.so.6", use_errno=True)
_EPOLL_CTL_MOD = 3
_EPOLLONESHOT = 1 << 30


class _EpollEvent(ctypes.Structure):
    _pack_ = 1 if platform.machine() == "x86_64" else 8  # glibc packs it on x86-64 only
    _fields_ = [("events", ctypes.c_uint32), ("data", ctypes.c_uint64)]


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (so nothing outlives a SIGKILLed controller)."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def become_subreaper() -> None:
    """Adopt orphaned descendants (the shadows a zygote double-forks), to supervise them."""
    _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1)


def fork_adopted(adopter: int, timeout_s: float) -> bool:
    """Fork a process for `adopter` (this process's nearest subreaper ancestor) to adopt: this
    process's child forks it and exits at once. True in the new process, once adopted and set to
    die with its adopter; False in the caller. A new process not adopted in time exits."""
    child = os.fork()
    if child:
        os.waitpid(child, 0)  # the intermediate process exits at once
        return False
    try:
        if os.fork():
            os._exit(0)
        deadline = time.monotonic() + timeout_s
        while os.getppid() != adopter:  # wait until the adopter has taken this orphan
            if time.monotonic() > deadline:
                os._exit(1)
            time.sleep(1e-3)
        die_with_parent()
        if os.getppid() != adopter:  # the adopter died in between
            os._exit(1)
        return True
    except BaseException:  # a half-made process must not return into the caller's code
        os._exit(1)


def proc_stat(pid: int, tid: int | None = None) -> list[str] | None:
    """The fields of /proc/<pid>/stat (or of one thread) after the command name, state first;
    None once the process is gone."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def name_thread(name: str) -> None:
    """Name the calling OS thread (15 bytes at most; /proc/<pid>/task/<tid>/comm shows it)."""
    _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))


def idle_priority() -> None:
    """Run the calling thread (and the threads and programs it starts) only on CPU time nothing
    else wants: SCHED_IDLE."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass


def normal_priority(pid: int | str = "self") -> None:
    """Give every thread of a process normal CPU priority again (SCHED_OTHER; raising a thread
    out of SCHED_IDLE is allowed unprivileged, unlike lowering a nice value)."""
    _set_policy(pid, os.SCHED_OTHER)


def batch_priority(pid: int | str = "self") -> None:
    """Give every thread of a process SCHED_BATCH: its fair share of the CPU like SCHED_OTHER,
    but waking up never preempts a running thread (allowed unprivileged from SCHED_IDLE too)."""
    _set_policy(pid, os.SCHED_BATCH)


def idle_priority_of(pid: int) -> None:
    """Put every thread of another process (of this user) back to SCHED_IDLE."""
    _set_policy(pid, os.SCHED_IDLE)


def _set_policy(pid: int | str, policy: int) -> None:
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tids:
        try:
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))
        except (AttributeError, OSError):
            pass


def describe_exit(code: int) -> str:
    """A child's exit status in words ("was killed by SIGKILL", "exited with code 3")."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def source_address(host: str, port: int) -> str:
    """The local address this host's packets to host:port leave from (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def interface_of(addr: str) -> str | None:
    """The network interface that holds IPv4 address `addr` (gloo binds to an interface by
    name: `GLOO_SOCKET_IFNAME`); None if no interface does."""
    for _, name in socket.if_nameindex():
        if address_of(name) == addr:
            return name
    return None


def address_of(interface: str) -> str | None:
    """The IPv4 address of network interface `interface`; None if it has none (or is no interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:  # SIOCGIFADDR: the interface's IPv4 address
            raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", interface.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(raw[20:24])


def start_time(pid: int) -> str | None:
    """The kernel's start time of process `pid` (clock ticks since boot, as /proc writes it):
    with the pid, it names one process (a pid is reused, a (pid, start time) pair is not until
    a reboot). None if `pid` is not a positive int, or the process is gone or a zombie."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return None
    fields = proc_stat(pid)
    if fields is None or fields[0] in ("Z", "X") or len(fields) < 20:
        return None
    return fields[19]


def same_process(pid: int, start: str | None) -> bool:
    """Whether `pid` is still the live process that had start time `start` (False when `start`
    is None: an unknown start time cannot vouch for a pid)."""
    return start is not None and start_time(pid) == start


def signal_process(pid: int, start: str | None, sig: int) -> bool:
    """Send `sig` to the process (pid, start time), never to a later process that reuses the
    pid: the pid is pinned (a pidfd) before its start time is compared. Whether it was sent."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError) as e:  # gone, or a kernel without pidfds (< 5.3): check, then kill
        if isinstance(e, ProcessLookupError) or not same_process(pid, start):
            return False
        try:
            os.kill(pid, sig)
            return True
        except ProcessLookupError:
            return False
    try:
        if not same_process(pid, start):
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)


class ExitWatch:
    """Sleeps until one of a set of processes exits or a timeout passes: a pidfd per process,
    polled together (a pidfd reads as ready once its process has exited)."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}
        self._poll = select.poll()

    def wait(self, pids: list[int], timeout_s: float) -> None:
        """Return when a process in `pids` has exited (maybe before the call) or after `timeout_s`."""
        for pid in set(self._fds) - set(pids):
            self._poll.unregister(self._fds[pid])
            os.close(self._fds.pop(pid))
        for pid in set(pids) - set(self._fds):
            try:
                self._fds[pid] = os.pidfd_open(pid)
            except (AttributeError, OSError):  # gone already (or no pidfds): look again at once
                timeout_s = 0.0
                continue
            self._poll.register(self._fds[pid], select.POLLIN)
        self._poll.poll(timeout_s * 1e3)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def epoll_watches(epfd: int) -> list[tuple[int, int, int, int]]:
    """What epoll instance `epfd` of this process watches, from /proc/self/fdinfo: (descriptor,
    events, data, inode) each; empty if `epfd` is not an epoll instance any more."""
    out = []
    try:
        with open(f"/proc/self/fdinfo/{epfd}") as f:
            for line in f:
                if line.startswith("tfd:"):
                    fields = line.split()
                    ino = next(x for x in fields if x.startswith("ino:"))
                    out.append((int(fields[1]), int(fields[3], 16), int(fields[5], 16), int(ino[4:], 16)))
    except (OSError, ValueError, IndexError, StopIteration):
        return []
    return out


def disarm_in_epoll(sockets: dict[int, str]) -> int:
    """Make every epoll set of this process that watches one of `sockets` (descriptor ->
    `socket:[inode]`) report it at most once more (EPOLLONESHOT, with the same events and data).
    Its registration stays, so its owner can still modify or remove it; no further event wakes
    the owner's loop for it. Returns how many registrations were disarmed."""
    inodes = {}
    for fd, ident in sockets.items():
        if ident.startswith("socket:[") and ident.endswith("]"):
            inodes[int(ident[8:-1])] = fd
    disarmed = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") != "anon_inode:[eventpoll]":
                continue
        except OSError:
            continue
        for fd, events, data, ino in epoll_watches(int(name)):
            if inodes.get(ino) != fd:
                continue
            event = _EpollEvent(events | _EPOLLONESHOT, data)
            if _libc.epoll_ctl(int(name), _EPOLL_CTL_MOD, fd, ctypes.byref(event)) == 0:
                disarmed += 1
    return disarmed
