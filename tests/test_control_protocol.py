"""The supervisor-coordinator protocol and the job configuration, without processes: the
coordinator is driven through a store alone (a HashStore), as a supervisor elsewhere would."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import torch.distributed as dist

from leto.config import (
    DEFAULT_TIMEOUT_S,
    JobConfig,
    ProtectionConfig,
    RecoveryConfig,
    Timeouts,
    TrainingConfig,
)
from leto.control.coordinator import Coordinator
from leto.protocol import keys
from leto.protocol.messages import (
    Command,
    JobState,
    Membership,
    ProcEvent,
    StepProgress,
    SupervisorReport,
    node_of_rank,
)
from leto.protocol.protection import Drain


def _config(run_dir: Path) -> JobConfig:
    return JobConfig(
        training=TrainingConfig(command=("-m", "x"), workers=4, nodes=2, steps=10),
        protection=ProtectionConfig(enabled=True, ec=(1, 1)),
        recovery=RecoveryConfig(spares=1, zygotes=False, inject=("kill:rank=1:step=3",)),
        run_dir=str(run_dir),
        quiet=True,
    )


def test_the_job_config_round_trips_and_names_every_timeout_with_its_unit(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    assert JobConfig.from_json(cfg.to_json()) == cfg
    assert all(f.name.endswith("_s") for f in dataclasses.fields(Timeouts))
    assert Timeouts().collective_s == DEFAULT_TIMEOUT_S == 60.0
    assert JobConfig.from_json("{}") == JobConfig()


def test_messages_round_trip_and_tolerate_fields_they_do_not_know() -> None:
    report = SupervisorReport(
        (ProcEvent("exited", "worker1-2", "worker", 1, 0, 42, -9, "was killed by SIGKILL"),),
        None,
        ("/dev/shm/leto-1-2-owner",),
    )
    assert SupervisorReport.from_json(report.to_json()) == report
    cmd = Command("spawn", "keeper-9", "keeper", None, 1, boost=True)
    assert Command.from_json(cmd.to_json()) == cmd
    assert JobState.from_json(JobState(3, True).to_json()) == JobState(3, True)
    rec = StepProgress.from_json(json.dumps({"step": 5, "loss": 2.5, "time": 1.0, "step_s": 0.1, "reduce_s": 0.01}))
    assert (rec.step, rec.step_s, rec.tokens_per_s) == (5, 0.1, None)
    assert json.loads(Drain((0, 1), 2).to_json()) == {"live_nodes": [0, 1], "next_generation": 2}  # as keepers read it
    assert [node_of_rank(r, 4, 2) for r in range(4)] == [0, 0, 1, 1]


def _commands(store: dist.Store) -> list[Command]:
    out = []
    while store.check([keys.command(len(out))]):
        out.append(Command.from_json(store.get(keys.command(len(out)))))
    return out


def _report(store: dist.Store, *events: ProcEvent) -> None:
    seq = store.add(keys.REPORTS, 1) - 1
    store.set(keys.sup_report(seq), SupervisorReport(events).to_json())


def test_the_coordinator_acts_only_through_the_store(tmp_path: Path) -> None:
    """Start: spawn commands for 4 workers, 2 keepers (first: the workers' first step waits for
    them) and a shadow, plan 0 and the job state.
    A reported SIGKILL of rank 1 (once protection committed): the drain, plan 1 and the job state
    (recovering) are written at once, the keepers are woken for the drain, and the shadow that
    adopts rank 1 is boosted."""
    store = dist.HashStore()
    coord = Coordinator(store, _config(tmp_path))
    coord.prepare()
    coord.start()
    started = _commands(store)
    assert [(c.kind, c.role, c.rank, c.node) for c in started] == (
        [("spawn", "worker", r, n) for r, n in enumerate((0, 0, 1, 1))]
        + [("spawn", "keeper", None, 0), ("spawn", "keeper", None, 1), ("spawn", "shadow", None, 0)]
    )
    workers = ["worker0-1", "worker1-2", "worker2-3", "worker3-4"]
    assert [c.proc_id for c in started] == [*workers, "keeper-5", "keeper-6", "shadow-7"]
    assert Membership.from_json(store.get(keys.membership(0))).proc_of_rank == tuple(c.proc_id for c in started[:4])
    assert JobState.from_json(store.get(keys.JOB_STATE)) == JobState(0, False)
    assert JobConfig.from_json((tmp_path / "config.json").read_text()) == _config(tmp_path)
    _report(store, *(ProcEvent("started", c.proc_id, c.role, c.rank, c.node, 100 + i) for i, c in enumerate(started)))
    assert coord.tick() is None and len(_commands(store)) == len(started)

    store.set(keys.committed(0, 0), "1")
    _report(store, ProcEvent("exited", "worker1-2", "worker", 1, 0, 101, -9, "was killed by SIGKILL"))
    assert coord.tick() is None
    membership = Membership.from_json(store.get(keys.membership(1)))
    assert membership.proc_of_rank == ("worker0-1", "shadow-7", "worker2-3", "worker3-4")
    assert [(c.kind, c.proc_id) for c in _commands(store)[len(started) :]] == [
        ("wake_keepers", ""),
        ("boost", "shadow-7"),
    ]
    assert Drain.from_json(store.get(keys.drain(0))) == Drain((0, 1), 1)
    assert JobState.from_json(store.get(keys.JOB_STATE)) == JobState(1, True)
    failure = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(e["event"], e["rank"], e["cause"]) for e in failure] == [("failure", 1, "was killed by SIGKILL")]
    coord._exit.close()


def test_a_recovery_forks_a_shadow_at_normal_priority_and_names_it_once_forked(tmp_path: Path) -> None:
    """With no idle shadow left, the lost rank goes to a shadow forked from a live node's warm
    zygote: the fork is asked for boosted (the zygote forks at normal priority), and the plan
    names the shadow once its supervisor reports it started (here a thread plays that part)."""
    cfg = dataclasses.replace(_config(tmp_path), recovery=RecoveryConfig(spares=1, zygotes=True))
    store = dist.HashStore()
    coord = Coordinator(store, cfg)
    coord.prepare()
    coord.start()
    started = _commands(store)
    zygotes = [c for c in started if c.role == "zygote"]
    assert [c.node for c in zygotes] == [0, 1]
    _report(store, *(ProcEvent("started", c.proc_id, c.role, c.rank, c.node, 100 + i) for i, c in enumerate(started)))
    assert coord.tick() is None
    store.set(keys.committed(0, 0), "1")
    store.set(keys.warm(zygotes[1].proc_id), "1")
    shadow = next(c for c in started if c.role == "shadow")
    forks: list[Command] = []
    announced_before: list[bool] = []  # whether plan 1 was out before the shadow was reported

    def supervisor() -> None:  # answers the first fork command it finds
        deadline = time.monotonic() + 10
        while not forks and time.monotonic() < deadline:
            forks.extend(c for c in _commands(store)[len(started) :] if c.kind == "fork")
            time.sleep(0.01)
        if forks:
            announced_before.append(store.check([keys.membership(1)]))
            _report(store, ProcEvent("started", forks[0].proc_id, "shadow", None, forks[0].node, 200))

    answering = threading.Thread(target=supervisor, daemon=True)
    answering.start()
    _report(
        store,
        ProcEvent("exited", "worker2-3", "worker", 2, 1, 102, -9, "was killed by SIGKILL"),
        ProcEvent("exited", shadow.proc_id, "shadow", None, shadow.node, 104, -9, "was killed by SIGKILL"),
    )
    assert coord.tick() is None
    answering.join(10)
    assert [(c.node, c.boost) for c in forks] == [(1, True)] and announced_before == [False]
    assert Membership.from_json(store.get(keys.membership(1))).proc_of_rank[2] == forks[0].proc_id
    coord._exit.close()
