"""A standby host's warm processes, on the supervisor's side (`runtime/standby.py` on theirs).

A host that waits to enter a running job (`--standby`, or `--join` while every node has its host)
starts, before it is admitted, its fork server and the processes a node it takes over will need:
its keeper, its zygote (where the job forks shadows from zygotes) and shadows, as many as a lost
host's ranks or `--spares`, whichever is more. They run as far as they can without a node (a
shadow or zygote imports and builds its model, then waits) and wait on the host's own store. Once
admitted, the host's supervisor binds one of them to each spawn command of its role that the
coordinator writes for the node, instead of starting a process (`Supervisor._spawn`); a spawn with
none left starts a process as before. One not needed stays warm for a later spawn of its role.

They never touch the job's store before they are bound; when the host leaves before it is
admitted (the job ended, its lease was lost, a join step failed), `close` stops them all.
"""

from __future__ import annotations

import signal
import subprocess
import time

import torch.distributed as dist

from leto.config import ENV_CONFIG, JobConfig
from leto.control.prefork import ForkServer
from leto.control.supervisor import Proc, _kill, _signal_quietly, child_environment, start_child
from leto.protocol import keys
from leto.runtime import env as rt
from leto.runtime import linux
from leto.runtime.standby import ENV_STANDBY, UNBOUND_NODE, Binding, bind_key


def warm_roles(config: JobConfig) -> list[str]:
    """What a standby starts: a keeper (with protection), a zygote (where zygotes would fork the
    node's shadows), and shadows for a lost host's ranks or `--spares`, whichever is more."""
    t, r = config.training, config.recovery
    roles = ["keeper"] if config.protection.enabled else []
    if r.zygotes and r.spares and config.protection.enabled:
        roles.append("zygote")
    return roles + ["shadow"] * max(-(-t.workers // t.nodes), r.spares)


class WarmStandby:
    """The warm, unbound processes of a host waiting to be admitted, and its fork server."""

    def __init__(self, config: JobConfig, child_env: dict[str, str], host_store: dist.Store) -> None:
        """`child_env`: the host's children's own environment (it names the host's store,
        `rt.ENV_HOST_STORE`, where the processes wait); `host_store`: that store."""
        self.cfg, self.host_store = config, host_store
        linux.become_subreaper()  # the fork server's children are reparented here
        env = child_environment(child_env)
        self.forker = ForkServer(env, config) if config.training.fork_server else None
        self.procs: list[Proc] = []  # started, not bound yet
        self.stopped = False
        for i, role in enumerate(warm_roles(config)):
            slot = f"standby-{role}-{i}"
            child = dict(env)
            child.update(
                {
                    ENV_CONFIG: config.to_json(),
                    rt.ENV_STORE: child_env[rt.ENV_HOST_STORE],
                    rt.ENV_ROLE: role,
                    rt.ENV_NODE: str(UNBOUND_NODE),
                    rt.ENV_PROC_ID: slot,
                    ENV_STANDBY: bind_key(slot),
                }
            )
            popen = start_child(role, child, config, self.forker)
            self.procs.append(Proc(role, None, UNBOUND_NODE, slot, popen))
            if self.forker is not None and self.forker.broken is not None:
                self.forker = None

    def take(self, role: str) -> Proc | None:
        """A live warm process of `role` (none once the host stopped), no longer the pool's."""
        if self.stopped:
            return None
        for p in self.procs:
            if p.role == role and p.popen.poll() is None:
                self.procs.remove(p)
                return p
        return None

    def bind(self, warm: Proc, proc_id: str, node: int, store: str, job_id: str) -> Proc:
        """Make `warm` (from `take`) the job's process `proc_id` of `node`: it reconnects to the
        job's `store` and goes on."""
        self.host_store.set(bind_key(warm.proc_id), Binding(proc_id, node, store, job_id).to_json())
        return Proc(warm.role, None, node, proc_id, warm.popen, warm.start)

    def close(self, grace_s: float | None = None) -> None:
        """Stop the fork server and every process not bound: asked to (the host's shutdown key,
        then SIGTERM), SIGKILLed after `grace_s` (None: the stop grace; 0: at once), reaped."""
        self.stopped = True
        grace_s = self.cfg.timeouts.stop_grace_s if grace_s is None else grace_s
        live = [p for p in self.procs if p.popen.poll() is None]
        if live and grace_s > 0:
            try:
                self.host_store.set(keys.SHUTDOWN, "1")
            except RuntimeError:  # the host's store is gone: the signals still reach them
                pass
            for p in live:
                _signal_quietly(p, signal.SIGTERM)
        if self.forker is not None:
            self.forker.close()
        deadline = time.monotonic() + grace_s
        for p in live:
            try:
                p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill(p, self.cfg.timeouts.stop_grace_s)
        self.procs.clear()
