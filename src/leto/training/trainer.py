"""`leto.Trainer`: sharded data parallel (ZeRO-1) on flat buffers, the training step Leto protects.

Parameters are replicated; gradients are reduce-scattered; fp32 master weights and AdamW moments
are sharded across ranks and laid out as fixed-size chunks `state[c] = (master, exp_avg,
exp_avg_sq)` so each chunk is one contiguous, self-contained unit of unique state; updated
parameters are all-gathered. The step is here; the state and its buffers are in
`leto.training.shard`, membership and recovery in `leto.training.member`, what each protection
mode adds to the step in `leto.training.protection_modes`.

With tensor parallelism (`--tp T`, a model whose layers are cut with
`leto.training.tensor_parallel`) each rank holds its TP slice of the model, and with pipeline
stages (`--pp P`, the model given as a `leto.training.pipeline.Pipeline`) its stage's slice;
ZeRO-1 runs per slice over the rank's DP group; the gradient norm and the digest cover the
whole model.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch
import torch.nn as nn

from leto.protection.layout import STATE_ROWS
from leto.protocol import keys
from leto.runtime import trace
from leto.runtime.comm import PeerFailure, backend_for, reduction_replicates
from leto.runtime.env import Job, await_keys
from leto.runtime.etcd_errors import Fenced
from leto.runtime.ordered import contiguous_part, hosted
from leto.training.flat import state_digest
from leto.training.member import RankMember
from leto.training.metrics import StepLog
from leto.training.optim import AdamW, Optimizer
from leto.training.param_groups import ParamGroups
from leto.training.pipeline import Pipeline, one_f_one_b, stages_gather, tied_range
from leto.training.rank_state import RankState, Stateful, reseed
from leto.training.shard import ShardedState
from leto.training.tensor_parallel import gather_full_state_dict, tp_layout
from leto.training.tp_slices import SliceLayout

LossFn = Callable[[], torch.Tensor] | Callable[[int], torch.Tensor]

T = TypeVar("T")
DEFAULT_CHUNK_BYTES = 12 * 16384  # 192 KiB: 16384 elements of (master, exp_avg, exp_avg_sq)

# What users see of a `Trainer` (docs/porting.md); `tests/test_public_surface.py` holds it to this.
PUBLIC_API = (
    "job",
    "model",
    "pipeline",
    "stage",
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
        model: nn.Module | Pipeline,
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
        mesh = job.config.mesh
        self.pipeline, self.stage, layout_numel = _pipeline_of(model, job, param_groups)
        if self.pipeline is not None:
            model = self.pipeline.build(self.stage)
        self.job, self.model = job, model.to(job.device)
        self._optimizer = optimizer or AdamW()
        params = _trainable(model)
        groups = ParamGroups(params, self._optimizer, param_groups or [])
        self._seed, self._max_grad_norm, self._autocast = seed, max_grad_norm, autocast
        self.grad_norm = float("nan")  # the last step's global gradient norm (before clipping)
        rank_state = RankState(model)
        if self.pipeline is not None and rank_state.buffers:
            raise ValueError("pipeline stages with persistent buffers are not supported: make them non-persistent")
        backend = backend_for(job.device, job.world_size)
        # on gloo every rank holds the whole reduced gradient: the keepers need no copy of it
        # (with model parallelism: where a slice has DP peers to hold it)
        replicated_grads = (
            reduction_replicates(backend) and not job.config.protection.grads and job.world_size > mesh.replica_ranks
        )
        sharded = ShardedState(
            params,
            groups,
            chunk_bytes // (STATE_ROWS * 4),
            job.device,
            job.world_size // mesh.replica_ranks,
            protection=job.config.protection.enabled,
            replicated_grads=replicated_grads,
            protect_every=job.config.protection.every,
            layout_numel=layout_numel,
        )
        slices = None
        if mesh.tp > 1:
            slices = SliceLayout(model, params, 0 if job.mesh is None else job.mesh.tp_rank, mesh.tp)
        self.member = RankMember(job, sharded, rank_state, backend, slices)  # what recovery and harnesses work with
        if self.pipeline is not None:
            self.member.restage = self._restage
            self._mark_tied()
        self._loss = torch.zeros(1, device=job.device)
        self.last_loss = float("nan")  # the last step's global loss
        self._log = StepLog(job)

    def _restage(self, stage: int) -> None:
        """Become pipeline stage `stage` (a shadow adopting a rank of another stage): its module,
        bound to the same buffers; the values come from the recovery."""
        if stage == self.stage:
            return
        model = self.pipeline.build(stage).to(self.job.device)
        params = _trainable(model)
        m = self.member
        m.sharded.rebind(params, ParamGroups(params, self._optimizer, []), None)
        if m.slices is not None:
            m.slices = SliceLayout(model, params, m.slices.tp_rank, m.slices.tp)
        self.model, self.stage = model, stage
        self._mark_tied()

    def _mark_tied(self) -> None:
        """On the last of several stages: its copy of the tied weight counts in no global norm
        and is left out of the whole model's state."""
        pipe, m = self.pipeline, self.member
        last = pipe.stages > 1 and self.stage == pipe.stages - 1
        where = tied_range(self.model, m.sharded.params, pipe.tied) if last else None
        m.sharded.uncounted = where
        m.tied_plain = None
        if where is not None:  # its place among the plain (TP-unsharded) parameters
            tp, layout = self.job.config.mesh.tp, tp_layout(self.model)
            offset = 0
            for name, p in self.model.named_parameters():
                if name == pipe.tied:
                    m.tied_plain = range(offset, offset + p.numel() * (tp if layout.get(name) else 1))
                    break
                if p.requires_grad:
                    offset += p.numel() * (tp if layout.get(name) else 1)

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
        while True:
            while self.step_count < total:
                if self.member.comm is None:  # its replica was dropped and the job ended before it was adopted again
                    return
                if self._seed is not None:
                    reseed(self._seed, self.step_count, self.dp_rank)
                yield self.step_count
            if self.member.comm is None:
                return
            if self._recovered(self._finish):
                break
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
        if self.member.comm is None:
            raise RuntimeError("call step() inside `for step in trainer.steps(n)`")
        return self._recovered(self._step, loss_fn, weight, tokens)

    def _recovered(self, fn: Callable[..., T], *args: object) -> T | None:
        """`fn(*args)`, or None when a failure interrupted it and the job recovered in place."""
        m = self.member
        try:
            try:
                return fn(*args)
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
        if self.pipeline is None:
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
            if self.pipeline is not None:
                losses[replica] = self._pipeline_pass(fns, replica, w, t + 1)
                continue
            if i:
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
        counts = (m.tp_comm is None or m.tp_comm.rank == 0) and (m.pp_comm is None or m.pp_comm.rank == m.pp - 1)
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

    def _pipeline_pass(self, fns: list[Callable[[], torch.Tensor]], replica: int, weight: float, step: int) -> float:
        """This stage's part of one replica's forward and backward passes, 1F1B over the
        pipeline's micro-batches (each weighted by its rows), then the tied weight's gradient
        summed over the embedding group. The replica's weighted loss on the last stage, else 0."""
        m, pipe = self.member, self.pipeline
        if len(fns) != 1:
            raise ValueError("with a pipeline, give one batch function per step: the pipeline cuts its micro-batches")
        if replica >= 0 and self._seed is not None:
            reseed(self._seed, self.step_count, replica)
        x, y = fns[0]()  # type: ignore[misc]
        rows, M = x.shape[0], pipe.microbatches
        if rows < M:
            raise ValueError(f"a batch of {rows} rows does not split into {M} micro-batches")
        parts = [contiguous_part(rows, M, i) for i in range(M)]
        xs, ys = [x[r.start : r.stop] for r in parts], [y[r.start : r.stop] for r in parts]

        def point(phase: str, mb: int) -> None:
            m.fault(phase, step, mb if phase in ("pp-send", "pp-recv") else None, M)

        with torch.autocast(self.job.device.type, dtype=self._autocast, enabled=self._autocast is not None):
            loss = one_f_one_b(
                self.model,
                m.pp_comm if m.pp_comm is not None else m.comm,
                self.stage,
                pipe.stages,
                xs,
                ys,
                lambda mb: pipe.act_shape(xs[mb]),
                point,
                [weight * len(r) / rows for r in parts],
            )
        if m.embedding_comm is not None and pipe.tied is not None:
            m.fault("tied", step)
            m.embedding_comm.all_reduce(dict(self.model.named_parameters())[pipe.tied].grad)
        return 0.0 if loss is None else loss

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
        self.grad_norm = m.sharded.grad_norm(m.dp_comm, self.dp_size, step, m.tp_comm, m.pp_comm)
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
        m = self.member
        state = self.model.state_dict() if m.tp_comm is None else gather_full_state_dict(self.model, m.tp_comm)
        if m.pp_comm is not None:
            state = self._stages_state_dict(state)
        return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}

    def _stages_state_dict(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole model's state dict from this stage's (plain, TP-unsharded) and the other
        stages' (a collective of the pipeline): each stage's names and shapes are known from
        building it on the meta device, its values come from the stage; the tied weight is the
        first stage's."""
        if any(v.dtype != torch.float32 for v in mine.values()):
            raise TypeError("the state dict of a pipeline's stages must be float32 to be gathered")
        flat = torch.cat([v.reshape(-1) for v in mine.values()])
        whole = stages_gather({"v": flat}, self.member.pp_comm, None)["v"]
        tp, out, offset = self.job.config.mesh.tp, {}, 0
        for s in range(self.pipeline.stages):
            with torch.device("meta"):
                stage = self.pipeline.build(s)
            layout = tp_layout(stage)
            for name, v in stage.state_dict().items():
                shape = list(v.shape)
                if (spec := layout.get(name)) is not None:
                    shape[spec.dim] *= tp
                n = math.prod(shape)
                out.setdefault(name, whole[offset : offset + n].view(shape))
                offset += n
        return out

    def digest(self) -> str:
        """sha256 of the step, all parameters, all optimizer state and the module buffers;
        independent of sharding (a collective)."""
        # buffers are the same on every rank
        return state_digest(self.step_count, self.full_state(), self.member.rank_state.update_digest)

    def _finish(self) -> bool:
        """The final digest (a collective); rank 0 records the result. Every other rank leaves only
        once it is recorded: a failure during the digest is then recovered by all ranks together
        and the digest done again, unless rank 0 recorded it, which ends training."""
        store = self.job.store
        self.member.fault("digest", self.step_count)
        try:
            digest = self.digest()
        except PeerFailure:
            if store.check([keys.RESULT]):  # rank 0's digest completed: nothing is left to recover
                return True
            raise
        if self.rank == 0:
            store.set(
                keys.RESULT, json.dumps({"steps": self.step_count, "final_loss": self.last_loss, "digest": digest})
            )
            return True
        watch = self.member.watch
        why = await_keys(store, [keys.RESULT], self.job.timeout_s, watch.reason if watch else lambda: None)
        if why is not None:
            raise PeerFailure(f"waiting for rank 0's result: {why}")
        return True


def _trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def _pipeline_of(
    model: nn.Module | Pipeline, job: Job, param_groups: list[dict] | None
) -> tuple[Pipeline | None, int, int]:
    """(the pipeline or None, this process's stage, the largest stage's elements): a shadow
    builds stage 0 until it adopts a rank."""
    pp = job.config.mesh.pp
    if not isinstance(model, Pipeline):
        if pp > 1:
            raise ValueError(f"--pp {pp} needs the model as a leto.training.pipeline.Pipeline of {pp} stages")
        return None, 0, 0
    if model.stages != pp:
        raise ValueError(f"a pipeline of {model.stages} stages in a job with --pp {pp}")
    if param_groups:
        raise ValueError("param_groups are not supported with a pipeline: each stage's parameters are its own")
    return model, 0 if job.mesh is None else job.mesh.pp_rank, model.largest_stage()


def _takes_replica(fn: LossFn) -> bool:
    """Whether a loss function is written per replica (`lambda replica: ...`): it has a
    positional parameter without a default."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: called without arguments
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return any(p.kind in positional and p.default is inspect.Parameter.empty for p in params)
