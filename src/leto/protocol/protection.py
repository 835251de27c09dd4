"""The protection messages: what keepers, workers and the controller write under the
protection keys (`keys.ready`, `keys.committed`, `keys.drain`, `keys.sent`,
`keys.barrier_state`, `keys.report`), each a dataclass with to/from JSON. The wire format is
the one the readers have always parsed: an optional field that is None is left out. Every
reader parses and checks a value as `messages.parse` does (`BadValue` naming the key)."""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, fields
from typing import Any

from leto.errors import BadValue
from leto.protocol.messages import load_json, negative, parse, parse_data, parse_pid

Table = list[Any]  # a version or checksum table as nested lists (numpy's tolist())


def _present(obj: object) -> dict[str, Any]:
    """The fields of a dataclass that are set (not None), by name."""
    return {f.name: getattr(obj, f.name) for f in fields(obj) if getattr(obj, f.name) is not None}


@dataclass(frozen=True)
class KeeperReady:
    """`keys.ready`: a node's keeper serves this generation; the value is its pid."""

    pid: int

    def to_json(self) -> str:
        return str(self.pid)

    @staticmethod
    def from_json(text: str | bytes, key: str = "") -> KeeperReady:
        return KeeperReady(parse_pid(text, key))


@dataclass(frozen=True)
class Tier2Address:
    """`keys.tier2_address`: the IPv4 address and port a keeper listens on for its peers'
    tier-2 connections."""

    addr: str
    port: int

    def to_json(self) -> str:
        return json.dumps({"addr": self.addr, "port": self.port})

    @staticmethod
    def from_json(text: str | bytes, key: str = "") -> Tier2Address:
        return parse(Tier2Address, text, key)

    def problem(self) -> str | None:
        try:
            ipaddress.IPv4Address(self.addr)
        except ValueError:
            return f"address {self.addr[:60]!r} is not an IPv4 address"
        return None if 0 < self.port < 65536 else f"port {self.port} is not one"


@dataclass(frozen=True)
class BaseCommitted:
    """`keys.committed`: a generation's base encode committed on a node (readers check that
    the key exists; the value is a constant)."""

    def to_json(self) -> str:
        return "1"

    @staticmethod
    def from_json(text: str | bytes, key: str = "") -> BaseCommitted:
        return BaseCommitted()


@dataclass(frozen=True)
class Drain:
    """`keys.drain`: the controller asks a generation's keepers to drain and report, before
    generation `next_generation` starts; `live_nodes`: the nodes whose keepers still run."""

    live_nodes: tuple[int, ...]
    next_generation: int

    def to_json(self) -> str:
        return json.dumps({"live_nodes": list(self.live_nodes), "next_generation": self.next_generation})

    @staticmethod
    def from_json(text: str | bytes, key: str = "") -> Drain:
        return parse(Drain, text, key)

    def problem(self) -> str | None:
        return negative(next_generation=self.next_generation, node=min(self.live_nodes, default=0))


@dataclass(frozen=True)
class SentCounts:
    """`keys.sent`: how many tier-2 messages of each kind a keeper sent to one peer, so the
    peer knows when it has received them all."""

    messages: dict[int, int]

    def to_json(self) -> str:
        return json.dumps(self.messages)

    @staticmethod
    def from_json(text: str | bytes, key: str = "") -> SentCounts:
        return parse_data(SentCounts, {"messages": load_json(text, key)}, key)

    def problem(self) -> str | None:
        bad = [(k, v) for k, v in self.messages.items() if k < 0 or v < 0]
        return f"message kind {bad[0][0]}: count {bad[0][1]} (negative)" if bad else None


# a barrier's state: on the wire False, True, "done", "failed" (the list format of old)
NOT_ENTERED, IN_FLIGHT, DONE, FAILED = "not_entered", "in_flight", "done", "failed"
_WIRE: dict[str, bool | str] = {NOT_ENTERED: False, IN_FLIGHT: True, DONE: DONE, FAILED: FAILED}
_FROM_WIRE = {wire: state for state, wire in _WIRE.items()}


