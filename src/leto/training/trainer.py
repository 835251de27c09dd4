"""`leto.Trainer`: sharded data parallel (ZeRO-1) on flat buffers, the training step Leto protects.

Parameters are replicated; gradients are reduce-scattered; fp32 master weights and AdamW moments
are sharded across ranks and laid out as fixed-size chunks `state[c] = (master, exp_avg,
exp_avg_sq)` so each chunk is one contiguous, self-contained unit of unique state; updated
parameters are all-gathered. The step is here; the state and its buffers are in
`leto.training.shard`, membership and recovery in `leto.training.member`, what each protection
mode adds to the step in `leto.training.protection_modes`.

With tensor parallelism (`--tp T`, a model whose layers are cut with
`leto.training.tensor_parallel`) each rank holds its TP slice of the model, and ZeRO-1 runs per
slice over the rank's DP group; the gradient norm and the digest cover the whole model.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn as nn

from leto.protection.layout import STATE_ROWS
from leto.protocol import keys
from leto.runtime import trace
from leto.runtime.comm import PeerFailure, backend_for, reduction_replicates
from leto.runtime.env import Job
from leto.runtime.etcd_store import Fenced
from leto.runtime.ordered import hosted
from leto.training.flat import state_digest
from leto.training.member import RankMember
from leto.training.metrics import StepLog
from leto.training.optim import AdamW, Optimizer
from leto.training.param_groups import ParamGroups
from leto.training.rank_state import RankState, Stateful, reseed
from leto.training.shard import ShardedState
from leto.training.tensor_parallel import gather_full_state_dict
from leto.training.tp_slices import SliceLayout

LossFn = Callable[[], torch.Tensor] | Callable[[int], torch.Tensor]

DEFAULT_CHUNK_BYTES = 12 * 16384  # 192 KiB: 16384 elements of (master, exp_avg, exp_avg_sq)

# What users see of a `Trainer` (docs/porting.md); `tests/test_public_surface.py` holds it to this.
PUBLIC_API = (
    "job",
    "model",
    "member",
    "rank",
    "world_size",
    "dp_rank",
    "dp_size",
    "replicas",
    "steps",
    "step",
    "step_count",
    "last_loss",
    "grad_norm",
    "register_state",
    "state_dict",
    "full_state",
    "digest",
    "close",
)


class Trainer:
    """Wraps a model and AdamW into ZeRO-1 over the job's ranks.

    >>> trainer = Trainer(model, job, AdamW(lr=1e-3))
    >>> for step in trainer.steps(100):          # shadows wait here to be adopted
    ...     trainer.step(lambda replica: model(*batch(step, replica, trainer.replicas)))

    A loss function of the replica keeps the failure-free bits across a shrink and a grow: the
    global batch stays split over the `replicas` of the launch, each computed on its own by
    whichever process hosts it now, and their gradients are summed over a group of all the
    replicas, as at full width (`leto.runtime.ordered`). A loss function without arguments
    trains on the rank's share (`dp_rank` of `dp_size`), re-split at a resize, where the losses
    only track the failure-free run.

    Every step (and, per replica, every replica's loss function) starts with torch's, Python's
    and NumPy's global generators reseeded from (`seed`, step, DP rank or replica), so dropout
    and random sampling replay exactly after a recovery (`seed=None` leaves them alone).
    Persistent module buffers follow DDP (rank 0's values are everyone's) and, like state
    registered with `register_state`, survive any recovery.

    With `--tp T` the model must be tensor-parallel already (its parallel layers cut for this
    rank's TP coordinate, with `tensor_parallel.pending_group(job)`): the trainer points them at
    the TP group whenever it is (re)built. The TP ranks of one replica train on the same batch.
    """

    def __init__(
        self,
        model: nn.Module,
        job: Job,
        optimizer: Optimizer | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        seed: int | None = 0,
        param_groups: list[dict] | None = None,
        max_grad_norm: float | None = None,
        autocast: torch.dtype | None = None,
    ) -> None:
        if chunk_bytes < STATE_ROWS * 4 or chunk_bytes % (STATE_ROWS * 4):
            raise ValueError(f"chunk size must be a positive multiple of {STATE_ROWS * 4} bytes, got {chunk_bytes}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm}")
        self.job, self.model = job, model.to(job.device)
        params = [p for p in model.parameters() if p.requires_grad]
        groups = ParamGroups(params, optimizer or AdamW(), param_groups or [])
        self._seed, self._max_grad_norm, self._autocast = seed, max_grad_norm, autocast
        self.grad_norm = float("nan")  # the last step's global gradient norm (before clipping)
        rank_state = RankState(model)
        backend = backend_for(job.device, job.world_size)
        # on gloo every rank holds the whole reduced gradient: the keepers need no copy of it
        tp = job.config.mesh.tp
        # (with tensor parallelism: where a slice has DP peers to hold it)
        replicated_grads = reduction_replicates(backend) and not job.config.protection.grads and job.world_size > tp
        sharded = ShardedState(
            params,
            groups,
            chunk_bytes // (STATE_ROWS * 4),
            job.device,
            job.world_size // tp,
            protection=job.config.protection.enabled,
            replicated_grads=replicated_grads,
            protect_every=job.config.protection.every,
        )
        slices = None
        if tp > 1:
            slices = SliceLayout(model, params, 0 if job.mesh is None else job.mesh.tp_rank, tp)
        self.member = RankMember(job, sharded, rank_state, backend, slices)  # what recovery and harnesses work with
        self._loss = torch.zeros(1, device=job.device)
        self.last_loss = float("nan")  # the last step's global loss
        self._log = StepLog(job)

    @property
    def rank(self) -> int:
        """This process's rank (it can change at a recovery: take the batch slice from it each step)."""
        return self.member.rank

    @property
    def world_size(self) -> int:
        """The ranks training now (fewer after a shrink)."""
        return self.member.world_size

    @property
    def dp_rank(self) -> int:
        """This rank's model replica: take the batch slice from it each step (the rank itself
        without tensor parallelism; it can change at a recovery)."""
        return self.member.dp_rank

    @property
    def dp_size(self) -> int:
        """The model replicas training now: the batch is split over them (`world_size` without
        tensor parallelism)."""
        return self.member.dp_size

    @property
    def replicas(self) -> int:
        """The model replicas of the launch, fixed for the whole run: a loss function of the
        replica (`trainer.step(lambda replica: ...)`) trains on that replica's slice of the global
        batch."""
        return self.member.replicas

    @property
    def step_count(self) -> int:
        """Optimizer steps applied."""
        return self.member.step_count

    # ----- the training loop
    def steps(self, total: int) -> Iterator[int]:
        """Yield the step numbers to run (0-based); shadows wait here until they are adopted or the job ends."""
        if not self.member.start():
            return
        while self.step_count < total:
            if self.member.comm is None:  # its replica was dropped and the job ended before it was adopted again
                return
            if self._seed is not None:
                reseed(self._seed, self.step_count, self.dp_rank)
            yield self.step_count
        self._finish()
        self.close()

    def step(
        self,
        loss_fn: LossFn | Sequence[LossFn],
        weight: float | Callable[[int], float] | None = None,
        tokens: int = 0,
    ) -> float | None:
        """One training step. `loss_fn` computes this rank's loss (under `autocast` if set), or,
        taking one argument, the loss of that replica (see the class); a list of them
        accumulates gradients over micro-batches (each weighted 1/len), reduced once. `weight` is
        this rank's share of the global batch (default 1/`dp_size`), or per replica a function
        of it (default 1/`replicas`); `tokens` is the number of tokens in the global batch (for
        metrics). Returns the global loss, or None when a failure interrupted the step: the job
        recovered in place and `steps()` yields the step to redo next."""
        m = self.member
        if m.comm is None:
            raise RuntimeError("call step() inside `for step in trainer.steps(n)`")
        try:
            try:
                return self._step(loss_fn, weight, tokens)
            except PeerFailure as e:
                trace.mark("peer_failure", why=str(e)[:200])
                if m.watch is None or not self.job.config.protection.enabled:
                    raise
                m.recover(str(e))
                return None
        except Fenced as e:  # this host is out of the job: its supervisor stops its processes
            raise SystemExit(f"leto: process {self.job.proc_id} stops: {e}") from None

    def _step(
        self, loss_fn: LossFn | Sequence[LossFn], weight: float | Callable[[int], float] | None, tokens: int
    ) -> float:
        """Forward, backward (accumulated), reduce, clip, update, all-gather; the protection
        mode's hooks and the fault-injection points between them, in this order."""
        m = self.member
        if m.watch is not None:
            m.watch.tick()  # progress for the controller's hang check (docs/design.md)
        micro = [loss_fn] if callable(loss_fn) else list(loss_fn)
        if not micro:
            raise ValueError("step() needs a loss function or a non-empty list of them")
        work = self._work(micro, weight)
        s, mode, fault, t = m.sharded, m.mode, m.fault, m.sharded.step
        fault("forward", t + 1)
        mode.before_forward(t)
        replica, fns, w = work[0]
        loss = self._forward(fns[0], replica)
        fault("backward", t + 1)
        mode.before_backward(t)
        s.zero_grads()
        losses: dict[int, float] = {}
        others: dict[int, torch.Tensor] = {}  # the gradients of the other replicas this rank hosts
        for i, (replica, fns, w) in enumerate(work):
            if i:
                others[work[i - 1][0]] = s.flat_grad.clone()
                s.flat_grad.zero_()
                loss = self._forward(fns[0], replica)
            losses[replica] = self._backward(loss, fns, w / len(fns)) / len(fns) * w
        fault("reduce-scatter", t + 1)
        s.reduce_grads(m.dp_comm, t + 1, None if replica < 0 else (replica, others, m.replica_comms))
        m.gather_rank_state(t + 1)  # held with the gradients: a replay of t+1 finds both
        if self._max_grad_norm is not None:
            self._clip(t + 1)  # in place, before they count as held: a replay reads them clipped
        s.grad_step = t + 1
        grads = s.grads_of(t + 1)
        # over the world, each replica's loss once: when it returns anywhere, every rank holds its
        # slice's whole gradients, so no recovery finds one slice updating before another's reduction
        self._global_loss(losses)
        mode.after_reduce(t, grads)
        src, dst = s.buf_for(t), s.buf_for(t + 1)
        for c in range(s.n_chunks):
            fault("update", t + 1, c)
            mode.update_chunk(t, c, src, grads, dst)
        s.mark_held(t + 1)
        s.shard_params(t + 1)
        fault("all-gather", t + 1)
        m.dp_comm.all_gather(s.flat_param, s.param_shard)
        mode.after_gather(t)
        s.step = t + 1
        self._log.record(
            self.rank,
            self.step_count,
            self.last_loss,
            tokens,
            None if self._max_grad_norm is None else self.grad_norm,
            mode.protector,
        )
        m.persist()
        return self.last_loss

    def _work(
        self, micro: list[LossFn], weight: float | Callable[[int], float] | None
    ) -> list[tuple[int, list[Callable[[], torch.Tensor]], float]]:
        """(replica, its micro-batches' loss functions, its weight) for each replica this rank
        computes: one, numbered -1, for loss functions of the rank's share."""
        if not _takes_replica(micro[0]):
            if callable(weight):
                raise TypeError("a weight function needs loss functions of the replica (lambda replica: ...)")
            return [(-1, micro, 1.0 / self.dp_size if weight is None else weight)]  # type: ignore[list-item]

        def share(r: int) -> float:
            return 1.0 / self.replicas if weight is None else weight(r) if callable(weight) else weight

        return [
            (r, [lambda fn=fn, r=r: fn(r) for fn in micro], share(r))  # type: ignore[misc]
            for r in hosted(self.replicas, self.dp_size, self.dp_rank)
        ]

    def _global_loss(self, losses: dict[int, float]) -> None:
        """`last_loss`: the weighted losses summed over replicas (a world all-reduce, each replica
        counted on its TP rank 0 only). Per replica in a vector, added in replica order: the same
        bits whichever processes computed them."""
        m = self.member
        counts = m.tp_comm is None or m.tp_comm.rank == 0
        if -1 in losses:
            self._loss.fill_(losses[-1] if counts else 0.0)
            m.comm.all_reduce(self._loss)
            self.last_loss = float(self._loss.item())
            return
        vec = torch.zeros(self.replicas, dtype=torch.float64, device=self.job.device)
        if counts:
            for r, value in losses.items():
                vec[r] = value
        m.comm.all_reduce(vec)
        total = 0.0
        for value in vec.tolist():
            total += value
        self.last_loss = total

    def _forward(self, loss_fn: Callable[[], torch.Tensor], replica: int = -1) -> torch.Tensor:
        if replica >= 0 and self._seed is not None:  # the replica's stream, whichever rank hosts it
            reseed(self._seed, self.step_count, replica)
        if self._autocast is None:
            return loss_fn()
        with torch.autocast(self.job.device.type, dtype=self._autocast):
            return loss_fn()

    def _backward(self, loss: torch.Tensor, micro: list[Callable[[], torch.Tensor]], wm: float) -> float:
        """Backward passes of the first micro-batch's `loss` and of the others' (each weighted
        `wm`) into the flat gradients: one reduction per optimizer step. The sum of the losses."""
        (loss * wm).backward()
        total = loss.item()
        for fn in micro[1:]:
            more = self._forward(fn)
            (more * wm).backward()
            total += more.item()
        return total

    def _clip(self, step: int) -> None:
        """Scale the reduced gradients of `step` to a global norm of at most `max_grad_norm`
        (`clip_grad_norm_` semantics)."""
        m = self.member
        self.grad_norm = m.sharded.grad_norm(m.dp_comm, self.dp_size, step, m.tp_comm)
        coef = min(1.0, self._max_grad_norm / (self.grad_norm + 1e-6))
        if coef < 1.0:
            m.sharded.scale_grads(step, coef)

    def close(self) -> None:
        """Leave the job: stop heartbeating and unmap protection. The process group stays usable
        for collectives after the loop (e.g. `full_state()`)."""
        self.member.close()

    def register_state(self, name: str, obj: Stateful) -> None:
        """Carry `obj` (with `state_dict()`/`load_state_dict()`, e.g. a stateful data loader)
        through recoveries: after one, every rank's object holds what it held at the end of the
        recovery step. Its state is captured after each step's backward pass (so a loader has
        fetched that step's batch) and sent to every rank: keep it small. Register on every
        rank, before its first `step()`; an adopting shadow may register once it has a rank, and
        then receives the state of the rank it adopted. The state must be tensors and plain data
        (dict, list, tuple, str, bytes, int, float, bool, None): anything else is refused here, with
        a TypeError naming where it is (what a peer sends is decoded without running code)."""
        self.member.rank_state.register(name, obj)

    # ----- state
    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter and optimizer tensor, unsharded, in canonical order (a collective)."""
        return self.member.full_state()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's plain PyTorch state dict (CPU copies): parameters are replicated on every
        rank and buffers synchronized, so any rank can call it, no collective; load it into the
        model without Leto (`model.load_state_dict(...)`). With tensor parallelism it is the
        full, unsharded model, loadable into the plain one, and a collective of the rank's TP
        group (every rank of it calls it)."""
        tp = self.member.tp_comm
        state = self.model.state_dict() if tp is None else gather_full_state_dict(self.model, tp)
        return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}

    def digest(self) -> str:
        """sha256 of the step, all parameters, all optimizer state and the module buffers;
        independent of sharding (a collective)."""
        # buffers are the same on every rank
        return state_digest(self.step_count, self.full_state(), self.member.rank_state.update_digest)

    def _finish(self) -> str:
        """Compute the final digest and publish the result to the controller (rank 0)."""
        digest = self.digest()
        if self.rank == 0:
            self.job.store.set(
                keys.RESULT, json.dumps({"steps": self.step_count, "final_loss": self.last_loss, "digest": digest})
            )
        return digest


def _takes_replica(fn: LossFn) -> bool:
    """Whether a loss function is written per replica (`lambda replica: ...`): it has a
    positional parameter without a default."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: called without arguments
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return any(p.kind in positional and p.default is inspect.Parameter.empty for p in params)
