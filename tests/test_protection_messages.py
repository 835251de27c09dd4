"""The protection messages (`leto.protocol.protection`): each round-trips through JSON, and the
wire format is the one the readers parse (lists, string stripe indices, absent optional fields)."""
from __future__ import annotations

import json

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
    r = KeeperReport(1, generation=2, generation_used=2, d_commit=3, applied=3, v1=[[3, 3]], crc1=[[5, 6]],
                     stripes={4: stripe})
    d = json.loads(r.to_json())
    assert set(d) == {"node", "generation", "generation_used", "d_commit", "applied", "v1", "crc1", "stripes"}
    assert d["stripes"] == {"4": {"v2": [[3, 3]], "crc2": [[11, 12]], "crc_pre": [[0, 0]], "pre_step": [2, 2]}}
    assert KeeperReport.from_json(r.to_json()) == r
    empty = KeeperReport(3, empty=True)
    assert json.loads(empty.to_json()) == {"node": 3, "empty": True}
    assert KeeperReport.from_json(empty.to_json()) == empty
