"""A standby host's warm processes: started before the host has a node, bound to one at admission.

A host that waits to enter a running job (`--standby`, or `--join` while every node has its
host) starts its keeper, zygote and shadows at once, as processes of no node: each runs as far as
it can without one (imports; a shadow or zygote builds its model and buffers), then waits on the
host's own store for its binding: the job's store (fenced by the host's new record), the host's
job id, its node and its process id, all known only once the coordinator admits the host. Until
then it never talks to the job's store, so a standby that dies, or is never needed, leaves
nothing in the job. The wait ends at the binding, at the host's shutdown (`keys.SHUTDOWN` in the
host's store), or with the supervisor (every child dies with its parent).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from datetime import timedelta

from leto.protocol import keys
from leto.protocol.messages import negative, parse
from leto.runtime import env as rt

ENV_STANDBY = "LETO_STANDBY"  # the key of the host's store where this warm process's binding arrives
BIND_PREFIX = "standby/bind/"
READY_PREFIX = "standby/ready/"
UNBOUND_NODE = -1  # a warm process's node until it is bound
WAIT_S = 0.5  # how often a waiting process checks for the host's shutdown


@dataclass(frozen=True)
class Binding:
    """What a warm process becomes (its supervisor writes it in the host's store)."""

    proc_id: str
    node: int
    store: str  # the job's store, as `rt.connect` takes it
    job_id: str  # the host's job id (its /dev/shm names)

    def problem(self) -> str | None:
        return negative(node=self.node) or (None if self.proc_id and self.store else "an empty proc_id or store")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes, key: str = "") -> Binding:
        return parse(cls, text, key)


def bind_key(slot: str) -> str:
    return BIND_PREFIX + slot


def ready_key(slot: str) -> str:
    """Set by the warm process `slot` (its pid) once it waits for its binding: as warm as it gets."""
    return READY_PREFIX + slot


def pending() -> bool:
    """Whether this process is a standby's warm process not bound yet."""
    return ENV_STANDBY in os.environ


def bind(job: rt.Job) -> bool:
    """Wait until this warm process is bound, then become the process it names (environment,
    store connection, node, id; the forks of a zygote inherit them). False when the host shuts
    down first. Raises `BadValue` for a malformed binding (the process exits; its supervisor
    reports it)."""
    key = os.environ[ENV_STANDBY]
    job.store.set(ready_key(job.proc_id), str(os.getpid()))
    while True:
        if job.store.check([keys.SHUTDOWN]):
            return False
        try:
            job.store.wait([key], timedelta(seconds=WAIT_S))
            break
        except RuntimeError:  # timed out: check for the shutdown, wait again
            continue
    b = Binding.from_json(job.store.get(key), key)
    os.environ.update(
        {rt.ENV_STORE: b.store, rt.ENV_JOB_ID: b.job_id, rt.ENV_NODE: str(b.node), rt.ENV_PROC_ID: b.proc_id}
    )
    del os.environ[ENV_STANDBY]
    job.store = rt.connect(b.store, job.timeout_s)
    job.node, job.proc_id, job.job_id = b.node, b.proc_id, b.job_id
    return True
