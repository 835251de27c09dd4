"""A rank's ZeRO-1 state on flat buffers: the parameters, its optimizer shard, its gradients.

Parameters and gradients are views of flat buffers padded to `shards` equal shards. This rank's
shard of (master, exp_avg, exp_avg_sq) is `n_chunks` chunks `[3, chunk_elems]`, each one
contiguous, self-contained unit of unique state. Protection keeps two versions of it (ping-pong
by step parity) or, updating in place, one with a step per chunk (docs/protection.md).
"""

from __future__ import annotations

import torch

from leto.protection.layout import STATE_ROWS, Geometry
from leto.recovery.rebuild import RecoveryError
from leto.runtime.comm import Comm
from leto.runtime.ordered import reduce_replicas
from leto.training.flat import bind_grads, flatten
from leto.training.optim import MASTER
from leto.training.param_groups import ParamGroups

STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")


class ShardedState:
    """This rank's parameters, optimizer shard and gradients, and the step they are at.

    `step` is the number of optimizer steps applied; `rank` the rank whose shard it holds (None
    until a shadow installs one), which can differ from the process's rank in a new
    generation until the reshard is settled. With tensor parallelism the parameters are this
    rank's TP slice, sharded over its DP group (ZeRO-1 per slice): `rank` is its DP rank.
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        groups: ParamGroups,
        chunk_elems: int,
        device: torch.device,
        shards: int,
        *,
        protection: bool,
        replicated_grads: bool,
        protect_every: int,
        layout_numel: int = 0,
    ) -> None:
        self.params, self.groups, self.chunk_elems, self.device = params, groups, chunk_elems, device
        self.numel = sum(p.numel() for p in params)
        # the elements the shards are laid out for: with pipeline stages the largest stage's, so
        # every rank of the job has one geometry (protection codes across ranks' equal shards)
        self.layout_numel = max(self.numel, layout_numel)
        self.uncounted: range | None = None  # flat elements no global norm counts (a tied copy)
        self.replicated_grads = replicated_grads
        # every-step protection with replicated gradients updates the one shard in place, handing
        # each chunk's delta over as it is computed (docs/protection.md, "One step, in order")
        self.inplace = protection and replicated_grads and protect_every == 1
        # Protection keeps two versions of the shard (ping-pong by step parity, see docs/protection.md)
        self.copies = 2 if protection and not self.inplace else 1
        # a gradient shard of its own only where the reduction leaves one (NCCL); two when it is
        # protected (an interval protects no gradients)
        self.grad_copies = 0 if replicated_grads else self.copies if protect_every == 1 else 1
        self.rank: int | None = None
        # with tensor parallelism: 1.0 where a flat element counts in the global gradient norm
        # (a replicated parameter counts on one TP rank only); None: every element counts
        self.norm_mask: torch.Tensor | None = None
        self.step = 0
        self._kept: dict[int, tuple[int, torch.Tensor]] = {}  # chunk -> (step, data) a recovery replaced
        self.snap: torch.Tensor | None = None  # --protect-every > 1: the state at the last protected step
        self.snap_step = -1
        self._pending: tuple[int, int, int, torch.Tensor, torch.Tensor, int] | None = None
        self._scratch = torch.zeros(chunk_elems, device=device)
        self.allocate(shards)
        self.buf_step[0] = 0
        self.chunk_step = [0] * self.n_chunks

    # ----- layout
    def allocate(self, shards: int) -> None:
        """Lay the state out for ZeRO-1 over `shards` ranks (again after a resize), keeping the
        parameter values; the shard buffers start empty (no step held)."""
        dev = self.device
        self.n_chunks = self.geometry_for(shards).n_chunks
        self.shard_elems = self.n_chunks * self.chunk_elems
        self.flat_param = flatten(self.params, shards * self.shard_elems, dev)
        self.fresh_grads()
        self.bufs = [torch.zeros(self.n_chunks, STATE_ROWS, self.chunk_elems, device=dev) for _ in range(self.copies)]
        self.gbufs = [torch.zeros(self.n_chunks, self.chunk_elems, device=dev) for _ in range(self.grad_copies)]
        self.buf_step = [-1] * self.copies  # the step each state buffer holds
        self.chunk_step = [-1] * self.n_chunks  # in place: the step each chunk holds
        self.next = torch.zeros(STATE_ROWS, self.chunk_elems, device=dev)  # in place: a chunk's next step
        self.gbuf_step = [-1] * self.grad_copies  # the step each gradient buffer holds
        self.param_shard = torch.zeros(self.shard_elems, device=dev)

    def rebind(self, params: list[torch.Tensor], groups: ParamGroups, uncounted: range | None) -> None:
        """Hold other parameters of at most `layout_numel` elements (a shadow adopting another
        pipeline stage) in the same buffers: their values come from the recovery."""
        numel = sum(p.numel() for p in params)
        if numel > self.layout_numel:
            raise RecoveryError(f"a stage of {numel} elements does not fit a layout of {self.layout_numel}")
        self.params, self.groups, self.numel, self.uncounted = params, groups, numel, uncounted
        self.flat_param = flatten(params, self.flat_param.numel(), self.device)
        self.fresh_grads()

    def count_in_norm(self, mask: torch.Tensor | None) -> None:
        """Count the elements of `mask` (1.0; None: all) in a global gradient norm, except
        `uncounted`."""
        if self.uncounted is not None:
            if mask is None:
                mask = torch.ones(self.flat_param.numel(), dtype=torch.float64, device=self.device)
            mask[self.uncounted.start : self.uncounted.stop] = 0.0
        self.norm_mask = mask

    def fresh_grads(self) -> None:
        """Give the gradients a new flat buffer. After a failure, a reduction abandoned in a gloo
        thread may still write into the old one (it stays with the parked process group)."""
        self.flat_grad = torch.zeros_like(self.flat_param)
        self.grad_step: int | None = None  # the step whose whole reduced gradient flat_grad holds
        bind_grads(self.params, self.flat_grad)

    @property
    def geometry(self) -> Geometry:
        return Geometry(self.n_chunks, self.chunk_elems)

    def geometry_for(self, shards: int) -> Geometry:
        """The chunking of a shard when the state is split over `shards` ranks."""
        return Geometry(-(-self.layout_numel // (shards * self.chunk_elems)), self.chunk_elems)

    def offset_of(self, c: int, rank: int | None = None) -> int:
        """The flat element index of chunk `c` of `rank`'s shard (default: the one held)."""
        return ((self.rank if rank is None else rank) * self.n_chunks + c) * self.chunk_elems

    # ----- the buffers: a ring of `copies` state buffers and `grad_copies` gradient buffers, by step
    def buf_for(self, step: int) -> torch.Tensor:
        """The state buffer that holds (or will hold) `step`: [n_chunks, 3, chunk_elems]."""
        return self.bufs[step % len(self.bufs)]

    def holds(self, step: int) -> bool:
        """Whether `buf_for(step)` holds `step`."""
        return self.buf_step[step % len(self.bufs)] == step

    def mark_held(self, step: int) -> None:
        """`buf_for(step)` now holds `step`."""
        self.buf_step[step % len(self.bufs)] = step

    def grad_buf_for(self, step: int) -> torch.Tensor:
        """This rank's own gradient buffer for `step` (reduce-scattered gradients): [n_chunks, chunk_elems]."""
        return self.gbufs[step % len(self.gbufs)]

    # ----- what is held
    @property
    def state(self) -> torch.Tensor:
        """This rank's unique state at `step`: [n_chunks, 3, chunk_elems]."""
        return self.buf_for(self.step)

    def state_at(self, step: int) -> torch.Tensor:
        """This rank's whole state at `step` ([n_chunks, 3, chunk_elems]), which it must hold."""
        if not self.holds(step) or (self.inplace and any(c != step for c in self.chunk_step)):
            raise RecoveryError(f"rank {self.rank} does not hold its whole state at step {step}")
        return self.buf_for(step)

    def chunk_at(self, step: int, c: int) -> torch.Tensor:
        """State chunk `c` at `step` (one of the two kept; in place: the one held, or the one a
        recovery replaced while the keepers' tables may still name it)."""
        if self.inplace:
            if self.chunk_step[c] == step:
                return self.bufs[0][c]
            kept = self._kept.get(c)
            if kept is not None and kept[0] == step:
                return kept[1]
            raise RecoveryError(
                f"rank {self.rank} does not hold chunk {c} at step {step} (it holds step {self.chunk_step[c]})"
            )
        if not self.holds(step):
            raise RecoveryError(f"rank {self.rank} does not hold step {step} (it holds {self.buf_step})")
        return self.buf_for(step)[c]

    def grads_of(self, step: int) -> torch.Tensor:
        """The gradient shard of `step` ([n_chunks, chunk_elems]): a view of the whole reduced
        gradient where every rank holds it, else one of this rank's own gradient shards."""
        if self.replicated_grads:
            if self.grad_step != step:
                raise RecoveryError(
                    f"rank {self.rank} does not hold gradients of step {step} (it holds {self.grad_step})"
                )
            lo = self.rank * self.shard_elems
            return self.flat_grad[lo : lo + self.shard_elems].view(self.n_chunks, self.chunk_elems)
        if self.gbuf_step[step % len(self.gbufs)] != step:
            raise RecoveryError(f"rank {self.rank} does not hold gradients of step {step} (it holds {self.gbuf_step})")
        return self.grad_buf_for(step)

    def grad_at(self, step: int, c: int) -> torch.Tensor:
        return self.grads_of(step)[c]

    def reachable_steps(self) -> set[int]:
        """Steps this rank can bring its own whole state to with no keeper (two buffers): the
        steps it holds (and its snapshot of the last protected one), and one more where it holds
        that step's gradients (`bring_to`)."""
        held = {s for s in self.buf_step if s >= 0}
        out = held | ({self.snap_step} if self.snap_step >= 0 else set())
        for s in held:
            try:
                self.grads_of(s + 1)
            except RecoveryError:
                continue
            out.add(s + 1)
        return out

    # ----- the update
    def update_chunk(self, old: torch.Tensor, grad: torch.Tensor, dst: torch.Tensor, step: int, offset: int) -> None:
        """The optimizer update to `step` of the chunk whose first element is flat element
        `offset` (also used to replay a decoded chunk): each parameter group's range with its own
        hyper-parameters. A chunk held elsewhere (a recovery's decoded chunk, on the host) is
        updated on this shard's device, by the kernels of the step itself, so to the same bits."""
        dev = self._scratch.device
        if old.device != dev or grad.device != dev or dst.device != dev:
            out = torch.empty(dst.shape, device=dev)
            self.update_chunk(old.to(dev), grad.to(dev), out, step, offset)
            dst.copy_(out)
            return
        for lo, hi, opt in self.groups.segments(offset, self.chunk_elems):
            if hi - lo == self.chunk_elems:
                opt.update(old, grad, dst, step, self._scratch)
            else:
                opt.update(old[:, lo:hi], grad[lo:hi], dst[:, lo:hi], step, self._scratch[: hi - lo])

    def bring_to(self, step: int) -> None:
        """A survivor's own state at `step`: it holds it, rolls back to its snapshot of the last
        protected step (--protect-every > 1), or finishes the update of `step`."""
        if self.inplace:
            self._bring_in_place(step)
            return
        if self.holds(step):
            return
        if self.snap_step == step:
            self.buf_for(step).copy_(self.snap)
            self.mark_held(step)
            return
        self.chunk_at(step - 1, 0)  # raises unless step-1 is held
        old, grads, dst = self.buf_for(step - 1), self.grads_of(step), self.buf_for(step)
        for c in range(self.n_chunks):
            self.update_chunk(old[c], grads[c], dst[c], step, self.offset_of(c))
        self.mark_held(step)

    def _bring_in_place(self, step: int) -> None:
        """Finish the update of `step` in place. A replaced chunk is kept until the next
        generation's protection commits: until then a second failure decodes from the previous
        tables, which may name it."""
        behind = [c for c in range(self.n_chunks) if self.chunk_step[c] != step]
        if not behind:
            return
        grads, s = self.grads_of(step), self.bufs[0]
        for c in behind:
            if self.chunk_step[c] != step - 1:
                raise RecoveryError(f"rank {self.rank} chunk {c} is at step {self.chunk_step[c]}, cannot reach {step}")
            self._kept[c] = (step - 1, s[c].clone())
            self.update_chunk(s[c], grads[c], s[c], step, self.offset_of(c))
            self.chunk_step[c] = step
        self.buf_step[0] = step

    def release_kept(self) -> None:
        """The keepers' tables name nothing older than the current step any more."""
        self._kept.clear()

    def snapshot(self, step: int, state: torch.Tensor) -> None:
        """--protect-every > 1: `state` is the last protected step's (the next deltas start from it)."""
        self.snap, self.snap_step = state.clone(), step

    def keep_snapshot(self, step: int) -> None:
        """--protect-every > 1: the held protected `step` becomes the snapshot, before an update
        overwrites its buffer."""
        self.snap.copy_(self.buf_for(step))
        self.snap_step = step

    # ----- one step: gradients, the update, the parameters
    def zero_grads(self) -> None:
        """Before a backward pass: no step's reduced gradient is held any more."""
        self.grad_step = None
        self.flat_grad.zero_()

    def reduce_grads(
        self, comm: Comm, step: int, replicas: tuple[int, dict[int, torch.Tensor], dict[int, Comm]] | None = None
    ) -> None:
        """Reduce `step`'s gradients: all-reduced into `flat_grad` where every rank holds the
        whole gradient, else reduce-scattered into this rank's own gradient buffer.

        `replicas` = (the replica whose gradient `flat_grad` holds, the gradients of the other
        replicas this rank hosts, its members of the group of all replicas while shrunk): summed
        with the bits of a full-width run (`reduce_replicas`). An all-reduce covers the
        parameters' elements only, not the padding: gloo cuts a tensor into segments by its
        size, and the padding depends on the number of shards."""
        if replicas is not None and replicas[2]:
            mine, others, group = replicas
            reduce_replicas(comm, group, {r: g[: self.numel] for r, g in {**others, mine: self.flat_grad}.items()})
            if self.replicated_grads:
                return
            n = self.shard_elems
            self.grad_buf_for(step).view(-1).copy_(self.flat_grad[comm.rank * n : (comm.rank + 1) * n])
        elif self.replicated_grads:
            comm.all_reduce(self.flat_grad[: self.numel])
            return
        else:
            comm.reduce_scatter(self.grad_buf_for(step).view(-1), self.flat_grad, self.numel)
        self.gbuf_step[step % len(self.gbufs)] = step

    def grad_norm(self, comm: Comm, world_size: int, step: int, *model_parallel: Comm | None) -> float:
        """The global norm of `step`'s reduced gradients (the same bits on every rank, in both
        reduction paths and whatever the number of shards: per-chunk sums of squares, added in
        chunk order; a collective where the gradients are reduce-scattered). `comm` is the
        group the state is sharded over (`world_size` ranks); `model_parallel` are the groups
        holding the model's other slices (TP, then the pipeline's stages), whose ranks' sums
        are added too, each counting only the elements of `norm_mask`."""
        if self.replicated_grads:
            parts = self._squares(self.flat_grad, 0).view(-1, self.chunk_elems).sum(dim=1)
        else:
            parts = torch.zeros(world_size * self.n_chunks, dtype=torch.float64, device=self.flat_grad.device)
            grads = self.grads_of(step).view(-1)
            mine = self._squares(grads, self.rank * self.shard_elems).view(-1, self.chunk_elems).sum(dim=1)
            comm.all_gather(parts, mine)
        for group in model_parallel:
            if group is not None:
                every = torch.zeros(group.world_size * parts.numel(), dtype=torch.float64, device=parts.device)
                group.all_gather(every, parts)
                parts = every
        total = 0.0
        for x in parts.tolist():
            total += x
        return total**0.5

    def _squares(self, grads: torch.Tensor, offset: int) -> torch.Tensor:
        """The squares (float64) of `grads`, flat elements from `offset` on, where they count."""
        sq = grads.double().pow(2)
        if self.norm_mask is not None:  # past the mask: padding, whose gradients are zero
            mask = self.norm_mask[offset : offset + grads.numel()]
            sq[: mask.numel()].mul_(mask)
        return sq

    def scale_grads(self, step: int, coef: float) -> None:
        """Scale `step`'s reduced gradients (all of them where they are replicated) by `coef`."""
        (self.flat_grad if self.replicated_grads else self.grads_of(step)).mul_(coef)

    def next_chunk(self, old: torch.Tensor, grad: torch.Tensor, step: int, c: int) -> torch.Tensor:
        """In place: chunk `c` updated to `step` into a scratch buffer (`old` still holds the
        previous step until `replace_chunk`)."""
        self.update_chunk(old, grad, self.next, step, self.offset_of(c))
        return self.next

    def replace_chunk(self, c: int, step: int) -> None:
        """In place: chunk `c` becomes its update to `step` from `next_chunk`."""
        self.buf_for(step)[c].copy_(self.next)
        self.chunk_step[c] = step

    def shard_params(self, step: int) -> None:
        """This rank's updated parameters (the master weights of `step`) into `param_shard`."""
        self.param_shard.copy_(self.buf_for(step)[:, MASTER, :].reshape(-1))

    # ----- installing state
    def take_master(self, rank: int) -> None:
        """Hold `rank`'s shard, its master weights taken from the parameters (the job's start)."""
        self.rank = rank
        shard = self.flat_param[rank * self.shard_elems : (rank + 1) * self.shard_elems]
        self.state[:, MASTER, :].copy_(shard.view(self.n_chunks, self.chunk_elems))

    def install(self, shard: torch.Tensor, step: int, rank: int) -> None:
        """Hold `shard` ([n_chunks, 3, chunk_elems], decoded, resharded or loaded) as `rank`'s state at `step`."""
        if shard.shape != self.bufs[0].shape:
            raise RecoveryError(f"shard of shape {tuple(shard.shape)} installed, expected {tuple(self.bufs[0].shape)}")
        self.buf_for(step).copy_(shard)
        self.mark_held(step)
        self.chunk_step = [step] * self.n_chunks
        self.rank = rank

    def load(self, shard: torch.Tensor, params: torch.Tensor, step: int, rank: int) -> None:
        """Be at `step` with `rank`'s `shard` and all parameters `params` (a resume, a reshard)."""
        self.install(shard, step, rank)
        self.flat_param[: self.numel].copy_(params[: self.numel])
        self.step = step

    def cut(self, full: torch.Tensor, shards: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """From the whole state `full` ([old world size, n_chunks, 3, chunk_elems], any chunking):
        `rank`'s shard when it is split over `shards` ranks, and all parameters (the master
        weights)."""
        rows = full.transpose(1, 2).reshape(full.shape[0], STATE_ROWS, -1).transpose(0, 1).reshape(STATE_ROWS, -1)
        new = self.geometry_for(shards)
        n = new.n_chunks * new.chunk_elems
        shard = torch.zeros(STATE_ROWS, n)
        lo = rank * n
        hi = min(lo + n, self.numel)
        if hi > lo:
            shard[:, : hi - lo].copy_(rows[:, lo:hi])
        shard = shard.view(STATE_ROWS, new.n_chunks, new.chunk_elems).transpose(0, 1).contiguous()
        return shard, rows[MASTER, : self.numel].clone()

    def stage_reshard(
        self, generation: int, shards: int, rank: int, shard: torch.Tensor, params: torch.Tensor, step: int
    ) -> None:
        """Hold a resharded state (rank `rank` of `shards`) until the protection of `generation`
        commits: until then the old shard is what the keepers protect, and a second failure must
        find it intact."""
        self._pending = (generation, shards, rank, shard, params, step)

    def settle_reshard(self, committed: int) -> None:
        """Generation `committed` is the one the keepers protect: switch to the state staged for
        it, or drop a staged state that never got protected."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == committed:
            _, shards, rank, shard, params, step = pending
            self.allocate(shards)
            self.load(shard, params, step, rank)

    @property
    def resharding(self) -> bool:
        """A resharded state waits for its generation's protection."""
        return self._pending is not None

    # ----- collectives
    def receive_grads(self, comm: Comm, geometry: Geometry, shards: int, step: int, source: int) -> torch.Tensor:
        """The whole reduced gradient of `step` (laid out as `shards` shards of `geometry`),
        broadcast from `source`: into this rank's gradient buffer where the layout is its own
        (which then holds `step`'s gradients), else into a new buffer."""
        numel = shards * geometry.n_chunks * geometry.chunk_elems
        same = self.geometry == geometry and self.flat_grad.numel() == numel
        buf = self.flat_grad if same else torch.zeros(numel, device=self.flat_grad.device)
        comm.broadcast(buf, source)
        self.grad_step = step if same else None
        return buf

    def gather_params(self, comm: Comm) -> None:
        """Every rank's parameters from the shards: this rank's master weights, all-gathered."""
        self.shard_params(self.step)
        comm.all_gather(self.flat_param, self.param_shard)

    def full_state(self, comm: Comm, world_size: int) -> dict[str, torch.Tensor]:
        """Every parameter and optimizer tensor, unsharded, in canonical order (a collective)."""
        gathered = torch.empty(world_size, *self.state.shape, device=self.state.device)
        comm.all_gather(gathered.view(-1), self.state.view(-1))
        rows = gathered.transpose(1, 2).reshape(world_size, STATE_ROWS, -1)
        full = {"params": self.flat_param[: self.numel]}
        for i, name in enumerate(STATE_NAMES):
            full[name] = rows[:, i, :].reshape(-1)[: self.numel]
        return full
