"""The per-job coordinator: membership and generations, and what the job reports.

It decides who is rank what (`decision.next_plan` / `grow_plan`), announces plans and drains,
shrinks and grows the job, keeps the recovery records and events (`metrics.jsonl`), the console
display and `summary.json`. It knows the processes only from the supervisors' reports and acts on
them only by commands, both through the store (docs/design.md, "Supervisor and coordinator").
"""
from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import torch.distributed as dist

from leto.config import JobConfig
from leto.console import StepDisplay, read_jsonl, say
from leto.control.decision import Spare, grow_plan, next_plan
from leto.errors import BadValue
from leto.protection.placement import degradation
from leto.protocol import keys
from leto.protocol.messages import (
    Command,
    JobResult,
    JobState,
    Plan,
    ProcEvent,
    RecoveryRecord,
    Refusals,
    StepProgress,
    SupervisorReport,
    node_of_rank,
    parse_beat,
    parse_float,
    parse_int,
)
from leto.protocol.protection import Drain
from leto.runtime import runlog, trace
from leto.runtime.durable import write_atomic

POLL_S = 0.01
FATAL_CHARS = 500  # of a worker's reason the job cannot recover (free text, shown and recorded)
MAX_GENERATIONS = 100  # a job that needs more recoveries than this is failing in a loop
GROW_CHECK_S = 0.1
RECORD_WAIT_S = 2.0  # how long a recovery waits, after its first step, for rank 0's record of it


class Hosts(Protocol):
    """The hosts of a multi-host job, as the coordinator needs them (control/hosts.py)."""

    def up(self) -> list[int]:
        """The nodes whose host is in the job."""

    def lost(self) -> dict[int, tuple[str, float]]:
        """Hosts newly out of the job (fenced already): why, and when each was last heard from."""

    def confirm(self) -> None:
        """Raise unless this host is still in the job."""


@dataclass
class ProcView:
    """A process as the coordinator knows it: from its own requests and the supervisors' reports."""

    proc_id: str
    role: str
    rank: int | None
    node: int
    pid: int = 0
    code: int | None = None   # the exit status once it exited

    @property
    def alive(self) -> bool:  # requested, started and not yet exited
        return self.code is None

    def describe(self) -> str:
        return f"{self.role} rank {self.rank}" if self.rank is not None else f"{self.role} {self.proc_id}"


