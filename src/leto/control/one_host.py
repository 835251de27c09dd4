"""`leto run` / `leto train` on one host: the job's store, one supervisor and one coordinator.

The two share nothing but the store (each has its own client): this process hosts the store,
and one loop gives each its round, the supervisor first, so that a failure it reports is decided
on in the same round. Nothing of the job listens beyond loopback: the store is bound to
127.0.0.1, and every child's gloo and NCCL to the loopback interface.
"""

from __future__ import annotations

import os
import sys
import time

from leto.config import JobConfig
from leto.control.coordinator import POLL_S, Coordinator
from leto.control.supervisor import HEARTBEAT_CHECK_S, Supervisor
from leto.runtime.env import LOOPBACK, connect, loopback_store, network_env
from leto.runtime.linux import ExitWatch

# between rounds while the job trains and no recovery is in flight: a process's exit ends the
# wait at once (`ExitWatch`), heartbeats are checked every HEARTBEAT_CHECK_S anyway, and a round
# costs the controller a store round trip or two (at POLL_S, ~2 % of a core of this machine)
STEADY_POLL_S = 0.05


def run_job(config: JobConfig, summary_extra: dict | None = None) -> int:
    """Run the job to its end; returns the exit code for `leto run`."""
    t0 = time.monotonic()
    store = loopback_store(config.timeouts.collective_s)
    addr = f"{LOOPBACK}:{store.port}"
    # the coordinator has the supervisor serve each command at once: its own look is a fallback
    supervisor = Supervisor(
        store,
        config,
        addr,
        f"{os.getpid()}-{store.port}",
        command_poll_s=HEARTBEAT_CHECK_S,
        child_env=network_env(LOOPBACK),
    )
    coordinator = Coordinator(
        connect(addr, config.timeouts.collective_s),
        config,
        serve=supervisor.serve_commands,
        summary_extra=summary_extra,
    )
    coordinator.prepare()
    supervisor.start()
    exits = ExitWatch()
    try:
        try:
            coordinator.start()
            while True:
                supervisor.tick()
                code = coordinator.tick()
                if code is not None:
                    break
                if coordinator.pending:  # a recovery waits for its first step: rounds at full rate
                    time.sleep(POLL_S)
                else:
                    exits.wait([p.popen.pid for p in supervisor.procs if p.popen.returncode is None], STEADY_POLL_S)
        finally:
            coordinator.stop()
            exits.close()
    except Exception as e:  # one host: an error of its controller stops the job, with one line
        print(
            f"leto: stopping the job after an unexpected error in its controller: {type(e).__name__}: {e}",
            file=sys.stderr,
            flush=True,
        )
        code = 1
    finally:
        supervisor.close()
    coordinator.write_summary(time.monotonic() - t0, code)
    return code
