"""The per-host supervisor: everything about the host's processes, nothing about membership.

It starts processes (forked by the host's fork server, or Popen with their pre-exec set-up;
shadows forked by a node's zygote), reaps them, signals them, fences hung ones (SIGKILL by PID)
and stops them at the end; it keeps `procs.json` and the job's `/dev/shm` owner record. It
talks to the coordinator only through the store: it reads its commands (`keys.command`) and
writes reports of what happened to its processes (`keys.sup_report`); docs/design.md,
"Supervisor and coordinator".
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch.distributed as dist

from leto.config import ENV_CONFIG, JobConfig
from leto.control import stream
from leto.control.latest import Latest
from leto.control.prefork import ForkServer, forkable, prepare
from leto.control.progress import ProgressCheck
from leto.errors import BadValue
from leto.protection import doorbell, shm
from leto.protocol import keys
from leto.protocol.messages import (
    Command,
    ForkRequest,
    JobState,
    Membership,
    ProcEvent,
    Refusals,
    StepProgress,
    SupervisorReport,
    parse_beat,
    parse_pid,
)
from leto.runtime import env as rt
from leto.runtime import linux, trace
from leto.runtime.runlog import write_procs

if TYPE_CHECKING:
    from leto.control.standby import WarmStandby

POLL_S = 0.01
FAILURE_SETTLE_S = 0.005  # after a death: signals sent in one burst (a node's processes) have landed
DYING_GRACE_S = 0.5  # the longest wait for killed processes to be reaped, to decide one event
HEARTBEAT_CHECK_S = 0.1
_PF_EXITING = 0x4
M = TypeVar("M", JobState, StepProgress, Membership)


class Forked:
    """The Popen-like handle of a shadow forked by a zygote and reparented to this process
    (a child subreaper): poll, wait, signal and returncode like a Popen. Made only for a pid
    checked to be this process's child (`Supervisor._adoptable`)."""

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
    """One process of this host: a child of this process, named by its pid and start time
    (`start`, read when it was adopted; a signal goes to that process or to none)."""

    role: str
    rank: int | None
    node: int
    proc_id: str
    popen: subprocess.Popen | Forked
    start: str | None = None
    since: float = field(default_factory=time.time)  # adopted then

    def __post_init__(self) -> None:
        if self.start is None:
            self.start = linux.start_time(self.popen.pid)

    def record(self) -> dict:
        return {
            "role": self.role,
            "rank": self.rank,
            "node": self.node,
            "pid": self.popen.pid,
            "start": self.start,
            "id": self.proc_id,
        }

    def event(self, kind: str, code: int | None = None, cause: str = "") -> ProcEvent:
        return ProcEvent(kind, self.proc_id, self.role, self.rank, self.node, self.popen.pid, code, cause)


