"""A gloo group parked after a failure costs its survivors nothing for the rest of the run.

The case: a receive this rank posted is dropped with its group (its buffer is gone), and the
peer's message for it arrives anyway. gloo never reads it, waiting for a receive buffer that will
not come back, so the connection stays ready and gloo's transport thread wakes on it without end:
a whole core, for the rest of the run, in a process that trains on. Parking the group disarms its
connections in gloo's epoll sets; gloo can still close them (here: another of its receives times
out, and gloo closes every connection of the group).
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch

from leto.runtime.comm import QUIET_AFTER_S, Comm, _sockets
from leto.runtime.env import LOOPBACK, connect, loopback_store, network_env
from leto.runtime.linux import disarm_in_epoll, proc_stat

GROUP_TIMEOUT_S = 4.0
SPINNING = 20  # clock ticks a second (of 100) of gloo's threads: spinning, even on a loaded machine
QUIET = 5  # gloo's loop wakes 100 times a second when idle, which costs well under one tick


def test_a_disarmed_socket_is_reported_once_more_and_stays_registered() -> None:
    a, b = socket.socketpair()
    ep = select.epoll()
    try:
        ep.register(a.fileno(), select.EPOLLIN)
        b.send(b"x")  # never read: level-triggered, `a` is ready at every wait
        assert ep.poll(0) == ep.poll(0) == [(a.fileno(), select.EPOLLIN)]
        assert disarm_in_epoll({a.fileno(): os.readlink(f"/proc/self/fd/{a.fileno()}")}) == 1
        assert ep.poll(0) == [(a.fileno(), select.EPOLLIN)]  # the same data: the owner's handler
        assert ep.poll(0) == []
        b.send(b"y")
        assert ep.poll(0) == []
        ep.modify(a.fileno(), select.EPOLLIN)  # still registered: its owner can re-arm it ...
        assert ep.poll(0) == [(a.fileno(), select.EPOLLIN)]
        ep.unregister(a.fileno())  # ... and remove it
    finally:
        ep.close()
        a.close()
        b.close()


def test_another_process_s_socket_of_the_same_number_is_not_touched() -> None:
    a, b = socket.socketpair()
    ep = select.epoll()
    try:
        ep.register(a.fileno(), select.EPOLLIN)
        b.send(b"x")
        assert disarm_in_epoll({a.fileno(): "socket:[1]"}) == 0  # not the socket open there
        assert ep.poll(0) == ep.poll(0) == [(a.fileno(), select.EPOLLIN)]
    finally:
        ep.close()
        a.close()
        b.close()


@pytest.fixture(scope="module")
def parked() -> dict:
    """Two ranks on loopback; rank 1 reports on its gloo threads and its parked group."""
    store = loopback_store(60)
    cmd = [sys.executable, __file__, f"{LOOPBACK}:{store.port}"]
    env = dict(os.environ, **network_env(LOOPBACK))
    procs = [
        subprocess.Popen([*cmd, str(r)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    return json.loads(outs[1][0].strip().splitlines()[-1])


def test_gloo_spins_on_a_message_for_a_dropped_receive(parked: dict) -> None:
    """The case is real: before its group is parked, rank 1's gloo threads spin."""
    assert parked["ticks_a_s_before_parking"] >= SPINNING, parked


def test_a_parked_group_s_transport_thread_is_quiet(parked: dict) -> None:
    assert parked["ticks_a_s_parked"] <= QUIET, parked


def test_gloo_still_closes_a_parked_group_s_disarmed_connections(parked: dict) -> None:
    """A receive of the parked group times out; gloo closes every connection of the group,
    removing the disarmed ones from its epoll set (it ends the process if that fails)."""
    assert parked["pending_receive"].startswith("raised"), parked
    assert parked["sockets_after_timeout"] < parked["sockets_parked"], parked


def _gloo_ticks() -> int:
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if not f.read().startswith("gloo"):
                    continue
        except OSError:
            continue
        fields = proc_stat(os.getpid(), int(tid))
        if fields is not None:
            total += int(fields[11]) + int(fields[12])  # utime + stime
    return total


def _ticks_a_second(seconds: float) -> float:
    before = _gloo_ticks()
    time.sleep(seconds)
    return (_gloo_ticks() - before) / seconds


def _rank(addr: str, rank: int) -> None:
    torch.set_num_threads(1)
    store = connect(addr, 60)
    comm = Comm(store, 0, rank, 2, GROUP_TIMEOUT_S)
    if rank == 0:
        store.wait(["posted"])
        comm.pg.send([torch.ones(1000)], 1, 7).wait()  # for the receive rank 1 dropped
        store.set("sent", "1")
        store.wait(["done"], timedelta(seconds=GROUP_TIMEOUT_S * 10))
        os._exit(0)
    dropped = comm.pg.recv([torch.zeros(1000)], 0, 7)
    del dropped  # its buffer is gone; rank 0 has been told to send
    pending = comm.pg.recv([torch.zeros(10)], 0, 9)  # never sent: times out once parked
    store.set("posted", "1")
    store.wait(["sent"])
    time.sleep(0.5)
    report = {"ticks_a_s_before_parking": _ticks_a_second(1.0)}
    comm.close(abandon=True)
    time.sleep(QUIET_AFTER_S + 0.5)
    report["ticks_a_s_parked"] = _ticks_a_second(2.0)
    report["sockets_parked"] = len(_sockets())
    try:
        pending.wait()
        report["pending_receive"] = "completed"
    except RuntimeError as e:
        report["pending_receive"] = f"raised {e}"[:200]
    time.sleep(0.5)
    report["sockets_after_timeout"] = len(_sockets())
    store.set("done", "1")
    print(json.dumps(report), flush=True)
    os._exit(0)  # the parked group is never destroyed (as in a worker)


if __name__ == "__main__":
    _rank(sys.argv[1], int(sys.argv[2]))
