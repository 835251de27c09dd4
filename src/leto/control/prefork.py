"""The host's fork server: one interpreter imports torch once, and every process the supervisor
starts is forked from it instead of being a new interpreter.

Why: `import torch` costs ~3 s of CPU here, and a 4-worker job with 1 spare starts 10 such
interpreters (controller, keepers, zygotes, workers, shadows). On 2 cores that took 17 s before
the first step. A fork costs milliseconds and shares the imported pages until they are written.

A forked process is made like a new interpreter:
- its own session, environment, working folder, argv, `sys.path[0]` and `__main__` (runpy);
- numpy's global generator is reseeded (`random` reseeds itself at fork);
- the same pre-start set-up its role gets from Popen (`PREPARE`).

What the server imported is frozen out of the garbage collector (`gc.freeze`) before it forks,
and a forked process that returns (or exits) ends like a `multiprocessing` child: atexit
handlers, then `os._exit`. A collection, or the interpreter's teardown, would otherwise walk every
object of torch in each process, copying the pages it shares (1.5 s a worker at the end of a run
here, 0.8 s of it the collection).

It is double-forked, so that the supervisor (a child subreaper) adopts it and reaps it like any
child; it tells the supervisor its pid only once adopted. The server never initializes CUDA, so
a forked process may. A command the server cannot run like `python ARGV` (interpreter flags)
is exec'd, and so is everything once the server fails (`ForkServer.broken` says why) or with
`--fork-server off`.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import runpy
import select
import subprocess
import sys
import threading
import time
from typing import NoReturn

from leto.config import JobConfig
from leto.protection import doorbell
from leto.runtime import linux

READY_TIMEOUT_S = 120.0  # the server's imports, on a host that is busy starting a job
REQUEST_TIMEOUT_S = 10.0  # one fork and adoption
ADOPT_TIMEOUT_S = 5.0
PRELOAD = ("torch", "torch.distributed", "leto.runtime.env", "leto.protection.keeper", "leto.training.train_gpt")
PERSIST_PRELOAD = ("torch.distributed.checkpoint",)  # ~2 s more per process where the job persists


def start_keeper() -> None:
    """A keeper starts with its doorbells blocked, so every thread it starts inherits the mask and
    leaves the rings to the thread that sleeps on them. It starts at idle priority, so that it
    never slows the workers' own start, and takes SCHED_BATCH once it is about to serve
    (`keeper.main`)."""
    linux.die_with_parent()
    doorbell.block()
    linux.idle_priority()


def start_shadow() -> None:
    """A shadow warms up (imports, builds its model) only on CPU time the job leaves idle:
    SCHED_IDLE, undone by a `boost` command when it is needed."""
    linux.die_with_parent()
    linux.idle_priority()


PREPARE = {"keeper": start_keeper, "shadow": start_shadow, "zygote": start_shadow}


def prepare(role: str) -> None:
    """The pre-start set-up of a process of `role`: it dies with its parent, and more by role."""
    PREPARE.get(role, linux.die_with_parent)()


def forkable(argv: tuple[str, ...] | list[str]) -> bool:
    """Whether the server can run `python ARGV`: `-m MODULE ...` or `SCRIPT ...`."""
    return bool(argv) and (argv[0] == "-m" and len(argv) > 1 or not argv[0].startswith("-"))


class ForkServer:
    """The supervisor's end of its host's fork server (started at once, ready seconds later)."""

    def __init__(self, env: dict[str, str], config: JobConfig) -> None:
        req_r, self._req_w = os.pipe()
        self._resp_r, resp_w = os.pipe()
        preload = PRELOAD + (PERSIST_PRELOAD if config.persistence.dir is not None else ())
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "leto.control.prefork", str(req_r), str(resp_w), ",".join(preload)],
                env=env,
                pass_fds=(req_r, resp_w),
                start_new_session=True,
                preexec_fn=linux.die_with_parent,
            )
        finally:
            os.close(req_r)
            os.close(resp_w)
        os.set_blocking(self._req_w, False)
        self.broken: str | None = None
        self._ready = False
        self._seq = 0
        self._buf = b""

    def start(self, argv: list[str], env: dict[str, str], role: str, quiet: bool) -> int | None:
        """Fork `python ARGV` with `env` for a process of `role`; its pid once this process has
        adopted it, or None when the server cannot (then `broken` says why, and stays set)."""
        if self.broken is not None:
            return None
        try:
            if not self._ready:
                self._expect("ready", time.monotonic() + READY_TIMEOUT_S)
                self._ready = True
            self._seq += 1
            request = {"id": self._seq, "argv": argv, "env": env, "role": role, "quiet": quiet, "cwd": os.getcwd()}
            deadline = time.monotonic() + REQUEST_TIMEOUT_S
            self._send((json.dumps(request) + "\n").encode(), deadline)
            return int(self._expect(str(self._seq), deadline))
        except (OSError, TimeoutError, ValueError) as e:
            self.close(f"{type(e).__name__}: {e}")
            return None

    def close(self, why: str = "closed") -> None:
        """Stop the server (the processes it forked are this process's children and live on)."""
        if self.broken is None:
            self.broken = why
        for fd in (self._req_w, self._resp_r):
            try:
                os.close(fd)
            except OSError:
                pass
        self._req_w = self._resp_r = -1
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()

    def _send(self, data: bytes, deadline: float) -> None:
        while data:
            if not select.select([], [self._req_w], [], max(0.0, deadline - time.monotonic()))[1]:
                raise TimeoutError("the fork server takes no request")
            data = data[os.write(self._req_w, data) :]

    def _expect(self, tag: str, deadline: float) -> str:
        """The rest of the next line from the server, which must start with `tag`."""
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._resp_r], [], [], left)[0]:
                code = self.popen.poll()
                raise TimeoutError(
                    "the fork server did not answer" if code is None else f"the fork server {linux.describe_exit(code)}"
                )
            chunk = os.read(self._resp_r, 4096)
            if not chunk:
                raise OSError(f"the fork server {linux.describe_exit(self.popen.wait())}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        head, _, rest = line.decode().partition(" ")
        if head != tag:
            raise ValueError(f"the fork server answered {line[:80]!r} where {tag!r} was due")
        return rest


def serve(req_fd: int, resp_fd: int, preload: list[str]) -> dict | None:
    """The server: import `preload`, then fork a process per request until the supervisor closes
    the requests (None). Returns the request in a forked process, made ready to run it."""
    for name in preload:
        importlib.import_module(name)
    # what every fork inherits, kept out of its collections: a collection, or the interpreter's
    # teardown at exit, would otherwise walk (and so copy) every page the server imported
    gc.freeze()
    adopter = os.getppid()
    os.write(resp_fd, b"ready\n")
    with os.fdopen(req_fd, "r") as requests:
        for line in requests:
            request = json.loads(line)
            if linux.fork_adopted(adopter, ADOPT_TIMEOUT_S):
                try:
                    _become(request, resp_fd)
                except BaseException:  # a half-made process must not run anything
                    os._exit(1)
                return request
    return None


def _become(request: dict, resp_fd: int) -> None:
    os.setsid()
    prepare(request["role"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if request["quiet"]:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
    if "numpy" in sys.modules:  # seeded from entropy at import: a new interpreter's would differ
        sys.modules["numpy"].random.seed()
    os.write(resp_fd, f"{request['id']} {os.getpid()}\n".encode())
    os.close(resp_fd)


def run(argv: list[str]) -> None:
    """Run `python ARGV` in this interpreter, as `python` would."""
    if argv[0] == "-m":
        sys.modules.pop(argv[1], None)  # preloaded (the keeper): run afresh as __main__, as `python -m` does
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def exit_now(code: int) -> NoReturn:
    """End a forked process as `multiprocessing` ends its children: its non-daemon threads are
    waited for, the atexit handlers run and buffered output is written, then `os._exit`, without
    the interpreter's teardown of what it imported."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or its reader gone: nothing more can be said
            pass
    os._exit(code)


def exit_code(e: SystemExit) -> int:
    """The status `python` exits with for `e` (a message is printed and counts as 1)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    job = serve(int(sys.argv[1]), int(sys.argv[2]), [m for m in sys.argv[3].split(",") if m])
    if job is not None:
        try:
            run(job["argv"])
        except SystemExit as e:
            exit_now(exit_code(e))
        exit_now(0)
