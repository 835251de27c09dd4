"""Finding spares: the shadows that adopt lost ranks, and keeping `--spares` of them.

A warm zygote forks a shadow in milliseconds; without one a shadow is started from scratch.
"""

from __future__ import annotations

from collections.abc import Callable

from leto.config import JobConfig
from leto.control.decision import Spare
from leto.control.procs import Processes
from leto.protocol import keys


class Spares:
    """The spare shadows of one job and the zygotes that fork them."""

    def __init__(self, processes: Processes, config: JobConfig, read_reports: Callable[[], None]) -> None:
        """`read_reports`: reads the supervisors' new reports (a fork is known once reported)."""
        self.processes, self.cfg, self._read_reports = processes, config, read_reports

    def zygotes_wanted(self) -> bool:
        """Zygotes need spares to make, protection to adopt with, and a job that can fork (a
        zygote that finds a CUDA context says so and exits: CUDA does not survive fork)."""
        return bool(
            self.cfg.recovery.zygotes
            and self.cfg.recovery.spares
            and self.cfg.protection.enabled
            and not self.processes.store.check([keys.ZYGOTES_OFF])
        )

    def live_nodes(self, down: set[int]) -> list[int]:
        return [n for n in range(self.cfg.training.nodes) if n not in down]

    def spare_node(self, down: set[int]) -> int:
        """The live node with the lightest load (node 0 if none is live)."""
        return min(self.live_nodes(down) or [0], key=self.processes.load)

    def fork(self, node: int, count: int = 1, boost: bool = False) -> list[Spare]:
        """Up to `count` shadows forked by the node's warm zygote (none if it has none)."""
        views = self.processes.fork_shadows(node, count, self._read_reports, boost)
        return [Spare(v.proc_id, v.node) for v in views]

    def for_ranks(self, lost: int, down: set[int], cold_down: set[int]) -> list[Spare]:
        """Spares for `lost` ranks off the nodes `down`: the idle shadows, then warm shadows
        forked (milliseconds), then (`--no-spare wait`) cold shadows started on the lightest
        node outside `cold_down`."""
        spares = [
            Spare(p.proc_id, p.node)
            for p in self.processes.views.values()
            if p.role == "shadow" and p.alive and p.node not in down
        ]
        for n in sorted(self.live_nodes(down), key=self.processes.load):
            if len(spares) < lost:
                spares += self.fork(n, lost - len(spares), boost=True)
        while self.cfg.recovery.no_spare == "wait" and len(spares) < lost:  # cold shadows, waited for
            p = self.processes.spawn("shadow", None, self.spare_node(cold_down))
            spares.append(Spare(p.proc_id, p.node))
        return spares

    def warm(self, down: set[int]) -> list[Spare]:
        """The idle shadows off the nodes `down` that are ready to join at once."""
        return [
            Spare(p.proc_id, p.node)
            for p in self.processes.views.values()
            if p.role == "shadow"
            and p.alive
            and p.pid
            and p.node not in down
            and self.processes.store.check([keys.warm(p.proc_id)])
        ]

    def start(self) -> None:
        """Generation 0's shadows and zygotes."""
        nodes = self.cfg.training.nodes
        for i in range(self.cfg.recovery.spares):
            self.processes.spawn("shadow", None, i % nodes)
        if self.zygotes_wanted():
            for n in range(nodes):
                self.processes.spawn("zygote", None, n)

    def replenish(self, down: set[int], missing: int = 0) -> None:
        """Keep --spares shadows: fork new ones from a warm zygote of the node (milliseconds),
        else start them from scratch; restart zygotes that died on live nodes (not `down`). With
        model parallelism and `missing` ranks (after a shrink) at least one replica's worth, so
        a whole replica can rejoin."""
        live = [p for p in self.processes.views.values() if p.role in ("shadow", "zygote") and p.alive]
        if self.zygotes_wanted():
            for n in self.live_nodes(down):
                if not any(p.role == "zygote" and p.node == n for p in live):
                    self.processes.spawn("zygote", None, n)
        wanted = self.cfg.recovery.spares
        if wanted and missing:
            wanted = max(wanted, self.cfg.mesh.replica_ranks)
        for _ in range(wanted - sum(p.role == "shadow" for p in live)):
            node = self.spare_node(down)
            if not self.fork(node):
                self.processes.spawn("shadow", None, node)
        self.processes.flush()
