"""The job's processes as the coordinator knows them, and the commands that start and steer them.

The coordinator knows the processes only from its own commands and the supervisors' reports, and
acts on them only by commands written to the store (docs/design.md, "Supervisor and coordinator").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from leto.control import stream
from leto.protocol import keys
from leto.protocol.failures import ProcEventKind
from leto.protocol.messages import Command, ProcEvent

POLL_S = 0.01


@dataclass
class ProcView:
    """A process as the coordinator knows it: from its own requests and the supervisors' reports."""

    proc_id: str
    role: str
    rank: int | None
    node: int
    pid: int = 0
    code: int | None = None  # the exit status once it exited

    @property
    def alive(self) -> bool:  # requested, started and not yet exited
        return self.code is None

    def describe(self) -> str:
        return f"{self.role} rank {self.rank}" if self.rank is not None else f"{self.role} {self.proc_id}"


class Processes:
    """Every process the coordinator asked for (`views`, by id) and the command stream to the supervisors."""

    def __init__(self, store: dist.Store, serve: Callable[[], None] | None, fork_s: float) -> None:
        """`serve`: see `Coordinator`; `fork_s`: how long a zygote may take to fork."""
        self.store, self._serve, self.fork_s = store, serve, fork_s
        self.views: dict[str, ProcView] = {}

    def command(self, cmd: Command) -> None:
        stream.append(self.store, keys.COMMANDS, keys.command, cmd.to_json())

    def flush(self) -> None:
        """Let the supervisor of this thread (if any) carry out the commands written so far."""
        if self._serve is not None:
            self._serve()

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}-{self.store.add(keys.PROC_SEQ, 1)}"

    def spawn(self, role: str, rank: int | None, node: int, boost: bool = False) -> ProcView:
        view = ProcView(self._new_id(f"{role}{rank if rank is not None else ''}"), role, rank, node)
        self.views[view.proc_id] = view
        self.command(Command("spawn", view.proc_id, role, rank, node, boost))
        return view

    def fork_shadows(
        self, node: int, count: int, read_reports: Callable[[], None], boost: bool = False
    ) -> list[ProcView]:
        """Ask the node's warm zygote for `count` shadows at once; those forked in time (none if
        the node has no warm zygote). `boost` (a recovery's fork): the zygote forks at normal
        priority, and the shadow starts at it. A recovery names the shadows only once they are
        forked: asked for while the survivors still wait, a fork took ~0.1 s here; run alongside
        the survivors' join (the membership out first) it took 0.4-0.6 s on 2 cores, and the new
        group waits for the shadow either way. All are asked for before any is awaited, so the
        new processes start up side by side."""
        if count < 1 or not any(
            p.role == "zygote" and p.node == node and p.alive and self.store.check([keys.warm(p.proc_id)])
            for p in self.views.values()
        ):
            return []
        asked = [ProcView(self._new_id("shadow"), "shadow", None, node) for _ in range(count)]
        for view in asked:
            self.views[view.proc_id] = view
            self.command(Command("fork", view.proc_id, "shadow", None, node, boost=boost))
        deadline = time.monotonic() + 2 * self.fork_s + POLL_S
        while time.monotonic() < deadline:
            self.flush()
            read_reports()
            waiting = [v for v in asked if v.proc_id in self.views and not v.pid]  # gone: fork_failed
            if not waiting:
                break
            time.sleep(1e-3)
        for view in asked:
            if view.proc_id in self.views and not view.pid:
                del self.views[view.proc_id]
        return [v for v in asked if v.pid and v.proc_id in self.views]

    def apply(self, e: ProcEvent) -> bool:
        """A supervisor's event: the process's pid, its exit, or a fork that never happened;
        False for a process the coordinator never asked for."""
        view = self.views.get(e.proc_id)
        if view is None:
            return False
        if e.kind is ProcEventKind.STARTED:
            view.pid = e.pid
        elif e.kind in (ProcEventKind.EXITED, ProcEventKind.FENCED):
            view.code = e.code if e.code is not None else -1
            view.pid = e.pid or view.pid
        elif e.kind is ProcEventKind.FORK_FAILED:
            del self.views[e.proc_id]
        return True

    def load(self, node: int) -> int:
        """The live processes of `node` that use its cores (zygotes sleep)."""
        return sum(1 for p in self.views.values() if p.node == node and p.role != "zygote" and p.alive)
