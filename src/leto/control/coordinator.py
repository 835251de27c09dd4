"""The per-job coordinator: membership and generations, and what the job reports.

It decides who is rank what (`decision.next_membership` / `grow_membership`), announces memberships and drains,
shrinks and grows the job, and keeps the events (`metrics.jsonl`). The processes and their
commands are `procs.Processes`, spare finding `spares.Spares`, the recovery records
`records.Recovery`, `summary.json` `summary.write_summary`; it emits `console.notices` and the
console renders them. It knows the processes only from the supervisors' reports and acts on them
only by commands, both through the store (docs/design.md, "Supervisor and coordinator").
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Protocol

import torch.distributed as dist

from leto.config import JobConfig
from leto.console import StepDisplay, notices, read_jsonl
from leto.control import stream, takeover
from leto.control.decision import Spare, grow_membership, next_membership
from leto.control.procs import POLL_S, Processes, ProcView
from leto.control.records import Recovery
from leto.control.spares import Spares
from leto.control.summary import write_summary
from leto.errors import BadValue
from leto.protection.placement import degradation
from leto.protocol import keys
from leto.protocol.failures import ProcEventKind
from leto.protocol.messages import (
    Command,
    HostRecord,
    JobState,
    JoinRequest,
    Membership,
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
from leto.runtime import linux, runlog, trace
from leto.runtime.durable import write_atomic

__all__ = ["POLL_S", "Coordinator", "Hosts"]

FATAL_CHARS = 500  # of a worker's reason the job cannot recover (free text, shown and recorded)
MAX_GENERATIONS = 100  # a job that needs more recoveries than this is failing in a loop
GROW_CHECK_S = 0.1
JOIN_WARM_S = 120.0  # an admitted host's shadows are warm by then, or the job grows onto those that are
RECORD_WAIT_S = 2.0  # how long a recovery waits, after its first step, for rank 0's record of it


class Hosts(Protocol):
    """The hosts of a multi-host job, as the coordinator needs them (control/hosts.py)."""

    def up(self) -> list[int]:
        """The nodes whose host is in the job."""

    def lost(self) -> dict[int, tuple[str, float]]:
        """Hosts newly out of the job (fenced already): why, and when each was last heard from."""

    def confirm(self) -> None:
        """Raise unless this host is still in the job."""

    def joiners(self) -> list[tuple[int, JoinRequest]]:
        """Hosts asking to enter, each with the lost node it would take."""

    def admit(self, node: int, request: JoinRequest, first_command: int) -> HostRecord | None:
        """Make a joiner node `node`'s host; None if it died waiting."""

    def admissions(self, first_command: int) -> dict[int, int]:
        """At a takeover: the nodes of admitted hosts, each with its first command; an admission
        the lost coordinator had not written yet is written now, at `first_command`."""


