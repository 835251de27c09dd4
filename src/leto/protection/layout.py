"""Where every protected byte lives for one membership generation.

The layout is a pure function of the membership (which rank runs on which node), the chunk
geometry and `--ec k+m`; every worker and keeper computes the same one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property

from leto.protection.codec import ErasureCode, make_code
from leto.protection.placement import Stripe, fitted_code, place_stripes
from leto.protocol.messages import negative, parse

GRAD_ROWS = 1
STATE_ROWS = 3
RING_SLOTS = (8, 16)  # staging slots a worker's ring has: at least, at most (`ring_slots_for`)


@dataclass(frozen=True)
class Geometry:
    """Chunking of one rank's shard: `n_chunks` chunks of `chunk_elems` elements."""

    n_chunks: int
    chunk_elems: int

    @property
    def state_bytes(self) -> int:
        return STATE_ROWS * 4 * self.chunk_elems

    @property
    def grad_bytes(self) -> int:
        return GRAD_ROWS * 4 * self.chunk_elems


def ring_slots_for(geometry: Geometry) -> int:
    """Staging slots in each worker's ring: room for all of a step's chunks, so that a worker
    never waits for its keeper to free a slot while it updates its shard (the keeper folds them
    while the next step computes), between RING_SLOTS' bounds: past a few MiB a worker a ring
    only absorbs the keeper's scheduling delays (docs/protection.md, "Keepers' priority")."""
    return max(RING_SLOTS[0], min(geometry.n_chunks, RING_SLOTS[1]))


@dataclass(frozen=True)
class Route:
    """Where the tier-2 contribution of one source chunk goes."""

    parity_node: int
    stripe: int
    j: int  # parity block index within the stripe
    p: int  # data position of the source node within the stripe
    i: int  # chunk offset inside the stripe's segment
    coef: int


