"""The one process-group handle of a worker, rebuildable inside the running process.

Every collective goes through `Comm`: it waits on the asynchronous work while polling an abort
check, so a worker blocked on a dead peer can be released by the control plane instead of
sitting out the backend's timeout (gloo cannot abort an in-flight operation, so the abandoned
group is left to time out in the background and never used again).
"""

from __future__ import annotations

import atexit
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from leto.protocol import keys
from leto.runtime import threads
from leto.runtime.linux import disarm_in_epoll


class PeerFailure(RuntimeError):
    """A collective failed or was aborted because the membership changed."""


def backend_for(device: torch.device, world_size: int) -> str:
    """NCCL where every rank has a GPU of its own; gloo otherwise: on the CPU, and where ranks
    share a GPU (NCCL cannot put two ranks on one device), with CUDA tensors through host copies.
    `world_size` is the job's, so every generation and subgroup of a job uses one backend."""
    return "nccl" if device.type == "cuda" and torch.cuda.device_count() >= world_size else "gloo"


def reduction_replicates(backend: str) -> bool:
    """Whether the gradient reduction leaves every rank holding the whole reduced gradient: on
    gloo it is an all-reduce (see `Comm.reduce_scatter`), on NCCL a real reduce-scatter."""
    return backend != "nccl"