class Coordinator:
    """Decides the membership of one job, from start to end."""

    def __init__(
        self,
        store: dist.Store,
        config: JobConfig,
        serve: Callable[[], None] | None = None,
        summary_extra: dict | None = None,
        hosts: Hosts | None = None,
    ) -> None:
        """`serve`: where the host's supervisor runs in this thread, the call that lets it carry
        out the commands written so far (so none waits for its next round); None where it runs
        elsewhere and polls the store itself. `hosts`: a multi-host job's hosts (None: one host)."""
        self.store, self.cfg, self.hosts = store, config, hosts
        self.run_dir = Path(config.run_dir)
        self.summary_extra = summary_extra or {}
        self.processes = Processes(store, serve, config.timeouts.fork_s)
        self.procs = self.processes.views  # every process asked for, by id (the same dict)
        self.spares = Spares(self.processes, config, self._read_reports)
        self.members: dict[int, ProcView] = {}  # rank -> its process in the current generation
        self.members_before: dict[int, ProcView] = {}
        self.pending: list[Recovery] = []  # recoveries waiting for their first step
        self.dead_keeper_nodes: set[int] = set()
        self.host_lost_at: dict[int, float] = {}  # a lost host's last sign of life (time.time())
        self.events: list[dict] = []
        self.max_step = 0
        self._script_exits: set[str] = set()  # processes that exited with a positive code (their script's error)
        self._script_error_step: int | None = None  # the step in flight at the last such failure of a rank
        self.membership = Membership(0, (), ())
        self.display = StepDisplay(config.training.steps, quiet=config.quiet)
        self._inbox: list[ProcEvent] = []
        self._refused = Refusals()  # malformed store values seen (said once)
        self._signal: int | None = None
        self._reports = stream.Reader(self.store, keys.REPORTS, keys.sup_report)
        self._last_step: tuple[int, float] | None = None
        self._last_progress: StepProgress | None = None
        self._progress_set = False  # rank 0 has set keys.PROGRESS (it stays set)
        self._last_grow_check = 0.0
        self._joined_shadows: list[str] = []  # an admitted host's shadows, started for the missing ranks
        self._joined_by = 0.0  # when the grow stops waiting for the rest of them
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
            self.display.show(notices.ConfigNotWritten(str(self.run_dir / "config.json"), str(e.strerror)))

    def start(self) -> None:
        """Ask for generation 0's workers, the keepers, the shadows and zygotes, and announce membership 0."""
        self._exit.enter_context(self.display)
        self.store.add(keys.REPORTS, 0)  # the counter exists from now on: `_poll` reads it
        t = self.cfg.training
        nodes = [node_of_rank(r, t.workers, t.nodes) for r in range(t.workers)]
        workers = [self.processes.spawn("worker", r, nodes[r]) for r in range(t.workers)]
        self.members = dict(enumerate(workers))
        self.membership = Membership(0, tuple(nodes), tuple(w.proc_id for w in workers))
        self.store.set(keys.membership(0), self.membership.to_json())
        self._set_state(recovering=False)
        if self.cfg.protection.enabled:  # before the spares: the workers' first step waits for its keeper
            for n in range(t.nodes):
                self.processes.spawn("keeper", None, n)
        self.spares.start()
        self.processes.flush()

    def restore(self, commands: dict[str, bytes], reports: dict[str, bytes]) -> None:
        """Take over a running job whose coordinator was lost: the processes from the command
        and report streams (every entry so far, by key), the membership from the newest generation,
        the events from metrics.jsonl. Failures its predecessor had not decided on yet are
        decided on at the next round, an admission it had not grown onto yet is finished
        (`takeover`, `_resume_joins`)."""
        self._exit.enter_context(self.display)
        admitted = self._admissions()
        for key, text in takeover.ordered(commands, self._refused):
            try:
                cmd = Command.from_json(text, key)
            except BadValue as e:  # malformed values are said once and skipped, here as in every round
                self._refused.refuse(e, text)
                continue
            if cmd.kind in ("spawn", "fork"):
                view = ProcView(cmd.proc_id, cmd.role, cmd.rank, cmd.node)
                if takeover.entry_seq(key) < admitted.get(cmd.node, -1):  # the replaced host's: lost with it
                    view.code = -signal.SIGKILL
                self.procs[cmd.proc_id] = view
        try:
            written = parse_int(self.store.get(keys.REPORTS), keys.REPORTS, minimum=0)
        except BadValue as e:
            self._refused.refuse(e)
            written = None
        for key, text in takeover.ordered(reports, self._refused, written):
            self._reports.skip_to(takeover.entry_seq(key) + 1)
            try:
                self._apply(SupervisorReport.from_json(text, key))
            except BadValue as e:
                self._refused.refuse(e, text)
        self._read_reports()  # any written since
        self._inbox.clear()
        self.membership = takeover.newest_membership(self.store, self.procs, self._refused)
        gen = self.membership.generation
        self.members = {q: self.procs[proc_id] for q, proc_id in enumerate(self.membership.proc_of_rank)}
        for q, proc in self.members.items():
            proc.role, proc.rank = "worker", q
        in_membership = set(self.membership.node_of_rank)
        self.dead_keeper_nodes = {
            n for n in range(self.cfg.training.nodes) if n not in in_membership and n not in admitted
        }
        for p in self.procs.values():  # undecided: a dead member, the last keeper of a node in the membership
            keeper_gone = (
                p.role == "keeper"
                and p.node in in_membership
                and not any(q.role == "keeper" and q.node == p.node and q.alive for q in self.procs.values())
            )
            if (p in self.members.values() and p.code not in (None, 0)) or (keeper_gone and p.code is not None):
                self._inbox.append(
                    ProcEvent(
                        ProcEventKind.EXITED,
                        p.proc_id,
                        p.role,
                        p.rank,
                        p.node,
                        p.pid,
                        p.code,
                        "exited before the coordinator was lost",
                    )
                )
        self.events = [r for r in read_jsonl(self.run_dir / runlog.METRICS) if "event" in r]
        self.event("takeover", generation=gen)
        self.display.show(notices.TookOver(gen))
        self._resume_joins({n: first for n, first in admitted.items() if n not in in_membership})

    def _admissions(self) -> dict[int, int]:
        """The admitted hosts' nodes and first commands (`Hosts.admissions`); none with a
        malformed command counter (said once: no admission can be finished at its end)."""
        if self.hosts is None:
            return {}
        value = self.store.get(keys.COMMANDS)
        try:
            return self.hosts.admissions(parse_int(value, keys.COMMANDS, minimum=0))
        except BadValue as e:
            self._refused.refuse(e, value)
            return {}

    def _resume_joins(self, admitted: dict[int, int]) -> None:
        """Hosts admitted by the lost coordinator and holding no rank yet: what their admission
        started and the command stream lacks (a keeper, a zygote, shadows for the missing ranks or
        `--spares`) is asked for now, and the grow waits for their shadows (`_maybe_grow`) as it
        would have. A `join_resumed` event for each."""
        missing = max(self.cfg.training.workers - len(self.members), 0)
        for node, first in sorted(admitted.items()):
            here = [p for p in self.procs.values() if p.node == node and p.alive]
            asked = []
            if self.cfg.protection.enabled and not any(p.role == "keeper" for p in here):
                asked.append(self.processes.spawn("keeper", None, node))
            if self.spares.zygotes_wanted() and not any(p.role == "zygote" for p in here):
                asked.append(self.processes.spawn("zygote", None, node))
            shadows = [p.proc_id for p in here if p.role == "shadow"]
            for _ in range(max(missing, self.cfg.recovery.spares) - len(shadows)):
                asked.append(self.processes.spawn("shadow", None, node))
                shadows.append(asked[-1].proc_id)
            self._joined_shadows += shadows[:missing]
            missing -= len(shadows[:missing])
            self._joined_by = time.monotonic() + JOIN_WARM_S
            self.event(
                "join_resumed",
                node=node,
                first_command=first,
                generation=self.membership.generation,
                asked=[p.role for p in asked],
                shadows=shadows,
            )
        self.processes.flush()

    def release(self) -> None:
        """Give the console back (the end, or this host leaves the job to another coordinator)."""
        self._exit.close()

    def stop(self) -> None:
        """Ask the supervisors to stop every process and wait until they have (with a timeout)."""
        self.release()
        self.processes.command(Command("stop"))
        self.processes.flush()
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
            self.display.show(notices.Stopping(signal.Signals(self._signal).name))
            return 128 + self._signal
        failed = self._take_failures()
        if failed:
            code = self._on_failures(failed)
            if code is not None:
                return code
        self._maybe_admit()
        self._maybe_grow()
        members = [self.members[r] for r in sorted(self.members)]
        done = bool(members) and all(p.code == 0 for p in members)
        if done:
            self._poll()
        elif self._result_during_recovery(members):
            self._close_at_end()
            return self._after_training([])
        if self._last_progress is not None and any(p.first_step is not None for p in self.pending):
            self._close_recoveries(self._last_progress, force=done)  # waiting for a record
        if done:
            self._close_at_end()
        return 0 if done else None

    def _result_during_recovery(self, members: list[ProcView]) -> bool:
        """Rank 0 recorded the result and left while a recovery was under way: a failure during
        the final digest, which rank 0's part of it survived. Training is over; the ranks still
        recovering would wait for ranks that have gone."""
        return bool(self.pending) and any(p.code == 0 for p in members) and self.store.check([keys.RESULT])

    def _close_at_end(self) -> None:
        """A recovery of the final digest has no step after it: the job's end closes it."""
        if any(p.first_step is None for p in self.pending):
            self._close_recoveries(StepProgress(self.max_step, time.time(), None), force=True)

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
            if parse_int(count, keys.REPORTS, minimum=0) > self._reports.next:
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
        while (entry := self._reports.take()) is not None:
            key, value = entry
            try:
                report = SupervisorReport.from_json(value, key)
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
            self.display.show(notices.SegmentsRemoved(len(report.shm_removed)))
        for e in report.events:
            if self.processes.apply(e):
                self._inbox.append(e)

    def _on_lost_hosts(self, lost: dict[int, tuple[str, float]]) -> None:
        """Every process of a lost host is gone with it (the host is fenced already). A host that
        holds no rank (admitted, not yet grown onto) holds no state either: its processes are
        forgotten without a recovery."""
        for node, (why, last_heard) in sorted(lost.items()):
            self.host_lost_at[node] = last_heard
            self.event("host_lost", node=node, cause=why, last_heard=round(last_heard, 4))
            ranks_here = node in self.membership.node_of_rank
            if not ranks_here:
                self.dead_keeper_nodes.add(node)
            for p in self.procs.values():
                if p.node == node and p.alive:
                    p.code = -signal.SIGKILL
                    if not ranks_here:
                        continue
                    self._inbox.append(
                        ProcEvent(
                            ProcEventKind.EXITED,
                            p.proc_id,
                            p.role,
                            p.rank,
                            node,
                            p.pid,
                            p.code,
                            f"lost with its host: {why}",
                        )
                    )

    def hosts_up(self) -> list[int]:
        """The nodes whose supervisor takes part (one host: node 0 stands for all)."""
        return [0] if self.hosts is None else self.hosts.up()

    def _take_failures(self) -> list[tuple[ProcView, str]]:
        """The failures among the events read: any non-zero exit, a keeper's exit, a fence."""
        self._script_exits |= {
            e.proc_id
            for e in self._inbox
            if e.proc_id in self.procs and e.kind is ProcEventKind.EXITED and _own_error(e.code)
        }
        out = [
            (self.procs[e.proc_id], e.cause)
            for e in self._inbox
            if e.proc_id in self.procs
            and (
                e.kind is ProcEventKind.FENCED
                or e.kind is ProcEventKind.EXITED
                and (e.code != 0 or self.procs[e.proc_id].role == "keeper")
            )
        ]
        self._inbox.clear()
        return out

    def _set_state(self, recovering: bool) -> None:
        self.store.set(keys.JOB_STATE, JobState(self.membership.generation, recovering).to_json())

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
            self.display.show(notices.CannotRecover(msg))
            return 1
        for p, why in failed:
            self.display.show(notices.ProcessFailed(p.describe(), p.pid, p.node, why))
            self.event("failure", role=p.role, rank=p.rank, node=p.node, pid=p.pid, cause=why)
        # rank 0 records the result after the final digest, a collective: training is over
        if any(p.code == 0 for p in self.members.values()) or self.store.check([keys.RESULT]):
            return self._after_training([p for p, _ in failed])
        dead_keepers = {p.node for p, _ in failed if p.role == "keeper"}
        lost_ranks = {r for r, p in self.members.items() if any(p is f for f, _ in failed)}
        lost_nodes = {
            n for n in dead_keepers if all(p.code not in (None, 0) for p in self.members.values() if p.node == n)
        }
        if not lost_ranks and not dead_keepers:
            self.spares.replenish(self.dead_keeper_nodes, self.cfg.training.workers - len(self.members))
            return None  # only idle shadows died
        code = self._refuse(lost_ranks)
        if code is None:
            code = self._script_fails_again([p for p, _ in failed if p.rank in lost_ranks])
        if code is not None:
            return code
        down = dead_keepers | self.dead_keeper_nodes | lost_nodes  # shadows there die with their node
        spares = self.spares.for_ranks(len(lost_ranks), down, lost_nodes | self.dead_keeper_nodes)
        cause = "; ".join(sorted({why for _, why in failed}))
        try:
            new, adopted = next_membership(
                self.membership, lost_ranks, lost_nodes, spares, cause, self.cfg.mesh.replica_ranks
            )
        except LookupError as e:
            self.display.show(notices.CannotRecover(str(e)))
            return 1
        trace.mark("plan_decided", generation=new.generation)
        self._announce(new, dead_keepers)
        trace.mark("announced", generation=new.generation)
        self._note_degradation(new)
        t_fail = min(self._failure_time(p, t_detect) for p, _ in failed)
        record = Recovery(
            new.generation,
            cause,
            t_fail,
            t_detect,
            len(new.proc_of_rank),
            sorted(lost_ranks),
            sorted(lost_nodes),
            {str(r): s.proc_id for r, s in adopted.items()},
        )
        if len(new.proc_of_rank) < len(self.members_before):
            self.display.show(
                notices.Shrinking(len(self.members_before) - len(new.proc_of_rank), len(new.proc_of_rank))
            )
        self._merge_pending(record)
        for n in dead_keepers - lost_nodes:  # the node lives: give it a new keeper, at normal priority
            self.processes.spawn("keeper", None, n, boost=True)  # (the workers wait for it to protect again)
            self.dead_keeper_nodes.discard(n)
        # new shadows start once this recovery has closed: starting one (importing torch, building
        # the model) would compete for the cores the recovery is using
        self.processes.flush()
        return None

    def _after_training(self, failed: list[ProcView]) -> int:
        """A failure once a member has finished: a rank ends only after the last step's collectives,
        so training is over and there is nothing left to recover (a recovery would wait for
        survivors that have gone). The job ends, successful if rank 0 recorded its result and no
        worker's script failed on its own after it (a positive exit code, not a signal)."""
        recorded = self.store.check([keys.RESULT])
        errors = tuple(sorted({p.code for p in failed if p.role == "worker" and p.code is not None and p.code > 0}))
        self.display.show(notices.AfterLastStep(recorded, errors))
        return 0 if recorded and not errors else 1

    def _refuse(self, lost_ranks: set[int]) -> int | None:
        """An exit code when no recovery may be tried (no protection, too many, nothing protected)."""
        if not self.cfg.protection.enabled:
            self.display.show(notices.ProtectionOff())
            return 1
        if self.membership.generation >= MAX_GENERATIONS:
            self.display.show(notices.RecoveringInALoop(MAX_GENERATIONS))
            return 1
        if not self._ever_protected():
            self.display.show(notices.NothingProtected())
            return 1
        return None

    def _script_fails_again(self, lost: list[ProcView]) -> int | None:
        """An exit code when a rank's process ended by its own error (`_own_error`) in the same
        step as the last time one did, with no step completed in between: recovering again would
        only replay the error."""
        errors = [p for p in lost if p.proc_id in self._script_exits]
        if not errors:
            return None
        step = self.max_step + 1
        if self._script_error_step == step:
            p = errors[0]
            how = linux.describe_exit(p.code or 0)
            self.event("fatal", cause=f"{p.describe()} {how} in step {step} again")
            self.display.show(notices.ScriptFailsAgain(p.describe(), how, step))
            return 1
        self._script_error_step = step
        return None

    def _merge_pending(self, record: Recovery) -> None:
        """A failure during a recovery makes one record with it, from the first failure; a grow
        cut short is replaced by the failure's recovery."""
        for old in self.pending:
            if not old.grow:
                record.absorb(old)
        self.pending = [record]

    def _announce(self, new: Membership, dead_keepers: set[int] = frozenset()) -> None:
        """Drain the current generation's keepers and publish generation g+1."""
        live_nodes = sorted({n for n in self.membership.node_of_rank if n not in self.dead_keeper_nodes | dead_keepers})
        # one etcd transaction: whoever sees the membership finds the drain it rebuilds from
        self.store.multi_set(
            [keys.drain(self.membership.generation), keys.membership(new.generation), keys.JOB_STATE],
            [
                Drain(tuple(live_nodes), new.generation).to_json(),
                new.to_json(),
                JobState(new.generation, True).to_json(),
            ],
        )
        self.processes.command(Command("wake_keepers"))
        for proc_id in new.proc_of_rank:  # adopting shadows run at normal priority from here
            if self.procs[proc_id].role == "shadow":
                self.processes.command(Command("boost", proc_id))
        self.processes.flush()
        self.members_before = dict(self.members)
        self.members = {q: self.procs[proc_id] for q, proc_id in enumerate(new.proc_of_rank)}
        for q, proc in self.members.items():
            proc.role, proc.rank = "worker", q
        for proc_id in new.demoted:  # a dropped replica's live ranks wait to be adopted again
            self.procs[proc_id].role, self.procs[proc_id].rank = "shadow", None
        self.membership = new
        self.dead_keeper_nodes |= dead_keepers

    def _note_degradation(self, new: Membership) -> None:
        """After a loss, say what the tier-2 code re-placed over the nodes left no longer covers
        (a `degraded` event, on the console and in summary.json); once per change."""
        nodes = sorted(set(new.node_of_rank))
        what = degradation(len(nodes), self.cfg.protection.ec) if self.cfg.protection.enabled else None
        last = next((e for e in reversed(self.events) if e["event"] in ("degraded", "restored")), None)
        if what is None or (last is not None and last["event"] == "degraded" and last["what"] == what):
            return
        self.event("degraded", generation=new.generation, nodes=nodes, what=what)
        self.display.show(notices.Degraded(what))

    def _maybe_grow(self) -> None:
        """After a shrink, a warm shadow joins as a new rank (no recovery may be in progress)."""
        now = time.monotonic()
        workers = self.cfg.training.workers
        if self.pending or len(self.members) >= workers or now - self._last_grow_check < GROW_CHECK_S:
            return
        self._last_grow_check = now
        warm = self.spares.warm(self.dead_keeper_nodes)
        if not warm or self.membership.generation >= MAX_GENERATIONS or self._warming(warm, now):
            return
        self._joined_shadows.clear()
        new = grow_membership(
            self.membership, warm[: workers - len(self.members)], self.cfg.mesh.tp, self.cfg.mesh.replica_ranks
        )
        if new is None:
            return
        t = time.time()
        self._announce(new)
        self.pending = [Recovery(new.generation, new.cause, t, t, len(new.proc_of_rank))]
        self.display.show(notices.Growing(new.cause, len(new.proc_of_rank)))

    def _maybe_admit(self) -> None:
        """Hosts asking to enter take the nodes of lost hosts, at a generation boundary (no
        recovery or resize in progress): each gets a keeper, a zygote and shadows for the ranks
        the job lacks, or `--spares` of them if more (spares off the other hosts, which cover
        their loss); `_maybe_grow` grows onto those for the missing ranks once they are warm. A
        standby's warm processes are bound to these spawns (control/standby.py)."""
        if self.hosts is None or self.pending or not self.members:
            return
        for node, request in self.hosts.joiners():
            first_command = parse_int(self.store.get(keys.COMMANDS), keys.COMMANDS, minimum=0)
            record = self.hosts.admit(node, request, first_command)
            if record is None:
                continue  # it died waiting: forgotten
            self.event("host_joined", node=node, addr=record.addr, generation=self.membership.generation)
            self.display.show(notices.HostJoined(node, record.addr))
            self.dead_keeper_nodes.discard(node)
            self.host_lost_at.pop(node, None)
            if self.cfg.protection.enabled:
                self.processes.spawn("keeper", None, node)
            if self.spares.zygotes_wanted():
                self.processes.spawn("zygote", None, node)
            missing = max(self.cfg.training.workers - len(self.members), 0)
            for i in range(max(missing, self.cfg.recovery.spares)):
                shadow = self.processes.spawn("shadow", None, node)
                if i < missing:
                    self._joined_shadows.append(shadow.proc_id)
            self._joined_by = time.monotonic() + JOIN_WARM_S
            self.processes.flush()

    def _warming(self, warm: list[Spare], now: float) -> bool:
        """Whether an admitted host's shadows are still starting (one grow takes them all, one
        pause of training rather than one per shadow), for at most `JOIN_WARM_S`."""
        ready = {s.proc_id for s in warm}
        waiting = [  # a shadow a recovery made a worker meanwhile is no longer awaited
            p
            for p in self._joined_shadows
            if p not in ready and p in self.procs and self.procs[p].alive and self.procs[p].role == "shadow"
        ]
        if not waiting or now < self._joined_by:
            return bool(waiting)
        self.display.show(notices.NotWarm(len(waiting), JOIN_WARM_S))
        self._joined_shadows.clear()
        return False

    def _note_restored(self, new: Membership) -> None:
        """After a grow: once the job runs its configured ranks again, over enough nodes for the
        tier-2 code it asked for, a `restored` event follows the `degraded` event or the shrink
        before it (on the console and in summary.json)."""
        since = []
        for e in self.events:
            since = [] if e["event"] == "restored" else [*since, e]
        workers = self.cfg.training.workers
        lessened = any(
            e["event"] == "degraded" or (e["event"] == "recovery" and e.get("world_size", workers) < workers)
            for e in since
        )
        nodes = sorted(set(new.node_of_rank))
        ec = self.cfg.protection.ec if self.cfg.protection.enabled else None
        if not lessened or len(new.proc_of_rank) < workers or degradation(len(nodes), ec) is not None:
            return
        what = f"{workers} ranks over {len(nodes)} nodes" + (
            f", tier 2 {ec[0]}+{ec[1]} survives {ec[1]} node loss(es) again" if ec is not None else ""
        )
        self.event("restored", generation=new.generation, nodes=nodes, what=what)
        self.display.show(notices.Restored(what))

    def _ever_protected(self) -> bool:
        """Has any generation's protection been committed (by any keeper)?"""
        return any(
            self.store.check([keys.committed(g, n)])
            for g in range(self.membership.generation + 1)
            for n in range(self.cfg.training.nodes)
        )

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
            beat = (
                parse_beat(self.store.get(key), key)
                if p.role in ("worker", "keeper") and self.store.check([key])
                else None
            )
        except BadValue:
            beat = None
        return min(t_detect, beat[0]) if beat is not None else t_detect

    # ----- reporting
    def event(self, kind: str, **fields: object) -> None:
        """Record an event of the job (metrics.jsonl; summary.json reads them)."""
        self.events.append(runlog.event(self.run_dir, kind, **fields))

    def _recovery_info(self, generation: int) -> RecoveryRecord | None:
        """Rank 0's record of how generation `generation` joined (None before it wrote one)."""
        key = keys.recovery(generation)
        if not self.store.check([key]):
            return None
        value = self.store.get(key)
        try:
            return RecoveryRecord.from_json(value, key)
        except BadValue as e:  # closed without rank 0's numbers, as if it had written none
            self._refused.refuse(e, value)
            return None

    def _close_recoveries(self, rec: StepProgress, force: bool = False) -> None:
        """The first step completed after a recovery closes its record (once rank 0's record of
        it is here, or RECORD_WAIT_S later, or at once with `force`)."""
        for pending in list(self.pending):
            if rec.time <= pending.t_detect:
                continue
            if pending.first_step is None:
                pending.first_step = (rec.time, self.max_step, time.monotonic())
            info = self._recovery_info(pending.generation)
            if info is None and not force and time.monotonic() - pending.first_step[2] < RECORD_WAIT_S:
                continue  # rank 0's record may reach this store after its step (etcd's mirror): look again
            done = pending.to_dict(info)
            self.pending.remove(pending)
            if not self.pending:
                self._set_state(recovering=False)
            self.spares.replenish(self.dead_keeper_nodes, self.cfg.training.workers - len(self.members))
            if pending.grow:
                self.event("resize", **done)
                self.display.show(
                    notices.Resized(done["generation"], done["world_size"], done["step"], done["total_s"])
                )
                self._note_restored(self.membership)
                continue
            self.event("recovery", **done)
            self.display.show(
                notices.Recovered(
                    done["generation"],
                    done["cause"],
                    done["tier"],
                    done["step"],
                    done["detect_s"],
                    done["restore_s"],
                    done["total_s"],
                )
            )
        self.max_step = max(self.max_step, rec.step)

    def write_summary(self, wall_s: float, code: int) -> None:
        """`summary.json` (`summary.write_summary`) from this job's events."""
        write_summary(self.store, self.cfg, self.run_dir, self.events, wall_s, code, self.summary_extra, self._refused)


OWN_SIGNALS = frozenset({signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL})


def _own_error(code: int | None) -> bool:
    """Whether an exit status is the process's own doing: an error exit, or a signal it raised
    itself (an uncaught exception while gloo's threads run ends in abort()). A kill from outside
    (SIGKILL, SIGTERM) or a lost host never is."""
    return code is not None and (code > 0 or -code in OWN_SIGNALS)
