"""A standby host's processes are warm before it has a node, and are bound to the node it is
admitted into (control/standby.py, runtime/standby.py).

Real processes on this host, no etcd: the host's store and the job's store are two loopback
TCPStores, the coordinator's commands are written as it writes them. A standby starts its keeper,
zygote and shadow at once; each builds what it can and says so in the host's store, writing
nothing in the job's. Once admitted, the coordinator's spawns for the node take those very
processes (same pids): they reconnect to the job's store, the zygote serves forks for the node,
the keeper heartbeats; the job's stop ends them all, and a standby that is never needed stops
its processes and leaves nothing behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from conftest import wait_for
from leto.config import JobConfig
from leto.control.procs import Processes
from leto.control.standby import WarmStandby, warm_roles
from leto.control.supervisor import Supervisor
from leto.protection import shm
from leto.protocol import keys
from leto.protocol.messages import Command, SupervisorReport
from leto.runtime.env import ENV_HOST_STORE, LOOPBACK, loopback_store
from leto.runtime.standby import ready_key

WARM_S = 60.0  # the fork server's imports and three tiny models, on 2 busy cores


def _config(tmp_path: Path, **recovery) -> JobConfig:
    return JobConfig.from_dict(
        {
            "training": {"workers": 2, "nodes": 2, "command": ["-m", "leto.training.train_gpt", "--steps", "3"]},
            "recovery": {"spares": 1, **recovery},
            "timeouts": {"collective_s": 30.0, "stop_grace_s": 5.0},
            "run_dir": str(tmp_path),
            "quiet": True,
        }
    )


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _ready(host_store, warm: WarmStandby) -> dict[str, int]:
    """Wait until every warm process waits for its binding; their pids by slot."""
    slots = [p.proc_id for p in warm.procs]
    wait_for(lambda: host_store.check([ready_key(s) for s in slots]), WARM_S, "the warm processes")
    return {s: int(host_store.get(ready_key(s))) for s in slots}


def _reports(store) -> list[SupervisorReport]:
    n = int(store.add(keys.REPORTS, 0))
    return [SupervisorReport.from_json(store.get(keys.sup_report(i))) for i in range(n)]


def test_a_standby_warms_a_keeper_a_zygote_and_shadows_without_a_node() -> None:
    cfg = _config(Path("/tmp"))
    assert warm_roles(cfg) == ["keeper", "zygote", "shadow"]
    assert warm_roles(_config(Path("/tmp"), spares=3)) == ["keeper", "zygote", "shadow", "shadow", "shadow"]
    assert warm_roles(_config(Path("/tmp"), spares=0)) == ["keeper", "shadow"]  # no spares: no zygote


def test_the_standbys_warm_processes_become_the_admitted_nodes_and_stop_with_the_job(tmp_path: Path) -> None:
    host_store, job_store = loopback_store(30.0), loopback_store(30.0)
    job_store.add(keys.COMMANDS, 0)
    job_store.add(keys.REPORTS, 0)
    cfg = _config(tmp_path)
    job_id = f"warm{os.getpid()}-h1"
    warm = WarmStandby(cfg, {ENV_HOST_STORE: f"{LOOPBACK}:{host_store.port}"}, host_store)
    supervisor: Supervisor | None = None
    pids: list[int] = []
    try:
        ready = _ready(host_store, warm)
        pids = list(ready.values())
        assert sorted(p.popen.pid for p in warm.procs) == sorted(pids)
        assert int(job_store.add(keys.PROC_SEQ, 0)) == 0 and not job_store.check([keys.ZYGOTES_OFF])
        # admitted into node 1: the coordinator's spawns for the node
        supervisor = Supervisor(
            job_store,
            cfg,
            f"{LOOPBACK}:{job_store.port}",
            job_id,
            node=1,
            child_env={ENV_HOST_STORE: f"{LOOPBACK}:{host_store.port}"},
            host_store=host_store,
            forker=warm.forker,
            warm=warm,
        )
        supervisor.start()
        processes = Processes(job_store, supervisor.serve_commands, cfg.timeouts.fork_s)
        t0 = time.monotonic()
        keeper, zygote, shadow = (processes.spawn(role, None, 1) for role in ("keeper", "zygote", "shadow"))
        processes.flush()
        started = {e.proc_id: e.pid for r in _reports(job_store) for e in r.events if e.kind == "started"}
        assert started == {
            keeper.proc_id: ready["standby-keeper-0"],
            zygote.proc_id: ready["standby-zygote-1"],
            shadow.proc_id: ready["standby-shadow-2"],
        }  # the warm processes themselves, no new ones
        wait_for(lambda: job_store.check([keys.warm(zygote.proc_id), keys.warm(shadow.proc_id)]), 20, "warm keys")
        bound_s = time.monotonic() - t0
        wait_for(lambda: host_store.check([keys.heartbeat(keeper.proc_id)]), 20, "the keeper's heartbeat")
        print(f"admission to a warm zygote and shadow of node 1: {bound_s:.2f}s")
        # the bound zygote forks the node's shadows
        processes.command(Command("fork", "shadow-9", "shadow", None, 1))
        wait_for(lambda: (supervisor.serve_commands(), job_store.check([keys.warm("shadow-9")]))[1], 20, "a fork")
        forked = [e for r in _reports(job_store) for e in r.events if e.proc_id == "shadow-9"]
        assert [e.kind for e in forked] == ["started"] and forked[0].node == 1
        pids.append(forked[0].pid)
        assert warm.procs == []  # every warm process was taken
        supervisor.stop_all()
        assert all(_gone(pid) for pid in pids)
        assert shm.job_files(job_id) == [p for p in shm.job_files(job_id) if p.name.endswith("-owner")]
    finally:
        if supervisor is not None and not supervisor.stopped:
            supervisor.fence()
        warm.close(grace_s=0)
        shm.remove_job_segments(job_id)


@pytest.mark.parametrize("grace", [None, 0], ids=["job-ended", "lease-lost"])
def test_a_standby_never_admitted_stops_its_warm_processes_and_leaves_nothing(
    tmp_path: Path, grace: float | None
) -> None:
    host_store = loopback_store(30.0)
    cfg = _config(tmp_path)
    warm = WarmStandby(cfg, {ENV_HOST_STORE: f"{LOOPBACK}:{host_store.port}"}, host_store)
    try:
        pids = list(_ready(host_store, warm).values())
        server = warm.forker.popen.pid if warm.forker is not None else None
    finally:
        warm.close(grace_s=grace)
    assert all(_gone(pid) for pid in pids) and (server is None or _gone(server))
    assert warm.take("shadow") is None