class Supervisor:
    """Supervises the processes of one host of a job."""

    def __init__(
        self,
        store: dist.Store,
        config: JobConfig,
        store_addr: str,
        job_id: str,
        command_poll_s: float = POLL_S,
        node: int | None = None,
        child_env: dict[str, str] | None = None,
        host_store: dist.Store | None = None,
        first_command: int = 0,
        forker: ForkServer | None = None,
        warm: WarmStandby | None = None,
    ) -> None:
        """`command_poll_s`: how often `tick` looks for commands; longer where the coordinator
        has this supervisor serve its commands at once (`serve_commands`), as a fallback.
        `node`: the one node this host is, in a multi-host job (None: every node is here).
        `child_env`: more environment for this host's children (its gloo interface, its
        `host_store`'s address). `host_store`: where this host's processes heartbeat, where it is
        not the job's store (a multi-host job). `first_command`: the first of the coordinator's
        commands that is this supervisor's (a host admitted into a running job; those before
        were for the host it replaces). `forker`: this host's fork server if it was started
        already (a standby's, warm while it waits); `warm`: a standby's warm processes, bound
        to this node's spawn commands of their role (control/standby.py)."""
        problem = shm.check_job_id(job_id, per_host=True)
        if problem is not None:
            raise ValueError(problem)
        self.store, self.cfg, self.store_addr, self.job_id = store, config, store_addr, job_id
        self.command_poll_s = command_poll_s
        self.node = node
        self.child_env = child_env or {}
        self.beats = host_store or store
        self._last_command_check = 0.0
        self.run_dir = Path(config.run_dir)
        self.procs: list[Proc] = []
        self.handled: set[str] = set()  # processes whose exit was reported
        self.progress = ProgressCheck(config.timeouts.progress_floor_s, config.recovery.progress_factor)
        self.state = JobState(0, False)
        self.members: set[str] = set()  # the current generation's processes
        self.stopped = False
        self._commands = stream.Reader(store, keys.COMMANDS, keys.command, first_command)
        self._forks: dict[str, int] = {}  # zygote -> fork requests sent
        self._pending_forks: dict[str, tuple[Proc, float, bool]] = {}  # shadow -> (its zygote, deadline, boost)
        self._last_beat_check = 0.0
        self._last_step: tuple[int, float] | None = None
        self._state = Latest(store, keys.JOB_STATE)
        self._progress = Latest(store, keys.PROGRESS)
        self._signal: int | None = None
        self._signal_reported = False
        self._old_handlers: dict = {}
        self._procs_stale = False
        self._forker = forker
        self._warm = warm
        self._beats: dict[str, tuple[float, int]] = {}  # the last well-formed heartbeat of each process
        self._refused = Refusals()
        self._start = linux.start_time(os.getpid())

    # ----- start and end
    def start(self) -> None:
        """Catch SIGINT/SIGTERM (the coordinator is told, and stops the job), adopt the shadows
        zygotes fork, remove dead jobs' /dev/shm leftovers and record this job's owner."""
        self._old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        linux.become_subreaper()  # forked shadows are orphans: reparented here, supervised like children
        removed = shm.remove_dead_segments()
        if removed:
            self._report(SupervisorReport(shm_removed=tuple(removed)))
        shm.write_owner(self.job_id, os.getpid())
        if self.cfg.training.fork_server and self._forker is None:
            self._forker = ForkServer(self._child_env(), self.cfg)
        self._write_procs()

    def close(self) -> None:
        """Stop everything that still runs and give the signal handlers back."""
        if not self.stopped:
            self.stop_all()
        for s, h in self._old_handlers.items():
            signal.signal(s, h)

    def stop_all(self) -> None:
        """SIGTERM every live child, SIGKILL what is left after a grace period, reap all; the
        keepers' shared memory dies with the job."""
        self.store.set(keys.SHUTDOWN, "1")
        live = [p for p in self.procs if p.popen.poll() is None]
        for p in live:
            _signal_quietly(p, signal.SIGTERM)
            if p.role == "keeper":  # another thread may take the SIGTERM: ring, or it exits at its doorbell's timeout
                _signal_quietly(p, doorbell.CONTROL)
        if self._warm is not None:
            self._warm.close()
        self._close_forker()
        deadline = time.monotonic() + self.cfg.timeouts.stop_grace_s
        for p in live:
            try:
                p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill(p, self.cfg.timeouts.stop_grace_s)
        self._remove_segments()
        self.stopped = True
        self.store.set(keys.stopped(self.node or 0), "1")
        self._write_procs()  # last: a procs file that cannot be written leaves nothing else undone

    def fence(self) -> None:
        """This host lost its lease: SIGKILL and reap every process now, without the store
        (which refuses this host's writes by now); a later generation never hears from them."""
        if self._warm is not None:
            self._warm.close(grace_s=0)
        self._close_forker()
        for p in self.procs:
            if p.popen.poll() is None:
                _kill(p, self.cfg.timeouts.stop_grace_s)
        self._remove_segments()
        self.stopped = True
        self._write_procs()

    def _close_forker(self) -> None:
        if self._forker is not None:
            self._forker.close()

    def _remove_segments(self) -> None:
        """The keepers' shared memory dies with the job (this job's segments only: names that
        parse to exactly its id)."""
        shm.remove_job_segments(self.job_id)

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signal = signum

    # ----- one round of supervision
    def tick(self) -> None:
        """Serve the coordinator's commands, then report exits and fence hung processes."""
        if self._procs_stale:
            self._write_procs()
        if time.monotonic() - self._last_command_check >= self.command_poll_s:
            self.serve_commands()
        elif self._pending_forks:
            self._check_forks()
        if self._signal is not None and not self._signal_reported:
            self._signal_reported = True
            self._report(SupervisorReport(signal=self._signal))
        events = self._find_exits()
        if any(e.kind == "fenced" or e.code != 0 or e.role == "keeper" for e in events):
            events += self._await_dying()  # processes of one node die within moments of each other
        if events:
            self._report(SupervisorReport(events=tuple(events)))
            self._procs_stale = True  # written next round: the coordinator decides on the report first

    def serve_commands(self) -> None:
        """Carry out every command the coordinator has written so far, in order."""
        self._last_command_check = time.monotonic()
        while not self.stopped and (entry := self._commands.take()) is not None:
            key, value = entry
            try:
                cmd = Command.from_json(value, key)
            except BadValue as e:  # that one command is not carried out
                self._refused.refuse(e)
                continue
            self._do(cmd)
        self._check_forks()

    def _do(self, cmd: Command) -> None:
        if cmd.kind in ("spawn", "fork") and self.node is not None and cmd.node != self.node:
            return  # another host's
        if cmd.kind == "spawn":
            proc = self._spawn(cmd.role, cmd.rank, cmd.node, cmd.proc_id)
            if cmd.boost:
                linux.normal_priority(proc.popen.pid)
            self._report(SupervisorReport(events=(proc.event("started"),)))
            self._procs_stale = True
        elif cmd.kind == "fork":
            trace.mark("fork_command", shadow=cmd.proc_id)
            self._fork_shadow(cmd.node, cmd.proc_id, cmd.boost)
        elif cmd.kind == "boost":
            if cmd.proc_id in self._pending_forks:  # boosted once it is forked
                zygote, deadline, _ = self._pending_forks[cmd.proc_id]
                self._pending_forks[cmd.proc_id] = (zygote, deadline, True)
            for p in self.procs:
                if p.proc_id == cmd.proc_id and p.popen.poll() is None:
                    linux.normal_priority(p.popen.pid)
        elif cmd.kind == "wake_keepers":  # keepers sleep between doorbells: wake them to read a drain
            for p in self.procs:
                if p.role == "keeper" and p.popen.poll() is None:
                    _signal_quietly(p, doorbell.CONTROL)
        elif cmd.kind == "stop":
            self.stop_all()

    # ----- processes
    def _child_env(self) -> dict[str, str]:
        return child_environment(self.child_env)

    def _spawn(self, role: str, rank: int | None, node: int, proc_id: str) -> Proc:
        """Start a process of `role`: a standby's warm one of that role bound to it, else one
        forked by the host's fork server, or exec'd where it cannot."""
        pool = self._warm if rank is None and self.node is not None else None
        if pool is not None and (warm := pool.take(role)) is not None:
            proc = pool.bind(warm, proc_id, node, self.store_addr, self.job_id)
            self.procs.append(proc)
            trace.mark("standby_bound", proc=proc_id, role=role)
            return proc
        env = self._child_env()
        env.update(
            {
                ENV_CONFIG: self.cfg.to_json(),
                rt.ENV_STORE: self.store_addr,
                rt.ENV_JOB_ID: self.job_id,
                rt.ENV_ROLE: role,
                rt.ENV_NODE: str(node),
                rt.ENV_PROC_ID: proc_id,
            }
        )
        if rank is not None:
            env[rt.ENV_RANK] = str(rank)
        popen = start_child(role, env, self.cfg, self._forker)
        if self._forker is not None and self._forker.broken is not None:
            self._forker = None
        proc = Proc(role, rank, node, proc_id, popen)
        self.procs.append(proc)
        return proc

    def _fork_shadow(self, node: int, proc_id: str, boost: bool = False) -> None:
        """Ask the node's warm zygote for a shadow named `proc_id`, and go on: `_check_forks`
        reports `started`, or `fork_failed` when it has none ready in time. `boost`: the
        zygote runs at normal priority until then, and the shadow inherits it."""
        zygote = next(
            (
                p
                for p in self.procs
                if p.role == "zygote"
                and p.node == node
                and p.popen.poll() is None
                and p.proc_id not in self.handled
                and self.store.check([keys.warm(p.proc_id)])
            ),
            None,
        )
        if zygote is None:
            self._report(SupervisorReport(events=(ProcEvent("fork_failed", proc_id, "shadow", None, node),)))
            return
        seq = self._forks.get(zygote.proc_id, 0)
        self._forks[zygote.proc_id] = seq + 1
        if boost:
            linux.normal_priority(zygote.popen.pid)
        self.store.set(keys.fork(zygote.proc_id, seq), ForkRequest(proc_id, node).to_json())
        self._pending_forks[proc_id] = (zygote, time.monotonic() + self.cfg.timeouts.fork_s, boost)

    def _check_forks(self) -> None:
        """Adopt the shadows the zygotes have forked since the last call; give up on those
        not delivered by the fork timeout. A zygote boosted for a fork goes back to SCHED_IDLE
        once no boosted fork of it is pending."""
        for proc_id, (zygote, deadline, boost) in list(self._pending_forks.items()):
            forked = self._forked(proc_id)
            if forked is None and time.monotonic() <= deadline and zygote.popen.poll() is None:
                continue
            del self._pending_forks[proc_id]
            if forked is not None:
                proc = Proc("shadow", None, zygote.node, proc_id, Forked(forked[0]), forked[1])
                self.procs.append(proc)
                if boost:
                    linux.normal_priority(proc.popen.pid)
                self._report(SupervisorReport(events=(proc.event("started"),)))
                self._procs_stale = True
            else:
                self._report(SupervisorReport(events=(ProcEvent("fork_failed", proc_id, "shadow", None, zygote.node),)))
            if boost and not any(z is zygote and b for z, _, b in self._pending_forks.values()):
                linux.idle_priority_of(zygote.popen.pid)

    def _forked(self, proc_id: str) -> tuple[int, str | None] | None:
        """(pid, start time) of the shadow its zygote forked as `proc_id`, once the zygote has
        written it; None until then, and for a value that names no new child of this process
        (logged once: a stray or hostile value is never adopted, so never waited for or signalled)."""
        key = keys.forked(proc_id)
        if not self.store.check([key]):
            return None
        value = self.store.get(key)
        if self._refused.known(key, value):
            return None
        try:
            pid = parse_pid(value, key)
            return pid, self._adoptable(pid, key)
        except BadValue as e:
            self._refused.refuse(e, value)
            return None

    def _adoptable(self, pid: int, key: str) -> str | None:
        """The start time of `pid` if it is a child of this process that no handle holds yet (a
        forked shadow is reparented here before its zygote names it); else `BadValue`. Only a
        child can be reaped here, and an unreaped child's pid is never reused."""
        fields = linux.proc_stat(pid)
        if fields is None or len(fields) < 20 or fields[1] != str(os.getpid()):
            raise BadValue(key, f"pid {pid} is not a child of this supervisor")
        held = {p.popen.pid for p in self.procs if p.popen.returncode is None}
        if self._forker is not None:
            held.add(self._forker.popen.pid)
        if pid in held:
            raise BadValue(key, f"pid {pid} is another process of this job")
        return fields[19]

    def _write_procs(self) -> None:
        records = [
            {
                "role": "controller",
                "rank": None,
                "node": self.node,
                "pid": os.getpid(),
                "start": self._start,
                "id": "controller",
                "job": self.job_id,
                "store": self.store_addr,
            }
        ]
        name = "procs.json" if self.node is None else f"procs-host{self.node}.json"
        if self._forker is not None and self._forker.popen.poll() is None:
            records.append(
                {
                    "role": "fork-server",
                    "rank": None,
                    "node": self.node,
                    "pid": self._forker.popen.pid,
                    "start": linux.start_time(self._forker.popen.pid),
                    "id": f"fork-server-{self.node or 0}",
                }
            )
        self._procs_stale = not write_procs(
            self.run_dir, records + [p.record() for p in self.procs if p.popen.returncode is None], name
        )

    # ----- exits and hangs
    def _await_dying(self) -> list[ProcEvent]:
        """Processes killed together (a node) are reaped one by one, 10-100+ ms apart on a loaded
        host: wait while any of ours is killed but not yet reaped, so they make one report. A
        lone failure costs only FAILURE_SETTLE_S."""
        time.sleep(FAILURE_SETTLE_S)
        deadline = time.monotonic() + DYING_GRACE_S
        while time.monotonic() < deadline and any(  # poll() first: it reaps the dead (zombies are dying)
            _dying(p.popen.pid) for p in self.procs if p.proc_id not in self.handled and p.popen.poll() is None
        ):
            time.sleep(1e-3)
        return self._find_exits(check_beats=False)

    def _find_exits(self, check_beats: bool | None = None) -> list[ProcEvent]:
        """Processes that exited (any code), stopped heartbeating or stopped making progress
        (both fenced here)."""
        out = []
        now = time.time()
        if check_beats is None:
            check_beats = now - self._last_beat_check >= HEARTBEAT_CHECK_S
        if check_beats:
            self._last_beat_check = now
            self._read_job_state()
        for p in self.procs:
            if p.proc_id in self.handled:
                continue
            code = p.popen.poll()
            if code is not None:
                out.append(p.event("exited", code, linux.describe_exit(code)))
                continue
            why = self._hung(p, now) if check_beats and p.role in ("worker", "keeper") else None
            if why is not None:
                code = _kill(p, self.cfg.timeouts.stop_grace_s)  # fence: a stopped process must never come back
                out.append(p.event("fenced", code, f"{why}; fenced with SIGKILL"))
        self.handled |= {e.proc_id for e in out}
        return out

    def _read_job_state(self) -> None:
        """The coordinator's generation and recovery flag, and rank 0's step times (for the
        progress timeout): what the hang checks need."""
        state = self._read(self._state.read(), JobState, keys.JOB_STATE)
        if state is not None:
            if state.generation != self.state.generation or not self.members:
                self._adopt_membership(state.generation)
            self.state = state
        if self.state.recovering:  # a recovery or resize runs: its phases are no steps
            self.progress.reset()
        rec = self._read(self._progress.read(), StepProgress, keys.PROGRESS)
        if rec is not None:
            if (rec.step, rec.time) != self._last_step and rec.step_s is not None:
                self.progress.record_step(rec.step_s)
            self._last_step = (rec.step, rec.time)

    def _read(self, value: bytes | None, cls: type[M], key: str) -> M | None:
        """`value` of `key` parsed as `cls`; None if absent or malformed (logged once)."""
        if value is None:
            return None
        try:
            return cls.from_json(value, key)
        except BadValue as e:
            self._refused.refuse(e, value)
            return None

    def _adopt_membership(self, generation: int) -> None:
        """A new generation: its members are workers of their new ranks (procs.json says so)."""
        key = keys.membership(generation)
        if not self.store.check([key]):
            return
        membership = self._read(self.store.get(key), Membership, key)
        if membership is None:
            return
        self.members = set(membership.proc_of_rank)
        for p in self.procs:
            if p.proc_id in self.members:
                p.role, p.rank = "worker", membership.rank_of(p.proc_id)
        self._write_procs()

    def _hung(self, p: Proc, now: float) -> str | None:
        """Why a live worker or keeper counts as hung: no heartbeat for the heartbeat timeout,
        or (a worker of the current generation) a training thread that made no progress for
        the progress timeout; None while it is fine."""
        beat = self._beat(p)
        if beat is None:
            return None
        last, progress = beat
        if now - last > self.cfg.timeouts.heartbeat_s:
            return f"stopped heartbeating for {now - last:.1f}s (hung)"
        if p.role != "worker" or self.state.recovering or p.proc_id not in self.members:
            return None
        stalled = self.progress.stalled_for(p.proc_id, progress, now)
        if stalled is None:
            return None
        return (
            f"made no progress for {stalled:.1f}s though its process heartbeats (training thread hung; "
            f"timeout {self.progress.timeout_s():.1f}s)"
        )

    def _beat(self, p: Proc) -> tuple[float, int] | None:
        """The last heartbeat (time, progress), or None (not started yet, or left on purpose).
        A malformed one is no sign of life: the last well-formed one stands (or, before any,
        the process's start), so a process whose beats cannot be read is judged hung in time."""
        key = keys.heartbeat(p.proc_id)
        if not self.beats.check([key]):
            return None
        value = self.beats.get(key)
        try:
            beat = parse_beat(value, key)
        except BadValue as e:
            self._refused.refuse(e, value)
            return self._beats.get(p.proc_id, (p.since, 0))
        if beat is not None:
            self._beats[p.proc_id] = beat
        return beat

    def _report(self, report: SupervisorReport) -> None:
        stream.append(self.store, keys.REPORTS, keys.sup_report, report.to_json())


