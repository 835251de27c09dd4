"""What a coordinator taking over a running job reads back: the command and report streams in
order, and the newest valid membership (`Coordinator.restore`)."""

from __future__ import annotations

from collections.abc import Container

import torch.distributed as dist

from leto.errors import BadValue
from leto.protocol import keys
from leto.protocol.messages import JobState, Membership, Refusals, parse_int


def entry_seq(key: str) -> int:
    """The number of a stream entry's key (`keys.command`, `keys.sup_report`), else `BadValue`."""
    return parse_int(key.rsplit("/", 1)[1], key, minimum=0)


def ordered(entries: dict[str, bytes], refused: Refusals, written: int | None = None) -> list[tuple[str, bytes]]:
    """A command or report stream's entries in order; an entry whose key is not numbered, or
    numbered past the `written` entries the stream's counter has, is refused."""
    out = []
    for key, text in entries.items():
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