class Comm:
    """Collectives of one membership generation over a torch.distributed backend."""

    def __init__(
        self,
        store: dist.Store,
        generation: int,
        rank: int,
        world_size: int,
        timeout_s: float,
        abort_check: Callable[[], str | None] = lambda: None,
        device: torch.device | None = None,
        name: str = "world",
        backend: str | None = None,
    ) -> None:
        self.rank, self.world_size, self.generation = rank, world_size, generation
        self.timeout_s = timeout_s
        self.abort_check = abort_check
        self.device = device or torch.device("cpu")
        self.backend = backend or backend_for(self.device, world_size)
        self.via_host = self.backend == "gloo" and self.device.type == "cuda"  # gloo collectives are CPU ones
        # a store client of its own: a client serves one request at a time, and a rendezvous left
        # waiting for a peer that died before it joined would hold the process's client (the
        # recovery's reads of the next generation) until the store's timeout. Python holds it, here
        # and in `make` for the rendezvous thread: a store written in Python (etcd's) is only a C++
        # shell once Python lets go of it
        self._store = client = store.clone()
        prefix, timeout = keys.group(generation, name), timedelta(seconds=timeout_s)

        def make() -> dist.ProcessGroup:
            group_store = dist.PrefixStore(prefix, client)
            if self.backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                return dist.ProcessGroupNCCL(group_store, rank, world_size, opts)
            return dist.ProcessGroupGloo(group_store, rank, world_size, timeout)

        self.pg: dist.ProcessGroup = self._rendezvous(make)

    def _rendezvous(self, make: Callable[[], dist.ProcessGroup]) -> dist.ProcessGroup:
        """Build the group in a helper thread: its store rendezvous cannot be interrupted, and
        a peer that died before joining must not hold this process until the store timeout."""
        box: list = []
        before = _sockets()
        thread = threads.start(lambda: box.append(_call(make)), "leto-rendezvous")
        deadline = time.monotonic() + self.timeout_s
        while thread.is_alive():
            thread.join(timeout=1e-3)
            reason = self.abort_check()
            if reason and thread.is_alive():
                raise PeerFailure(f"joining generation {self.generation} aborted: {reason}")
            if time.monotonic() > deadline and thread.is_alive():
                raise PeerFailure(f"joining generation {self.generation} timed out after {self.timeout_s:.0f}s")
        result = box[0]
        if isinstance(result, BaseException):
            raise PeerFailure(f"joining generation {self.generation} failed: {result}") from result
        # the group's own connections: nothing else in a worker opens sockets while it is built
        self._own_sockets = {fd: ident for fd, ident in _sockets().items() if before.get(fd) != ident}
        return result

    def _wait(self, work: dist.Work, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        delay = 1e-5
        while True:
            try:
                if work.is_completed():
                    work.wait()  # re-raises a failure of the operation
                    return
            except RuntimeError as e:
                raise PeerFailure(f"{what} failed in generation {self.generation}: {e}") from e
            reason = self.abort_check()
            if reason:
                raise PeerFailure(f"{what} aborted in generation {self.generation}: {reason}")
            if time.monotonic() > deadline:
                raise PeerFailure(f"{what} timed out after {self.timeout_s:.1f}s in generation {self.generation}")
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, used: int | None = None) -> None:
        """out = this rank's slice of the element-wise sum of `inp` over ranks; `inp` is clobbered.

        gloo's reduce-scatter runs synchronously inside `wait()` (so it cannot be aborted) and
        measured 2x slower than its ring all-reduce on loopback, so on gloo it is an all-reduce,
        of the first `used` elements where only they carry data (the rest being zero everywhere).
        """
        if self.backend == "nccl":
            self._wait(self.pg._reduce_scatter_base(out, inp), "reduce-scatter")
            return
        self.all_reduce(inp[:used])
        n = out.numel()
        out.copy_(inp[self.rank * n : (self.rank + 1) * n])

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """out = the concatenation of every rank's `inp`."""
        host_out, host_inp = self._host(out), self._host(inp)
        self._wait(self.pg._allgather_base(host_out, host_inp), "all-gather")
        self._back(out, host_out)

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
        self.start_all_reduce(t, op)()

    def start_all_reduce(self, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> Callable[[], None]:
        """Start an all-reduce of `t`; the returned function waits for it (several groups' reductions
        can be in flight at once)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        host = self._host(t)
        work = self.pg.allreduce([host], opts)

        def wait() -> None:
            self._wait(work, "all-reduce")
            self._back(t, host)

        return wait

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        host = self._host(t)
        self._wait(self.pg.broadcast([host], opts), "broadcast")
        self._back(t, host)

    def exchange(
        self,
        sends: list[tuple[torch.Tensor, int, int]],
        recvs: list[tuple[torch.Tensor, int, int]],
        what: str,
    ) -> None:
        """Point-to-point messages: each `(tensor, peer, tag)` of `sends` goes to rank `peer`, each
        of `recvs` is filled from it; all are posted at once, then waited for. A message is
        matched by (peer, tag), so tags keep apart several messages between one pair of ranks.
        Tensors must be contiguous."""
        if not sends and not recvs:
            return
        host_sends = [(self._host(t), peer, tag) for t, peer, tag in sends]
        host_recvs = [(self._host(t), peer, tag) for t, peer, tag in recvs]
        nccl = self.backend == "nccl"
        try:  # posting fails too where a peer has closed its connection already
            if nccl:  # one group of p2p calls: a pair sending to each other would deadlock
                self.pg._start_coalescing()
            works = [self.pg.send([t], peer, tag) for t, peer, tag in host_sends]
            works += [self.pg.recv([t], peer, tag) for t, peer, tag in host_recvs]
            work = self.pg._end_coalescing() if nccl else self._p2p_waiter().wait_on(works)
        except RuntimeError as e:
            raise PeerFailure(f"{what} failed in generation {self.generation}: {e}") from e
        self._wait(work, what)  # type: ignore[arg-type]
        for (t, _, _), (host, _, _) in zip(recvs, host_recvs):
            self._back(t, host)

    def _p2p_waiter(self) -> _P2PWaiter:
        if getattr(self, "_p2p", None) is None:
            self._p2p = _P2PWaiter()
        return self._p2p

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor a collective runs on: `t` itself, or its host copy where gloo carries a
        GPU job's tensors (ranks sharing one GPU)."""
        return t.cpu() if self.via_host else t

    def _back(self, t: torch.Tensor, host: torch.Tensor) -> None:
        if host is not t:
            t.copy_(host)

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, device=self.device))

    def close(self, abandon: bool = False) -> None:
        """Leave the group. A group abandoned after a failure may still have an operation stuck
        in a gloo thread until the backend timeout, and destroying it would block until then; it
        is parked instead, and the process exits without running those destructors."""
        if self.pg is not None and abandon:
            _ABANDONED.append((self.pg, self._store))  # its store too: see __init__
            if len(_ABANDONED) == 1:
                atexit.register(_exit_without_destructors)
            _abort(self.pg)
            own = getattr(self, "_own_sockets", {})
            _shut_down(own)
            if self.backend == "gloo":
                threads.start(lambda: _quiet(own), "leto-quiet")
        if getattr(self, "_p2p", None) is not None:
            self._p2p.stop()
            self._p2p = None
        self.pg = None  # type: ignore[assignment]