class Coordinator:
    """Decides the membership of one job, from start to end."""

    def __init__(self, store: dist.Store, config: JobConfig, serve: Callable[[], None] | None = None,
                 summary_extra: dict | None = None, hosts: Hosts | None = None) -> None:
        """`serve`: where the host's supervisor runs in this thread, the call that lets it carry
        out the commands written so far (so none waits for its next round); None where it runs
        elsewhere and polls the store itself. `hosts`: a multi-host job's hosts (None: one host)."""
        self.store, self.cfg, self._serve, self.hosts = store, config, serve, hosts
        self.run_dir = Path(config.run_dir)
        self.summary_extra = summary_extra or {}
        self.procs: dict[str, ProcView] = {}
        self.members: dict[int, ProcView] = {}    # rank -> its process in the current generation
        self.members_before: dict[int, ProcView] = {}
        self.pending: list[dict] = []             # recoveries waiting for their first step
        self.dead_keeper_nodes: set[int] = set()
        self.host_lost_at: dict[int, float] = {}  # a lost host's last sign of life (time.time())
        self.events: list[dict] = []
        self.max_step = 0
        self.plan = Plan(0, (), ())
        self.display = StepDisplay(config.training.steps, quiet=config.quiet)
        self._inbox: list[ProcEvent] = []
        self._refused = Refusals()               # malformed store values seen (said once)
        self._signal: int | None = None
        self._next_report = 0
        self._last_step: tuple[int, float] | None = None
        self._last_progress: StepProgress | None = None
        self._progress_set = False  # rank 0 has set keys.PROGRESS (it stays set)
        self._last_grow_check = 0.0
        self._exit = ExitStack()

    # ----- start and end
    def prepare(self) -> None:
        """Before anything starts: a fresh metrics.jsonl and summary.json, and config.json."""
        for stale in (runlog.METRICS, runlog.SUMMARY):
            (self.run_dir / stale).unlink(missing_ok=True)
        try:
            write_atomic(self.run_dir / "config.json", json.dumps(self.cfg.to_dict(), indent=1).encode())
        except OSError as e:
            if not runlog.is_disk_error(e):
                raise
            say(f"leto: cannot write {self.run_dir / 'config.json'} ({e.strerror}); the job goes on without it "
                f"(a --resume of this run then needs the job's flags)", err=True)

    def start(self) -> None:
        """Ask for generation 0's workers, the shadows, zygotes and keepers, and announce plan 0."""
        self._exit.enter_context(self.display)
        self.store.add(keys.REPORTS, 0)  # the counter exists from now on: `_poll` reads it
        t = self.cfg.training
        nodes = [node_of_rank(r, t.workers, t.nodes) for r in range(t.workers)]
        workers = [self._spawn("worker", r, nodes[r]) for r in range(t.workers)]
        self.members = dict(enumerate(workers))
        self.plan = Plan(0, tuple(nodes), tuple(w.proc_id for w in workers))
        self.store.set(keys.plan(0), self.plan.to_json())
        self._set_state(recovering=False)
        for i in range(self.cfg.recovery.spares):
            self._spawn("shadow", None, i % t.nodes)
        if self._zygotes_wanted():
            for n in range(t.nodes):
                self._spawn("zygote", None, n)
        if self.cfg.protection.enabled:
            for n in range(t.nodes):
                self._spawn("keeper", None, n)
        self._flush()

    def restore(self, commands: dict[str, bytes], reports: dict[str, bytes]) -> None:
        """Take over a running job whose coordinator was lost: the processes from the command
        and report streams (every entry so far, by key), the plan from the newest generation,
        the events from metrics.jsonl. Failures its predecessor had not decided on yet are
        decided on at the next round."""
        self._exit.enter_context(self.display)
        for key, text in self._stream(commands):
            try:
                cmd = Command.from_json(text, key)
            except BadValue as e:  # malformed values are said once and skipped, here as in every round
                self._refused.refuse(e, text)
                continue
            if cmd.kind in ("spawn", "fork"):
                self.procs[cmd.proc_id] = ProcView(cmd.proc_id, cmd.role, cmd.rank, cmd.node)
        try:
            written = parse_int(self.store.get(keys.REPORTS), keys.REPORTS, minimum=0)
        except BadValue as e:
            self._refused.refuse(e)
            written = None
        for key, text in self._stream(reports, written):
            self._next_report = max(self._next_report, self._seq(key) + 1)
            try:
                self._apply(SupervisorReport.from_json(text, key))
            except BadValue as e:
                self._refused.refuse(e, text)
        self._read_reports()  # any written since
        self._inbox.clear()
        self.plan = self._newest_plan()
        gen = self.plan.generation
        self.members = {q: self.procs[proc_id] for q, proc_id in enumerate(self.plan.proc_of_rank)}
        for q, proc in self.members.items():
            proc.role, proc.rank = "worker", q
        in_plan = set(self.plan.node_of_rank)
        self.dead_keeper_nodes = {n for n in range(self.cfg.training.nodes) if n not in in_plan}
        for p in self.procs.values():  # undecided: a dead member, the last keeper of a node in the plan
            keeper_gone = p.role == "keeper" and p.node in in_plan and not any(
                q.role == "keeper" and q.node == p.node and q.alive for q in self.procs.values())
            if (p in self.members.values() and p.code not in (None, 0)) or (keeper_gone and p.code is not None):
                self._inbox.append(ProcEvent("exited", p.proc_id, p.role, p.rank, p.node, p.pid, p.code,
                                             "exited before the coordinator was lost"))
        self.events = [r for r in read_jsonl(self.run_dir / runlog.METRICS) if "event" in r]
        self.event("takeover", generation=gen)
        self.display.message(f"leto: this host took over as coordinator at generation {gen}")

    def _stream(self, entries: dict[str, bytes], written: int | None = None) -> list[tuple[str, bytes]]:
        """A command or report stream's entries in order; an entry whose key is not numbered, or
        numbered past the `written` entries the stream's counter has, is refused."""
        ordered = []
        for key, text in entries.items():
            try:
                seq = self._seq(key)
                if written is not None and seq >= written:
                    raise BadValue(key, f"entry {seq} is past the {written} entries written")
            except BadValue as e:
                self._refused.refuse(e, text)
                continue
            ordered.append((seq, key, text))
        return [(key, text) for _, key, text in sorted(ordered)]

    @staticmethod
    def _seq(key: str) -> int:
        return parse_int(key.rsplit("/", 1)[1], key, minimum=0)

    def _newest_plan(self) -> Plan:
        """The newest generation's plan at a takeover. A malformed one (or one naming processes
        no command started) is refused and the one before it taken: the next decision writes
        the generation after it. Only a job without one valid plan cannot be taken over."""
        value = self.store.get(keys.JOB_STATE)
        try:
            gen = JobState.from_json(value, keys.JOB_STATE).generation
        except BadValue as e:
            self._refused.refuse(e, value)
            gen = 0
        if not self.store.check([keys.plan(gen)]):
            gen = 0  # a generation never announced: look from the first
        while self.store.check([keys.plan(gen + 1)]):
            gen += 1
        while True:
            key = keys.plan(gen)
            value = self.store.get(key)
            try:
                plan = Plan.from_json(value, key)
                unknown = [p for p in plan.proc_of_rank if p not in self.procs]
                if plan.generation != gen or unknown:
                    raise BadValue(key, f"generation {plan.generation}, processes {unknown[:3]} no command started")
                return plan
            except BadValue as e:
                self._refused.refuse(e, value)
                if gen == 0:
                    raise
                gen -= 1

    def release(self) -> None:
        """Give the console back (the end, or this host leaves the job to another coordinator)."""
        self._exit.close()

    def stop(self) -> None:
        """Ask the supervisors to stop every process and wait until they have (with a timeout)."""
        self.release()
        self._command(Command("stop"))
        self._flush()
        deadline = time.monotonic() + self.cfg.timeouts.stop_grace_s + self.cfg.timeouts.collective_s
        while not self.store.check([keys.stopped(n) for n in self.hosts_up()]) and time.monotonic() < deadline:
            time.sleep(POLL_S)

    # ----- one round
    def tick(self) -> int | None:
        """Show progress, decide on what the supervisors reported; the job's exit code once it ends."""
        self._poll()
        if self.hosts is not None:
            self._on_lost_hosts(self.hosts.lost())
        if self._signal is not None:
            self.display.message(f"leto: received {signal.Signals(self._signal).name}, stopping all processes")
            return 128 + self._signal
        failed = self._take_failures()
        if failed:
            code = self._on_failures(failed)
            if code is not None:
                return code
        self._maybe_grow()
        members = [self.members[r] for r in sorted(self.members)]
        done = bool(members) and all(p.code == 0 for p in members)
        if done:
            self._poll()
        if self._last_progress is not None and any("first_step" in p for p in self.pending):
            self._close_recoveries(self._last_progress, force=done)  # waiting for a record
        return 0 if done else None

    def _poll(self) -> None:
        """Rank 0's latest step and the supervisors' new reports: one store round trip a round
        once rank 0 has set its first step (the report counter and the progress together)."""
        self._progress_set = self._progress_set or self.store.check([keys.PROGRESS])
        if self._progress_set:
            count, progress = self.store.multi_get([keys.REPORTS, keys.PROGRESS])
            try:
                self._on_progress(StepProgress.from_json(progress, keys.PROGRESS))
            except BadValue as e:  # malformed values are logged and ignored (messages.py)
                self._refused.refuse(e, progress)
        else:
            count = self.store.get(keys.REPORTS)  # a read: `add(..., 0)` would be a write in etcd
        try:
            if parse_int(count, keys.REPORTS, minimum=0) > self._next_report:
                self._read_reports()
        except BadValue as e:
            self._refused.refuse(e, count)

    def _on_progress(self, rec: StepProgress) -> None:
        """A step record: the display, and closing recoveries (once per step seen)."""
        if (rec.step, rec.time) == self._last_step:
            return
        self._last_step = (rec.step, rec.time)
        self._last_progress = rec
        self.display.step(rec.record())
        self._close_recoveries(rec)

    def _read_reports(self) -> None:
        """Every report the supervisors wrote since the last call: apply it to the process views
        and keep its events for the decisions."""
        while self.store.check([keys.sup_report(self._next_report)]):
            key = keys.sup_report(self._next_report)
            self._next_report += 1
            try:
                report = SupervisorReport.from_json(self.store.get(key), key)
            except BadValue as e:
                self._refused.refuse(e)
                continue
            self._apply(report)

    def _apply(self, report: SupervisorReport) -> None:
        """One report: the signal, the clean-up, the process views; its events go to the inbox."""
        if report.signal is not None:
            self._signal = report.signal
        if report.shm_removed:
            self.event("shm_cleanup", removed=list(report.shm_removed))
            if not self.cfg.quiet:
                say(f"leto: removed {len(report.shm_removed)} shared-memory segment(s) left behind by dead jobs",
                    err=True)
        for e in report.events:
            view = self.procs.get(e.proc_id)
            if view is None:
                continue
            if e.kind == "started":
                view.pid = e.pid
            elif e.kind in ("exited", "fenced"):
                view.code = e.code if e.code is not None else -1
                view.pid = e.pid or view.pid
            elif e.kind == "fork_failed":
                del self.procs[e.proc_id]
            self._inbox.append(e)

    def _on_lost_hosts(self, lost: dict[int, tuple[str, float]]) -> None:
        """Every process of a lost host is gone with it (the host is fenced already)."""
        for node, (why, last_heard) in sorted(lost.items()):
            self.host_lost_at[node] = last_heard
            self.event("host_lost", node=node, cause=why, last_heard=round(last_heard, 4))
            for p in self.procs.values():
                if p.node == node and p.alive:
                    p.code = -signal.SIGKILL
                    self._inbox.append(ProcEvent("exited", p.proc_id, p.role, p.rank, node, p.pid, p.code,
                                                 f"lost with its host: {why}"))

    def hosts_up(self) -> list[int]:
        """The nodes whose supervisor takes part (one host: node 0 stands for all)."""
        return [0] if self.hosts is None else self.hosts.up()

    def _take_failures(self) -> list[tuple[ProcView, str]]:
        """The failures among the events read: any non-zero exit, a keeper's exit, a fence."""
        out = [(self.procs[e.proc_id], e.cause) for e in self._inbox
               if e.proc_id in self.procs and (e.kind == "fenced" or e.kind == "exited"
                                               and (e.code != 0 or self.procs[e.proc_id].role == "keeper"))]
        self._inbox.clear()
        return out

    # ----- commands
    def _command(self, cmd: Command) -> None:
        seq = self.store.add(keys.COMMANDS, 1) - 1
        self.store.set(keys.command(seq), cmd.to_json())

    def _flush(self) -> None:
        if self._serve is not None:
            self._serve()

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}-{self.store.add(keys.PROC_SEQ, 1)}"

    def _spawn(self, role: str, rank: int | None, node: int, boost: bool = False) -> ProcView:
        view = ProcView(self._new_id(f"{role}{rank if rank is not None else ''}"), role, rank, node)
        self.procs[view.proc_id] = view
        self._command(Command("spawn", view.proc_id, role, rank, node, boost))
        return view

    def _fork_shadow(self, node: int, boost: bool = False) -> ProcView | None:
        """Ask the node's warm zygote for a shadow; None if it has none ready in time. `boost`
        (a recovery's fork): the zygote forks at normal priority, and the shadow starts at it.
        A recovery names the shadow only once it is forked: asked for while the survivors still
        wait, the fork took ~0.1 s here; run alongside the survivors' join (the plan out first)
        it took 0.4-0.6 s on 2 cores, and the new group waits for the shadow either way."""
        if not any(p.role == "zygote" and p.node == node and p.alive and self.store.check([keys.warm(p.proc_id)])
                   for p in self.procs.values()):
            return None
        view = ProcView(self._new_id("shadow"), "shadow", None, node)
        self.procs[view.proc_id] = view
        self._command(Command("fork", view.proc_id, "shadow", None, node, boost=boost))
        deadline = time.monotonic() + 2 * self.cfg.timeouts.fork_s + POLL_S
        while time.monotonic() < deadline:
            self._flush()
            self._read_reports()
            if view.proc_id not in self.procs:
                return None  # fork_failed
            if view.pid:
                return view
            time.sleep(1e-3)
        del self.procs[view.proc_id]
        return None

    def _set_state(self, recovering: bool) -> None:
        self.store.set(keys.JOB_STATE, JobState(self.plan.generation, recovering).to_json())

    # ----- decisions
    def _on_failures(self, failed: list[tuple[ProcView, str]]) -> int | None:
        """Decide generation g+1 and announce it; returns an exit code when the job must stop."""
        t_detect = time.time()
        trace.mark("failures", procs=[p.proc_id for p, _ in failed])
        if self.hosts is not None:
            self.hosts.confirm()  # a deposed coordinator (its link back) records nothing in the shared run dir
        if self.store.check([keys.FATAL]):
            msg = self.store.get(keys.FATAL).decode(errors="replace")[:FATAL_CHARS]
            self.event("fatal", cause=msg)
            self.display.message(f"leto: cannot recover: {msg}; stopping the job")
            return 1
        for p, why in failed:
            self.display.message(f"leto: {p.describe()} (pid {p.pid}, node {p.node}) {why}")
            self.event("failure", role=p.role, rank=p.rank, node=p.node, pid=p.pid, cause=why)
        if any(p.code == 0 for p in self.members.values()):
            return self._after_training()
        dead_keepers = {p.node for p, _ in failed if p.role == "keeper"}
        lost_ranks = {r for r, p in self.members.items() if any(p is f for f, _ in failed)}
        lost_nodes = {n for n in dead_keepers
                      if all(p.code not in (None, 0) for p in self.members.values() if p.node == n)}
        if not lost_ranks and not dead_keepers:
            self._replenish()
            return None  # only idle shadows died
        code = self._refuse(lost_ranks)
        if code is not None:
            return code
        down = dead_keepers | self.dead_keeper_nodes | lost_nodes  # shadows there die with their node
        spares = [Spare(p.proc_id, p.node) for p in self.procs.values()
                  if p.role == "shadow" and p.alive and p.node not in down]
        for n in sorted(self._live_nodes(down), key=self._load):  # fork warm shadows: milliseconds
            while len(spares) < len(lost_ranks) and (forked := self._fork_shadow(n, boost=True)) is not None:
                spares.append(Spare(forked.proc_id, forked.node))
        while self.cfg.recovery.no_spare == "wait" and len(spares) < len(lost_ranks):  # cold shadows, waited for
            p = self._spawn("shadow", None, self._spare_node(lost_nodes))
            spares.append(Spare(p.proc_id, p.node))
        cause = "; ".join(sorted({why for _, why in failed}))
        try:
            new, adopted = next_plan(self.plan, lost_ranks, lost_nodes, spares, cause)
        except LookupError as e:
            self.display.message(f"leto: cannot recover: {e}; stopping the job")
            return 1
        trace.mark("plan_decided", generation=new.generation)
        self._announce(new, dead_keepers)
        trace.mark("announced", generation=new.generation)
        self._note_degradation(new)
        t_fail = min(self._failure_time(p, t_detect) for p, _ in failed)
        record = {"generation": new.generation, "failed_ranks": sorted(lost_ranks), "failed_nodes": sorted(lost_nodes),
                  "cause": cause, "t_fail": t_fail, "t_detect": t_detect, "world_size": len(new.proc_of_rank),
                  "adopted_by": {str(r): s.proc_id for r, s in adopted.items()}, "interrupted": []}
        if len(new.proc_of_rank) < len(self.members_before):
            self.display.message(f"leto: no shadow left for {len(self.members_before) - len(new.proc_of_rank)} "
                                 f"lost rank(s): shrinking to {len(new.proc_of_rank)} ranks (same global batch)")
        self._merge_pending(record)
        for n in dead_keepers - lost_nodes:  # the node lives: give it a new keeper, at normal priority
            self._spawn("keeper", None, n, boost=True)  # (the workers wait for it to protect again)
            self.dead_keeper_nodes.discard(n)
        # new shadows start once this recovery has closed: starting one (importing torch, building
        # the model) would compete for the cores the recovery is using
        self._flush()
        return None

    def _after_training(self) -> int:
        """A failure once a member has finished: a rank ends only after the last step's collectives,
        so training is over and there is nothing left to recover (a recovery would wait for
        survivors that have gone). The job ends, successful if rank 0 recorded its result."""
        recorded = self.store.check([keys.RESULT])
        self.display.message("leto: the failure came after the last step; nothing to recover"
                             + ("" if recorded else " (rank 0 did not record the result)"))
        return 0 if recorded else 1

    def _refuse(self, lost_ranks: set[int]) -> int | None:
        """An exit code when no recovery may be tried (no protection, too many, nothing protected)."""
        if not self.cfg.protection.enabled:
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
        return None

    def _merge_pending(self, record: dict) -> None:
        """A failure during a recovery makes one record with it, from the first failure; a grow
        cut short is replaced by the failure's recovery."""
        self.pending = [old for old in self.pending if old["kind"] != "grow"]
        for old in self.pending:
            record["failed_ranks"] = sorted(set(record["failed_ranks"]) | set(old["failed_ranks"]))
            record["failed_nodes"] = sorted(set(record["failed_nodes"]) | set(old["failed_nodes"]))
            record["cause"] = f"{old['cause']}; then during its recovery: {record['cause']}"
            record["t_fail"], record["t_detect"] = min(old["t_fail"], record["t_fail"]), min(old["t_detect"],
                                                                                          record["t_detect"])
            record["interrupted"] += old["interrupted"] + [old["generation"]]
        self.pending = [dict(record, kind="failure")]

    def _announce(self, new: Plan, dead_keepers: set[int] = frozenset()) -> None:
        """Drain the current generation's keepers and publish generation g+1."""
        live_nodes = sorted({n for n in self.plan.node_of_rank if n not in self.dead_keeper_nodes | dead_keepers})
        # one etcd transaction: whoever sees the plan finds the drain it rebuilds from
        self.store.multi_set([keys.drain(self.plan.generation), keys.plan(new.generation), keys.JOB_STATE],
                             [Drain(tuple(live_nodes), new.generation).to_json(), new.to_json(),
                              JobState(new.generation, True).to_json()])
        self._command(Command("wake_keepers"))
        for proc_id in new.proc_of_rank:  # adopting shadows run at normal priority from here
            if self.procs[proc_id].role == "shadow":
                self._command(Command("boost", proc_id))
        self._flush()
        self.members_before = dict(self.members)
        self.members = {q: self.procs[proc_id] for q, proc_id in enumerate(new.proc_of_rank)}
        for q, proc in self.members.items():
            proc.role, proc.rank = "worker", q
        self.plan = new
        self.dead_keeper_nodes |= dead_keepers

    def _note_degradation(self, new: Plan) -> None:
        """After a loss, say what the tier-2 code re-placed over the nodes left no longer covers
        (a `degraded` event, on the console and in summary.json); once per change."""
        nodes = sorted(set(new.node_of_rank))
        what = degradation(len(nodes), self.cfg.protection.ec) if self.cfg.protection.enabled else None
        if what is None or any(e["event"] == "degraded" and e["what"] == what for e in self.events):
            return
        self.event("degraded", generation=new.generation, nodes=nodes, what=what)
        self.display.message(f"leto: degraded: {what}")

    def _maybe_grow(self) -> None:
        """After a shrink, a warm shadow joins as a new rank (no recovery may be in progress)."""
        now = time.monotonic()
        workers = self.cfg.training.workers
        if self.pending or len(self.members) >= workers or now - self._last_grow_check < GROW_CHECK_S:
            return
        self._last_grow_check = now
        warm = [Spare(p.proc_id, p.node) for p in self.procs.values() if p.role == "shadow" and p.alive and p.pid
                and p.node not in self.dead_keeper_nodes and self.store.check([keys.warm(p.proc_id)])]
        if not warm or self.plan.generation >= MAX_GENERATIONS:
            return
        new = grow_plan(self.plan, warm[:workers - len(self.members)])
        t = time.time()
        self._announce(new)
        self.pending = [{"generation": new.generation, "kind": "grow", "cause": new.cause, "t_fail": t,
                         "t_detect": t, "world_size": len(new.proc_of_rank), "failed_ranks": [], "failed_nodes": [],
                         "interrupted": []}]
        self.display.message(f"leto: {new.cause}: growing back to {len(new.proc_of_rank)} ranks")

    def _ever_protected(self) -> bool:
        """Has any generation's protection been committed (by any keeper)?"""
        return any(self.store.check([keys.committed(g, n)])
                   for g in range(self.plan.generation + 1) for n in range(self.cfg.training.nodes))

    def _failure_time(self, p: ProcView, t_detect: float) -> float:
        """When the failure happened: the injector's record, else the last sign of life of its
        host (a host loss), else the last heartbeat before it."""
        key = keys.inject_time(p.proc_id)
        try:  # a malformed value is no evidence: the next one is tried
            if self.store.check([key]):
                return parse_float(self.store.get(key), key)
        except BadValue:
            pass
        if p.node in self.host_lost_at:
            return min(t_detect, self.host_lost_at[p.node])
        key = keys.heartbeat(p.proc_id)
        try:
            beat = parse_beat(self.store.get(key), key) if p.role in ("worker", "keeper") and self.store.check([key]) \
                else None
        except BadValue:
            beat = None
        return min(t_detect, beat[0]) if beat is not None else t_detect

    def _live_nodes(self, lost_nodes: set[int]) -> list[int]:
        return [n for n in range(self.cfg.training.nodes) if n not in lost_nodes | self.dead_keeper_nodes]

    def _load(self, node: int) -> int:
        return sum(1 for p in self.procs.values() if p.node == node and p.role != "zygote" and p.alive)

    def _spare_node(self, lost_nodes: set[int]) -> int:
        return min(self._live_nodes(lost_nodes) or [0], key=self._load)

    def _zygotes_wanted(self) -> bool:
        """Zygotes need spares to make, protection to adopt with, and a job that can fork (a
        zygote that finds a CUDA context says so and exits: CUDA does not survive fork)."""
        return bool(self.cfg.recovery.zygotes and self.cfg.recovery.spares and self.cfg.protection.enabled
                    and not self.store.check([keys.ZYGOTES_OFF]))

    def _replenish(self) -> None:
        """Keep --spares shadows: fork new ones from a warm zygote of the node (milliseconds),
        else start them from scratch; restart zygotes that died on live nodes."""
        live = [p for p in self.procs.values() if p.role in ("shadow", "zygote") and p.alive]
        if self._zygotes_wanted():
            for n in range(self.cfg.training.nodes):
                if n not in self.dead_keeper_nodes and not any(p.role == "zygote" and p.node == n for p in live):
                    self._spawn("zygote", None, n)
        for _ in range(self.cfg.recovery.spares - sum(p.role == "shadow" for p in live)):
            node = self._spare_node(set())
            if self._fork_shadow(node) is None:
                self._spawn("shadow", None, node)
        self._flush()

    # ----- reporting
    def event(self, kind: str, **fields: object) -> None:
        self.events.append(runlog.event(self.run_dir, kind, **fields))

    def _recovery_info(self, generation: int) -> dict:
        """Rank 0's record of how generation `generation` joined ({} before it wrote one)."""
        key = keys.recovery(generation)
        if not self.store.check([key]):
            return {}
        value = self.store.get(key)
        try:
            return asdict(RecoveryRecord.from_json(value, key))
        except BadValue as e:  # closed without rank 0's numbers, as if it had written none
            self._refused.refuse(e, value)
            return {}

    def _close_recoveries(self, rec: StepProgress, force: bool = False) -> None:
        """The first step completed after a recovery closes its record (once rank 0's record of
        it is here, or RECORD_WAIT_S later, or at once with `force`)."""
        for pending in list(self.pending):
            if rec.time <= pending["t_detect"]:
                continue
            first = pending.setdefault("first_step", (rec.time, self.max_step, time.monotonic()))
            info = self._recovery_info(pending["generation"])
            if not info and not force and time.monotonic() - first[2] < RECORD_WAIT_S:
                continue  # rank 0's record may reach this store after its step (etcd's mirror): look again
            t_first, max_step = first[0], first[1]
            done = {k: v for k, v in pending.items() if k not in ("t_fail", "t_detect", "kind", "first_step")}
            done.update({"tier": info.get("tier"), "step": info.get("step"), "repaired": list(info.get("repaired", [])),
                         "detect_s": round(pending["t_detect"] - pending["t_fail"], 4),
                         "restore_s": info.get("restore_s"), "join_s": info.get("join_s"),
                         "protect_s": info.get("protect_s"), "join_phases_s": info.get("phases_s", {}),
                         "total_s": round(t_first - pending["t_fail"], 4),
                         "lost_steps": None if info.get("step") is None else max(0, max_step - info["step"])})
            self.pending.remove(pending)
            if not self.pending:
                self._set_state(recovering=False)
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
        self.max_step = max(self.max_step, rec.step)

    def write_summary(self, wall_s: float, code: int) -> None:
        """`summary.json` (atomically and durably; retried a few times on a full disk, else said
        on stderr: the job's exit code stays the job's)."""
        result: dict = {"steps": None, "final_loss": None, "digest": None}
        if self.store.check([keys.RESULT]):
            value = self.store.get(keys.RESULT)
            try:
                result.update(asdict(JobResult.from_json(value, keys.RESULT)))
            except BadValue as e:
                self._refused.refuse(e, value)
        t = self.cfg.training
        summary = {**result, "wall_s": round(wall_s, 3), "workers": t.workers,
                   "spares": self.cfg.recovery.spares, "nodes": t.nodes, "exit_code": code,
                   "recoveries": [e for e in self.events if e["event"] == "recovery"],
                   "resizes": [e for e in self.events if e["event"] == "resize"],
                   "degraded": [e for e in self.events if e["event"] == "degraded"],
                   "fatal": next((e["cause"] for e in self.events if e["event"] == "fatal"), None), **self.summary_extra,
                   "config": self.cfg.to_dict()}
        runlog.flush()
        runlog.write_summary(self.run_dir, summary)
