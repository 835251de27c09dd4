"""`leto.init()`: how a worker or shadow process joins the job that `leto run` started."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from leto.config import ENV_CONFIG, JobConfig
from leto.protocol import keys
from leto.runtime import linux
from leto.runtime.etcd_errors import SCHEME
from leto.runtime.mesh import Mesh

# The job's configuration reaches a child whole, in `config.ENV_CONFIG`; these variables say
# where the running job is and, per process, who this process is.
ENV_STORE = "LETO_STORE"  # host:port of the job's TCPStore (known once it is up), or etcd://...
ENV_JOB_ID = "LETO_JOB_ID"  # names the job's shared-memory files (known once the store is up)
ENV_ROLE = "LETO_ROLE"  # worker | shadow | zygote | keeper
ENV_RANK = "LETO_RANK"  # worker rank (absent for shadows)
ENV_NODE = "LETO_NODE"
ENV_PROC_ID = "LETO_PROC_ID"  # the coordinator's id for this process (unique in the job)
ENV_HOST_STORE = "LETO_HOST_STORE"  # host:port of the host's own TCPStore, for heartbeats (multi-host jobs)
LOOPBACK = "127.0.0.1"


@dataclass(kw_only=True)
class Job:
    """This process's place in the job: who it is, where the job is, and the whole configuration."""

    config: JobConfig
    role: str
    rank: int | None  # None for a shadow until it adopts a rank
    world_size: int  # ranks of the current generation
    node: int
    store: dist.Store
    proc_id: str
    device: torch.device
    job_id: str = "solo"
    run_dir: Path | None = None  # None outside `leto run`

    @property
    def timeout_s(self) -> float:
        """Every collective and store wait of the job."""
        return self.config.timeouts.collective_s

    @property
    def mesh(self) -> Mesh | None:
        """This rank's place in the DP x PP x TP mesh of the current generation; None for a
        shadow that has not adopted a rank."""
        mesh = self.config.mesh
        return None if self.rank is None else Mesh.of(self.rank, self.world_size, mesh.tp, mesh.pp)

    @property
    def is_shadow(self) -> bool:
        return self.role == "shadow"

    @property
    def is_zygote(self) -> bool:
        return self.role == "zygote"

    def shutdown_requested(self) -> bool:
        return self.store.check([keys.SHUTDOWN])


def connect(addr: str, timeout_s: float) -> dist.Store:
    """A client of the job's store: host:port of a TCPStore, or an `etcd://` address (a
    multi-host job, `runtime/etcd_store.py`)."""
    if addr.startswith(SCHEME):
        from leto.runtime import etcd_store  # only here: its client's imports cost ~0.1 s a process

        return etcd_store.EtcdStore.from_url(addr, timeout_s)
    host, port = addr.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def loopback_store(timeout_s: float) -> dist.TCPStore:
    """A TCPStore server that listens on 127.0.0.1 only. torch's server binds every interface
    (and authenticates no one) for a port it opens itself, so it is handed a socket bound here."""
    sock = socket.create_server((LOOPBACK, 0))
    port = sock.getsockname()[1]
    fd = sock.detach()  # the store owns it from here on
    try:
        return dist.TCPStore(
            LOOPBACK,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
            master_listen_fd=fd,
        )
    except BaseException:
        os.close(fd)
        raise


def network_env(addr: str) -> dict[str, str]:
    """The environment that makes a child's gloo and NCCL listen only on the interface that holds
    IPv4 address `addr` (127.0.0.1: loopback); empty if no interface holds it."""
    iface = linux.interface_of(addr)
    if iface is None:
        return {}
    return {"GLOO_SOCKET_IFNAME": iface, "NCCL_SOCKET_IFNAME": f"={iface}"}  # "=": this name exactly


def await_keys(
    store: dist.Store,
    names: list[str],
    timeout_s: float,
    stop: Callable[[], str | None] = lambda: None,
    every_s: float = 0.05,
) -> str | None:
    """Wait until every key in `names` exists; None once they do, else why not (`stop`'s reason,
    checked every `every_s`, or the timeout). The store pushes the keys (a TCPStore wait, an etcd
    watch): a poll would be a request each time, and in etcd one costs milliseconds of CPU."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            store.wait(names, timedelta(seconds=max(1e-3, min(every_s, deadline - time.monotonic()))))
            return None
        except RuntimeError:  # this wait timed out (DistStoreError)
            pass
        if (why := stop()) is not None:
            return why
        if time.monotonic() >= deadline:
            return f"timed out after {timeout_s:.0f}s"


def _deterministic() -> None:
    """Exact recovery replays a step bit for bit: on a GPU that needs deterministic kernels
    (cuBLAS's workspace setting must be in place before its first use)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def _nccl_never_kills() -> None:
    """NCCL's watchdog tears a process down when a collective times out or errs, and its
    monitor when the watchdog is stuck: a survivor whose peer died would be killed. Leto's own
    waits time out, abort the communicator and join the next generation instead."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    os.environ.setdefault("TORCH_NCCL_ENABLE_MONITORING", "0")


def init(device: str | None = None) -> Job:
    """Join the job. Outside `leto run` this is a one-process job (rank 0 of 1)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    text = os.environ.get(ENV_CONFIG)
    cfg = JobConfig.from_json(text) if text else JobConfig()
    addr = os.environ.get(ENV_STORE)
    if addr is None:  # no keepers, nothing to inject into
        return Job(
            config=solo(cfg),
            role="worker",
            rank=0,
            world_size=1,
            node=0,
            store=dist.HashStore(),
            proc_id="solo",
            device=dev,
        )
    store = connect(addr, cfg.timeouts.collective_s)
    role = os.environ[ENV_ROLE]
    rank = int(os.environ[ENV_RANK]) if role == "worker" else None
    if dev.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank or 0)) % torch.cuda.device_count())
        _deterministic()
        _nccl_never_kills()
    return Job(
        config=cfg,
        role=role,
        rank=rank,
        world_size=cfg.training.workers,
        node=int(os.environ[ENV_NODE]),
        store=store,
        proc_id=os.environ[ENV_PROC_ID],
        device=dev,
        job_id=os.environ.get(ENV_JOB_ID, "solo"),
        run_dir=Path(cfg.run_dir),
    )


def solo(config: JobConfig) -> JobConfig:
    """The configuration of a process that trains outside Leto's supervision (no keepers, no
    injections): `leto.init()` without `leto run`, and the baselines' workers."""
    return replace(
        config, protection=replace(config.protection, enabled=False), recovery=replace(config.recovery, inject=())
    )
