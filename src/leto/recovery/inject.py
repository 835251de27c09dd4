"""Fault injection for tests and demos: real signals at chosen steps and phases.

`--inject KIND:rank=R|node=N:step=S[:phase=P]`, repeatable. KIND is `kill` (SIGKILL the rank),
`stop` (SIGSTOP it: a hang) or `node-kill` (SIGKILL every process of node N: workers, shadows,
keeper). Step S is the 1-based step being computed; the phase is where in it (default forward).
Each injection fires once per job, even if the step is redone after recovery.
"""
from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

KINDS = ("kill", "stop", "node-kill")
PHASES = ("forward", "backward", "reduce-scatter", "parity", "update", "all-gather")


@dataclass(frozen=True)
class Injection:
    index: int
    kind: str
    step: int
    phase: str = "forward"
    rank: int | None = None
    node: int | None = None


def parse(spec: str, index: int = 0) -> Injection:
    """Parse one --inject spec; ValueError naming the problem."""
    parts = spec.split(":")
    kind = parts[0]
    if kind not in KINDS:
        raise ValueError(f"--inject {spec!r}: unknown kind {kind!r}; use one of {', '.join(KINDS)}")
    fields: dict[str, str] = {}
    for part in parts[1:]:
        key, sep, value = part.partition("=")
        if not sep or key not in ("rank", "node", "step", "phase"):
            raise ValueError(f"--inject {spec!r}: bad field {part!r}; expected rank=R, node=N, step=S, phase=P")
        fields[key] = value
    try:
        step = int(fields["step"])
        rank = int(fields["rank"]) if "rank" in fields else None
        node = int(fields["node"]) if "node" in fields else None
    except KeyError:
        raise ValueError(f"--inject {spec!r}: step=S is required") from None
    except ValueError:
        raise ValueError(f"--inject {spec!r}: rank, node and step must be integers") from None
    phase = fields.get("phase", "forward")
    if phase not in PHASES:
        raise ValueError(f"--inject {spec!r}: unknown phase {phase!r}; use one of {', '.join(PHASES)}")
    if step < 1:
        raise ValueError(f"--inject {spec!r}: step must be at least 1")
    if kind == "node-kill" and node is None:
        raise ValueError(f"--inject {spec!r}: node-kill needs node=N")
    if kind != "node-kill" and rank is None:
        raise ValueError(f"--inject {spec!r}: {kind} needs rank=R")
    return Injection(index, kind, step, phase, rank, node)


class Injector:
    """Fires this process's injections at the matching (step, phase)."""

    def __init__(self, store, specs: list[str], run_dir: Path | None, proc_id: str) -> None:
        self.store, self.run_dir, self.proc_id = store, run_dir, proc_id
        self.todo = [parse(s, i) for i, s in enumerate(specs)]

    def at(self, phase: str, step: int, rank: int, node_of_rank: tuple[int, ...]) -> None:
        for inj in self.todo:
            if inj.step != step or inj.phase != phase:
                continue
            if inj.kind == "node-kill":
                if inj.node is None or rank != min((r for r, n in enumerate(node_of_rank) if n == inj.node), default=-1):
                    continue
            elif inj.rank != rank:
                continue
            fired = f"control/inject/fired/{inj.index}"
            if self.store.check([fired]):
                continue
            self.store.set(fired, self.proc_id)
            self.store.set(f"control/inject/time/{self.proc_id}", str(time.time()))
            self._fire(inj)

    def _fire(self, inj: Injection) -> None:
        if inj.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        if inj.kind == "node-kill" and self.run_dir is not None:
            procs = json.loads((self.run_dir / "procs.json").read_text())
            for p in procs:
                if p["node"] == inj.node and p["pid"] != os.getpid():
                    self.store.set(f"control/inject/time/{p['id']}", str(time.time()))
                    try:
                        os.kill(p["pid"], signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        os.kill(os.getpid(), signal.SIGKILL)