def start_child(role: str, env: dict[str, str], cfg: JobConfig, forker: ForkServer | None) -> subprocess.Popen | Forked:
    """Start a process of `role` with `env`: forked by the host's fork server where it can (one
    that fails says so once, and stays `broken`), else exec'd."""
    command = ["-m", "leto.protection.keeper"] if role == "keeper" else list(cfg.training.command)
    if forker is not None and forker.broken is None and forkable(command):
        pid = forker.start(command, env, role, cfg.quiet)
        if pid is not None:
            return Forked(pid)
        print(f"leto: the fork server failed ({forker.broken}); processes are exec'd from now on", file=sys.stderr)
    # every child dies with this process, even a SIGKILLed one (`prepare`)
    # quiet (benchmarks): the children's own prints go too; their errors still reach stderr
    return subprocess.Popen(
        [sys.executable, *command],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL if cfg.quiet else None,
        preexec_fn=lambda: prepare(role),
    )


def child_environment(extra: dict[str, str]) -> dict[str, str]:
    """The environment of a host's children: this process's, with `extra` (the host's own)."""
    env = dict(os.environ, **extra)
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # store waits that time out are routine here
    return env


def _dying(pid: int) -> bool:
    """Killed but not yet reaped: SIGKILL pending, exiting (PF_EXITING), or a zombie."""
    fields = linux.proc_stat(pid)
    if fields is None:
        return False
    try:
        if fields[0] in ("Z", "X") or int(fields[6]) & _PF_EXITING:
            return True
        with open(f"/proc/{pid}/status") as f:
            return any(
                line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & (1 << (signal.SIGKILL - 1))
                for line in f
            )
    except (OSError, ValueError, IndexError):
        return False


def _kill(p: Proc, timeout_s: float) -> int:
    """SIGKILL and reap; the status (-SIGKILL if it is not reaped in time: stuck in the kernel)."""
    _signal_quietly(p, signal.SIGKILL)
    try:
        return p.popen.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return -signal.SIGKILL


def _signal_quietly(p: Proc, sig: int) -> None:
    """Signal `p` if it is still the process adopted (same pid and start time); an exited one
    (a zombie, not yet reaped) needs no signal."""
    if p.popen.poll() is not None or not linux.same_process(p.popen.pid, p.start):
        return
    try:
        p.popen.send_signal(sig)
    except ProcessLookupError:
        pass
