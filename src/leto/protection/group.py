"""The keepers of a generation as a group (their gloo group and their tier-2 connections), and its
early formation as soon as the generation's membership is out."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from leto.errors import BadValue
from leto.protection.layout import Layout
from leto.protection.peer_sockets import PeerSockets
from leto.protocol import keys
from leto.protocol.messages import Refusals
from leto.runtime import env as rt
from leto.runtime import threads
from leto.runtime.membership import read_membership

_refused = Refusals("leto keeper")  # malformed store values this keeper ignored (said once each)


@dataclass(frozen=True)
class KeeperGroup:
    """A generation's keepers together: their gloo group (the commit barrier's all-reduce) and
    this keeper's TCP connections to the others (tier-2 traffic: `transport.Link`)."""

    pg: dist.ProcessGroup
    sockets: PeerSockets


def keeper_group(store: dist.Store, gen: int, nodes: list[int], node: int, timeout_s: float) -> KeeperGroup:
    """Generation `gen`'s keepers (one per node of its membership, in node order). Every wait on
    them ends within `timeout_s` (the job's collective timeout): idle links carry keepalives
    (`transport.Link`), and blocked waits of an abandoned generation end by that time too."""
    pg = dist.ProcessGroupGloo(
        dist.PrefixStore(keys.keeper_pg(gen), store), nodes.index(node), len(nodes), timedelta(seconds=timeout_s)
    )
    return KeeperGroup(pg, PeerSockets(store, gen, nodes, node, timeout_s))


class EarlyGroup:
    """Generation `gen`'s `KeeperGroup`, built in a thread as soon as its membership is out (its nodes
    are the membership's): its rendezvous through the store overlaps the workers' recovery instead of
    following rank 0's layout, which comes only once the state is rebuilt. A generation that is
    superseded before its layout leaves its thread blocked in the rendezvous, like the waits of
    an abandoned generation. The rendezvous has a store client of its own: a store client
    serves one request at a time, and a rendezvous waiting on a keeper that died before it
    joined would hold the keeper's own client (its drains, its reports) for the whole timeout."""

    def __init__(self, store: dist.Store, gen: int, nodes: list[int], node: int, timeout_s: float) -> None:
        self.gen, self.nodes, self.timeout_s = gen, nodes, timeout_s
        self._box: list = []
        self._thread = threads.start(self._build, f"keeper-group-g{gen}", store.clone(), node)

    def _build(self, store: dist.Store, node: int) -> None:
        try:
            self._box.append(keeper_group(store, self.gen, self.nodes, node, self.timeout_s))
        except Exception as e:  # noqa: BLE001 (raised by `take`)
            self._box.append(e)

    def take(self, layout: Layout) -> KeeperGroup:
        """The group, once built (bounded by the timeout); raises what the rendezvous raised."""
        if layout.nodes != self.nodes:
            raise RuntimeError(
                f"generation {self.gen}'s layout names nodes {layout.nodes}, its membership {self.nodes}"
            )
        self._thread.join(self.timeout_s)
        if not self._box:
            raise RuntimeError(
                f"the keepers of generation {self.gen} did not form their group within {self.timeout_s:.0f}s"
            )
        if isinstance(self._box[0], Exception):
            raise self._box[0]
        return self._box[0]


def early_group(job: rt.Job, gen: int, node: int) -> EarlyGroup | None:
    """Start generation `gen`'s keeper group if its membership is out and names this node."""
    if not job.store.check([keys.membership(gen)]):
        return None
    try:
        nodes = sorted(set(read_membership(job.store, gen).node_of_rank))
    except BadValue as e:  # no early group: the generation's group forms once its layout is out
        _refused.refuse(e)
        return None
    return EarlyGroup(job.store, gen, nodes, node, job.timeout_s) if node in nodes else None
