"""In-place recovery, worker side: survivors and adopting shadows join the next generation.

Survivors keep their process, parameters, optimizer shards and data pipeline; an adopting shadow
brings its pre-built model and buffers. Together they read the keepers' reports, agree on the
recovery step, decode what was lost, install it, rebuild the process group inside the running
processes, re-protect and record the recovery. The member and its state are known only through
`leto.recovery.member` (recovery imports nothing from training).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import torch

from leto.errors import BadValue
from leto.protection.layout import Layout
from leto.protocol import keys
from leto.protocol.messages import Membership, RecoveryRecord, Refusals
from leto.protocol.protection import Drain, KeeperReport
from leto.recovery.member import Member
from leto.recovery.rebuild import (
    Rebuilder,
    RebuildRecipe,
    RecoveryError,
    Roles,
    assign_roles,
    make_recipe,
    recovery_step,
)
from leto.runtime import trace
from leto.runtime.comm import Comm, PeerFailure
from leto.runtime.env import await_keys
from leto.runtime.membership import read_membership

GradOf = Callable[[int, int], torch.Tensor]  # (lost old rank, chunk) -> its gradient chunk of the recovery step
T = TypeVar("T")
_refused = Refusals()  # malformed store values a recovery of this process ignored (said once each)


@dataclass(frozen=True)
class Source:
    """The protection data a generation rebuilds from."""

    layout: Layout
    reports: dict[int, KeeperReport]  # node -> its keeper's drained report
    roles: Roles
    me: int | None  # the old rank whose shard this process wrote (None: an adopter)


@dataclass(frozen=True)
class Point:
    """The recovery step and what rebuilds the state at it."""

    membership: RebuildRecipe
    held: int  # the latest step whose whole reduced gradient a member holds (-1: none)
    grad_of: GradOf | None  # lost ranks' gradients of the step, where replicated (not protected)

    @property
    def step(self) -> int:
        return self.membership.step


def latest_generation(store, start: int) -> int:
    """The newest generation announced from `start` on."""
    g = start
    while store.check([keys.membership(g + 1)]):
        g += 1
    return g


def join(m: Member, gen: int) -> RecoveryRecord:
    """Join generation `gen` (announced by the controller); returns the recovery record."""
    t0 = time.time()
    trace.mark("join", generation=gen)
    phases = _Phases()
    membership = enter(m, gen)
    phases.done("enter")  # the membership, and the new process group's rendezvous
    reports = read_reports(m, gen)
    phases.done("keeper_reports")
    if not reports:  # every keeper is gone or new: go on if no rank's state was lost
        return _rejoin_intact(m, gen, membership, t0)
    src = protection_source(m, membership, reports)
    m.fault("recovery", m.sharded.step + 1)
    recipe, held, holder = agree_on_step(m, membership, src)
    if m.job.config.protection.enabled and not src.roles.reshard:  # the keepers set up while the state is decoded
        m.publish_layout(gen, recipe.step, src.layout.geometry.n_chunks)
    phases.done("agree_on_step")
    t_decode = time.time()
    point = bring_to_step(m, gen, src, recipe, held, holder)
    phases.done("bring_to_step")
    rb, point, repaired = decode(m, gen, membership, src, point)
    phases.done("decode")
    shard = install(m, gen, src, rb, point)
    phases.done("install")
    restore_s = time.time() - t_decode
    t_protect = time.time()
    reprotect(m, gen, point.step, shard)
    phases.done("reprotect")
    return record(
        m,
        RecoveryRecord(
            generation=gen,
            failed_ranks=src.roles.lost,
            failed_nodes=membership.failed_nodes,
            cause=membership.cause,
            tier=point.membership.tier,
            step=point.step,
            world_size=m.world_size,
            restore_s=round(restore_s, 4),
            protect_s=round(time.time() - t_protect, 4),
            join_s=round(time.time() - t0, 4),
            decode_start_s=round(t_decode - t0, 4),
            resharded=src.roles.reshard,
            repaired=tuple(repaired),
            phases_s=phases.spent,
        ),
    )


class _Phases:
    """How long each named phase of a join took (the recovery record's `phases_s`)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self._last = time.time()

    def done(self, name: str) -> None:
        now = time.time()
        trace.mark(f"join_{name}")
        self.spent[name] = round(now - self._last, 4)
        self._last = now


def enter(m: Member, gen: int) -> Membership:
    """Become a member of generation `gen` (its membership must name this process)."""
    membership = read_membership(m.job.store, gen)
    m.enter(gen, membership)
    return membership


def read_reports(m: Member, gen: int) -> dict[int, KeeperReport]:
    """The drained reports of the keepers of generation `gen - 1` that hold protection data
    (a new keeper holds nothing yet), by node."""
    store = m.job.store
    drain = read_message(store, Drain.from_json, keys.drain(gen - 1)) if store.check([keys.drain(gen - 1)]) else None
    if drain is None:
        raise RecoveryError(f"generation {gen} has no protection to rebuild from (protection off?)")
    live = drain.live_nodes
    _wait_keys(m, [keys.report(gen - 1, n) for n in live], f"keeper reports of generation {gen - 1}")
    reports = {}
    for n in live:
        key = keys.report(gen - 1, n)
        value = store.get(key)
        try:
            reports[n] = KeeperReport.from_json(value, key)
        except BadValue as e:  # that node's protection is not used: the others may still cover its loss
            _refused.refuse(e, value)
    return {n: r for n, r in reports.items() if not r.empty}


def read_message(store: torch.distributed.Store, parse: Callable[[bytes, str], T], key: str) -> T:
    """A message a recovery cannot do without: a malformed one fails the recovery (one line)."""
    try:
        return parse(store.get(key), key)
    except BadValue as e:
        raise RecoveryError(f"malformed value of {e}") from None


def protection_source(m: Member, membership: Membership, reports: dict[int, KeeperReport]) -> Source:
    """The generation whose protection the keepers hold, its layout and who wrote what; the
    state is laid out to match it (a staged reshard settles, a shadow built for another world
    size reallocates)."""
    store = m.job.store
    used = {r.generation_used for r in reports.values()}
    if len(used) != 1:
        raise RecoveryError(f"keepers report different protection generations {sorted(used)}")
    used_gen = used.pop()
    m.sharded.settle_reshard(used_gen)
    layout = read_message(store, Layout.from_json, keys.layout(used_gen))
    # the writers of the protection data
    roles = assign_roles(read_membership(store, used_gen), membership, m.replica_ranks)
    me = roles.old_rank_of.get(m.rank)
    if me is None and not roles.reshard and m.sharded.geometry != layout.geometry:
        # a shadow built for another world size adopts a rank
        m.sharded.allocate(layout.world_size // m.replica_ranks)
    if me is not None and m.sharded.geometry != layout.geometry:
        raise RecoveryError(
            f"rank {m.rank} holds its shard in geometry {m.sharded.geometry}, the protection data "
            f"of generation {used_gen} has {layout.geometry}"
        )
    return Source(layout, reports, roles, me)


def agree_on_step(m: Member, membership: Membership, src: Source) -> tuple[RebuildRecipe, int, int]:
    """The recovery step every member is rebuilt at (docs/protection.md, "Recovery point") and
    who rebuilds what. Returns the recipe, the latest step whose whole reduced gradient a member
    holds (-1: none) and the lowest member holding it."""
    held, holder = _held_gradients(m, src.layout)
    return make_recipe(src.layout, membership, src.reports, src.roles, held=held), held, holder


def bring_to_step(m: Member, gen: int, src: Source, recipe: RebuildRecipe, held: int, holder: int) -> Point:
    """Everything but the lost shards at the recovery step: the replicated gradients of it
    shared from `holder`, module buffers and registered state restored, a survivor's own shard
    finished."""
    T, g = recipe.step, src.layout.geometry
    grads = _share_grads(m, src.layout, T, holder) if T == held >= 0 else None
    if grads is None:  # what the gradient buffer holds is no step the new generation starts from
        m.sharded.grad_step = None
    m.restore_rank_state(T, _lineage(m.job.store, gen, m.rank, m.job.proc_id, src.roles))

    def lost_grad(r: int, c: int) -> torch.Tensor:  # lost rank r's gradient chunk c of step T (its slice's)
        lo = (r // m.replica_ranks * g.n_chunks + c) * g.chunk_elems
        return grads[lo : lo + g.chunk_elems]

    if src.me is not None:
        try:
            m.sharded.bring_to(T)
        except RecoveryError as e:
            if grads is not None or src.layout.protects_grads or m.replica_ranks == 1:
                raise
            raise RecoveryError(
                f"{e}; no member holds the gradient of step {T} of every model slice (it is replicated "
                f"within a slice and lost with the ranks that held it; --protect-grads on protects it)"
            ) from None
    return Point(recipe, held, lost_grad if grads is not None else None)


def decode(
    m: Member, gen: int, membership: Membership, src: Source, point: Point
) -> tuple[Rebuilder, Point, list[str]]:
    """Rebuild the lost ranks' chunks at the recovery step; tier-1 data that fails its checks
    is rebuilt again from tier 2 (and so are the stripes that read a rank it rebuilt, whose
    decode failed with it). Returns the rebuilder holding them, the recipe that succeeded and
    what was repaired; raises when no redundancy is left for corrupt data."""
    layout, recipe, repaired, attempt = src.layout, point.membership, [], 0
    while True:
        tag = f".{attempt}"
        rb = Rebuilder(
            layout,
            recipe,
            src.reports,
            m.rank,
            m.job.job_id,
            m.sharded.chunk_at,
            m.sharded.grad_at,
            m.comm,
            # a retry's groups are new ones: the first attempt's stay alive (`_subgroup`), and a
            # rendezvous under the same name would read their addresses
            lambda name, members, tag=tag: _subgroup(m, gen, name + tag, members),
        )
        rb.run()
        bad = _agree_on_corruption(m, layout, rb.corrupt)
        if not bad["tier1"] and not bad["tier2"]:
            return rb, replace(point, membership=recipe), repaired + rb.notes
        if set(bad["tier1"]) <= set(recipe.force_tier2) or layout.tier2 is None:
            what = ", ".join(
                [f"tier-1 data of node {n}" for n in bad["tier1"]] + [f"tier-2 stripe {s}" for s in bad["tier2"]]
            )
            raise RecoveryError(
                f"decoded state failed its checksums or version checks ({what}) and no other redundancy "
                f"is left: stopping rather than continue on corrupt state"
            )
        repaired += [f"tier-1 data of node {n} failed its checksums; rebuilt from tier 2" for n in bad["tier1"]]
        recipe = make_recipe(
            layout, membership, src.reports, src.roles, frozenset(bad["tier1"]) | recipe.force_tier2, point.held
        )
        attempt += 1


def install(m: Member, gen: int, src: Source, rb: Rebuilder, point: Point) -> torch.Tensor | None:
    """Hold the state at the recovery step: the adopted shards and every rank's parameters; or,
    when the new generation shards differently, stage this rank's new shard (returned) until
    its protection commits."""
    T, g, s = point.step, src.layout.geometry, m.sharded
    if src.roles.reshard:
        shard, params = _reshard(m, src, rb, T, point.grad_of)
        s.stage_reshard(gen, m.dp_size, m.dp_rank, shard, params, T)
        return shard
    for r, q in src.roles.holder.items():
        if q == m.rank and r in src.roles.lost:
            shard = rb.shard_at(r, g.n_chunks, g.chunk_elems, s.update_chunk, point.grad_of, r // m.replica_ranks)
            s.install(shard, T, m.dp_rank)
    s.step = T
    s.gather_params(m.dp_comm)
    return None


def reprotect(m: Member, gen: int, step: int, staged: torch.Tensor | None) -> None:
    """Protect the new generation from the state at `step`. A staged reshard is protected
    before it replaces the old shard; otherwise the commit is awaited by the next step,
    overlapping its forward pass."""
    if staged is not None:
        m.protect(gen, step, staged)
        m.sharded.settle_reshard(gen)
    elif m.job.config.protection.enabled:
        m.protect(gen, step, wait=False)


def record(m: Member, rec: RecoveryRecord) -> RecoveryRecord:
    """Publish the recovery record (rank 0) for the controller; returns it."""
    if m.rank == 0:
        m.job.store.set(keys.recovery(rec.generation), rec.to_json())
    return rec


def _wait_keys(m: Member, names: list[str], what: str) -> None:
    why = await_keys(m.job.store, names, m.job.timeout_s, m.watch.reason if m.watch is not None else lambda: None)
    if why is None:
        return
    if m.watch is not None and m.watch.reason():
        raise PeerFailure(f"waiting for {what}: {why}")
    raise RecoveryError(f"{why} waiting for {what}")


def _lineage(store, gen: int, rank: int, proc_id: str, roles: Roles) -> list[str]:
    """The processes whose per-rank state this one continues: itself, then (adopting a rank at
    the same world size) whoever held its rank in earlier generations, newest first."""
    if roles.reshard:
        return [proc_id]
    procs = [proc_id]
    for g in range(gen - 1, -1, -1):
        p = read_membership(store, g).proc_of_rank
        if rank < len(p) and p[rank] not in procs:
            procs.append(p[rank])
    return procs


def _settled_generation(m: Member) -> int:
    """The last generation this process completed joining (0: an original worker; -1: none)."""
    if m.recoveries:
        return m.recoveries[-1].generation
    return 0 if read_membership(m.job.store, 0).rank_of(m.job.proc_id) is not None else -1


def _rejoin_intact(m: Member, gen: int, membership: Membership, t0: float) -> RecoveryRecord:
    """Join generation `gen` with no keeper data at all (every keeper died or is new: a one-node
    job, or the last node's keeper): possible only when every member holds its own state, i.e.
    all settled in one generation with the same processes in the same ranks, nothing resharding.
    The members agree on a step each can reach from what it holds, finish it, and protect the new
    generation from their own shards (a new base, like the initial protection)."""
    T = _agree_on_own_step(m, membership)
    m.restore_rank_state(T, [m.job.proc_id])  # same processes in the same ranks
    t_restore = time.time()
    m.sharded.bring_to(T)
    m.sharded.step = T
    m.sharded.gather_params(m.dp_comm)
    restore_s = time.time() - t_restore
    t_protect = time.time()
    m.protect(gen, T, wait=False)
    return record(
        m,
        RecoveryRecord(
            generation=gen,
            failed_ranks=(),
            failed_nodes=membership.failed_nodes,
            cause=membership.cause,
            tier="none",
            step=T,
            world_size=m.world_size,
            restore_s=round(restore_s, 4),
            protect_s=round(time.time() - t_protect, 4),
            join_s=round(time.time() - t0, 4),
            decode_start_s=round(t_restore - t0, 4),
            rebuilt_from="the workers' own state (no keeper data)",
        ),
    )


def _agree_on_own_step(m: Member, membership: Membership) -> int:
    """With no keeper data: check that every member holds its own state in one generation and
    agree on a step all can reach (sharing the replicated gradients of it where needed)."""
    s = m.sharded
    settled = _settled_generation(m)
    layout = read_message(m.job.store, Layout.from_json, keys.layout(settled)) if settled >= 0 else None
    reach = set() if s.inplace else s.reachable_steps()
    fits = (
        layout is not None
        and not s.resharding
        and s.geometry == layout.geometry
        and read_membership(m.job.store, settled).proc_of_rank == membership.proc_of_rank
        and (s.inplace or bool(reach))
    )
    low = -1 if not fits else min(s.chunk_step) if s.inplace else min(reach)
    agree = torch.tensor([settled, -settled, 1 if fits else 0, low], dtype=torch.int64)
    m.comm.all_reduce(agree, torch.distributed.ReduceOp.MIN)
    if int(agree[0]) != -int(agree[1]) or int(agree[2]) != 1:
        raise RecoveryError(
            "no keeper holds committed protection data, and not every member holds its own state "
            "in one generation: nothing to rebuild from"
        )
    if not s.inplace:
        return _common_step(m, int(agree[3]), reach)
    # the replicated-gradient rule of `recovery_step`, from the members' own chunk versions
    held, holder = _held_gradients(m, layout)
    T = recovery_step({-1: KeeperReport(-1, applied=int(agree[3]))}, layout, held)
    if T == held >= 0:
        _share_grads(m, layout, T, holder)
    return T


def _common_step(m: Member, low: int, reach: set[int]) -> int:
    """The latest step every member can reach: one BAND all-reduce of bit masks from `low`."""
    bits = torch.tensor([sum(1 << (s - low) for s in reach if 0 <= s - low < 62)], dtype=torch.int64)
    m.comm.all_reduce(bits, torch.distributed.ReduceOp.BAND)
    if int(bits.item()) == 0:
        raise RecoveryError("no keeper holds committed protection data and the members hold no common step")
    return low + int(bits.item()).bit_length() - 1


def _reshard(
    m: Member, src: Source, rb: Rebuilder, T: int, grad_of: GradOf | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every shard of this rank's slice in the old layout at step T, exchanged through one BXOR
    all-reduce over the slice's DP group (each is held by exactly one of its processes; XOR with
    zeros keeps every bit, -0.0 included), then cut into this rank's shard of the new DP size.
    Returns (new shard, all parameters of the slice)."""
    layout, s, k = src.layout, m.sharded, m.replica_ranks
    g = layout.geometry
    mine = m.rank % k  # the slice: a resize moves whole replicas, so it keeps its coordinates
    full = torch.zeros(layout.world_size // k, g.n_chunks, 3, g.chunk_elems)
    if src.me is not None:
        if src.me % k != mine:
            raise RecoveryError(f"rank {m.rank} holds slice {src.me % k} of the old layout, not {mine}")
        full[src.me // k].copy_(s.state_at(T))
    for r in src.roles.lost:
        if src.roles.holder[r] == m.rank:
            if r % k != mine:
                raise RecoveryError(f"rank {m.rank} holds slice {mine}, asked to rebuild rank {r} of slice {r % k}")
            full[r // k].copy_(rb.shard_at(r, g.n_chunks, g.chunk_elems, s.update_chunk, grad_of, r // k))
    m.dp_comm.all_reduce(full.view(torch.int32), torch.distributed.ReduceOp.BXOR)
    return s.cut(full, m.dp_size, m.dp_rank)


def _held_gradients(m: Member, layout: Layout) -> tuple[int, int]:
    """Where gradients are replicated, not protected: the latest step whose whole reduced
    gradient (of every slice) a member holds (-1: none) and the lowest member holding this
    rank's slice's (one all-reduce). Slices holding different steps hold none in common: the
    step's update started nowhere (see `Trainer._step`), so it is redone."""
    if layout.protects_grads or layout.protect_every > 1:
        return -1, -1
    W, s, k = m.world_size, m.sharded, m.replica_ranks
    mine = s.grad_step if s.grad_step is not None and s.geometry == layout.geometry else -1
    keys_ = torch.full((k,), -1, dtype=torch.int64)
    keys_[m.rank % k] = mine * W + (W - 1 - m.rank) if mine >= 0 else -1
    m.comm.all_reduce(keys_, torch.distributed.ReduceOp.MAX)
    got = keys_.tolist()
    if min(got) < 0 or len({g // W for g in got}) != 1:
        return -1, -1
    top = got[m.rank % k]
    return top // W, W - 1 - top % W


def _share_grads(m: Member, layout: Layout, step: int, holder: int) -> torch.Tensor:
    """The whole reduced gradient of `step` of this rank's slice, broadcast over its DP group
    from `holder` (a world rank holding it)."""
    shards = layout.world_size // m.replica_ranks
    return m.sharded.receive_grads(m.dp_comm, layout.geometry, shards, step, holder // m.replica_ranks)


def _agree_on_corruption(m: Member, layout: Layout, corrupt: set[tuple[str, int]]) -> dict[str, list[int]]:
    """Only the adopter can check a decoded chunk; everyone must learn what failed."""
    n_stripes = len(layout.tier2[1]) if layout.tier2 else 0
    flags = torch.zeros(len(layout.nodes) + n_stripes, dtype=torch.int32)
    for kind, idx in corrupt:
        flags[layout.nodes.index(idx) if kind == "tier1" else len(layout.nodes) + idx] = 1
    m.comm.all_reduce(flags, torch.distributed.ReduceOp.MAX)
    return {
        "tier1": [layout.nodes[i] for i in range(len(layout.nodes)) if flags[i]],
        "tier2": [i for i in range(n_stripes) if flags[len(layout.nodes) + i]],
    }


def _subgroup(m: Member, gen: int, name: str, members: tuple[int, ...]) -> Comm:
    """A group of some of the generation's ranks, kept with the generation's own groups."""
    comm = Comm(
        m.job.store,
        gen,
        members.index(m.rank),
        len(members),
        m.job.timeout_s,
        m.watch.reason,
        m.job.device,
        name=name,
        backend=m.comm.backend,
    )
    m.side_comms.append(comm)
    return comm