def _call(make: Callable[[], dist.ProcessGroup]) -> dist.ProcessGroup | BaseException:
    try:
        return make()
    except BaseException as e:  # handed to the waiting thread
        return e


ABORT_WAIT_S = 1.0  # how long leaving a group waits for gloo to abort it


def _abort(pg: dist.ProcessGroup) -> None:
    """Abort an abandoned group's connections (torch >= 2.9 gloo: `abort()`), in a helper thread
    so that leaving never blocks. Its operations still pending between two live ranks would
    otherwise wait out the backend timeout, and meanwhile gloo's transport thread spins on the
    data their peers keep sending (measured: a third of a core per abandoned group)."""
    abort = getattr(pg, "abort", None)
    if abort is None:
        return
    thread = threads.start(lambda: _call(abort), "leto-abort")
    thread.join(ABORT_WAIT_S)


def _sockets() -> dict[int, str]:
    """This process's socket file descriptors and their identities (`socket:[inode]`)."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            ident = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if ident.startswith("socket:"):
            out[int(name)] = ident
    return out


def _connected(own: dict[int, str]) -> dict[int, str]:
    """Those of a group's sockets that are still open as themselves and are not its listener
    (left alone: gloo terminates the process when accepting on it fails)."""
    now, out = _sockets(), {}
    for fd, ident in own.items():
        if now.get(fd) != ident:
            continue
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                if not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    out[fd] = ident
        except OSError:
            pass
    return out


def _shut_down(own: dict[int, str]) -> None:
    """Shut an abandoned gloo group's connections down (both directions), so that its pending
    operations fail at once on both ends (gloo's `abort()` leaves them open)."""
    for fd in _connected(own):
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


QUIET_AFTER_S = 1.0  # how long gloo has to close an abandoned group's shut-down connections itself


def _quiet(own: dict[int, str]) -> None:
    """After `QUIET_AFTER_S`, disarm in gloo's epoll sets those of an abandoned group's
    connections that gloo has not closed. A message that arrives for an operation this rank
    dropped is never read (gloo waits for a receive buffer that is gone), so the connection
    stays ready and gloo's transport thread spins on it, a whole core, for the rest of the run;
    a connection shut down reports hang-up for ever, to the same effect. Disarmed, it is still
    registered, so gloo can still remove it if it ever closes the connection."""
    time.sleep(QUIET_AFTER_S)
    disarm_in_epoll(_connected(own))


_ABANDONED: list[tuple[dist.ProcessGroup, dist.Store]] = []
_failed = [False]
_prev_hook = sys.excepthook


def _record_failure(*exc: object) -> None:
    _failed[0] = True
    _prev_hook(*exc)  # type: ignore[arg-type]


sys.excepthook = _record_failure


def _exit_without_destructors() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if _failed[0] else 0)


class _Posted:
    """Point-to-point works posted together, standing in for one work in `Comm._wait`: done once
    a `_P2PWaiter` has waited on all of them."""

    # how long `is_completed` waits for the waiter: `_wait` then sees the end at once rather than
    # after one of its sleeps (up to 1 ms each, and a schedule has many exchanges)
    POLL_S = 5e-3

    def __init__(self, works: list[dist.Work]) -> None:
        self.works, self.error, self.done = works, None, threading.Event()

    def wait_all(self) -> None:
        try:
            for work in self.works:
                work.wait()
        except RuntimeError as e:  # handed to the waiting thread
            self.error = e
        finally:
            self.done.set()

    def is_completed(self) -> bool:
        return self.done.wait(self.POLL_S)

    def wait(self) -> None:
        if self.error is not None:
            raise self.error


class _P2PWaiter:
    """One Comm's thread that waits on its gloo sends and receives: their works report
    completion only from inside a blocking `wait()`, with no abort check. One thread for the
    Comm's life rather than one per exchange: starting a thread measured 1-2 ms of an exchange's
    latency on 2 loaded cores, a kept one 0.3 ms in all. An abandoned group's waiter may stay
    stuck in a wait until gloo's timeout; it is a daemon and belongs to that Comm only."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Posted | None] = queue.SimpleQueue()
        threads.start(self._run, "leto-p2p-wait")

    def _run(self) -> None:
        while (posted := self._queue.get()) is not None:
            posted.wait_all()

    def wait_on(self, works: list[dist.Work]) -> _Posted:
        posted = _Posted(works)
        self._queue.put(posted)
        return posted

    def stop(self) -> None:
        self._queue.put(None)
