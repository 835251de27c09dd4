"""The command and report streams: entries in order, and a number its writer reserved but never
wrote (killed between the two writes) passed over once it has been a hole for `HOLE_S`, without
losing the entry of a writer that was only slow."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from leto.control import stream, takeover
from leto.protocol import keys
from leto.protocol.messages import Refusals

HOLE_S = 0.2


@pytest.fixture(autouse=True)
def short_holes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream, "HOLE_S", HOLE_S)


def _read(reader: stream.Reader) -> list[bytes]:
    got = []
    while (entry := reader.take()) is not None:
        got.append(entry[1])
    return got


def _until_past_the_hole(reader: stream.Reader) -> list[bytes]:
    """Read until the reader has passed its hole (it reads the counter, waits `HOLE_S`, fills it)."""
    got, start = [], reader.next
    for _ in range(200):
        got += _read(reader)
        if reader.next > start:
            return got
        time.sleep(HOLE_S / 10)
    raise AssertionError("the reader never passed the hole")


def test_entries_are_read_in_order_once_each() -> None:
    store = dist.HashStore()
    reader = stream.Reader(store, keys.COMMANDS, keys.command)
    assert [stream.append(store, keys.COMMANDS, keys.command, v) for v in ("a", "b")] == [0, 1]
    assert _read(reader) == [b"a", b"b"] and _read(reader) == []
    stream.append(store, keys.COMMANDS, keys.command, "c")
    assert _read(reader) == [b"c"]


def test_an_entry_is_taken_once_even_by_a_reader_called_again_while_it_is_carried_out() -> None:
    """A command carried out may lead to the stream being read again (a nested call): the entry
    in hand is taken already, and the nested read goes on from the next."""
    store = dist.HashStore()
    for v in ("a", "b"):
        stream.append(store, keys.REPORTS, keys.sup_report, v)
    reader = stream.Reader(store, keys.REPORTS, keys.sup_report)
    first = reader.take()
    assert first is not None and first[1] == b"a"
    assert _read(reader) == [b"b"] and reader.take() is None


def test_a_number_reserved_and_never_written_is_passed_over_after_hole_s() -> None:
    """The writer killed between reserving number 1 and writing it: the reader waits at it for
    `HOLE_S` (not less), then fills it and reads on; nothing else is lost."""
    store = dist.HashStore()
    reader = stream.Reader(store, keys.COMMANDS, keys.command)
    stream.append(store, keys.COMMANDS, keys.command, "a")
    store.add(keys.COMMANDS, 1)  # number 1 reserved; its writer dies here
    stream.append(store, keys.COMMANDS, keys.command, "c")
    t0 = time.monotonic()
    assert _read(reader) == [b"a"]  # stops at the hole ...
    assert _until_past_the_hole(reader) == [b"c"]  # ... and passes it only after HOLE_S
    assert time.monotonic() - t0 >= HOLE_S
    assert store.get(keys.command(1)) == stream.TOMBSTONE and reader.next == 3


def test_a_writer_slower_than_hole_s_appends_its_entry_again_under_a_new_number() -> None:
    store = dist.HashStore()
    reader = stream.Reader(store, keys.COMMANDS, keys.command)
    store.add(keys.COMMANDS, 1)  # a slow writer reserved number 0 ...
    _until_past_the_hole(reader)  # ... and the reader filled it meanwhile
    assert stream.append(store, keys.COMMANDS, keys.command, "late") == 1  # the writer's next try
    assert _read(reader) == [b"late"]


class _FillsEveryNumber(dist.Store):
    """A store on which a reader fills every number before its writer writes it."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = dist.HashStore()

    def add(self, key: str, value: int) -> int:
        return self.inner.add(key, value)

    def compare_set(self, key: str, expected: str, desired: bytes) -> bytes:
        return self.inner.compare_set(key, "", stream.TOMBSTONE)


def test_a_writer_whose_every_number_is_filled_says_the_store_is_failing() -> None:
    store = _FillsEveryNumber()
    with pytest.raises(stream.StreamStalled, match="taken for holes"):
        stream.append(store, keys.COMMANDS, keys.command, "never")


def test_a_reader_passes_no_hole_where_nothing_was_reserved() -> None:
    store = dist.HashStore()
    reader = stream.Reader(store, keys.COMMANDS, keys.command)
    stream.append(store, keys.COMMANDS, keys.command, "a")
    assert _read(reader) == [b"a"]
    time.sleep(2 * HOLE_S)
    assert _read(reader) == [] and _read(reader) == [] and reader.next == 1
    assert not store.check([keys.command(1)])  # nothing filled


def test_a_takeover_reads_the_streams_without_their_filled_holes() -> None:
    entries = {keys.command(2): b"c", keys.command(0): b"a", keys.command(1): stream.TOMBSTONE}
    refused = Refusals("test")
    assert takeover.ordered(entries, refused) == [(keys.command(0), b"a"), (keys.command(2), b"c")]
