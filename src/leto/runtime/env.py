"""`leto.init()`: how a worker or shadow process joins the job the controller started."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from leto.protocol import keys

# The controller passes the membership to its children in these variables.
ENV_STORE = "LETO_STORE"          # host:port of the controller's TCPStore
ENV_ROLE = "LETO_ROLE"            # worker | shadow | zygote
ENV_RANK = "LETO_RANK"            # worker rank (absent for shadows)
ENV_WORLD = "LETO_WORLD_SIZE"
ENV_NODE = "LETO_NODE"
ENV_NODES = "LETO_NODES"
ENV_RUN_DIR = "LETO_RUN_DIR"
ENV_PROC_ID = "LETO_PROC_ID"      # the controller's id for this process (unique in the job)
ENV_TIMEOUT = "LETO_TIMEOUT_S"    # collective / store wait timeout
ENV_JOB_ID = "LETO_JOB_ID"        # names the job's shared-memory files
ENV_PROTECTION = "LETO_PROTECTION"  # on | off
ENV_EC = "LETO_EC"                # tier-2 code "k+m", or "none"
ENV_PROTECT_EVERY = "LETO_PROTECT_EVERY"  # protect the state every N steps (--protect-every)
ENV_PROTECT_GRADS = "LETO_PROTECT_GRADS"  # "on": stage gradients even where every rank holds them
ENV_INJECT = "LETO_INJECT"        # fault injections, a JSON list of --inject specs



@dataclass
class Job:
    """This process's place in the job."""

    role: str
    rank: int | None
    world_size: int
    node: int
    num_nodes: int
    run_dir: Path | None
    store: dist.Store
    proc_id: str
    timeout_s: float
    device: torch.device
    job_id: str = "solo"
    protection: bool = False
    ec: tuple[int, int] | None = None
    protect_every: int = 1
    protect_grads: bool = False  # --protect-grads on (otherwise: only where the reduction shards them)

    @property
    def is_shadow(self) -> bool:
        return self.role == "shadow"

    @property
    def is_zygote(self) -> bool:
        return self.role == "zygote"

    def shutdown_requested(self) -> bool:
        return self.store.check([keys.SHUTDOWN])


def connect(addr: str, timeout_s: float) -> dist.TCPStore:
    """A client of the controller's store at host:port."""
    host, port = addr.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def init(device: str | None = None) -> Job:
    """Join the job. Outside `leto run` this is a one-process job (rank 0 of 1)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    timeout_s = float(os.environ.get(ENV_TIMEOUT, "60"))
    addr = os.environ.get(ENV_STORE)
    if addr is None:
        return Job("worker", 0, 1, 0, 1, None, dist.HashStore(), "solo", timeout_s, dev)
    store = connect(addr, timeout_s)
    role = os.environ[ENV_ROLE]
    rank = int(os.environ[ENV_RANK]) if role == "worker" else None
    if dev.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank or 0)) % torch.cuda.device_count())
    run_dir = os.environ.get(ENV_RUN_DIR)
    ec_spec = os.environ.get(ENV_EC, "none")
    ec = None
    if ec_spec != "none":
        k, m = ec_spec.split("+")
        ec = (int(k), int(m))
    return Job(role, rank, int(os.environ[ENV_WORLD]), int(os.environ[ENV_NODE]),
               int(os.environ[ENV_NODES]), Path(run_dir) if run_dir else None, store,
               os.environ[ENV_PROC_ID], timeout_s, dev, os.environ.get(ENV_JOB_ID, "solo"),
               os.environ.get(ENV_PROTECTION, "off") == "on", ec, int(os.environ.get(ENV_PROTECT_EVERY, "1")),
               os.environ.get(ENV_PROTECT_GRADS, "auto") == "on")
