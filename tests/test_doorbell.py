"""Doorbells wake a sleeping keeper; ringing is harmless to a process that is not listening."""

from __future__ import annotations

import subprocess
import sys
import time

from leto.protection import doorbell
from leto.protection.doorbell import Doorbell

SLEEPER = """
import sys
from leto.protection import doorbell
doorbell.install()
print("ready", flush=True)
for _ in range(int(sys.argv[1])):
    print(doorbell.wait(60.0), flush=True)
"""


def _sleeper(rings: int) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", SLEEPER, str(rings)], stdout=subprocess.PIPE, text=True, preexec_fn=doorbell.block
    )  # as the controller starts keepers
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def test_a_ring_wakes_the_sleeper_with_the_signal_that_was_rung() -> None:
    p = _sleeper(2)
    try:
        bell = Doorbell(p.pid)
        bell.ring()
        assert p.stdout.readline().strip() == str(int(doorbell.DATA))  # woken, not timed out (60 s)
        bell.ring(doorbell.CONTROL)
        assert p.stdout.readline().strip() == str(int(doorbell.CONTROL))
        assert p.wait(timeout=30) == 0
        bell.close()
    finally:
        p.kill()
        p.wait()


def test_a_ring_before_the_sleeper_waits_is_not_lost() -> None:
    """Started with the doorbells blocked (as the controller starts keepers), no thread of the
    process, not even those torch starts at import, can take a ring away from the sleeper."""
    p = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time, sys; from leto.protection import doorbell; "
            "doorbell.install(); print('ready', flush=True); time.sleep(1.0); "
            "print(doorbell.wait(60.0), flush=True)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=doorbell.block,
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        Doorbell(p.pid).ring()  # while it sleeps in time.sleep: stays pending (blocked), not dropped
        assert p.stdout.readline().strip() == str(int(doorbell.DATA))
        assert p.wait(timeout=30) == 0
    finally:
        p.kill()
        p.wait()


def test_ringing_a_process_that_does_not_listen_is_harmless() -> None:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    try:
        bell = Doorbell(p.pid)
        bell.ring()
        bell.ring(doorbell.CONTROL)
        time.sleep(0.2)
        assert p.poll() is None  # both doorbells default to ignore
        assert p.wait(timeout=30) == 0
        bell.ring()  # it exited: nothing to ring, no error
        assert bell.fd is None
    finally:
        p.kill()
        p.wait()


def test_a_doorbell_for_a_process_that_is_gone_rings_nothing() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=30)
    bell = Doorbell(p.pid)  # reaped: no pidfd, no error
    assert bell.fd is None
    bell.ring()
