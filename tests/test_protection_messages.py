"""The protection messages (`leto.protocol.protection`): each round-trips through JSON, and the
wire format is the one the readers parse (lists, string stripe indices, absent optional fields).
A malformed value (the wrong type, a negative node or generation, a ragged or non-integer table,
a pid of -1) is refused with `BadValue` naming its key, never turned into a message."""

from __future__ import annotations

import json

import pytest

from leto.errors import BadValue
from leto.protection.layout import Geometry, Layout
from leto.protocol.protection import (
    DONE,
    FAILED,
    IN_FLIGHT,
    NOT_ENTERED,
    BarrierState,
    BaseCommitted,
    Drain,
    KeeperReady,
    KeeperReport,
    SentCounts,
    StripeReport,
)


def test_small_messages_round_trip_in_their_wire_format() -> None:
    assert KeeperReady.from_json(KeeperReady(4321).to_json()) == KeeperReady(4321)
    assert KeeperReady(4321).to_json() == "4321" and BaseCommitted().to_json() == "1"
    d = Drain((0, 2), 5)
    assert json.loads(d.to_json()) == {"live_nodes": [0, 2], "next_generation": 5}
    assert Drain.from_json(d.to_json().encode()) == d
    s = SentCounts({1: 3, 2: 7})
    assert json.loads(s.to_json()) == {"1": 3, "2": 7} and SentCounts.from_json(s.to_json()) == s


def test_barrier_states_keep_the_list_format() -> None:
    wire = {NOT_ENTERED: False, IN_FLIGHT: True, DONE: "done", FAILED: "failed"}
    for state, value in wire.items():
        b = BarrierState(2, 7, state)
        assert json.loads(b.to_json()) == [2, 7, value]
        assert BarrierState.from_json(b.to_json()) == b
        assert b.hopeless() == (state in (NOT_ENTERED, FAILED))


def test_keeper_reports_round_trip_and_leave_out_what_they_lack() -> None:
    stripe = StripeReport([[3, 3]], [[11, 12]], crc_pre=[[0, 0]], pre_step=[2, 2])
    r = KeeperReport(
        1, generation=2, generation_used=2, d_commit=3, applied=3, v1=[[3, 3]], crc1=[[5, 6]], stripes={4: stripe}
    )
    d = json.loads(r.to_json())
    assert set(d) == {"node", "generation", "generation_used", "d_commit", "applied", "v1", "crc1", "stripes"}
    assert d["stripes"] == {"4": {"v2": [[3, 3]], "crc2": [[11, 12]], "crc_pre": [[0, 0]], "pre_step": [2, 2]}}
    assert KeeperReport.from_json(r.to_json()) == r
    empty = KeeperReport(3, empty=True)
    assert json.loads(empty.to_json()) == {"node": 3, "empty": True}
    assert KeeperReport.from_json(empty.to_json()) == empty


@pytest.mark.parametrize(
    ("cls", "value", "why"),
    [
        (KeeperReady, "-1", "below 1"),
        (KeeperReady, "nan", "not an integer"),
        (Drain, '{"live_nodes": [0, -1], "next_generation": 2}', "negative"),
        (Drain, '{"live_nodes": [0], "next_generation": "2"}', "not int"),
        (Drain, "{", "not JSON"),
        (SentCounts, '{"x": 1}', "not int"),
        (SentCounts, '{"1": -5}', "negative"),
        (BarrierState, "[1, 2, 3]", "not a barrier state"),
        (BarrierState, "[1, -2, true]", "negative"),
        (KeeperReport, '{"node": 1, "v1": [[1], [1, 2]]}', "v1 is not a table of integers"),
        (KeeperReport, '{"node": 1, "crc1": [[1.5]]}', "crc1 is not a table of integers"),
        (KeeperReport, '{"node": 1, "stripes": {"0": {"v2": [["a"]], "crc2": [[1]]}}}', "v2 is not a table"),
        (KeeperReport, '{"node": 1, "stripes": {"x": {"v2": [[1]], "crc2": [[1]]}}}', "not int"),
        (KeeperReport, '{"generation": 1}', "has no 'node'"),
        (KeeperReport, '{"node": 1, "d_commit": NaN}', "not int"),
        (Layout, '{"generation": 0}', "has no"),
    ],
)
def test_malformed_values_are_refused_naming_their_key(cls: type, value: str, why: str) -> None:
    with pytest.raises(BadValue, match=why) as e:
        cls.from_json(value, "protect/some/key")
    assert e.value.key == "protect/some/key"


def test_layouts_round_trip_and_refuse_what_no_writer_writes() -> None:
    layout = Layout(3, 40, Geometry(4, 256), (0, 0, 1, 1), (1, 1), 8, 2, False)
    assert Layout.from_json(layout.to_json(), "k") == layout
    for field, bad in [
        ("n_chunks", 0),
        ("chunk_elems", -4),
        ("node_of_rank", []),
        ("node_of_rank", [0, -1]),
        ("ec", [2]),
        ("ec", [0, 1]),
        ("generation", 1.5),
        ("protect_every", True),
    ]:
        d = json.loads(layout.to_json()) | {field: bad}
        with pytest.raises(BadValue):
            Layout.from_json(json.dumps(d), "k")
