"""Rebuild lost ranks' state from the protection tiers, inside the running processes.

Every member of the new generation computes the same recipe from the same inputs (the old
layout, the keepers' drained reports, the new membership) and joins the same sequence of BXOR
all-reduces: each contributes the blocks it holds, scaled by its decode coefficient, and the
adopter of a lost rank keeps the result. See docs/protection.md ("Recovery point").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from leto.protection.codec import UnrecoverableError, scale_into, xor_into
from leto.protection.integrity import checksum
from leto.protection.layout import Layout
from leto.protection.placement import Stripe
from leto.protection.shm import Region
from leto.protection.staging import as_bytes
from leto.protocol.messages import Membership
from leto.protocol.protection import KeeperReport, StripeReport
from leto.runtime.comm import Comm


class RecoveryError(RuntimeError):
    """The lost state cannot be rebuilt exactly; the job must stop rather than go on wrong."""


def recovery_step(reports: dict[int, KeeperReport], layout: Layout, held: int = -1) -> int:
    """The one step every rank is rebuilt at (docs/protection.md, "Recovery point"; with
    `protect_every` > 1, "Protection interval": the last step every surviving keeper holds whole).
    `held`: the latest step whose whole reduced gradient a member of the new generation holds
    (-1: none), which decides where gradients are not protected but replicated."""
    if not reports:
        raise RecoveryError("no keeper survived: there is no protection data to rebuild from")
    if layout.protect_every > 1:
        return min(r.applied for r in reports.values())
    if not layout.protects_grads:  # replicated gradients ("Recovery point")
        applied = min(r.applied for r in reports.values())
        if held < applied and held != -1 or held > applied + 1:
            raise RecoveryError(
                f"inconsistent recovery point: gradients of step {held} held, every delta of step {applied} applied"
            )
        return max(held, applied)
    c = max(r.g_commit for r in reports.values())
    if all(c + 1 in r.grads_complete for r in reports.values()):
        return c + 1
    return c


def _replay_needed(reports: dict[int, KeeperReport], step: int) -> bool:
    """Does any recorded chunk version lag the recovery step (so its update must be replayed)?"""
    if step < 1:  # nothing before step 0 to replay (and -1 marks chunks never written)
        return False
    for r in reports.values():
        rows = list(r.v1 or [])
        for st in (r.stripes or {}).values():
            rows += st.v2 or []
        if any(v == step - 1 for row in rows for v in row):
            return True
    return False


@dataclass(frozen=True)
class Roles:
    """Who is who between the generation that wrote the protection data (old ranks, the layout's
    numbering) and the new generation (new ranks, the process group's numbering)."""

    old_rank_of: dict[int, int]  # new rank -> the old rank it wrote (survivors only)
    holder: dict[int, int]  # old rank -> new rank that holds its state after the rebuild
    lost: tuple[int, ...]  # old ranks whose writer is gone
    reshard: bool  # the new generation shards the state differently


def assign_roles(writers: Membership, new: Membership, replica_ranks: int = 1) -> Roles:
    """Survivors keep their own shard; a newcomer at a lost rank's number adopts it (same world
    size: no resharding). Otherwise (shrink, grow) the lost shards are decoded by survivors (one
    on the same node preferred: node-local tier-1 traffic) and the whole state is resharded;
    with model parallelism (`replica_ranks` = tp x pp > 1) by a survivor holding the same slice
    of the model (rank % replica_ranks)."""
    old_rank_of = {
        q: writers.proc_of_rank.index(p) for q, p in enumerate(new.proc_of_rank) if p in writers.proc_of_rank
    }
    holder = {r: q for q, r in old_rank_of.items()}
    lost = tuple(r for r in range(len(writers.proc_of_rank)) if r not in holder)
    newcomers = [q for q in range(len(new.proc_of_rank)) if q not in old_rank_of]
    identity = (
        len(new.proc_of_rank) == len(writers.proc_of_rank)
        and set(newcomers) == set(lost)
        and all(old_rank_of.get(q, q) == q for q in range(len(new.proc_of_rank)))
    )
    if identity:
        holder.update({r: r for r in lost})
        return Roles(old_rank_of, holder, lost, False)
    candidates = sorted(old_rank_of) or newcomers
    load = dict.fromkeys(candidates + newcomers, 0)
    for r in lost:
        k = replica_ranks
        same_slice = [q for q in candidates if q % k == r % k] or [q for q in newcomers if q % k == r % k]
        if not same_slice:
            raise RecoveryError(f"no member of the new generation holds slice {r % k} of lost rank {r}")
        q = min(same_slice, key=lambda q: (new.node_of_rank[q] != writers.node_of_rank[r], load[q], q))
        holder[r] = q
        load[q] += 1
    return Roles(old_rank_of, holder, lost, True)


@dataclass(frozen=True)
class Tier1Job:
    node: int
    lost_rank: int  # old rank
    members: tuple[int, ...]  # new-generation ranks in the decode group (sorted)
    reader: int  # member that reads the keeper's shared memory
    holder: int  # member that keeps the decoded state


@dataclass(frozen=True)
class Tier2Job:
    stripe: Stripe
    chosen: tuple[int, ...]  # block indices used
    coeffs: dict[int, list[int]]  # missing data block -> coefficient per chosen block
    readers: dict[int, int]  # parity block index -> new-generation rank that reads it


@dataclass
class RebuildRecipe:
    step: int
    roles: Roles
    tier1: list[Tier1Job]
    tier2: list[Tier2Job]
    force_tier2: frozenset[int] = frozenset()

    @property
    def lost(self) -> tuple[int, ...]:
        return self.roles.lost

    @property
    def tier(self) -> str:
        """What rebuilt the lost ranks: "tier1", "tier2", both ("tier1+tier2": a rank lost inside
        one node and another node lost together) or "none"."""
        return "+".join(t for t, jobs in (("tier1", self.tier1), ("tier2", self.tier2)) if jobs) or "none"


def make_recipe(
    layout: Layout,
    new: Membership,
    reports: dict[int, KeeperReport],
    roles: Roles,
    force_tier2: frozenset[int] = frozenset(),
    held: int = -1,
) -> RebuildRecipe:
    """Which tier rebuilds which lost rank, and who contributes. A node that lost one rank and
    kept its keeper rebuilds it from tier 1; every other lost rank is decoded from tier 2, where
    a rank rebuilt from tier 1 counts as present (its holder contributes it: the tiers together
    cover a rank lost in one node and another whole node). Nodes in `force_tier2` are rebuilt
    from tier 2 (their tier-1 data failed its checksums); `held` as in `recovery_step`.
    RecoveryError, naming what was lost, when the tiers together cannot rebuild it."""
    step = recovery_step(reports, layout, held)
    lost = roles.lost
    tier1, t2_nodes = [], set()
    for n in layout.nodes:
        lost_here = [r for r in layout.local_ranks(n) if r in lost]
        if not lost_here:
            continue
        readers = [q for q, node in enumerate(new.node_of_rank) if node == n]
        if n in reports and len(lost_here) == 1 and readers and n not in force_tier2:
            holder = roles.holder[lost_here[0]]
            tier1.append(Tier1Job(n, lost_here[0], tuple(sorted(set(readers) | {holder})), readers[0], holder))
        else:
            t2_nodes.add(n)
    from_tier1 = {job.lost_rank for job in tier1}
    t2_lost = tuple(r for r in lost if r not in from_tier1)
    tier2 = _tier2_jobs(layout, new, reports, t2_lost, lost) if t2_nodes else []
    return RebuildRecipe(step, roles, tier1, tier2, force_tier2)


def what_was_lost(layout: Layout, reports: dict[int, KeeperReport], lost: tuple[int, ...]) -> str:
    """The lost ranks and keepers, by node: "rank 1 of node 0 and node 1 (ranks 2, 3, its keeper)"."""
    parts = []
    for n in layout.nodes:
        ranks = [r for r in layout.local_ranks(n) if r in lost]
        keeper = n not in reports
        if not ranks and not keeper:
            continue
        names = (f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}") if ranks else ""
        if ranks and len(ranks) == len(layout.local_ranks(n)) and keeper:
            parts.append(f"node {n} ({names}, its keeper)")
        elif ranks:
            parts.append(f"{names} of node {n}" + (" and its keeper" if keeper else ""))
        else:
            parts.append(f"the keeper of node {n}")
    return " and ".join(parts) if len(parts) <= 2 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _tier2_jobs(
    layout: Layout,
    new: Membership,
    reports: dict[int, KeeperReport],
    lost: tuple[int, ...],
    every_lost: tuple[int, ...],
) -> list[Tier2Job]:
    """The stripe decodes of the ranks `lost` to tier 2 (`every_lost`: those and the ranks tier 1
    rebuilds, for the message when the stripes cannot)."""
    if layout.tier2 is None:
        raise RecoveryError(
            f"lost {what_was_lost(layout, reports, every_lost)}: beyond what tier 1 rebuilds (one rank per node "
            f"whose keeper lives), and tier 2 is off ({'--ec none' if layout.ec is None else 'too few nodes for --ec'})"
        )
    code, stripes = layout.tier2
    L = layout.segment_len
    jobs, short = [], []
    dead_keepers = {n for n in layout.nodes if n not in reports}
    for s in stripes:
        present, needed = [], False
        for p, dn in enumerate(s.data_nodes):
            node, seg = layout.nodes[dn], s.segment_of(dn)
            srcs = [layout.source_of(node, seg * L + i) for i in range(L)]
            if any(src is not None and src[0] in lost for src in srcs):
                needed = True
            else:
                present.append(p)
        if not needed:
            continue
        readers = {}
        for j, pn in enumerate(s.parity_nodes):
            node = layout.nodes[pn]
            on_node = [r for r, n in enumerate(new.node_of_rank) if n == node]
            if node not in dead_keepers and on_node:
                readers[code.k + j] = on_node[0]
                present.append(code.k + j)
        try:
            chosen, coeffs = code.recovery_coefficients(present)
        except UnrecoverableError:
            gone = [layout.nodes[i] for b, i in enumerate(s.nodes) if b not in present]
            short.append(f"stripe {s.index} lost nodes {', '.join(map(str, gone))}")
            continue
        jobs.append(Tier2Job(s, tuple(chosen), coeffs, {b: readers[b] for b in chosen if b >= code.k}))
    if short:
        raise RecoveryError(
            f"lost {what_was_lost(layout, reports, every_lost)}: more than the tiers together rebuild "
            f"(tier 1: one rank of a node whose keeper lives; tier 2 {code.k}+{code.m}: {code.m} node(s) of a "
            f"stripe, and {'; '.join(short)})"
        )
    return jobs


def torn_offsets(layout: Layout, s: Stripe, reports: dict[int, StripeReport]) -> set[int]:
    """Offsets of stripe `s` where the parity blocks in `reports` (block -> that parity node's
    stripe report) folded different versions of some data block (an update reached one parity
    node and not the other): decoding them together there would be garbage, so those chunks
    are refused by name, not by a checksum's luck. Padding offsets carry no version."""
    L = layout.segment_len
    torn = set()
    for i in range(L):
        for d, dn in enumerate(s.data_nodes):
            if layout.source_of(layout.nodes[dn], s.segment_of(dn) * L + i) is None:
                continue
            if len({r.v2[d][i] for r in reports.values()}) > 1:
                torn.add(i)
    return torn


class Rebuilder:
    """Runs a `RebuildRecipe` in one process of the new generation."""

    def __init__(
        self,
        layout: Layout,
        recipe: RebuildRecipe,
        reports: dict[int, KeeperReport],
        rank: int,
        job_id: str,
        chunk: Callable[[int, int], torch.Tensor],
        grad: Callable[[int, int], torch.Tensor],
        comm: Comm,
        subgroup: Callable[[str, tuple[int, ...]], Comm],
    ) -> None:
        self.layout, self.recipe, self.reports, self.rank, self.job_id = layout, recipe, reports, rank, job_id
        self.chunk, self.grad = chunk, grad  # (version step, chunk index) -> this rank's own data
        self.comm, self.subgroup = comm, subgroup
        self.regions: dict[int, Region] = {}
        self.me = recipe.roles.old_rank_of.get(rank)  # the old rank this process wrote, if any
        g = layout.geometry
        # (old rank, chunk) -> decoded bytes, kept by the holder of that lost rank
        self.result_state: dict[tuple[int, int], np.ndarray] = {}
        self.result_version: dict[tuple[int, int], int] = {}
        self.result_grad: dict[tuple[int, int], np.ndarray] = {}
        # (old rank, chunk) -> gradient of the recovery step decoded from tier 1, and its checksum
        self.rebuilt_grad: dict[tuple[int, int], tuple[np.ndarray, int]] = {}
        self.corrupt: set[tuple[str, int]] = set()  # ("tier1", node) / ("tier2", stripe) that failed checksums
        self.notes: list[str] = []  # what was decoded another way (torn tier-2 rows)
        self.interval = layout.protect_every > 1  # state only, all at the recovery step; no replay
        # gradients of the recovery step are decoded only to replay chunks one step behind; at a
        # generation's base (a failure right after a recovery) no gradients of it were staged
        self.grads = layout.protects_grads and _replay_needed(reports, recipe.step)
        self.sb, self.gb = g.state_bytes, g.grad_bytes if self.grads else 0

    def _region(self, node: int) -> Region:
        if node not in self.regions:
            self.regions[node] = Region(self.layout, self.job_id, node, create=False)
        return self.regions[node]

    def run(self) -> None:
        for job in self.recipe.tier1:
            if self.rank in job.members:
                self._tier1(job)
        for job in self.recipe.tier2:
            self._tier2(job)
        for r in self.regions.values():
            r.close()

    # ----- tier 1: P1 XOR the node's survivors, node-local group
    def _tier1(self, job: Tier1Job) -> None:
        lay, T = self.layout, self.recipe.step
        n = lay.geometry.n_chunks
        rep = self.reports[job.node]
        w_lost = lay.local_index(job.lost_rank)
        b = T % 2
        pre = (
            [
                self._from_preimage([v[c] for v in rep.v1], rep.pre_step[c], f"node {job.node} chunk {c}")
                for c in range(n)
            ]
            if self.interval
            else [False] * n
        )
        buf = torch.zeros(n, self.sb + self.gb, dtype=torch.uint8)
        acc = buf.numpy()
        if self.rank == job.reader:
            region = self._region(job.node)
            if self.interval:
                for c in range(n):
                    acc[c] ^= region["p1_pre" if pre[c] else "p1"][c]
            else:
                acc[:, : self.sb] ^= region["p1"]
            if self.grads:
                if any(s != T for s in region["g1_step"][b]):
                    raise RecoveryError(f"tier-1 gradients of step {T} on node {job.node} are incomplete")
                acc[:, self.sb :] ^= region["g1"][b]
        if self.me is not None and lay.node_of_rank[self.me] == job.node:
            w = lay.local_index(self.me)
            for c in range(n):
                v = T if self.interval else rep.v1[w][c]
                xor_into(acc[c, : self.sb], as_bytes(self.chunk(v, c)))
                if self.grads:
                    xor_into(acc[c, self.sb :], as_bytes(self.grad(T, c)))
        comm = self.subgroup(f"t1n{job.node}", job.members)
        comm.all_reduce(buf, dist.ReduceOp.BXOR)
        if self.rank == job.holder:
            for c in range(n):
                if self.interval:
                    version, crc, gcrc = T, (rep.crc_pre if pre[c] else rep.crc1)[w_lost][c], 0
                else:
                    version, crc = rep.v1[w_lost][c], rep.crc1[w_lost][c]
                    gcrc = rep.gcrc1[w_lost][b][c] if self.grads else 0
                if not self._keep(job.lost_rank, c, acc[c, : self.sb], version, crc, acc[c, self.sb :], gcrc):
                    self.corrupt.add(("tier1", job.node))
                elif self.grads:  # a tier-2 decode may need it as a surviving data block
                    self.rebuilt_grad[job.lost_rank, c] = (acc[c, self.sb :].copy(), rep.gcrc1[w_lost][b][c])

    # ----- tier 2: Reed-Solomon stripe decode over the whole new group
    def _tier2(self, job: Tier2Job) -> None:
        lay, T = self.layout, self.recipe.step
        L, k = lay.segment_len, lay.tier2[0].k
        s, b = job.stripe, T % 2
        reps = {
            k + j: self.reports[lay.nodes[pn]].stripes[s.index]
            for j, pn in enumerate(s.parity_nodes)
            if k + j in job.readers
        }
        first = next(iter(reps))
        rep = reps[first]
        # the step each offset is decoded at, and which offsets each parity block reads from its
        # pre-image: under an interval, T; a torn offset, T-1 from pre-images (then replayed);
        # elsewhere the versions every parity row agrees on
        torn = set() if self.interval else torn_offsets(lay, s, reps)
        at = {i: T for i in range(L)} if self.interval else {i: T - 1 for i in torn} if lay.tier2_preimages else {}
        pre = {blk: self._stripe_preimage(s, r, at) for blk, r in reps.items()}
        if torn and lay.tier2_preimages:
            self.notes.append(
                f"tier-2 stripe {s.index} offsets {sorted(torn)}: parity rows torn by the loss; "
                f"decoded at step {T - 1} from their pre-images and replayed"
            )
        missing = sorted(job.coeffs)
        buf = torch.zeros(len(missing), L, self.sb + self.gb, dtype=torch.uint8)
        acc = buf.numpy()
        for bi, blk in enumerate(job.chosen):
            if blk < k:  # a surviving data node's segment: each source rank adds its own chunks
                node = lay.nodes[s.data_nodes[blk]]
                seg = s.segment_of(s.data_nodes[blk])
                for i in range(L):
                    src = lay.source_of(node, seg * L + i)
                    held = None if src is None else self._held_chunk(src, at.get(i, rep.v2[blk][i]))
                    if held is None:
                        continue
                    data, grad = held
                    for mi, e in enumerate(missing):
                        scale_into(acc[mi, i, : self.sb], job.coeffs[e][bi], data)
                        if grad is not None:
                            scale_into(acc[mi, i, self.sb :], job.coeffs[e][bi], grad)
            elif job.readers[blk] == self.rank:
                j = blk - k
                region = self._region(lay.nodes[s.parity_nodes[j]])
                p2 = region[f"p2_{s.index}"]
                rows = (
                    [region[f"p2_{s.index}_pre"][i] if pre[blk][i] else p2[i] for i in range(L)]
                    if any(pre[blk])
                    else p2
                )
                g2 = region[f"g2_{s.index}"][b] if self.grads else None
                for mi, e in enumerate(missing):
                    for i in range(L):
                        scale_into(acc[mi, i, : self.sb], job.coeffs[e][bi], rows[i])
                        if g2 is not None:
                            scale_into(acc[mi, i, self.sb :], job.coeffs[e][bi], g2[i])
        self.comm.all_reduce(buf, dist.ReduceOp.BXOR)
        for mi, e in enumerate(missing):
            node = lay.nodes[s.data_nodes[e]]
            seg = s.segment_of(s.data_nodes[e])
            for i in range(L):
                src = lay.source_of(node, seg * L + i)
                if src is None or src[0] not in self.recipe.lost or self.recipe.roles.holder[src[0]] != self.rank:
                    continue
                if i in torn and not lay.tier2_preimages:
                    self.corrupt.add(("tier2", s.index))
                    continue
                if i in at:
                    version, crc = at[i], (rep.crc_pre if pre[first][i] else rep.crc2)[e][i]
                    gcrc = rep.gcrc2[e][b][i] if self.grads and version == T - 1 else 0
                else:
                    version, crc = rep.v2[e][i], rep.crc2[e][i]
                    gcrc = rep.gcrc2[e][b][i] if self.grads else 0
                if not self._keep(src[0], src[1], acc[mi, i, : self.sb], version, crc, acc[mi, i, self.sb :], gcrc):
                    self.corrupt.add(("tier2", s.index))

    def _held_chunk(self, src: tuple[int, int], v: int) -> tuple[np.ndarray, np.ndarray | None] | None:
        """Chunk `src` (old rank, chunk) at version `v` and its gradient of the recovery step, if
        this process holds them: its own, or a lost rank's it rebuilt from tier 1 (which then
        stands in for it in the stripe). None otherwise; a rebuilt chunk at another version than
        the stripe folded, or whose gradient fails its checksum, is left out, so the stripe's
        decode fails its checks rather than go on wrong."""
        T = self.recipe.step
        r, c = src
        if r == self.me:
            return as_bytes(self.chunk(v, c)), as_bytes(self.grad(T, c)) if self.grads else None
        if (r, c) not in self.result_state or self.recipe.roles.holder.get(r) != self.rank:
            return None
        if self.result_version[r, c] != v:
            return None
        if not self.grads:
            return self.result_state[r, c], None
        grad, gcrc = self.rebuilt_grad[r, c]
        return (self.result_state[r, c], grad) if checksum(grad) == gcrc else None

    # ----- protection interval: every parity row at the recovery step, current or pre-image
    def _from_preimage(self, versions: list[int], pre_step: int, where: str, step: int | None = None) -> bool:
        """Whether a parity row's state at `step` (default: the recovery step) is its pre-image
        (some source has already folded in a later step) rather than the row itself (every
        source at `step`)."""
        T = self.recipe.step if step is None else step
        if all(v == T for v in versions):
            return False
        if pre_step == T and min(versions) >= T:
            return True
        raise RecoveryError(
            f"{where}: no parity at step {T} (sources at steps {sorted(set(versions))}, pre-image at step {pre_step})"
        )

    def _stripe_preimage(self, s: Stripe, rep: StripeReport, at: dict[int, int]) -> list[bool]:
        """Per offset of stripe `s`: whether this parity row is read from its pre-image to be at
        step `at[offset]` (offsets not in `at` read the row as it is)."""
        lay, L = self.layout, self.layout.segment_len
        out = []
        for i in range(L):
            if i not in at:
                out.append(False)
                continue
            versions = [
                rep.v2[p][i]
                for p, dn in enumerate(s.data_nodes)
                if lay.source_of(lay.nodes[dn], s.segment_of(dn) * L + i) is not None
            ]
            out.append(self._from_preimage(versions, rep.pre_step[i], f"stripe {s.index} offset {i}", at[i]))
        return out

    def _keep(self, r: int, c: int, state: np.ndarray, version: int, crc: int, grad: np.ndarray, gcrc: int) -> bool:
        """Keep decoded chunk `c` of lost rank `r` if its version and checksums are right;
        False if it is corrupt."""
        T = self.recipe.step
        if version not in (T - 1, T) or checksum(state) != crc:
            return False
        if version == T - 1 and self.grads and checksum(grad) != gcrc:
            return False
        self.result_state[r, c], self.result_version[r, c] = state.copy(), version
        if version == T - 1 and self.grads:
            self.result_grad[r, c] = grad.copy()
        return True

    def shard_at(
        self,
        r: int,
        n_chunks: int,
        chunk_elems: int,
        update: Callable,
        grad_of: Callable[[int, int], torch.Tensor] | None = None,
        shard: int | None = None,
    ) -> torch.Tensor:
        """Lost rank `r`'s decoded shard at the recovery step ([n_chunks, 3, chunk_elems]),
        replaying the interrupted update of chunks still one step behind (with the decoded
        gradient chunk, or `grad_of(r, c)` where gradients are replicated, not protected).
        `shard`: which shard of its flat state it is (default `r`; with tensor parallelism its
        DP rank)."""
        T = self.recipe.step
        missing = [c for c in range(n_chunks) if (r, c) not in self.result_state]
        if missing:
            raise RecoveryError(f"rank {r}: chunks {missing} were not rebuilt")
        out = torch.empty(n_chunks, 3, chunk_elems)
        for c in range(n_chunks):
            offset = ((r if shard is None else shard) * n_chunks + c) * chunk_elems  # its first flat element
            data = torch.from_numpy(self.result_state[r, c].view(np.float32).reshape(3, chunk_elems))
            if self.result_version[r, c] == T:
                out[c].copy_(data)
            elif (r, c) in self.result_grad:
                update(data.clone(), torch.from_numpy(self.result_grad[r, c].view(np.float32)), out[c], T, offset)
            elif grad_of is not None:
                update(data.clone(), grad_of(r, c), out[c], T, offset)
            else:
                raise RecoveryError(f"rank {r} chunk {c} needs a replay of step {T} and no gradient of it is held")
        return out
