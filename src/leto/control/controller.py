"""`leto run`: host the rendezvous store, start and supervise workers, shadows and keepers.

Like torchrun, but the controller owns the TCPStore (no worker is special) and keeps
`procs.json` current so tests and operators can find every process by role.
"""
from __future__ import annotations

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
from leto.control.progress import ProgressCheck
from leto.protection import doorbell, shm
from leto.protection.placement import degradation
from leto.protocol import keys
from leto.protocol.messages import Plan, parse_beat
from leto.recovery.decision import Spare, grow_plan, next_plan
from leto.runtime import env as rt
from leto.runtime import linux

FORK_TIMEOUT_S = 2.0  # a zygote that does not deliver a shadow by then is passed over
POLL_S = 0.01
FAILURE_SETTLE_S = 0.005  # after a death: signals sent in one burst (a node's processes) have landed
DYING_GRACE_S = 0.5       # the longest wait for killed processes to be reaped, to decide one event
_PF_EXITING = 0x4
HEARTBEAT_CHECK_S = 0.1
MAX_GENERATIONS = 100  # a job that needs more recoveries than this is failing in a loop
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
    protect_every: int = 1           # protect the state every N steps (--protect-every)
    protect_grads: bool = False      # stage gradients even where every rank holds them (--protect-grads on)
    heartbeat_timeout_s: float = 3.0   # a worker or keeper silent this long is declared hung and fenced
    progress_floor_s: float = 30.0     # a worker whose training thread has not advanced for
    progress_factor: float = 20.0      # max(floor, factor x median step time) is hung (docs/design.md)
    inject: list[str] = field(default_factory=list)  # fault injections (--inject)
    no_spare: str = "shrink"           # lost ranks without a shadow: "shrink" the job, or "wait" for a cold one
    zygotes: bool = True               # one zygote per node forks replacement shadows (CPU jobs)
    env: dict[str, str] = field(default_factory=dict)
    summary_extra: dict = field(default_factory=dict)  # more fields for summary.json (e.g. a resume's)


