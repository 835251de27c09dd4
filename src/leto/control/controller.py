"""`leto run`: host the rendezvous store, start and supervise workers, shadows and keepers.

Like torchrun, but the controller owns the TCPStore (no worker is special) and keeps
`procs.json` current so tests and operators can find every process by role.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from leto.console import MetricsTail, StepDisplay
from leto.control import runtime as rt
from leto.control.membership import Plan, plan_key

_PR_SET_PDEATHSIG = 1
_GRACE_S = 5.0


@dataclass
class JobSpec:
    """What `leto run` was asked to start."""

    command: list[str]               # argv after the python interpreter
    workers: int
    spares: int = 0
    nodes: int = 1
    run_dir: Path = Path("runs")
    timeout_s: float = 60.0
    total_steps: int | None = None   # for the progress bar only
    quiet: bool = False              # no progress output (benchmarks)
    protection: bool = True          # start keepers and protect every step
    ec: tuple[int, int] | None = None  # tier-2 code; None: tier 1 only
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Proc:
    role: str
    rank: int | None
    node: int
    proc_id: str
    popen: subprocess.Popen

    def record(self) -> dict:
        return {"role": self.role, "rank": self.rank, "node": self.node, "pid": self.popen.pid, "id": self.proc_id}


def node_of_rank(rank: int, workers: int, nodes: int) -> int:
    """Ranks are split into `nodes` contiguous, balanced groups (failure domains)."""
    return rank * nodes // workers


def _die_with_parent() -> None:
    # children must not outlive a controller that was SIGKILLed
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Controller:
    """Starts the processes of one job and supervises them until it ends."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.run_dir = spec.run_dir
        self.procs: list[Proc] = []
        self._signal: int | None = None
        self._seq = 0
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=spec.timeout_s))
        self.events: list[dict] = []
        self.job_id = f"{os.getpid()}-{self.store.port}"

    # ----- processes
    def _spawn(self, role: str, rank: int | None, node: int) -> Proc:
        self._seq += 1
        proc_id = f"{role}{rank if rank is not None else ''}-{self._seq}"
        env = dict(os.environ, **self.spec.env)
        env.update({rt.ENV_STORE: f"127.0.0.1:{self.store.port}", rt.ENV_ROLE: role,
                    rt.ENV_WORLD: str(self.spec.workers), rt.ENV_NODE: str(node),
                    rt.ENV_NODES: str(self.spec.nodes), rt.ENV_RUN_DIR: str(self.run_dir),
                    rt.ENV_PROC_ID: proc_id, rt.ENV_TIMEOUT: str(self.spec.timeout_s),
                    rt.ENV_JOB_ID: self.job_id, rt.ENV_PROTECTION: "on" if self.spec.protection else "off",
                    rt.ENV_EC: "+".join(map(str, self.spec.ec)) if self.spec.ec else "none"})
        if rank is not None:
            env[rt.ENV_RANK] = str(rank)
        command = ["-m", "leto.protection.keeper"] if role == "keeper" else self.spec.command
        popen = subprocess.Popen([sys.executable, *command], env=env,
                                 start_new_session=True, preexec_fn=_die_with_parent)
        proc = Proc(role, rank, node, proc_id, popen)
        self.procs.append(proc)
        return proc

    def _write_procs(self) -> None:
        records = [{"role": "controller", "rank": None, "node": None, "pid": os.getpid(), "id": "controller"}]
        records += [p.record() for p in self.procs if p.popen.returncode is None]
        tmp = self.run_dir / "procs.json.tmp"
        tmp.write_text(json.dumps(records, indent=1))
        os.replace(tmp, self.run_dir / "procs.json")

    def _stop_all(self) -> None:
        """SIGTERM every live child, SIGKILL what is left after a grace period, reap all."""
        self.store.set(rt.SHUTDOWN_KEY, "1")
        live = [p for p in self.procs if p.popen.poll() is None]
        for p in live:
            _signal_quietly(p.popen, signal.SIGTERM)
        deadline = time.monotonic() + _GRACE_S
        for p in live:
            try:
                p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_quietly(p.popen, signal.SIGKILL)
                p.popen.wait()
        self._write_procs()
        for f in Path("/dev/shm").glob(f"leto-{self.job_id}-*"):  # keepers' memory dies with the job
            f.unlink(missing_ok=True)

    def event(self, kind: str, **fields: object) -> None:
        rec = {"event": kind, "time": time.time(), **fields}
        self.events.append(rec)
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    # ----- the supervision loop
    def run(self) -> int:
        """Run the job to its end; returns the exit code for `leto run`."""
        t0 = time.monotonic()
        for stale in ("metrics.jsonl", "summary.json"):
            (self.run_dir / stale).unlink(missing_ok=True)
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            nodes = [node_of_rank(r, self.spec.workers, self.spec.nodes) for r in range(self.spec.workers)]
            workers = [self._spawn("worker", r, nodes[r]) for r in range(self.spec.workers)]
            self.store.set(plan_key(0), Plan(0, tuple(nodes), tuple(w.proc_id for w in workers)).to_json())
            for i in range(self.spec.spares):
                self._spawn("shadow", None, i % self.spec.nodes)
            if self.spec.protection:
                for n in range(self.spec.nodes):
                    self._spawn("keeper", None, n)
            self._write_procs()
            code = self._supervise()
        finally:
            self._stop_all()
            for s, h in old.items():
                signal.signal(s, h)
        self._write_summary(time.monotonic() - t0, code)
        return code

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signal = signum

    def _supervise(self) -> int:
        tail = MetricsTail(self.run_dir / "metrics.jsonl")
        with StepDisplay(self.spec.total_steps, quiet=self.spec.quiet) as display:
            self.display = display
            while True:
                for rec in tail.read():
                    if "step" in rec and "event" not in rec:
                        display.step(rec)
                if self._signal is not None:
                    display.message(f"leto: received {signal.Signals(self._signal).name}, stopping all processes")
                    return 128 + self._signal
                workers = [p for p in self.procs if p.role == "worker"]
                for p in self.procs:
                    code = p.popen.poll()
                    if code is None or code == 0:
                        continue
                    if p.role in ("worker", "shadow", "keeper"):
                        what = f"{p.role} rank {p.rank}" if p.rank is not None else f"{p.role} {p.proc_id}"
                        msg = f"{what} (pid {p.popen.pid}, node {p.node}) {describe_exit(code)}"
                        self.event("failure", role=p.role, rank=p.rank, node=p.node, pid=p.popen.pid, cause=describe_exit(code))
                        display.message(f"leto: {msg}; stopping the job")
                        return 1
                if workers and all(p.popen.returncode == 0 for p in workers):
                    for rec in tail.read():
                        if "step" in rec and "event" not in rec:
                            display.step(rec)
                    return 0
                time.sleep(0.05)

    def _write_summary(self, wall_s: float, code: int) -> None:
        result: dict = {"steps": None, "final_loss": None, "digest": None}
        if self.store.check([rt.RESULT_KEY]):
            result.update(json.loads(self.store.get(rt.RESULT_KEY)))
        summary = {**result, "wall_s": round(wall_s, 3), "workers": self.spec.workers,
                   "spares": self.spec.spares, "nodes": self.spec.nodes, "exit_code": code,
                   "recoveries": [e for e in self.events if e["event"] == "recovery"]}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))


def _signal_quietly(popen: subprocess.Popen, sig: int) -> None:
    try:
        popen.send_signal(sig)
    except ProcessLookupError:
        pass
