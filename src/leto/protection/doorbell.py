"""Doorbells: how workers, the keeper's own threads and the controller wake a sleeping keeper.

A keeper has nothing to do most of a step; polling shared memory for staged chunks cost it more
CPU than folding them. Instead it sleeps in `sigtimedwait` and is woken by a signal: no data
moves through it (the bytes are in shared memory, tier-2 traffic goes over gloo), it only says
"look now". Both signals default to *ignore*, so ringing a process that has not set itself up
yet (a keeper still importing torch) is harmless. A signal that a thread not blocking it takes
(threads started before `install`) is lost to the sleeper, which then wakes at its timeout:
doorbells cut latency and CPU, correctness never depends on them.
"""

from __future__ import annotations

import os
import signal
import threading

DATA = signal.SIGURG  # something to fold: a staged slot, a tier-2 message, a finished barrier
CONTROL = signal.SIGWINCH  # the controller wrote a drain request to the store


def block() -> None:
    """Block both doorbells in the calling thread; threads it starts later, and programs it
    execs, inherit the mask. The controller calls it between fork and exec of a keeper, so that
    the threads torch starts at import leave every ring pending for `wait`."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {DATA, CONTROL})


def install() -> None:
    """Make the calling (main) thread the one that takes rings (see `block`)."""
    for sig in (DATA, CONTROL):
        signal.signal(sig, lambda *_: None)  # a thread that does not block them must not act on them
    block()


def wait(timeout_s: float) -> int | None:
    """Sleep until a doorbell rings or `timeout_s` passes; returns the signal or None."""
    info = signal.sigtimedwait({DATA, CONTROL}, timeout_s)
    return None if info is None else info.si_signo


def ring_main() -> None:
    """Wake this process's main thread (from one of its own threads)."""
    signal.pthread_kill(threading.main_thread().ident, DATA)


class Doorbell:
    """Rings another process by pidfd, so a recycled PID can never be signalled."""

    def __init__(self, pid: int) -> None:
        try:
            self.fd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # already gone: ringing is a no-op, its supervisor handles it
            self.fd = None

    def ring(self, sig: int = DATA) -> None:
        if self.fd is None:
            return
        try:
            signal.pidfd_send_signal(self.fd, sig)
        except ProcessLookupError:  # it exited; whoever supervises it handles that
            self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
