"""Fault injection for every system's benchmark: kill a rank or a node when a step is reached.

The injector watches `run_dir/metrics.jsonl` (rank 0 appends `{"step": n, ...}` after each
completed step) and, when step n >= the target is recorded, signals processes listed in
`run_dir/procs.json` - by PID and start time, never by name: a process listed there that has
exited and whose pid was reused since is never signalled.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from leto.console import parse_records
from leto.protocol.failures import FailureKind
from leto.runtime.linux import signal_process

POLL_S = 0.005
EXTERNAL = (FailureKind.KILL, FailureKind.NODE_KILL)  # the kinds a signal from outside the job can cause


class InjectionCancelled(RuntimeError):
    """The injection was cancelled before its step was reached."""


@dataclass
class Kill:
    """One executed injection."""

    spec: dict
    time: float  # time.time() right after the signals were sent
    step: int  # the step record that triggered it
    pids: list[int] = field(default_factory=list)


class _StepWatch:
    """Tails metrics.jsonl; survives the file being replaced (a restarted job starts a new one)."""

    def __init__(self, path: Path, since: float) -> None:
        self.path, self.since = path, since
        self.inode: int | None = None
        self.offset = 0
        self.partial = b""

    def max_step(self) -> int | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        if st.st_ino != self.inode or st.st_size < self.offset:
            self.inode, self.offset, self.partial = st.st_ino, 0, b""
        if st.st_size == self.offset:
            return None
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        best: int | None = None
        for rec in parse_records(lines):
            if "event" in rec or not isinstance(rec.get("step"), int):
                continue
            if rec.get("time", self.since) < self.since:  # a record of an earlier run in this folder
                continue
            best = rec["step"] if best is None else max(best, rec["step"])
        return best


def _targets(run_dir: Path, rank: int | None, node: int | None) -> list[tuple[int, str | None]]:
    """(pid, start time) of the processes procs.json lists for `rank` (a worker) or `node`
    (all but the controller)."""
    try:
        procs = json.loads((run_dir / "procs.json").read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(procs, list):
        return []
    procs = [p for p in procs if isinstance(p, dict) and isinstance(p.get("pid"), int) and p["pid"] > 0]
    if rank is not None:
        chosen = [p for p in procs if p.get("role") == "worker" and p.get("rank") == rank]
    else:
        chosen = [p for p in procs if p.get("role") != "controller" and p.get("node") == node]
    return [(p["pid"], p.get("start")) for p in chosen]


def inject_at_step(
    run_dir: Path,
    *,
    rank: int | None = None,
    node: int | None = None,
    step: int,
    sig: int = signal.SIGKILL,
    timeout_s: float = 600.0,
    since: float | None = None,
    cancel: threading.Event | None = None,
) -> Kill:
    """Like `kill_at_step`, returning what was done (`Kill`)."""
    if (rank is None) == (node is None):
        raise ValueError("give exactly one of rank= or node=")
    watch = _StepWatch(Path(run_dir) / "metrics.jsonl", time.time() if since is None else since)
    deadline = time.monotonic() + timeout_s
    seen: int | None = None
    while True:
        if cancel is not None and cancel.is_set():
            raise InjectionCancelled(f"cancelled before step {step}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"step {step} not reached in {run_dir} within {timeout_s}s (last seen: {seen})")
        latest = watch.max_step()
        if latest is not None:
            seen = latest if seen is None else max(seen, latest)
        if seen is not None and seen >= step:
            # a zombie (died, not yet reaped) or a reused pid has another start time: not signalled
            sent = [pid for pid, start in _targets(Path(run_dir), rank, node) if signal_process(pid, start, sig)]
            if sent:
                kind = FailureKind.KILL if rank is not None else FailureKind.NODE_KILL
                spec = {
                    "kind": kind.value,
                    "rank": rank,
                    "node": node,
                    "step": step,
                    "signal": signal.Signals(sig).name,
                }
                return Kill(spec, time.time(), seen, sent)
            # procs.json does not list a live target yet (a job between restarts): keep looking
        time.sleep(POLL_S)


def kill_at_step(
    run_dir: Path,
    *,
    rank: int | None = None,
    node: int | None = None,
    step: int,
    sig: int = signal.SIGKILL,
    timeout_s: float = 600.0,
) -> float:
    """Wait until step >= `step` is recorded in run_dir/metrics.jsonl, then send `sig` to the worker
    with that `rank`, or to every process (worker, shadow, keeper) of `node`, by PID from
    run_dir/procs.json. Returns time.time() of the kill; TimeoutError if the step never comes."""
    return inject_at_step(run_dir, rank=rank, node=node, step=step, sig=sig, timeout_s=timeout_s).time


class ExternalInjector:
    """Runs injections `[{"kind": "kill"|"node-kill", "rank", "node", "step"}, ...]` against a
    run folder, each from its own background thread; `stop()` cancels what has not fired."""

    def __init__(self, run_dir: Path, inject: list[dict], timeout_s: float = 3600.0, sig: int = signal.SIGKILL) -> None:
        self.run_dir, self.timeout_s, self.sig = Path(run_dir), timeout_s, sig
        self.specs = [self._check(s) for s in inject]
        self.kills: list[Kill] = []
        self.errors: list[str] = []
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    @staticmethod
    def _check(spec: dict) -> dict:
        kind = spec.get("kind", FailureKind.KILL.value)
        if kind not in EXTERNAL:
            raise ValueError(f"unknown injection kind {kind!r}")
        kind = FailureKind(kind)
        if not isinstance(spec.get("step"), int) or spec["step"] < 1:
            raise ValueError(f"injection needs a step >= 1: {spec}")
        who = "node" if kind.targets_node else "rank"
        if not isinstance(spec.get(who), int):
            raise ValueError(f"a {kind.value!r} injection needs an integer {who!r}: {spec}")
        return {
            "kind": kind.value,
            "rank": None if kind.targets_node else spec.get("rank"),
            "node": spec.get("node") if kind.targets_node else None,
            "step": spec["step"],
        }

    def start(self) -> ExternalInjector:
        since = time.time()
        for spec in self.specs:
            t = threading.Thread(
                target=self._run, args=(spec, since), daemon=True, name=f"leto-inject-{spec['kind']}-{spec['step']}"
            )
            t.start()
            self._threads.append(t)
        return self

    def _run(self, spec: dict, since: float) -> None:
        try:
            kill = inject_at_step(
                self.run_dir,
                rank=spec["rank"],
                node=spec["node"],
                step=spec["step"],
                sig=self.sig,
                timeout_s=self.timeout_s,
                since=since,
                cancel=self._cancel,
            )
        except InjectionCancelled:
            return
        except Exception as e:  # reported, not raised: the benchmark decides what a missed fault means
            with self._lock:
                self.errors.append(f"{spec}: {e}")
            return
        kill.spec = {**spec, "signal": kill.spec["signal"]}
        with self._lock:
            self.kills.append(kill)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._cancel.set()
        for t in self._threads:
            t.join(timeout=timeout_s)

    def __enter__(self) -> ExternalInjector:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
