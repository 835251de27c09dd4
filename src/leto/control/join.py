"""`leto run|train --rdzv ... --join` (or `--standby`): a host entering a job that is running.

The joiner asks (a join request bound to its lease) and waits; the coordinator admits it at a
generation boundary (no recovery in progress) into the node of a host that was lost and fenced
out: it creates that node's host record bound to the joiner's lease (a new create revision, so
the fenced host's processes stay fenced whatever the new host is called), then tells the joiner
its node and the first command of the stream that is its own. Until then the joiner holds
nothing of the job: if it dies, its lease takes its request with it, and the job never heard of
it. While every node has its host the joiner waits as a standby, its fork server warm.

Every step is bounded: finding the running job (`FIND_S`) and being admitted once a node is free
(`ADMIT_S`); each fails with one line (`JoinError`).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

from leto.config import JobConfig
from leto.control.lease import HostLease, Liveness
from leto.errors import BadValue
from leto.protocol import keys
from leto.protocol.messages import Admission, HostRecord, JoinRequest, Refusals
from leto.runtime.etcd_store import EtcdError, EtcdStore

POLL_S = 0.05
# a running job is one with a coordinator; a joiner that finds none in this long gives up
FIND_S = 60.0
# once a node is free: the coordinator admits at the next generation boundary, after any
# recovery in progress (itself bounded by the collective timeout)
ADMIT_MARGIN_S = 30.0


class JoinError(RuntimeError):
    """A join step ran out its timeout, or the job cannot take this host: one line, why."""


def admit_timeout_s(config: JobConfig) -> float:
    """How long a free node may wait for the coordinator to admit this host (`ADMIT_S`)."""
    return 2 * config.timeouts.collective_s + ADMIT_MARGIN_S


def enter(
    store: EtcdStore,
    config: JobConfig,
    lease: HostLease,
    addr: str,
    liveness: Liveness,
    say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> Admission | None:
    """Ask to enter the running job and wait to be admitted: the admission, or None when the job
    ended first (a standby never needed). Raises `JoinError` when a step runs out its time,
    `HostLost` (the caller's) when this host's lease is gone."""
    job = config.rendezvous.job_id
    request = JoinRequest(addr, liveness.port, os.getpid(), lease.id)
    if store.create(keys.join_request(lease.id), request.to_json(), lease.id) is None:
        raise JoinError(f"job {job!r} already has a join request under this host's lease {lease.id:x}")
    found_by = time.monotonic() + FIND_S
    admit_by: float | None = None
    waiting_said = False
    refused = Refusals()
    while True:
        if (why := lease.lost()) is not None:
            raise JoinError(f"this host's etcd lease ended before it was admitted: {why}")
        free = free_nodes(store, config.training.nodes, refused)  # read first: an admission takes a node
        value = store.value(keys.admission(lease.id))
        if value is not None:
            try:
                return Admission.from_json(value, keys.admission(lease.id))
            except BadValue as e:
                raise JoinError(f"the coordinator's admission is malformed: {e}") from e
        if store.value(keys.EXIT_CODE) is not None:
            say(f"leto: job {job!r} ended before this host was needed")
            return None
        now = time.monotonic()
        if store.value(keys.COORDINATOR) is None:
            if now > found_by:
                raise JoinError(
                    f"no running job {job!r} at {config.rendezvous.url} within {FIND_S:.0f}s (join find timeout)"
                )
        elif free:
            admit_by = admit_by or now + admit_timeout_s(config)
            if now > admit_by:
                raise JoinError(
                    f"job {job!r} has a free node but did not admit this host within "
                    f"{admit_timeout_s(config):.0f}s (join admission timeout)"
                )
        else:
            admit_by = None
            if not waiting_said:
                waiting_said = True
                say(
                    f"leto: job {job!r} has its {config.training.nodes} hosts: this host waits as a standby "
                    f"until one is lost"
                )
        time.sleep(POLL_S)


def free_nodes(store: EtcdStore, nodes: int, refused: Refusals) -> list[int]:
    """The nodes of the job with no live host record."""
    held = set()
    for key in store.under("control/host/"):
        try:
            held.add(int(key.rsplit("/", 1)[1]))
        except ValueError as e:
            refused.refuse(BadValue(key, str(e)))
    return [n for n in range(nodes) if n not in held]


def join_requests(store: EtcdStore, refused: Refusals) -> list[JoinRequest]:
    """The hosts asking to enter and not admitted yet, oldest lease first (a malformed request
    is said once, skipped)."""
    out = []
    admitted = store.under(keys.ADMISSION_PREFIX)
    for key, value in store.under(keys.JOIN_PREFIX).items():
        try:
            req = JoinRequest.from_json(value, key)
            if keys.join_request(req.lease) != key:
                raise BadValue(key, f"names lease {req.lease:x}")
        except BadValue as e:
            refused.refuse(e, value)
            continue
        if keys.admission(req.lease) not in admitted:
            out.append(req)
    return sorted(out, key=lambda r: r.lease)


def admit(store: EtcdStore, node: int, request: JoinRequest, first_command: int) -> HostRecord | None:
    """Make `request`'s host node `node`: its host record bound to its lease, then the admission
    (both bound to its lease). None when its lease is gone (it died waiting: forgotten) or the
    node's record exists."""
    record = HostRecord(node, request.addr, request.port, request.pid, request.lease)
    try:
        if store.create(keys.host(node), record.to_json(), request.lease) is None:
            return None
        store.create(keys.admission(request.lease), Admission(node, first_command).to_json(), request.lease)
    except EtcdError as e:  # etcd refuses a put bound to a lease that ended: the joiner died waiting
        if "lease not found" in str(e):
            return None
        raise
    return record