class Forked:
    """The Popen-like handle of a shadow forked by a zygote and reparented to the controller
    (a child subreaper): poll, wait, signal and returncode like a Popen."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode, self.args = pid, None, [f"<forked {pid}>"]

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: it is gone, cause unknown
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(1e-3)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


@dataclass
class Proc:
    role: str
    rank: int | None
    node: int
    proc_id: str
    popen: subprocess.Popen | Forked

    def record(self) -> dict:
        return {"role": self.role, "rank": self.rank, "node": self.node, "pid": self.popen.pid, "id": self.proc_id}


def node_of_rank(rank: int, workers: int, nodes: int) -> int:
    """Ranks are split into `nodes` contiguous, balanced groups (failure domains)."""
    return rank * nodes // workers


def _start_keeper() -> None:
    """A keeper starts with its doorbells blocked, so every thread it starts (torch starts one at
    import) inherits the mask and leaves the rings to the thread that sleeps on them. It imports
    torch at idle priority, so that it never slows the workers' own start, and takes normal
    priority back once it is about to serve (`keeper.main`)."""
    linux.die_with_parent()
    doorbell.block()
    linux.idle_priority()


def _start_shadow() -> None:
    """A shadow warms up (imports, builds its model) only on CPU time the job leaves idle:
    SCHED_IDLE, undone by `_boost` when it is needed."""
    linux.die_with_parent()
    linux.idle_priority()


def _boost(pid: int) -> None:
    """Give every thread of a shadow normal CPU priority again (it adopts a rank)."""
    linux.normal_priority(pid)


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
        self.members: dict[int, Proc] = {}    # rank -> its process in the current generation
        self.members_before: dict[int, Proc] = {}
        self.handled: set[str] = set()         # processes whose failure was dealt with
        self.pending: list[dict] = []          # recoveries waiting for their first step
        self.dead_keeper_nodes: set[int] = set()
        self.max_step = 0
        self._last_beat_check = 0.0
        self._last_grow_check = 0.0
        self._forks: dict[str, int] = {}       # zygote -> fork requests sent
        self.progress = ProgressCheck(spec.progress_floor_s, spec.progress_factor)

    # ----- processes
    def _spawn(self, role: str, rank: int | None, node: int) -> Proc:
        self._seq += 1
        proc_id = f"{role}{rank if rank is not None else ''}-{self._seq}"
        env = dict(os.environ, **self.spec.env)
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # store waits that time out are routine here
        env.update({rt.ENV_STORE: f"127.0.0.1:{self.store.port}", rt.ENV_ROLE: role,
                    rt.ENV_WORLD: str(self.spec.workers), rt.ENV_NODE: str(node),
                    rt.ENV_NODES: str(self.spec.nodes), rt.ENV_RUN_DIR: str(self.run_dir),
                    rt.ENV_PROC_ID: proc_id, rt.ENV_TIMEOUT: str(self.spec.timeout_s),
                    rt.ENV_JOB_ID: self.job_id, rt.ENV_PROTECTION: "on" if self.spec.protection else "off",
                    rt.ENV_EC: "+".join(map(str, self.spec.ec)) if self.spec.ec else "none",
                    rt.ENV_PROTECT_EVERY: str(self.spec.protect_every),
                    rt.ENV_PROTECT_GRADS: "on" if self.spec.protect_grads else "auto",
                    rt.ENV_INJECT: json.dumps(self.spec.inject)})
        if rank is not None:
            env[rt.ENV_RANK] = str(rank)
        command = ["-m", "leto.protection.keeper"] if role == "keeper" else self.spec.command
        # every child dies with the controller, even a SIGKILLed one (the preexec functions)
        # quiet (benchmarks): the children's own prints go too; their errors still reach stderr
        popen = subprocess.Popen([sys.executable, *command], env=env, start_new_session=True,
                                 stdout=subprocess.DEVNULL if self.spec.quiet else None,
                                 preexec_fn=_start_shadow if role in ("shadow", "zygote") else
                                 _start_keeper if role == "keeper" else linux.die_with_parent)
        proc = Proc(role, rank, node, proc_id, popen)
        self.procs.append(proc)
        return proc

    def _write_procs(self) -> None:
        records = [{"role": "controller", "rank": None, "node": None, "pid": os.getpid(), "id": "controller",
                    "job": self.job_id, "store_port": self.store.port}]
        records += [p.record() for p in self.procs if p.popen.returncode is None]
        tmp = self.run_dir / "procs.json.tmp"
        tmp.write_text(json.dumps(records, indent=1))
        os.replace(tmp, self.run_dir / "procs.json")

    def _stop_all(self) -> None:
        """SIGTERM every live child, SIGKILL what is left after a grace period, reap all."""
        self.store.set(keys.SHUTDOWN, "1")
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

    def _claim_shm(self) -> None:
        """Remove the /dev/shm leftovers of dead jobs, and record this job's owner (the
        record goes with the job's other segments in `_stop_all`)."""
        removed = shm.remove_dead_segments()
        if removed:
            self.event("shm_cleanup", removed=removed)
            if not self.spec.quiet:
                print(f"leto: removed {len(removed)} shared-memory segment(s) left behind by dead jobs", file=sys.stderr)
        shm.write_owner(self.job_id, os.getpid())

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
        # shadows forked by zygotes are orphans: they are reparented here and supervised like children
        linux.become_subreaper()
        self._claim_shm()
        try:
            nodes = [node_of_rank(r, self.spec.workers, self.spec.nodes) for r in range(self.spec.workers)]
            workers = [self._spawn("worker", r, nodes[r]) for r in range(self.spec.workers)]
            self.members = dict(enumerate(workers))
            self.plan = Plan(0, tuple(nodes), tuple(w.proc_id for w in workers))
            self.store.set(keys.plan(0), self.plan.to_json())
            for i in range(self.spec.spares):
                self._spawn("shadow", None, i % self.spec.nodes)
            if self._zygotes_wanted():
                for n in range(self.spec.nodes):
                    self._spawn("zygote", None, n)
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
                        self._close_recoveries(rec)
                        if rec.get("step_s") is not None:
                            self.progress.record_step(float(rec["step_s"]))
                if self._signal is not None:
                    display.message(f"leto: received {signal.Signals(self._signal).name}, stopping all processes")
                    return 128 + self._signal
                failed = self._find_failures()
                if failed:  # processes of one node die within moments of each other: gather them
                    failed += self._await_dying()
                    code = self._on_failures(failed)
                    if code is not None:
                        return code
                self._maybe_grow()
                members = [self.members[r] for r in sorted(self.members)]
                if members and all(p.popen.poll() == 0 for p in members):
                    for rec in tail.read():
                        if "step" in rec and "event" not in rec:
                            display.step(rec)
                            self._close_recoveries(rec)
                    return 0
                time.sleep(POLL_S)

    def _await_dying(self) -> list[tuple[Proc, str]]:
        """Processes killed together (a node) are reaped one by one, 10-100+ ms apart on a loaded
        host: wait while any of ours is killed but not yet reaped, so they make one event. A lone
        failure costs only FAILURE_SETTLE_S."""
        time.sleep(FAILURE_SETTLE_S)
        deadline = time.monotonic() + DYING_GRACE_S
        while time.monotonic() < deadline and any(  # poll() first: it reaps the dead (zombies are dying)
                _dying(p.popen.pid) for p in self.procs if p.proc_id not in self.handled and p.popen.poll() is None):
            time.sleep(1e-3)
        return self._find_failures()

    def _find_failures(self) -> list[tuple[Proc, str]]:
        """Processes that died (any non-zero exit), stopped heartbeating or stopped making
        progress (both fenced here)."""
        out = []
        now = time.time()
        check_beats = now - self._last_beat_check >= HEARTBEAT_CHECK_S
        if check_beats:
            self._last_beat_check = now
        if self.pending:  # a recovery or resize runs: its phases are no steps (ProgressCheck.reset)
            self.progress.reset()
        for p in self.procs:
            if p.proc_id in self.handled:
                continue
            code = p.popen.poll()
            if code is not None:
                if code != 0 or p.role == "keeper":
                    out.append((p, describe_exit(code)))
                else:  # a worker or shadow that finished
                    self.handled.add(p.proc_id)
                continue
            why = self._hung(p, now) if check_beats and p.role in ("worker", "keeper") else None
            if why is not None:
                _signal_quietly(p.popen, signal.SIGKILL)  # fence: a stopped process must never come back
                p.popen.wait()
                out.append((p, f"{why}; fenced with SIGKILL"))
        for p, _ in out:
            self.handled.add(p.proc_id)
        return out

    def _hung(self, p: Proc, now: float) -> str | None:
        """Why a live worker or keeper counts as hung: no heartbeat for the heartbeat timeout,
        or (a worker of the current generation) a training thread that made no progress for
        the progress timeout; None while it is fine."""
        beat = self._beat(p)
        if beat is None:
            return None
        last, progress = beat
        if now - last > self.spec.heartbeat_timeout_s:
            return f"stopped heartbeating for {now - last:.1f}s (hung)"
        if p.role != "worker" or self.pending or not any(m is p for m in self.members.values()):
            return None
        stalled = self.progress.stalled_for(p.proc_id, progress, now)
        if stalled is None:
            return None
        return (f"made no progress for {stalled:.1f}s though its process heartbeats (training thread hung; "
                f"timeout {self.progress.timeout_s():.1f}s)")

    def _beat(self, p: Proc) -> tuple[float, int] | None:
        """The last heartbeat (time, progress), or None (not started yet, or left on purpose)."""
        key = keys.heartbeat(p.proc_id)
        if not self.store.check([key]):
            return None
        return parse_beat(self.store.get(key).decode())

    def _heartbeat(self, p: Proc) -> float | None:
        """The last heartbeat time, or None (not started yet, or left the job on purpose)."""
        beat = self._beat(p)
        return None if beat is None else beat[0]

    def _on_failures(self, failed: list[tuple[Proc, str]]) -> int | None:
        """Decide generation g+1 and announce it; returns an exit code when the job must stop."""
        t_detect = time.time()
        if self.store.check([keys.FATAL]):
            msg = self.store.get(keys.FATAL).decode()
            self.event("fatal", cause=msg)
            self.display.message(f"leto: cannot recover: {msg}; stopping the job")
            return 1
        for p, why in failed:
            what = f"{p.role} rank {p.rank}" if p.rank is not None else f"{p.role} {p.proc_id}"
            self.display.message(f"leto: {what} (pid {p.popen.pid}, node {p.node}) {why}")
            self.event("failure", role=p.role, rank=p.rank, node=p.node, pid=p.popen.pid, cause=why)
        dead_keepers = {p.node for p, _ in failed if p.role == "keeper"}
        lost_ranks = {r for r, p in self.members.items() if any(p is f for f, _ in failed)}
        lost_nodes = {n for n in dead_keepers
                      if all(p.popen.poll() not in (None, 0) for p in self.members.values() if p.node == n)}
        if not lost_ranks and not dead_keepers:
            self._replenish()
            return None  # only idle shadows died
        if not self.spec.protection:
            self.display.message("leto: protection is off, so the lost state cannot be rebuilt; stopping the job")
            return 1
        if self.plan.generation >= MAX_GENERATIONS:
            self.display.message(f"leto: {MAX_GENERATIONS} recoveries in one job: something fails over and over; "
                                 f"stopping the job rather than loop")
            return 1
        if not self._ever_protected():
            self.display.message("leto: the failure came before any state was protected (the script does not use "
                                 "leto.Trainer, or protection had not started); stopping the job")
            return 1
        down = dead_keepers | self.dead_keeper_nodes | lost_nodes  # shadows there die with their node
        spares = [Spare(p.proc_id, p.node) for p in self.procs if p.role == "shadow" and p.popen.poll() is None
                  and p.proc_id not in self.handled and p.node not in down]
        for n in sorted(self._live_nodes(down), key=self._load):  # fork warm shadows: milliseconds
            while len(spares) < len(lost_ranks) and (forked := self._fork_shadow(n)) is not None:
                spares.append(Spare(forked.proc_id, forked.node))
        while self.spec.no_spare == "wait" and len(spares) < len(lost_ranks):  # start cold shadows, wait for them
            p = self._spawn("shadow", None, self._spare_node(lost_nodes))
            spares.append(Spare(p.proc_id, p.node))
        cause = "; ".join(sorted({why for _, why in failed}))
        try:
            new, adopted = next_plan(self.plan, lost_ranks, lost_nodes, spares, cause, shrink=True)
        except LookupError as e:
            self.display.message(f"leto: cannot recover: {e}; stopping the job")
            return 1
        self._announce(new, dead_keepers)
        self._note_degradation(new)
        t_fail = min(self._failure_time(p, t_detect) for p, _ in failed)
        record = {"generation": new.generation, "failed_ranks": sorted(lost_ranks), "failed_nodes": sorted(lost_nodes),
                  "cause": cause, "t_fail": t_fail, "t_detect": t_detect, "world_size": len(new.proc_of_rank),
                  "adopted_by": {str(r): s.proc_id for r, s in adopted.items()}, "interrupted": []}
        if len(new.proc_of_rank) < len(self.members_before):
            self.display.message(f"leto: no shadow left for {len(self.members_before) - len(new.proc_of_rank)} "
                                 f"lost rank(s): shrinking to {len(new.proc_of_rank)} ranks (same global batch)")
        for old in [p for p in self.pending if p["kind"] == "grow"]:  # a grow cut short: the failure's recovery takes over
            self.pending.remove(old)
        for old in self.pending:  # a failure during a recovery: one record, from the first failure
            record["failed_ranks"] = sorted(set(record["failed_ranks"]) | set(old["failed_ranks"]))
            record["failed_nodes"] = sorted(set(record["failed_nodes"]) | set(old["failed_nodes"]))
            record["cause"] = f"{old['cause']}; then during its recovery: {record['cause']}"
            record["t_fail"], record["t_detect"] = min(old["t_fail"], t_fail), min(old["t_detect"], t_detect)
            record["interrupted"] += old["interrupted"] + [old["generation"]]
        self.pending = [dict(record, kind="failure")]
        for n in dead_keepers - lost_nodes:  # the node lives: give it a new keeper, at normal priority
            _boost(self._spawn("keeper", None, n).popen.pid)  # (the workers wait for it to protect again)
            self.dead_keeper_nodes.discard(n)
        # new shadows start once this recovery has closed: starting one (importing torch, building
        # the model) would compete for the cores the recovery is using
        self._write_procs()
        return None

    def _announce(self, new: Plan, dead_keepers: set[int] = frozenset()) -> None:
        """Drain the current generation's keepers and publish generation g+1."""
        live_nodes = sorted({n for n in self.plan.node_of_rank if n not in self.dead_keeper_nodes | dead_keepers})
        by_id = {p.proc_id: p for p in self.procs}
        for q, proc_id in enumerate(new.proc_of_rank):
            if by_id[proc_id].role == "shadow":
                _boost(by_id[proc_id].popen.pid)
        self.store.set(keys.drain(self.plan.generation), json.dumps(
            {"live_nodes": live_nodes, "next_generation": new.generation}))
        for p in self.procs:  # keepers sleep between doorbells: wake them to read the drain
            if p.role == "keeper" and p.popen.poll() is None:
                _signal_quietly(p.popen, doorbell.CONTROL)
        self.store.set(keys.plan(new.generation), new.to_json())
        self.members_before = dict(self.members)
        self.members = {q: by_id[proc_id] for q, proc_id in enumerate(new.proc_of_rank)}
        for q, proc in self.members.items():
            proc.role, proc.rank = "worker", q
        self.plan = new
        self.dead_keeper_nodes |= dead_keepers

    def _note_degradation(self, new: Plan) -> None:
        """After a loss, say what the tier-2 code re-placed over the nodes left no longer covers
        (a `degraded` event, on the console and in summary.json); once per change."""
        nodes = sorted(set(new.node_of_rank))
        what = degradation(len(nodes), self.spec.ec) if self.spec.protection else None
        if what is None or any(e["event"] == "degraded" and e["what"] == what for e in self.events):
            return
        self.event("degraded", generation=new.generation, nodes=nodes, what=what)
        self.display.message(f"leto: degraded: {what}")

    def _maybe_grow(self) -> None:
        """After a shrink, a warm shadow joins as a new rank (no recovery may be in progress)."""
        now = time.monotonic()
        if self.pending or len(self.members) >= self.spec.workers or now - self._last_grow_check < HEARTBEAT_CHECK_S:
            return
        self._last_grow_check = now
        warm = [Spare(p.proc_id, p.node) for p in self.procs if p.role == "shadow" and p.popen.poll() is None
                and p.proc_id not in self.handled and p.node not in self.dead_keeper_nodes
                and self.store.check([keys.warm(p.proc_id)])]
        if not warm or self.plan.generation >= MAX_GENERATIONS:
            return
        new = grow_plan(self.plan, warm[:self.spec.workers - len(self.members)])
        t = time.time()
        self._announce(new)
        self.pending = [{"generation": new.generation, "kind": "grow", "cause": new.cause, "t_fail": t,
                         "t_detect": t, "world_size": len(new.proc_of_rank), "failed_ranks": [], "failed_nodes": [],
                         "interrupted": []}]
        self.display.message(f"leto: {new.cause}: growing back to {len(new.proc_of_rank)} ranks")
        self._write_procs()

    def _ever_protected(self) -> bool:
        """Has any generation's protection been committed (by any keeper)?"""
        return any(self.store.check([keys.committed(g, n)])
                   for g in range(self.plan.generation + 1) for n in range(self.spec.nodes))

    def _failure_time(self, p: Proc, t_detect: float) -> float:
        """When the failure happened: the injector's record, else the last heartbeat before it."""
        key = keys.inject_time(p.proc_id)
        if self.store.check([key]):
            return float(self.store.get(key))
        last = self._heartbeat(p) if p.role in ("worker", "keeper") else None
        return min(t_detect, last) if last is not None else t_detect

    def _live_nodes(self, lost_nodes: set[int]) -> list[int]:
        return [n for n in range(self.spec.nodes) if n not in lost_nodes | self.dead_keeper_nodes]

    def _load(self, node: int) -> int:
        return sum(1 for p in self.procs if p.node == node and p.role != "zygote" and p.popen.poll() is None)

    def _spare_node(self, lost_nodes: set[int]) -> int:
        return min(self._live_nodes(lost_nodes) or [0], key=self._load)

    def _zygotes_wanted(self) -> bool:
        """Zygotes need spares to make, protection to adopt with, and a job that can fork (a
        zygote that finds a CUDA context says so and exits: CUDA does not survive fork)."""
        return bool(self.spec.zygotes and self.spec.spares and self.spec.protection
                    and not self.store.check([keys.ZYGOTES_OFF]))

    def _replenish(self) -> None:
        """Keep --spares shadows: fork new ones from a warm zygote of the node (milliseconds),
        else start them from scratch; restart zygotes that died on live nodes."""
        live = [p for p in self.procs if p.role in ("shadow", "zygote") and p.popen.poll() is None]
        if self._zygotes_wanted():
            for n in range(self.spec.nodes):
                if n not in self.dead_keeper_nodes and not any(p.role == "zygote" and p.node == n for p in live):
                    self._spawn("zygote", None, n)
        for _ in range(self.spec.spares - sum(p.role == "shadow" for p in live)):
            node = self._spare_node(set())
            if self._fork_shadow(node) is None:
                self._spawn("shadow", None, node)
        self._write_procs()

    def _fork_shadow(self, node: int) -> Proc | None:
        """Ask the node's warm zygote for a shadow; None if it has none ready in time."""
        zygote = next((p for p in self.procs if p.role == "zygote" and p.node == node and p.popen.poll() is None
                       and p.proc_id not in self.handled and self.store.check([keys.warm(p.proc_id)])), None)
        if zygote is None:
            return None
        self._seq += 1
        proc_id = f"shadow-{self._seq}"
        seq = self._forks.get(zygote.proc_id, 0)
        self._forks[zygote.proc_id] = seq + 1
        self.store.set(keys.fork(zygote.proc_id, seq), json.dumps({"proc_id": proc_id, "node": node}))
        deadline = time.monotonic() + FORK_TIMEOUT_S
        while not self.store.check([keys.forked(proc_id)]):
            if time.monotonic() > deadline or zygote.popen.poll() is not None:
                return None
            time.sleep(1e-3)
        proc = Proc("shadow", None, node, proc_id, Forked(int(self.store.get(keys.forked(proc_id)))))
        self.procs.append(proc)
        return proc

    def _close_recoveries(self, rec: dict) -> None:
        """The first step completed after a recovery closes its record."""
        for pending in list(self.pending):
            if rec.get("time", 0) <= pending["t_detect"]:
                continue
            key = keys.recovery(pending['generation'])
            info = json.loads(self.store.get(key)) if self.store.check([key]) else {}
            done = {k: v for k, v in pending.items() if k not in ("t_fail", "t_detect", "kind")}
            done.update({"tier": info.get("tier"), "step": info.get("step"), "repaired": info.get("repaired", []),
                         "detect_s": round(pending["t_detect"] - pending["t_fail"], 4),
                         "restore_s": info.get("restore_s"), "join_s": info.get("join_s"),
                         "protect_s": info.get("protect_s"),
                         "total_s": round(rec["time"] - pending["t_fail"], 4),
                         "lost_steps": None if info.get("step") is None else max(0, self.max_step - info["step"])})
            self.pending.remove(pending)
            self._replenish()
            if pending["kind"] == "grow":
                self.event("resize", **done)
                self.display.message(f"leto: generation {done['generation']} runs {done['world_size']} ranks again "
                                     f"(step {done['step']}, {done['total_s']:.3f}s)")
                continue
            self.event("recovery", **done)
            self.display.recovered()
            self.display.message(f"leto: recovered generation {done['generation']} ({done['cause']}) via "
                                 f"{done['tier']} at step {done['step']}: detect {done['detect_s']:.3f}s, "
                                 f"restore {done['restore_s']}s, total {done['total_s']:.3f}s")
        self.max_step = max(self.max_step, rec["step"])

    def _write_summary(self, wall_s: float, code: int) -> None:
        result: dict = {"steps": None, "final_loss": None, "digest": None}
        if self.store.check([keys.RESULT]):
            result.update(json.loads(self.store.get(keys.RESULT)))
        summary = {**result, "wall_s": round(wall_s, 3), "workers": self.spec.workers,
                   "spares": self.spec.spares, "nodes": self.spec.nodes, "exit_code": code,
                   "recoveries": [e for e in self.events if e["event"] == "recovery"],
                   "resizes": [e for e in self.events if e["event"] == "resize"],
                   "degraded": [e for e in self.events if e["event"] == "degraded"], **self.spec.summary_extra}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))


def _dying(pid: int) -> bool:
    """Killed but not yet reaped: SIGKILL pending, exiting (PF_EXITING), or a zombie."""
    fields = linux.proc_stat(pid)
    if fields is None:
        return False
    try:
        if fields[0] in ("Z", "X") or int(fields[6]) & _PF_EXITING:
            return True
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & (1 << (signal.SIGKILL - 1))
                       for line in f)
    except (OSError, ValueError, IndexError):
        return False


def _signal_quietly(popen: subprocess.Popen, sig: int) -> None:
    try:
        popen.send_signal(sig)
    except ProcessLookupError:
        pass
