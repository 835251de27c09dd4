"""In-place recovery, worker side: survivors and adopting shadows join the next generation.

Survivors keep their process, parameters, optimizer shards and data pipeline; an adopting shadow
brings its pre-built model and buffers. Together they decode what was lost, agree on the
recovery step, rebuild the process group inside the running processes and re-protect.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from leto.protection.layout import Layout
from leto.protocol import keys
from leto.recovery.rebuild import (
    Rebuilder,
    RecoveryError,
    Roles,
    assign_roles,
    make_plan,
    recovery_step,
)
from leto.runtime.comm import Comm, PeerFailure
from leto.runtime.membership import read_plan
from leto.training.optim import MASTER

if TYPE_CHECKING:
    from leto.training.trainer import Trainer



def _wait_keys(tr: Trainer, names: list[str], what: str) -> None:
    deadline = time.monotonic() + tr.job.timeout_s
    while not tr.job.store.check(names):
        if tr.watch is not None and tr.watch.reason():
            raise PeerFailure(f"waiting for {what}: {tr.watch.reason()}")
        if time.monotonic() > deadline:
            raise RecoveryError(f"timed out after {tr.job.timeout_s:.0f}s waiting for {what}")
        time.sleep(1e-3)


def latest_generation(store, start: int) -> int:
    g = start
    while store.check([keys.plan(g + 1)]):
        g += 1
    return g


def join(tr: Trainer, gen: int) -> dict:
    """Join generation `gen` (announced by the controller); returns the recovery record."""
    t0 = time.time()
    store, job = tr.job.store, tr.job
    plan = read_plan(store, gen)
    rank = plan.rank_of(job.proc_id)
    if rank is None:
        raise RecoveryError(f"process {job.proc_id} is not part of generation {gen}")
    tr.watch.advance(gen)
    tr.generation, tr.plan, job.rank, job.world_size = gen, plan, rank, len(plan.proc_of_rank)
    if tr.comm is not None:
        tr.comm.close(abandon=True)
        if tr.grad_step is None:  # its reduction of the step in flight may still be running
            tr.fresh_grads()
    tr.comm = Comm(store, gen, rank, tr.world_size, job.timeout_s, tr.watch.reason, job.device)

    drain = json.loads(store.get(keys.drain(gen - 1))) if store.check([keys.drain(gen - 1)]) else None
    if drain is None:
        raise RecoveryError(f"generation {gen} has no protection to rebuild from (protection off?)")
    live = drain["live_nodes"]
    _wait_keys(tr, [keys.report(gen - 1, n) for n in live], f"keeper reports of generation {gen - 1}")
    reports = {n: json.loads(store.get(keys.report(gen - 1, n))) for n in live}
    reports = {n: r for n, r in reports.items() if not r.get("empty")}  # a new keeper holds nothing yet
    if not reports:  # every keeper is gone or new: go on if no rank's state was lost
        return _rejoin_intact(tr, gen, plan, t0)
    used = {r["generation_used"] for r in reports.values()}
    if len(used) != 1:
        raise RecoveryError(f"keepers report different protection generations {sorted(used)}")
    used_gen = used.pop()
    tr.settle_reshard(used_gen)
    layout = Layout.from_json(store.get(keys.layout(used_gen)))
    roles = assign_roles(read_plan(store, used_gen), plan)  # the writers of the protection data
    me = roles.old_rank_of.get(rank)
    if me is None and not roles.reshard and tr.geometry != layout.geometry:
        tr._allocate(layout.world_size)  # a shadow built for another world size adopts a rank
    if me is not None and tr.geometry != layout.geometry:
        raise RecoveryError(f"rank {rank} holds its shard in geometry {tr.geometry}, the protection data of "
                            f"generation {used_gen} has {layout.geometry}")
    if tr.injector is not None:
        tr.injector.at("recovery", tr.step_count + 1, rank, plan.node_of_rank)
    held, source = _held_gradients(tr, layout)
    rplan = make_plan(layout, plan, reports, roles, held=held)
    T = rplan.step
    t_decode = time.time()
    g = layout.geometry
    grads = _share_gradients(tr, layout, T, source) if T == held >= 0 else None
    tr.grad_step = T if grads is tr.flat_grad else None
    tr.restore_rank_state(T, _lineage(store, gen, rank, job.proc_id, roles))

    def lost_grad(r: int, c: int) -> torch.Tensor:  # lost rank r's gradient chunk c of step T
        lo = (r * g.n_chunks + c) * g.chunk_elems
        return grads[lo:lo + g.chunk_elems]

    grad_of = lost_grad if grads is not None else None
    if me is not None:
        tr.bring_to(T)
    repaired: list[str] = []
    while True:
        rb = Rebuilder(layout, rplan, reports, rank, job.job_id, tr.chunk_at, tr.grad_at, tr.comm,
                       lambda name, members: _subgroup(tr, gen, name, members))
        rb.run()
        bad = _agree_on_corruption(tr, layout, rb.corrupt)
        if not bad["tier1"] and not bad["tier2"]:
            break
        if bad["tier2"] or set(bad["tier1"]) <= set(rplan.force_tier2) or layout.tier2 is None:
            what = ", ".join([f"tier-1 data of node {n}" for n in bad["tier1"]] +
                             [f"tier-2 stripe {s}" for s in bad["tier2"]])
            raise RecoveryError(f"decoded state failed its checksums or version checks ({what}) and no other redundancy "
                                f"is left: stopping rather than continue on corrupt state")
        repaired += [f"tier-1 data of node {n} failed its checksums; rebuilt from tier 2" for n in bad["tier1"]]
        rplan = make_plan(layout, plan, reports, roles, frozenset(bad["tier1"]) | rplan.force_tier2, held)

    if roles.reshard:
        shard, params = _reshard(tr, layout, roles, rb, T, me, grad_of)
        restore_s = time.time() - t_decode
        t_protect = time.time()
        tr.stage_reshard(gen, shard, params, T)
        tr._protect(gen, T, shard)
        tr.settle_reshard(gen)
    else:
        for r, q in roles.holder.items():
            if q == rank and r in roles.lost:
                tr.install(rb.shard_at(r, g.n_chunks, g.chunk_elems, tr.update_chunk, grad_of), T)
        tr.step_count = T
        tr.param_shard.copy_(tr.state[:, MASTER, :].reshape(-1))
        tr.comm.all_gather(tr.flat_param, tr.param_shard)
        restore_s = time.time() - t_decode
        t_protect = time.time()
        if job.protection:  # the commit is awaited by the next step, overlapping its forward pass
            tr._protect(gen, T, wait=False)
    record = {"generation": gen, "failed_ranks": list(roles.lost), "failed_nodes": list(plan.failed_nodes),
              "cause": plan.cause, "tier": rplan.tier, "step": T, "restore_s": round(restore_s, 4),
              "world_size": tr.world_size, "resharded": roles.reshard, "decode_start_s": round(t_decode - t0, 4),
              "protect_s": round(time.time() - t_protect, 4), "join_s": round(time.time() - t0, 4),
              "repaired": repaired}
    if rank == 0:
        store.set(keys.recovery(gen), json.dumps(record))
    return record


def _lineage(store, gen: int, rank: int, proc_id: str, roles: Roles) -> list[str]:
    """The processes whose per-rank state this one continues: itself, then (adopting a rank at
    the same world size) whoever held its rank in earlier generations, newest first."""
    if roles.reshard:
        return [proc_id]
    procs = [proc_id]
    for g in range(gen - 1, -1, -1):
        p = read_plan(store, g).proc_of_rank
        if rank < len(p) and p[rank] not in procs:
            procs.append(p[rank])
    return procs


def _settled_generation(tr: Trainer) -> int:
    """The last generation this process completed joining (0: an original worker; -1: none)."""
    if tr.recoveries:
        return int(tr.recoveries[-1]["generation"])
    return 0 if read_plan(tr.job.store, 0).rank_of(tr.job.proc_id) is not None else -1


def _rejoin_intact(tr: Trainer, gen: int, plan, t0: float) -> dict:
    """Join generation `gen` with no keeper data at all (every keeper died or is new: a one-node
    job, or the last node's keeper): possible only when every member holds its own state, i.e.
    all settled in one generation with the same processes in the same ranks, nothing resharding.
    The members agree on a step each can reach from what it holds, finish it, and protect the new
    generation from their own shards (a new base, like the initial protection)."""
    settled = _settled_generation(tr)
    layout = Layout.from_json(tr.job.store.get(keys.layout(settled))) if settled >= 0 else None
    reach = set() if tr.inplace else _reachable_steps(tr)
    fits = (layout is not None and tr._pending_reshard is None and tr.geometry == layout.geometry
            and read_plan(tr.job.store, settled).proc_of_rank == plan.proc_of_rank and (tr.inplace or bool(reach)))
    low = -1 if not fits else min(tr.chunk_step) if tr.inplace else min(reach)
    agree = torch.tensor([settled, -settled, 1 if fits else 0, low], dtype=torch.int64)
    tr.comm.all_reduce(agree, torch.distributed.ReduceOp.MIN)
    if int(agree[0]) != -int(agree[1]) or int(agree[2]) != 1:
        raise RecoveryError("no keeper holds committed protection data, and not every member holds its own state "
                            "in one generation: nothing to rebuild from")
    if tr.inplace:  # the replicated-gradient rule of `recovery_step`, from the members' own chunk versions
        held, source = _held_gradients(tr, layout)
        T = recovery_step({-1: {"applied": int(agree[3])}}, layout, held)
        if T == held >= 0:
            grads = _share_gradients(tr, layout, T, source)
            tr.grad_step = T if grads is tr.flat_grad else None
    else:
        T = _common_step(tr, int(agree[3]), reach)
    tr.restore_rank_state(T, [tr.job.proc_id])  # same processes in the same ranks
    t_restore = time.time()
    tr.bring_to(T)
    tr.step_count = T
    tr.param_shard.copy_(tr.state[:, MASTER, :].reshape(-1))
    tr.comm.all_gather(tr.flat_param, tr.param_shard)
    restore_s = time.time() - t_restore
    t_protect = time.time()
    tr._protect(gen, T, wait=False)
    record = {"generation": gen, "failed_ranks": [], "failed_nodes": list(plan.failed_nodes), "cause": plan.cause,
              "tier": "none", "step": T, "restore_s": round(restore_s, 4), "world_size": tr.world_size,
              "resharded": False, "decode_start_s": round(t_restore - t0, 4),
              "protect_s": round(time.time() - t_protect, 4), "join_s": round(time.time() - t0, 4),
              "repaired": [], "rebuilt_from": "the workers' own state (no keeper data)"}
    if tr.rank == 0:
        tr.job.store.set(keys.recovery(gen), json.dumps(record))
    return record


def _reachable_steps(tr: Trainer) -> set[int]:
    """Steps this rank can bring its own whole state to (two buffers, no keeper): the steps it
    holds (and its snapshot of the last protected one), and one more where it holds that step's
    gradients (`Trainer.bring_to`)."""
    held = {s for s in tr.buf_step if s >= 0}
    out = held | ({tr.snap_step} if tr.snap_step >= 0 else set())
    for s in held:
        try:
            tr.grads_of(s + 1)
        except RecoveryError:
            continue
        out.add(s + 1)
    return out


def _common_step(tr: Trainer, low: int, reach: set[int]) -> int:
    """The latest step every member can reach: one BAND all-reduce of bit masks from `low`."""
    bits = torch.tensor([sum(1 << (s - low) for s in reach if 0 <= s - low < 62)], dtype=torch.int64)
    tr.comm.all_reduce(bits, torch.distributed.ReduceOp.BAND)
    if int(bits.item()) == 0:
        raise RecoveryError("no keeper holds committed protection data and the members hold no common step")
    return low + int(bits.item()).bit_length() - 1


def _reshard(tr: Trainer, layout: Layout, roles: Roles, rb: Rebuilder, T: int, me: int | None,
             grad_of: Callable[[int, int], torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every shard of the old layout at step T, exchanged through one BXOR all-reduce (each is
    held by exactly one process; XOR with zeros keeps every bit, -0.0 included), then cut into
    this rank's shard of the new world size. Returns (new shard, all parameters)."""
    g = layout.geometry
    full = torch.zeros(layout.world_size, g.n_chunks, 3, g.chunk_elems)
    if me is not None:
        full[me].copy_(tr.state_at(T))

    for r in roles.lost:
        if roles.holder[r] == tr.rank:
            full[r].copy_(rb.shard_at(r, g.n_chunks, g.chunk_elems, tr.update_chunk, grad_of))
    tr.comm.all_reduce(full.view(torch.int32), torch.distributed.ReduceOp.BXOR)
    rows = full.transpose(1, 2).reshape(layout.world_size, 3, -1).transpose(0, 1).reshape(3, -1)  # [3, elements]
    new = tr.geometry_for(tr.world_size)
    n = new.n_chunks * new.chunk_elems
    shard = torch.zeros(3, n)
    lo = tr.rank * n
    hi = min(lo + n, tr.numel)
    if hi > lo:
        shard[:, :hi - lo].copy_(rows[:, lo:hi])
    shard = shard.view(3, new.n_chunks, new.chunk_elems).transpose(0, 1).contiguous()
    return shard, rows[MASTER, :tr.numel].clone()


def _held_gradients(tr: Trainer, layout: Layout) -> tuple[int, int]:
    """Where gradients are replicated, not protected: the latest step whose whole reduced
    gradient a member holds (-1: none) and the lowest member holding it (one all-reduce)."""
    if layout.protects_grads or layout.protect_every > 1:
        return -1, -1
    W = tr.world_size
    mine = tr.grad_step if tr.grad_step is not None and tr.geometry == layout.geometry else -1
    key = torch.tensor([mine * W + (W - 1 - tr.rank) if mine >= 0 else -1], dtype=torch.int64)
    tr.comm.all_reduce(key, torch.distributed.ReduceOp.MAX)
    k = int(key.item())
    return (-1, -1) if k < 0 else (k // W, W - 1 - k % W)


def _share_gradients(tr: Trainer, layout: Layout, step: int, source: int) -> torch.Tensor:
    """Broadcast the whole reduced gradient of `step` from `source`: survivors that were still
    in the reduction need their shard of it, the holder of a lost rank its shard to replay."""
    g = layout.geometry
    numel = layout.world_size * g.n_chunks * g.chunk_elems
    same = tr.geometry == layout.geometry and tr.flat_grad.numel() == numel
    buf = tr.flat_grad if same else torch.zeros(numel, device=tr.flat_grad.device)
    tr.comm.broadcast(buf, source)
    return buf


def _agree_on_corruption(tr: Trainer, layout: Layout, corrupt: set[tuple[str, int]]) -> dict[str, list[int]]:
    """Only the adopter can check a decoded chunk; everyone must learn what failed."""
    n_stripes = len(layout.tier2[1]) if layout.tier2 else 0
    flags = torch.zeros(len(layout.nodes) + n_stripes, dtype=torch.int32)
    for kind, idx in corrupt:
        flags[layout.nodes.index(idx) if kind == "tier1" else len(layout.nodes) + idx] = 1
    tr.comm.all_reduce(flags, torch.distributed.ReduceOp.MAX)
    return {"tier1": [layout.nodes[i] for i in range(len(layout.nodes)) if flags[i]],
            "tier2": [i for i in range(n_stripes) if flags[len(layout.nodes) + i]]}


def _subgroup(tr: Trainer, gen: int, name: str, members: tuple[int, ...]) -> Comm:
    return Comm(tr.job.store, gen, members.index(tr.rank), len(members), tr.job.timeout_s, tr.watch.reason,
                tr.job.device, name=name)
