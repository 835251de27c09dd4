"""Rebuild lost ranks' state from the protection tiers, inside the running processes.

Every member of the new generation computes the same plan from the same inputs (the old
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

from leto.control.comm import Comm
from leto.control.membership import Plan
from leto.protection.client import as_bytes
from leto.protection.codec import UnrecoverableError, scale_into, xor_into
from leto.protection.integrity import checksum
from leto.protection.layout import Layout
from leto.protection.placement import Stripe, lost_summary
from leto.protection.shm import Region


class RecoveryError(RuntimeError):
    """The lost state cannot be rebuilt exactly; the job must stop rather than go on wrong."""


def recovery_step(reports: dict[int, dict]) -> int:
    """The one step every rank is rebuilt at (docs/protection.md, "Recovery point")."""
    if not reports:
        raise RecoveryError("no keeper survived: there is no protection data to rebuild from")
    c = max(r["g_commit"] for r in reports.values())
    if all(c + 1 in r["grads_complete"] for r in reports.values()):
        return c + 1
    return c


@dataclass(frozen=True)
class Tier1Job:
    node: int
    lost_rank: int
    members: tuple[int, ...]   # new-generation ranks in the decode group (sorted)
    reader: int                # member that reads the keeper's shared memory


@dataclass(frozen=True)
class Tier2Job:
    stripe: Stripe
    chosen: tuple[int, ...]                # block indices used
    coeffs: dict[int, list[int]]           # missing data block -> coefficient per chosen block
    readers: dict[int, int]                # parity block index -> new-generation rank that reads it


@dataclass
class RebuildPlan:
    step: int
    lost: tuple[int, ...]
    tier1: list[Tier1Job]
    tier2: list[Tier2Job]
    force_tier2: frozenset[int] = frozenset()

    @property
    def tier(self) -> str:
        return "tier2" if self.tier2 else ("tier1" if self.tier1 else "none")


def make_plan(layout: Layout, new: Plan, reports: dict[int, dict], lost_ranks: set[int],
              force_tier2: frozenset[int] = frozenset()) -> RebuildPlan:
    """Which tier rebuilds which lost rank, and who contributes. A rank is lost when its
    process differs from the one the protection data was written by. Nodes in `force_tier2`
    are rebuilt from tier 2 (their tier-1 data failed its checksums)."""
    step = recovery_step(reports)
    lost = tuple(sorted(lost_ranks))
    new_node = new.node_of_rank
    tier1, t2_nodes = [], set()
    for n in layout.nodes:
        lost_here = [r for r in layout.local_ranks(n) if r in lost]
        if not lost_here:
            continue
        members = sorted({r for r in range(new_node.__len__()) if new_node[r] == n} | set(lost_here))
        readers = [r for r in members if new_node[r] == n]
        if n in reports and len(lost_here) == 1 and readers and n not in force_tier2:
            tier1.append(Tier1Job(n, lost_here[0], tuple(members), readers[0]))
        else:
            t2_nodes.add(n)
    tier2 = _tier2_jobs(layout, new, reports, t2_nodes, lost) if t2_nodes else []
    return RebuildPlan(step, lost, tier1, tier2, force_tier2)


def _tier2_jobs(layout: Layout, new: Plan, reports: dict[int, dict], lost_nodes: set[int],
                lost: tuple[int, ...]) -> list[Tier2Job]:
    if layout.tier2 is None:
        names = ", ".join(f"node {n}" for n in sorted(lost_nodes))
        raise RecoveryError(f"lost {names} (ranks {list(lost)}) beyond what tier 1 can repair, and tier 2 "
                            f"is off ({'--ec none' if layout.ec is None else 'too few nodes for --ec'})")
    code, stripes = layout.tier2
    L = layout.segment_len
    jobs = []
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
        except UnrecoverableError as e:
            lost_idx = {layout.nodes.index(n) for n in lost_nodes | dead_keepers}
            raise RecoveryError(f"unrecoverable: {lost_summary(stripes, lost_idx)} ({e}; keepers reporting: "
                                f"{sorted(reports)}, parity readers: {readers})") from e
        jobs.append(Tier2Job(s, tuple(chosen), coeffs, {b: readers[b] for b in chosen if b >= code.k}))
    return jobs


class Rebuilder:
    """Runs a `RebuildPlan` in one process of the new generation."""

    def __init__(self, layout: Layout, plan: RebuildPlan, reports: dict[int, dict], rank: int, job_id: str,
                 chunk: Callable[[int, int], torch.Tensor], grad: Callable[[int, int], torch.Tensor],
                 comm: Comm, subgroup: Callable[[str, tuple[int, ...]], Comm]) -> None:
        self.layout, self.plan, self.reports, self.rank, self.job_id = layout, plan, reports, rank, job_id
        self.chunk, self.grad = chunk, grad   # (version step, chunk index) -> this rank's own data
        self.comm, self.subgroup = comm, subgroup
        self.regions: dict[int, Region] = {}
        g = layout.geometry
        self.result_state: dict[int, np.ndarray] = {}   # chunk -> bytes (for an adopter)
        self.result_version: dict[int, int] = {}
        self.result_crc: dict[int, int] = {}
        self.result_grad: dict[int, np.ndarray] = {}
        self.corrupt: set[tuple[str, int]] = set()   # ("tier1", node) / ("tier2", stripe) that failed checksums
        self.sb, self.gb = g.state_bytes, g.grad_bytes

    def _region(self, node: int) -> Region:
        if node not in self.regions:
            self.regions[node] = Region(self.layout, self.job_id, node, create=False)
        return self.regions[node]

    def run(self) -> None:
        for job in self.plan.tier1:
            if self.rank in job.members:
                self._tier1(job)
        for job in self.plan.tier2:
            self._tier2(job)
        for r in self.regions.values():
            r.close()

    # ----- tier 1: P1 XOR the node's survivors, node-local group
    def _tier1(self, job: Tier1Job) -> None:
        lay, T = self.layout, self.plan.step
        n = lay.geometry.n_chunks
        rep = self.reports[job.node]
        w_lost = lay.local_index(job.lost_rank)
        b = T % 2
        buf = torch.zeros(n, self.sb + self.gb, dtype=torch.uint8)
        acc = buf.numpy()
        if self.rank == job.reader:
            region = self._region(job.node)
            if any(s != T for s in region["g1_step"][b]):
                raise RecoveryError(f"tier-1 gradients of step {T} on node {job.node} are incomplete")
            acc[:, :self.sb] ^= region["p1"]
            acc[:, self.sb:] ^= region["g1"][b]
        if self.rank != job.lost_rank and lay.node_of_rank[self.rank] == job.node:
            w = lay.local_index(self.rank)
            for c in range(n):
                v = rep["v1"][w][c]
                xor_into(acc[c, :self.sb], as_bytes(self.chunk(v, c)))
                xor_into(acc[c, self.sb:], as_bytes(self.grad(T, c)))
        comm = self.subgroup(f"t1n{job.node}", job.members)
        comm.all_reduce(buf, dist.ReduceOp.BXOR)
        if self.rank == job.lost_rank:
            for c in range(n):
                if not self._keep(c, acc[c, :self.sb], rep["v1"][w_lost][c], rep["crc1"][w_lost][c],
                                  acc[c, self.sb:], rep["gcrc1"][w_lost][b][c]):
                    self.corrupt.add(("tier1", job.node))

    # ----- tier 2: Reed-Solomon stripe decode over the whole new group
    def _tier2(self, job: Tier2Job) -> None:
        lay, T = self.layout, self.plan.step
        L, k = lay.segment_len, lay.tier2[0].k
        s, b = job.stripe, T % 2
        rep = next(self.reports[lay.nodes[pn]]["stripes"][str(s.index)]
                   for j, pn in enumerate(s.parity_nodes) if k + j in job.readers)
        missing = sorted(job.coeffs)
        buf = torch.zeros(len(missing), L, self.sb + self.gb, dtype=torch.uint8)
        acc = buf.numpy()
        for bi, blk in enumerate(job.chosen):
            if blk < k:  # a surviving data node's segment: each source rank adds its own chunks
                node = lay.nodes[s.data_nodes[blk]]
                seg = s.segment_of(s.data_nodes[blk])
                for i in range(L):
                    src = lay.source_of(node, seg * L + i)
                    if src is None or src[0] != self.rank:
                        continue
                    v = rep["v2"][blk][i]
                    data, grad = as_bytes(self.chunk(v, src[1])), as_bytes(self.grad(T, src[1]))
                    for mi, e in enumerate(missing):
                        scale_into(acc[mi, i, :self.sb], job.coeffs[e][bi], data)
                        scale_into(acc[mi, i, self.sb:], job.coeffs[e][bi], grad)
            elif job.readers[blk] == self.rank:
                j = blk - k
                region = self._region(lay.nodes[s.parity_nodes[j]])
                p2, g2 = region[f"p2_{s.index}"], region[f"g2_{s.index}"][b]
                for mi, e in enumerate(missing):
                    for i in range(L):
                        scale_into(acc[mi, i, :self.sb], job.coeffs[e][bi], p2[i])
                        scale_into(acc[mi, i, self.sb:], job.coeffs[e][bi], g2[i])
        self.comm.all_reduce(buf, dist.ReduceOp.BXOR)
        for mi, e in enumerate(missing):
            node = lay.nodes[s.data_nodes[e]]
            seg = s.segment_of(s.data_nodes[e])
            for i in range(L):
                src = lay.source_of(node, seg * L + i)
                if src is None or src[0] != self.rank or src[0] not in self.plan.lost:
                    continue
                if not self._keep(src[1], acc[mi, i, :self.sb], rep["v2"][e][i], rep["crc2"][e][i],
                                  acc[mi, i, self.sb:], rep["gcrc2"][e][b][i]):
                    self.corrupt.add(("tier2", s.index))

    def _keep(self, c: int, state: np.ndarray, version: int, crc: int, grad: np.ndarray, gcrc: int) -> bool:
        """Keep a decoded chunk if its version and checksums are right; False if it is corrupt."""
        T = self.plan.step
        if version not in (T - 1, T) or checksum(state) != crc:
            return False
        if version == T - 1 and checksum(grad) != gcrc:
            return False
        self.result_state[c], self.result_version[c] = state.copy(), version
        if version == T - 1:
            self.result_grad[c] = grad.copy()
        return True
