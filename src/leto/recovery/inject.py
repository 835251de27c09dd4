"""Fault injection for tests and demos: real signals at chosen steps and phases.

`--inject KIND:rank=R|node=N:step=S[:phase=P][:chunk=C]`, repeatable. KIND is `kill` (SIGKILL
the rank), `stop` (SIGSTOP it: a hang), `hang` (the training thread sleeps for ever while the
process and its heartbeat thread live on: a deadlock only progress can reveal) or `node-kill`
(SIGKILL every process of node N: workers, shadows, keeper). Step S is the 1-based step being
computed; the phase is where in it (default forward): forward, backward, tp-forward and
tp-backward (with tensor parallelism: inside the first TP all-reduce of the forward or backward
pass, its peers already in it), pp-warmup, pp-steady, pp-cooldown (with pipeline stages: as the
stage's part of the 1F1B schedule enters that phase), pp-send, pp-recv (as the stage posts a
micro-batch's activations or gradients to a neighbour, or a receive from one; chunk=C picks the
micro-batch, default the middle one), tied (the tied embedding's gradient sum between the first
and last stage), reduce-scatter, grads (staging gradient chunks), update (the
chunked optimizer update), all-gather, parity (staging the state deltas of the previous step,
which happens at the start of step S), recovery (while joining the first recovery at or after
step S). In the chunked phases the failure hits just
before chunk C (default: the middle chunk). Each injection fires once per job, even if the step
is redone after recovery.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from leto.protocol import keys
from leto.protocol.failures import FailureKind
from leto.runtime import linux

PHASES = (
    "forward",
    "backward",
    "tp-forward",
    "tp-backward",
    "pp-warmup",
    "pp-steady",
    "pp-cooldown",
    "pp-send",
    "pp-recv",
    "tied",
    "reduce-scatter",
    "grads",
    "update",
    "all-gather",
    "parity",
    "recovery",
    "digest",  # the final digest, after the last step (step=S: the last step)
)
# phases that run chunk by chunk (chunk=C picks the boundary) or micro-batch by micro-batch
CHUNKED = ("grads", "update", "parity", "pp-send", "pp-recv")


@dataclass(frozen=True)
class Injection:
    index: int
    kind: FailureKind
    step: int
    phase: str = "forward"
    rank: int | None = None
    node: int | None = None
    chunk: int | None = None


def parse(spec: str, index: int = 0) -> Injection:
    """Parse one --inject spec; ValueError naming the problem."""
    parts = spec.split(":")
    try:
        kind = FailureKind(parts[0])
    except ValueError:
        raise ValueError(f"--inject {spec!r}: unknown kind {parts[0]!r}; use one of {', '.join(FailureKind)}") from None
    fields: dict[str, str] = {}
    for part in parts[1:]:
        key, sep, value = part.partition("=")
        if not sep or key not in ("rank", "node", "step", "phase", "chunk"):
            raise ValueError(
                f"--inject {spec!r}: bad field {part!r}; expected rank=R, node=N, step=S, phase=P, chunk=C"
            )
        fields[key] = value
    try:
        step = int(fields["step"])
        rank = int(fields["rank"]) if "rank" in fields else None
        node = int(fields["node"]) if "node" in fields else None
        chunk = int(fields["chunk"]) if "chunk" in fields else None
    except KeyError:
        raise ValueError(f"--inject {spec!r}: step=S is required") from None
    except ValueError:
        raise ValueError(f"--inject {spec!r}: rank, node, step and chunk must be integers") from None
    phase = fields.get("phase", "forward")
    if phase not in PHASES:
        raise ValueError(f"--inject {spec!r}: unknown phase {phase!r}; use one of {', '.join(PHASES)}")
    if chunk is not None and phase not in CHUNKED:
        raise ValueError(f"--inject {spec!r}: chunk=C only applies to phases {', '.join(CHUNKED)}")
    if step < 1:
        raise ValueError(f"--inject {spec!r}: step must be at least 1")
    if kind.targets_node and node is None:
        raise ValueError(f"--inject {spec!r}: {kind} needs node=N")
    if not kind.targets_node and rank is None:
        raise ValueError(f"--inject {spec!r}: {kind} needs rank=R")
    return Injection(index, kind, step, phase, rank, node, chunk)


class InProcessInjector:
    """Fires this process's injections at the matching (step, phase)."""

    def __init__(self, store, specs: list[str], run_dir: Path | None, proc_id: str) -> None:
        self.store, self.run_dir, self.proc_id = store, run_dir, proc_id
        self.todo = [parse(s, i) for i, s in enumerate(specs)]

    def at(
        self,
        phase: str,
        step: int,
        rank: int,
        node_of_rank: tuple[int, ...],
        chunk: int | None = None,
        n_chunks: int = 0,
    ) -> None:
        for inj in self.todo:
            if inj.phase != phase or (inj.step > step if phase == "recovery" else inj.step != step):
                continue
            if chunk is not None and chunk != (n_chunks // 2 if inj.chunk is None else inj.chunk):
                continue
            if inj.kind.targets_node:
                if inj.node is None or rank != min(
                    (r for r, n in enumerate(node_of_rank) if n == inj.node), default=-1
                ):
                    continue
            elif inj.rank != rank:
                continue
            fired = keys.inject_fired(inj.index)
            if self.store.check([fired]):
                continue
            self.store.set(fired, self.proc_id)
            self.store.set(keys.inject_time(self.proc_id), str(time.time()))
            self._fire(inj)

    def _fire(self, inj: Injection) -> None:
        """Each `FailureKind`'s action."""
        if inj.kind is FailureKind.STOP:
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        if inj.kind is FailureKind.HANG:  # for ever, on purpose: only the controller's fence ends it
            while True:
                time.sleep(3600)
        if inj.kind is FailureKind.NODE_KILL and self.run_dir is not None:
            procs = json.loads((self.run_dir / "procs.json").read_text())
            for p in procs:
                if p["node"] == inj.node and p["pid"] != os.getpid():
                    self.store.set(keys.inject_time(p["id"]), str(time.time()))
                    linux.signal_process(p["pid"], p.get("start"), signal.SIGKILL)  # never a reused pid
        os.kill(os.getpid(), signal.SIGKILL)
