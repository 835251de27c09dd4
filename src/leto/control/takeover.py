"""What a coordinator taking over a running job reads back: the command and report streams in
order, the newest valid membership, and the hosts admitted into lost nodes (`Coordinator.restore`).

A coordinator may be lost between a joiner's admission and the grow onto its shadows: its
successor finds the admitted host by its host record and admission (`admissions`), finishes what
the admission started (the node's keeper, zygote and shadows) and grows onto them; one lost
between the host record and the admission has the admission written by its successor."""

from __future__ import annotations

from collections.abc import Container

import torch.distributed as dist

from leto.control.stream import TOMBSTONE
from leto.errors import BadValue
from leto.protocol import keys
from leto.protocol.messages import Admission, HostRecord, JobState, Membership, Refusals, parse_int
from leto.runtime.etcd_store import EtcdError, EtcdStore


def entry_seq(key: str) -> int:
    """The number of a stream entry's key (`keys.command`, `keys.sup_report`), else `BadValue`."""
    return parse_int(key.rsplit("/", 1)[1], key, minimum=0)


def ordered(entries: dict[str, bytes], refused: Refusals, written: int | None = None) -> list[tuple[str, bytes]]:
    """A command or report stream's entries in order, without the holes filled (`stream`); an
    entry whose key is not numbered, or numbered past the `written` entries the stream's counter
    has, is refused."""
    out = []
    for key, text in entries.items():
        if text == TOMBSTONE:  # a hole a reader filled: its writer died before writing it
            continue
        try:
            seq = entry_seq(key)
            if written is not None and seq >= written:
                raise BadValue(key, f"entry {seq} is past the {written} entries written")
        except BadValue as e:
            refused.refuse(e, text)
            continue
        out.append((seq, key, text))
    return [(key, text) for _, key, text in sorted(out)]


def newest_membership(store: dist.Store, started: Container[str], refused: Refusals) -> Membership:
    """The newest generation's membership. A malformed one (or one naming processes no command
    `started`) is refused and the one before it taken: the next decision writes the generation
    after it. Only a job without one valid membership cannot be taken over (`BadValue`)."""
    value = store.get(keys.JOB_STATE)
    try:
        gen = JobState.from_json(value, keys.JOB_STATE).generation
    except BadValue as e:
        refused.refuse(e, value)
        gen = 0
    if not store.check([keys.membership(gen)]):
        gen = 0  # a generation never announced: look from the first
    while store.check([keys.membership(gen + 1)]):
        gen += 1
    while True:
        key = keys.membership(gen)
        value = store.get(key)
        try:
            membership = Membership.from_json(value, key)
            unknown = [p for p in membership.proc_of_rank if p not in started]
            if membership.generation != gen or unknown:
                raise BadValue(key, f"generation {membership.generation}, processes {unknown[:3]} no command started")
            return membership
        except BadValue as e:
            refused.refuse(e, value)
            if gen == 0:
                raise
            gen -= 1


def admissions(
    store: EtcdStore, records: dict[int, HostRecord], first_command: int, refused: Refusals
) -> dict[int, int]:
    """The nodes held by admitted hosts (joiners, among the live host `records`), each with the
    first command that is its host's (those before were for the host it replaced). A joiner whose
    record exists but whose admission the lost coordinator never wrote is admitted now, at
    `first_command` (the stream's length: nothing was written for it yet); one whose lease ended
    meanwhile is left out (its loss is seen next). An admission that is malformed, or names
    another node, is refused and its host left out: it holds no process of the job."""
    out: dict[int, int] = {}
    for node, record in sorted(records.items()):
        key = keys.admission(record.lease)
        value = store.value(key)
        if value is None and store.value(keys.join_request(record.lease)) is not None:
            try:
                if store.create(key, Admission(node, first_command).to_json(), record.lease) is not None:
                    out[node] = first_command
                    continue
            except EtcdError as e:  # a put bound to an ended lease: the joiner is gone
                if "lease not found" in str(e):
                    continue
                raise
            value = store.value(key)  # written meanwhile (the mirror lagged)
        if value is None:
            continue  # a host of the job's start
        try:
            admission = Admission.from_json(value, key)
            if admission.node != node:
                raise BadValue(key, f"names node {admission.node}, its host record node {node}")
        except BadValue as e:
            refused.refuse(e, value)
            continue
        out[node] = admission.first_command
    return out
