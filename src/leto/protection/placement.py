"""Tier-2 stripe placement: Reed-Solomon stripes across nodes.

Nodes form consecutive groups of `n = k + m` nodes. Within a group
`g[0..n-1]` there are n stripes, by rotation: stripe j has data nodes
`g[j], ..., g[j+k-1]` and parity nodes `g[j+k], ..., g[j+k+m-1]` (indices
mod n). Each node is data in k stripes and parity in m stripes, never both in
one stripe.

Each node's data is split into k equal segments (`segment_bounds`). In
stripe j, the data node at position p (`data_nodes[p]`) contributes its
segment p: node `g[t]` gives segment `(t - j) mod n` to stripe j, so its k
stripes receive k different segments and every segment is protected exactly
once. (One segment number shared by all data nodes of a stripe is impossible
in general: e.g. for 2+1 the three stripes pairwise share a data node, so they
would need three different segment numbers out of two.)

A parity block has the length of one segment; a node holds m of them, so the
memory overhead per node is m/k of its (padded) data.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "Stripe",
    "default_code",
    "fitted_code",
    "lost_summary",
    "padded_size",
    "place_stripes",
    "segment_bounds",
    "valid_specs",
]


@dataclass(frozen=True)
class Stripe:
    """One Reed-Solomon stripe.

    Attributes:
        index: global stripe number.
        data_nodes: the k nodes whose segments are the stripe's data blocks.
        parity_nodes: parity block j lives on `parity_nodes[j]`.
        segments: `segments[p]` is the segment number (0..k-1) that
            `data_nodes[p]` contributes; data block p of the code.
    """

    index: int
    data_nodes: tuple[int, ...]
    parity_nodes: tuple[int, ...]
    segments: tuple[int, ...]

    @property
    def k(self) -> int:
        """Number of data blocks."""
        return len(self.data_nodes)

    @property
    def m(self) -> int:
        """Number of parity blocks."""
        return len(self.parity_nodes)

    @property
    def nodes(self) -> tuple[int, ...]:
        """All nodes, in code block order: data blocks then parity blocks."""
        return self.data_nodes + self.parity_nodes

    def segment_of(self, node: int) -> int:
        """Segment number that data node `node` contributes to this stripe."""
        try:
            return self.segments[self.data_nodes.index(node)]
        except ValueError:
            raise ValueError(f"node {node} is not a data node of stripe {self.index}") from None


def default_code(num_nodes: int) -> tuple[int, int] | None:
    """`--ec auto`: (nodes-1)+1 across all nodes; no tier 2 on a single node."""
    return (num_nodes - 1, 1) if num_nodes >= 2 else None


def fitted_code(num_nodes: int, requested: tuple[int, int] | None) -> tuple[int, int] | None:
    """The tier-2 code placed over `num_nodes` nodes for the requested k+m: as requested while
    k + m divides the node count; otherwise (fewer nodes after a loss) re-placed as one group
    over every node, (nodes - m')+m' with m' = min(m, nodes - 1), so that the next node loss is
    survivable again; None when fewer than 2 nodes are left (or none was requested)."""
    if requested is None:
        return None
    k, m = requested
    if num_nodes >= k + m and num_nodes % (k + m) == 0:
        return requested
    m = min(m, num_nodes - 1)
    return (num_nodes - m, m) if m >= 1 else None


def degradation(num_nodes: int, requested: tuple[int, int] | None) -> str | None:
    """What the requested tier-2 code no longer covers on `num_nodes` nodes, or None."""
    if requested is None:
        return None
    fitted = fitted_code(num_nodes, requested)
    if fitted is None:
        return (
            f"tier 2 is off: {num_nodes} node left, so a node loss is no longer survivable "
            f"(--ec {requested[0]}+{requested[1]} asked for {requested[1]}); tier 1 still covers one rank per node"
        )
    if fitted[1] < requested[1]:
        return (
            f"tier 2 re-placed as {fitted[0]}+{fitted[1]} over {num_nodes} nodes: it survives {fitted[1]} "
            f"node loss(es) at once, not {requested[1]} as --ec {requested[0]}+{requested[1]} asked"
        )
    return None


def valid_specs(num_nodes: int, max_m: int = 3) -> list[str]:
    """Erasure-code specs "k+m" (1 <= m <= max_m) whose k + m divides `num_nodes`."""
    return [
        f"{n - m}+{m}"
        for n in range(2, min(num_nodes, 256) + 1)
        if num_nodes % n == 0
        for m in range(1, min(max_m, n - 1) + 1)
    ]


def place_stripes(num_nodes: int, k: int, m: int) -> list[Stripe]:
    """Rotated stripes over groups of k + m consecutive nodes (see module doc)."""
    if k < 1 or m < 1:
        raise ValueError(f"tier-2 code needs k >= 1 and m >= 1, got k={k}, m={m}")
    n = k + m
    if num_nodes < 1 or num_nodes % n != 0:
        specs = valid_specs(num_nodes) if num_nodes > 0 else []
        hint = (
            f"valid ec specs for {num_nodes} nodes include {', '.join(specs)}"
            if specs
            else "tier 2 needs at least 2 nodes"
        )
        raise ValueError(f"ec {k}+{m} needs the node count to be a multiple of k+m={n}, got {num_nodes} nodes; {hint}")
    stripes = []
    for base in range(0, num_nodes, n):
        for j in range(n):
            stripes.append(
                Stripe(
                    index=len(stripes),
                    data_nodes=tuple(base + (j + p) % n for p in range(k)),
                    parity_nodes=tuple(base + (j + k + q) % n for q in range(m)),
                    segments=tuple(range(k)),
                )
            )
    return stripes


def _round_up(x: int, align: int) -> int:
    return -(-x // align) * align


def segment_bounds(nbytes: int, k: int, *, align: int = 8) -> list[tuple[int, int]]:
    """Byte ranges `[start, end)` of the k equal segments of `nbytes` of data.

    Padding rule: every segment has length `L = ceil(nbytes / k)` rounded up
    to a multiple of `align` (so segments of an aligned buffer stay aligned
    for the fast XOR/uint16 paths). The ranges cover `padded_size(nbytes, k)
    = k * L >= nbytes` bytes; bytes past `nbytes` are padding and must be
    zero (or at least identical at encode and decode time).
    """
    if k < 1 or nbytes < 0 or align < 1:
        raise ValueError(
            f"segment_bounds needs nbytes >= 0, k >= 1, align >= 1; got nbytes={nbytes}, k={k}, align={align}"
        )
    length = _round_up(-(-nbytes // k), align)
    return [(s * length, (s + 1) * length) for s in range(k)]


def padded_size(nbytes: int, k: int, *, align: int = 8) -> int:
    """Total length of the padded buffer that `segment_bounds` splits."""
    return segment_bounds(nbytes, k, align=align)[-1][1]


def _overloaded(stripes: Iterable[Stripe], lost_nodes: set[int]) -> list[tuple[Stripe, list[int]]]:
    bad = []
    for stripe in stripes:
        lost = sorted(node for node in stripe.nodes if node in lost_nodes)
        if len(lost) > stripe.m:
            bad.append((stripe, lost))
    return bad


def lost_summary(stripes: Sequence[Stripe], lost_nodes: set[int]) -> str:
    """Human-readable verdict on losing `lost_nodes`; names each failing stripe."""
    lost = sorted(lost_nodes)
    bad = _overloaded(stripes, lost_nodes)
    if not bad:
        return f"losing nodes {lost} is survivable: every stripe lost at most m of its nodes"
    details = "; ".join(
        f"stripe {s.index} (data nodes {list(s.data_nodes)}, parity nodes "
        f"{list(s.parity_nodes)}) lost nodes {nodes}: {len(nodes)} > m={s.m}"
        for s, nodes in bad
    )
    return f"losing nodes {lost} is not survivable: {details}"
