"""Background threads that never die quietly.

Every long-lived thread of a Leto process starts through `start`. An exception its target does
not handle itself ends the whole process at once: one line on stderr names the process, the
thread and the error, and the exit code is `THREAD_FAILED`. A thread that dies quietly leaves a
process that looks healthy and is not (a heartbeat thread gone: a live worker fenced later as
hung; a keeper's receiver gone: a drain that sits out its timeout); a process that ends is seen
by its supervisor at once and recovered from like any other failure. Errors a thread expects
(a store wait that times out, a peer that closed its connection) stay handled where they are.

Tests make one chosen thread raise with `FAIL_ENV` (see `_planned_failure`): a real exception
in a real thread of a real job, delivered between two of its Python instructions.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time
from collections.abc import Callable

THREAD_FAILED = 70  # the exit code of a process whose background thread failed (EX_SOFTWARE)
FAIL_ENV = "LETO_TEST_FAIL_THREAD"  # tests only: JSON {"thread", "when", ["role", "node", "rank"]}
FAIL_WATCH_S = 600.0  # how long a planned failure waits for its `when` file


class InjectedFailure(Exception):
    """The exception `FAIL_ENV` raises in a thread (an unexpected one: not a RuntimeError)."""


class Thread(threading.Thread):
    """A `threading.Thread` whose target, if it raises, ends the process (see the module's docstring)."""

    def run(self) -> None:
        try:
            super().run()
        except BaseException as e:  # noqa: BLE001 (anything the thread did not handle ends the process)
            fail(self.name, e)

    def start(self) -> None:
        super().start()
        _planned_failure(self)


def start(target: Callable[..., object], name: str, *args: object) -> Thread:
    """Start a daemon `Thread` named `name` that runs `target(*args)`."""
    thread = Thread(target=target, name=name, args=args, daemon=True)
    thread.start()
    return thread


def fail(name: str, error: BaseException) -> None:
    """End this process: thread `name` cannot go on because of `error`."""
    from leto.runtime import env  # here: env imports comm (through mesh), whose threads run under this module

    role = os.environ.get(env.ENV_ROLE, "controller")
    who = f"{role} {os.environ[env.ENV_PROC_ID]}" if os.environ.get(env.ENV_PROC_ID) else role
    detail = str(error).replace("\n", " ")[:500]
    cause = f"{type(error).__name__}: {detail}" if detail else type(error).__name__
    try:
        sys.stderr.write(f"leto: {who} thread {name} failed: {cause}\n")
        sys.stderr.flush()
    finally:
        os._exit(THREAD_FAILED)


def _planned_failure(thread: threading.Thread) -> None:
    """Tests: raise InjectedFailure in `thread` once the file `when` exists, if `FAIL_ENV` names
    it (a prefix of its name) and this process (its role, node and rank variables). Fires once
    per job: the process that creates `when`.fired is the one."""
    spec = os.environ.get(FAIL_ENV)
    if not spec:
        return
    from leto.runtime import env

    failure = json.loads(spec)
    if not thread.name.startswith(failure["thread"]):
        return
    for field, var in (("role", env.ENV_ROLE), ("node", env.ENV_NODE), ("rank", env.ENV_RANK)):
        if field in failure and os.environ.get(var) != str(failure[field]):
            return

    def fire() -> None:
        deadline = time.monotonic() + FAIL_WATCH_S
        while not os.path.exists(failure["when"]):
            if time.monotonic() > deadline or not thread.is_alive():
                return
            time.sleep(0.05)
        try:
            os.close(os.open(failure["when"] + ".fired", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return
        if thread.ident is not None and thread.is_alive():
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(InjectedFailure))

    threading.Thread(target=fire, name=f"{thread.name}-failure", daemon=True).start()