@dataclass(frozen=True)
class BarrierState:
    """`keys.barrier_state`: where a draining keeper stopped: its next barrier (kind, step)
    and whether it entered it, and how the barrier ended."""

    kind: int
    step: int
    state: str  # NOT_ENTERED, IN_FLIGHT, DONE or FAILED

    def hopeless(self) -> bool:
        """The barrier cannot complete for the keeper that wrote this: never entered, or failed."""
        return self.state in (NOT_ENTERED, FAILED)

    def to_json(self) -> str:
        return json.dumps([self.kind, self.step, _WIRE[self.state]])

    @staticmethod
    def from_json(text: str | bytes, key: str = "") -> BarrierState:
        d = load_json(text, key)
        if not (isinstance(d, list) and len(d) == 3 and isinstance(d[2], (bool, str)) and d[2] in _FROM_WIRE):
            raise BadValue(key, f"{str(d)[:40]!r} is not a barrier state [kind, step, state]")
        return parse_data(BarrierState, {"kind": d[0], "step": d[1], "state": _FROM_WIRE[d[2]]}, key)

    def problem(self) -> str | None:
        return negative(kind=self.kind, step=self.step)


@dataclass(frozen=True)
class StripeReport:
    """A parity node's tables of one tier-2 stripe: the version (`v2`) and checksum (`crc2`)
    of every data block it folded per offset; with protected gradients their checksums
    (`gcrc2`) and steps (`g2_step`); under an interval the pre-images' checksums and step."""

    v2: Table
    crc2: Table
    gcrc2: Table | None = None
    g2_step: Table | None = None
    crc_pre: Table | None = None
    pre_step: Table | None = None

    def problem(self) -> str | None:
        return _tables_problem(self)


@dataclass(frozen=True)
class KeeperReport:
    """`keys.report`: what a drained keeper reports of its last committed generation
    (`generation_used`; `generation`: the one it served then). `empty`: it holds none.

    Always: `d_commit` (last delta commit), tier-1 versions `v1` and checksums `crc1`
    ([worker][chunk]), `stripes` by index. With protected gradients: `g_commit`,
    `grads_complete` (steps whose gradients are all folded here), `gcrc1`, `g1_step`. Without:
    `applied` (the step every delta is folded at) and, under an interval, the tier-1
    pre-images' `crc_pre` and `pre_step`."""

    node: int
    generation: int | None = None
    generation_used: int | None = None
    empty: bool | None = None
    d_commit: int | None = None
    applied: int | None = None
    g_commit: int | None = None
    grads_complete: list[int] | None = None
    v1: Table | None = None
    crc1: Table | None = None
    gcrc1: Table | None = None
    g1_step: Table | None = None
    crc_pre: Table | None = None
    pre_step: Table | None = None
    stripes: dict[int, StripeReport] | None = None

    def to_json(self) -> str:
        d = _present(self)
        if self.stripes is not None:
            d["stripes"] = {str(i): _present(s) for i, s in self.stripes.items()}
        return json.dumps(d)

    @staticmethod
    def from_json(text: str | bytes, key: str = "") -> KeeperReport:
        return parse(KeeperReport, text, key)

    def problem(self) -> str | None:
        return negative(
            node=self.node,
            generation=self.generation,
            generation_used=self.generation_used,
            stripe=min(self.stripes or [0]),
        ) or _tables_problem(self)


def _tables_problem(msg: object) -> str | None:
    """Whether a table field of `msg` is not a rectangular nested list of ints (what numpy's
    tolist() of an integer array writes)."""
    for f in fields(msg):  # type: ignore[arg-type]
        t = getattr(msg, f.name)
        if isinstance(t, list) and f.name != "grads_complete" and _shape(t) is None:
            return f"{f.name} is not a table of integers"
    return None


def _shape(t: Any) -> tuple[int, ...] | None:
    """The shape of a rectangular nested list of ints, else None."""
    if isinstance(t, int) and not isinstance(t, bool):
        return ()
    if not isinstance(t, list):
        return None
    shapes = {_shape(x) for x in t}
    if None in shapes or len(shapes) > 1:
        return None
    return (len(t), *(shapes.pop() if shapes else ()))