@dataclass(frozen=True)
class Layout:
    generation: int
    base_step: int  # the step every rank's state is at when it starts
    geometry: Geometry
    node_of_rank: tuple[int, ...]
    ec: tuple[int, int] | None  # requested tier-2 code
    ring_slots: int = 8
    protect_every: int = 1  # --protect-every: only every N-th step's state is protected
    replicated_grads: bool = False  # every rank holds the whole reduced gradient (gloo's all-reduce):
    #                                     gradients are not staged, a replay takes them from a survivor

    @property
    def protects_grads(self) -> bool:
        """Whether keepers hold gradient parity: only when a step's gradient shard exists on its
        rank alone (a real reduce-scatter, NCCL) and every step is protected (docs/protection.md)."""
        return self.protect_every == 1 and not self.replicated_grads

    @cached_property
    def tier2_preimages(self) -> bool:
        """Whether tier-2 parity rows keep pre-images: under an interval, and wherever a decode
        reads two or more parity blocks of a stripe (m >= 2). A data node lost while it ships a
        chunk's contributions can leave one parity row at the new version of that chunk and
        another at the old one (torn); the rows' pre-images agree, and the chunk is decoded at
        the step before and replayed (docs/protection.md, "Torn tier-2 rows")."""
        t2 = self.tier2
        return self.protect_every > 1 or (t2 is not None and t2[0].m >= 2)

    # ----- protection interval (docs/protection.md, "Protection interval")
    def protects(self, step: int) -> bool:
        """Whether the state at `step` is protected: the base step and, after it, every step
        that is a multiple of `protect_every` (every step when it is 1)."""
        return step == self.base_step or (step > self.base_step and step % self.protect_every == 0)

    def next_protected(self, step: int) -> int:
        return (step // self.protect_every + 1) * self.protect_every

    # ----- membership
    @cached_property
    def nodes(self) -> list[int]:
        return sorted(set(self.node_of_rank))

    def local_ranks(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.node_of_rank) if n == node]

    def local_index(self, rank: int) -> int:
        return self.local_ranks(self.node_of_rank[rank]).index(rank)

    @property
    def world_size(self) -> int:
        return len(self.node_of_rank)

    # ----- tier 2
    @cached_property
    def tier2(self) -> tuple[ErasureCode, list[Stripe]] | None:
        """The code and stripes over node indices: the requested code, re-placed over the nodes
        left after a loss (`fitted_code`); None with no code or a single node."""
        code = fitted_code(len(self.nodes), self.ec)
        if code is None:
            return None
        return make_code(*code), place_stripes(len(self.nodes), *code)

    @cached_property
    def positions_per_node(self) -> int:
        """Chunk positions of a node's data (padded to the largest node)."""
        return max(len(self.local_ranks(n)) for n in self.nodes) * self.geometry.n_chunks

    @cached_property
    def segment_len(self) -> int:
        if self.tier2 is None:
            return 0
        k = self.tier2[0].k
        return -(-self.positions_per_node // k)

    def position(self, rank: int, chunk: int) -> int:
        return self.local_index(rank) * self.geometry.n_chunks + chunk

    def source_of(self, node: int, position: int) -> tuple[int, int] | None:
        """(rank, chunk) held at a node's data position, or None for padding."""
        w, c = divmod(position, self.geometry.n_chunks)
        ranks = self.local_ranks(node)
        return (ranks[w], c) if w < len(ranks) else None

    def routes(self, node: int, position: int) -> list[Route]:
        """The tier-2 parity destinations of the chunk at `position` of `node`'s data."""
        if self.tier2 is None:
            return []
        code, stripes = self.tier2
        idx = self.nodes.index(node)
        seg, i = divmod(position, self.segment_len)
        out = []
        for s in stripes:
            if idx in s.data_nodes and s.segment_of(idx) == seg:
                p = s.data_nodes.index(idx)
                for j, pn in enumerate(s.parity_nodes):
                    out.append(Route(self.nodes[pn], s.index, j, p, i, code.parity_matrix[j][p]))
        return out

    def parity_stripes(self, node: int) -> list[tuple[Stripe, int]]:
        """(stripe, j) for every stripe whose parity block j this node keeps."""
        if self.tier2 is None:
            return []
        idx = self.nodes.index(node)
        return [(s, s.parity_nodes.index(idx)) for s in self.tier2[1] if idx in s.parity_nodes]

    def senders_to(self, node: int) -> list[int]:
        """Nodes that ship tier-2 contributions to `node`."""
        return sorted({self.nodes[d] for s, _ in self.parity_stripes(node) for d in s.data_nodes})

    def receivers_from(self, node: int) -> list[int]:
        return sorted({n for n in self.nodes if node in self.senders_to(n)})

    # ----- serialization through the store
    def to_json(self) -> str:
        return json.dumps(
            {
                "generation": self.generation,
                "base_step": self.base_step,
                "n_chunks": self.geometry.n_chunks,
                "chunk_elems": self.geometry.chunk_elems,
                "node_of_rank": list(self.node_of_rank),
                "ec": list(self.ec) if self.ec else None,
                "ring_slots": self.ring_slots,
                "protect_every": self.protect_every,
                "replicated_grads": self.replicated_grads,
            }
        )

    @staticmethod
    def from_json(text: str | bytes, key: str = "") -> Layout:
        """The layout rank 0 published (`BadValue` naming `key` unless every field checks out)."""
        d = parse(_LayoutWire, text, key)
        return Layout(
            d.generation,
            d.base_step,
            Geometry(d.n_chunks, d.chunk_elems),
            d.node_of_rank,
            d.ec,
            d.ring_slots,
            d.protect_every,
            d.replicated_grads,
        )


@dataclass(frozen=True)
class _LayoutWire:
    """A layout as written to the store (`Layout.to_json`), checked field by field."""

    generation: int
    base_step: int
    n_chunks: int
    chunk_elems: int
    node_of_rank: tuple[int, ...]
    ec: tuple[int, ...] | None
    ring_slots: int
    protect_every: int
    replicated_grads: bool

    def problem(self) -> str | None:
        if min(self.n_chunks, self.chunk_elems, self.ring_slots, self.protect_every) < 1 or not self.node_of_rank:
            return "n_chunks, chunk_elems, ring_slots and protect_every must be positive, node_of_rank not empty"
        if self.ec is not None and (len(self.ec) != 2 or self.ec[0] < 1 or self.ec[1] < 0):
            return f"ec {self.ec} is not a code k+m"
        return negative(generation=self.generation, base_step=self.base_step, node=min(self.node_of_rank))
