"""Sharded data parallel (ZeRO-1) on flat buffers: the training step Leto protects.

Parameters are replicated; gradients are reduce-scattered; fp32 master weights and AdamW moments
are sharded across ranks and laid out as fixed-size chunks `state[c] = (master, exp_avg,
exp_avg_sq)` so each chunk is one contiguous, self-contained unit of unique state; updated
parameters are all-gathered.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta

import torch
import torch.nn as nn

from leto.persistence import loader
from leto.persistence.store import RESUME_FAILED, CheckpointError
from leto.persistence.writer import Persister, persister_for
from leto.protection.client import Protector
from leto.protection.layout import STATE_ROWS, Geometry, Layout
from leto.protocol import keys
from leto.protocol.messages import Plan, RecoveryRecord
from leto.recovery.inject import InProcessInjector
from leto.recovery.inplace import join, latest_generation, read_message
from leto.recovery.rebuild import RecoveryError
from leto.runtime import env as rt
from leto.runtime import runlog, trace
from leto.runtime.comm import Comm, PeerFailure, backend_for, reduction_replicates
from leto.runtime.env import Job
from leto.runtime.etcd_store import Fenced
from leto.runtime.membership import GenerationWatch, read_plan
from leto.training.flat import state_digest
from leto.training.optim import MASTER, AdamW, Optimizer
from leto.training.param_groups import ParamGroups
from leto.training.rank_state import RankState, Stateful, reseed
from leto.training.shard import ShardedState

DEFAULT_CHUNK_BYTES = 12 * 16384  # 192 KiB: 16384 elements of (master, exp_avg, exp_avg_sq)


def _of_sharded(name: str, doc: str) -> property:
    """A read-only view of `Trainer.sharded.<name>`."""
    return property(lambda self: getattr(self.sharded, name), doc=doc)


class Trainer:
    """Wraps a model and AdamW into ZeRO-1 over the job's ranks.

    >>> trainer = Trainer(model, job, AdamW(lr=1e-3))
    >>> for step in trainer.steps(100):          # shadows wait here to be adopted
    ...     x, y = batch(step, trainer.rank, trainer.world_size)
    ...     trainer.step(lambda: model(x, y))

    Every step starts with torch's, Python's and NumPy's global generators reseeded from
    (`seed`, step, rank), so dropout and random sampling replay exactly after a recovery
    (`seed=None` leaves them alone). Persistent module buffers follow DDP (rank 0's values are
    everyone's) and, like state registered with `register_state`, survive any recovery.
    """

    def __init__(self, model: nn.Module, job: Job, optimizer: Optimizer | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, seed: int | None = 0,
                 param_groups: list[dict] | None = None, max_grad_norm: float | None = None,
                 autocast: torch.dtype | None = None) -> None:
        if chunk_bytes < STATE_ROWS * 4 or chunk_bytes % (STATE_ROWS * 4):
            raise ValueError(f"chunk size must be a positive multiple of {STATE_ROWS * 4} bytes, got {chunk_bytes}")
        self.job, self.model = job, model.to(job.device)
        self.optimizer = optimizer or AdamW()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.groups = ParamGroups(self.params, self.optimizer, param_groups or [])
        self.seed = seed
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm}")
        self.max_grad_norm = max_grad_norm
        self.grad_norm = float("nan")  # the last step's global gradient norm (before clipping)
        self.autocast = autocast
        self.rank_state = RankState(model)
        # on gloo every rank holds the whole reduced gradient: the keepers need no copy of it
        self.backend = backend_for(job.device, job.world_size)
        self.replicated_grads = reduction_replicates(self.backend) and not job.config.protection.grads
        self.sharded = ShardedState(self.params, self.groups, chunk_bytes // (STATE_ROWS * 4), job.device,
                                    job.world_size, protection=job.config.protection.enabled,
                                    replicated_grads=self.replicated_grads, protect_every=job.config.protection.every)
        self.generation = 0
        self.recoveries: list[RecoveryRecord] = []
        self._layout_published: int | None = None  # the generation whose layout this rank 0 published
        specs = list(job.config.recovery.inject)
        self.injector = InProcessInjector(job.store, specs, job.run_dir, job.proc_id) if specs else None
        self._loss = torch.zeros(1, device=job.device)
        self.last_loss = float("nan")
        self.comm: Comm | None = None
        self.protector: Protector | None = None
        self.watch: GenerationWatch | None = None
        self.plan: Plan | None = None
        self._t_last = time.perf_counter()
        self.persister = persister_for(job)

    # ----- the sharded state (`sharded`), as users and the baselines read it
    @property
    def step_count(self) -> int:
        """Optimizer steps applied."""
        return self.sharded.step

    @step_count.setter
    def step_count(self, step: int) -> None:
        self.sharded.step = step

    state = _of_sharded("state", "This rank's unique state at `step_count`: [n_chunks, 3, chunk_elems].")
    buf_step = _of_sharded("buf_step", "The step each state buffer holds.")
    flat_param = _of_sharded("flat_param", "All parameters (views of it), padded to whole shards.")
    flat_grad = _of_sharded("flat_grad", "All gradients (views of it), laid out like `flat_param`.")
    param_shard = _of_sharded("param_shard", "This rank's updated parameters, sent by the all-gather.")
    numel = _of_sharded("numel", "Elements of all trainable parameters.")
    chunk_elems = _of_sharded("chunk_elems", "Elements of one protected chunk.")
    n_chunks = _of_sharded("n_chunks", "Chunks of this rank's shard.")
    shard_elems = _of_sharded("shard_elems", "Elements of one rank's shard (whole chunks).")
    geometry = _of_sharded("geometry", "The chunking of this rank's shard.")
    inplace = _of_sharded("inplace", "One shard updated in place, each chunk's delta handed over as computed.")

    # ----- membership
    @property
    def rank(self) -> int:
        if self.job.rank is None:
            raise RuntimeError("a shadow has no rank until it adopts one")
        return self.job.rank

    @property
    def world_size(self) -> int:
        return self.job.world_size

    def connect(self) -> None:
        """Join generation 0: its plan, the generation watch, the process group, rank 0's
        initial parameters (a collective; `steps()` does it, a harness may do it earlier)."""
        job = self.job
        if job.proc_id != "solo":
            self.plan = read_plan(job.store, 0)
            self.watch = GenerationWatch(os.environ[rt.ENV_STORE], job.proc_id, 0, job.timeout_s)
        abort = self.watch.reason if self.watch else (lambda: None)
        self.comm = Comm(job.store, 0, self.rank, self.world_size, job.timeout_s, abort, job.device,
                         backend=self.backend)
        self.comm.broadcast(self.flat_param, 0)  # all ranks start from rank 0's initialization
        self.sharded.take_master(self.rank)
        self._resume()  # --resume: start from a persistent checkpoint
        self._gather_rank_state(self.step_count)  # rank 0's buffers (resumed ones too) are everyone's
        if job.config.protection.enabled and self.plan is not None:
            self.protect(0, self.step_count)

    def enter(self, generation: int, plan: Plan) -> None:
        """Become `plan`'s member (a recovery or resize): its rank and world size, and a new
        process group; the old one is parked."""
        rank = plan.rank_of(self.job.proc_id)
        if rank is None:  # declared lost (e.g. its host was cut off): the others go on without it
            raise SystemExit(f"leto: process {self.job.proc_id} is not part of generation {generation} (it was "
                             f"declared lost): it stops")
        self.watch.advance(generation)
        self.generation, self.plan = generation, plan
        self.job.rank, self.job.world_size = rank, len(plan.proc_of_rank)
        if self.comm is not None:
            self.comm.close(abandon=True)
            if self.sharded.grad_step is None:  # its reduction of the step in flight may still be running
                self.sharded.fresh_grads()
        self.comm = Comm(self.job.store, generation, rank, self.world_size, self.job.timeout_s, self.watch.reason,
                         self.job.device, backend=self.backend)

    def protect(self, generation: int, base_step: int, state: torch.Tensor | None = None, wait: bool = True) -> None:
        """Start protection of this generation: encode the full state at `base_step` (this
        rank's current shard, or `state` when the generation shards differently). With
        `wait=False` the commit is awaited by the next step, before its update (every-step
        protection only: until then the previous generation's protection still covers
        `base_step`, see docs/protection.md)."""
        state = self.state if state is None else state
        if self.protector is not None:
            self.protector.close()
            self.protector = None
        self.publish_layout(generation, base_step, state.shape[0])
        layout = read_message(self.job.store, Layout.from_json, keys.layout(generation))
        self.protector = Protector(self.job.store, layout, self.rank, self.job.job_id, self.job.timeout_s,
                                   self.watch.reason, self.job.device)
        trace.mark("protector_ready", generation=generation)
        self.protector.stage_deltas(base_step, None, state)
        trace.mark("base_staged", generation=generation)
        if wait or layout.protect_every > 1:
            self.protector.wait_delta_commit(base_step)
            self.sharded.release_kept()
        if layout.protect_every > 1:  # the next protected step's deltas start from here
            self.sharded.snapshot(base_step, state)

    def publish_layout(self, generation: int, base_step: int, state_chunks: int) -> None:
        """Rank 0: publish `generation`'s protection layout, once (a recovery does it as soon as
        the step is agreed, so the keepers set up while the lost state is decoded)."""
        if self.rank != 0 or self._layout_published == generation:
            return
        geometry = Geometry(state_chunks, self.sharded.chunk_elems)
        layout = Layout(generation, base_step, geometry, self.plan.node_of_rank, self.job.config.protection.ec,
                        protect_every=self.job.config.protection.every, replicated_grads=self.replicated_grads)
        self.job.store.set(keys.layout(generation), layout.to_json())
        self._layout_published = generation

    # ----- the training loop
    def steps(self, total: int) -> Iterator[int]:
        """Yield the step numbers to run (0-based); shadows wait here until the job ends."""
        if self.job.is_zygote:  # forks shadows; returns in a fork, which is a shadow from here on
            from leto.runtime.zygote import serve
            if not serve(self.job):
                return
            if self.injector is not None:
                self.injector.store, self.injector.proc_id = self.job.store, self.job.proc_id
        if self.job.is_shadow:
            if not self._wait_for_adoption():
                return
        elif self.comm is None:
            self.connect()
        while self.step_count < total:
            if self.seed is not None:
                reseed(self.seed, self.step_count, self.rank)
            yield self.step_count
        self.finish()
        self.close()

    def close(self) -> None:
        """Leave the job: stop heartbeating and unmap protection. The process group stays usable
        for collectives after the loop (e.g. `full_state()`)."""
        if self.watch is not None:
            self.watch.stop()
        if self.persister is not None:
            self.persister.close()
        if self.protector is not None:
            self.protector.close()
            self.protector = None

    def step(self, loss_fn: Callable[[], torch.Tensor] | Sequence[Callable[[], torch.Tensor]],
             weight: float | None = None, tokens: int = 0) -> float | None:
        """One training step. `loss_fn` computes this rank's loss (under `autocast` if set); a
        list of them accumulates gradients over micro-batches (each weighted 1/len), reduced
        once. `weight` is this rank's share of the global batch (default 1/world);
        `tokens` is the number of tokens in the global batch (for metrics). Returns the global loss,
        or None when a failure interrupted the step: the job recovered in place and `steps()`
        yields the step to redo next."""
        if self.comm is None:
            raise RuntimeError("call step() inside `for step in trainer.steps(n)`")
        try:
            try:
                return self._step(loss_fn, weight, tokens)
            except PeerFailure as e:
                trace.mark("peer_failure", why=str(e)[:200])
                if self.watch is None or not self.job.config.protection.enabled:
                    raise
                self._recover(str(e))
                return None
        except Fenced as e:  # this host is out of the job: its supervisor stops its processes
            raise SystemExit(f"leto: process {self.job.proc_id} stops: {e}") from None

    def _recover(self, why: str) -> None:
        while True:
            gen = latest_generation(self.job.store, self.generation)
            if gen == self.generation:  # the failure was seen here first: wait for the controller's plan
                if rt.await_keys(self.job.store, [keys.plan(gen + 1)], self.job.timeout_s) is not None:
                    raise PeerFailure(f"{why}; and no new generation was announced")
                continue
            try:
                self.recoveries.append(join(self, gen))
                return
            except PeerFailure:
                continue  # another failure during recovery: join the next generation
            except RecoveryError as e:
                self.job.store.set(keys.FATAL, f"rank {self.rank}: {e}")
                raise

    def fault(self, phase: str, step: int, chunk: int | None = None) -> None:
        """A fault injection point (--inject)."""
        if self.injector is not None:
            self.injector.at(phase, step, self.rank, self.plan.node_of_rank if self.plan else (), chunk,
                             self.sharded.n_chunks)

    def _forward(self, loss_fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        if self.autocast is None:
            return loss_fn()
        with torch.autocast(self.job.device.type, dtype=self.autocast):
            return loss_fn()

    def _clip(self, step: int) -> None:
        """Scale the reduced gradients of `step` to a global norm of at most `max_grad_norm`
        (`clip_grad_norm_` semantics). The norm is the same bits on every rank and in both
        reduction paths: per-shard sums of squares, added in rank order."""
        s = self.sharded
        W, e = self.world_size, s.shard_elems
        if self.replicated_grads:
            parts = s.flat_grad.view(W, e).double().pow(2).sum(dim=1)
        else:
            parts = torch.zeros(W, dtype=torch.float64, device=s.flat_grad.device)
            mine = s.grads_of(step).double().pow(2).sum().reshape(1)
            self.comm.all_gather(parts, mine)
        total = 0.0
        for x in parts.tolist():
            total += x
        self.grad_norm = total ** 0.5
        coef = min(1.0, self.max_grad_norm / (self.grad_norm + 1e-6))
        if coef < 1.0:
            (s.flat_grad if self.replicated_grads else s.grads_of(step)).mul_(coef)

    def _step(self, loss_fn: Callable[[], torch.Tensor] | Sequence[Callable[[], torch.Tensor]],
              weight: float | None, tokens: int) -> float:
        if self.watch is not None:
            self.watch.tick()  # progress for the controller's hang check (docs/design.md)
        w = 1.0 / self.world_size if weight is None else weight
        micro = [loss_fn] if callable(loss_fn) else list(loss_fn)
        if not micro:
            raise ValueError("step() needs a loss function or a non-empty list of them")
        s = self.sharded
        t, n = s.step, len(s.bufs)
        prot, fault = self.protector, self.fault
        every = prot.layout.protect_every if prot is not None else 1
        grads_protected = prot is not None and prot.layout.protects_grads
        fault("forward", t + 1)
        if prot is not None and t > prot.base and every == 1 and not s.inplace:  # protect the update of step t
            if grads_protected:
                prot.wait_grad_commit(t)
            prot.stage_deltas(t, s.bufs[(t - 1) % n], s.bufs[t % n], lambda c: fault("parity", t + 1, c))
        elif prot is not None and t > prot.base and every > 1 and prot.layout.protects(t):  # "Protection interval"
            prot.stage_deltas(t, s.snap, s.bufs[t % n], lambda c: fault("parity", t + 1, c))
        loss = self._forward(micro[0])
        fault("backward", t + 1)
        if prot is not None and every == 1 and not grads_protected:
            prot.wait_delta_commit(t)  # until then a replay of step t takes its gradients from flat_grad
            s.release_kept()
        s.grad_step = None
        s.flat_grad.zero_()
        wm = w / len(micro)
        (loss * wm).backward()
        total = loss.item()
        for fn in micro[1:]:  # gradient accumulation: one reduction per optimizer step
            more = self._forward(fn)
            (more * wm).backward()
            total += more.item()
        fault("reduce-scatter", t + 1)
        if self.replicated_grads:
            self.comm.all_reduce(s.flat_grad)
        else:
            self.comm.reduce_scatter(s.gbufs[(t + 1) % len(s.gbufs)].view(-1), s.flat_grad)
            s.gbuf_step[(t + 1) % len(s.gbufs)] = t + 1
        self._gather_rank_state(t + 1)  # held with the gradients: a replay of t+1 finds both
        if self.max_grad_norm is not None:
            self._clip(t + 1)  # in place, before they count as held: a replay reads them clipped
        s.grad_step = t + 1
        grads = s.grads_of(t + 1)
        self._loss.fill_(total / len(micro) * w)
        self.comm.all_reduce(self._loss)  # after the gradients: done anywhere, every rank holds them
        if grads_protected:
            prot.stage_grads(t + 1, grads, lambda c: fault("grads", t + 1, c))
            prot.wait_delta_commit(t)  # nobody needs step t-1 any more: its buffer may be overwritten
        elif prot is not None and t - 1 > prot.base and prot.layout.protects(t - 1) and every > 1:
            prot.wait_delta_commit(t - 1)  # the update overwrites protected step t-1: keep it
            s.snap.copy_(s.bufs[(t - 1) % n])
            s.snap_step = t - 1
        src, dst = s.bufs[t % n], s.bufs[(t + 1) % n]
        for c in range(s.n_chunks):
            fault("update", t + 1, c)
            if prot is None or not s.inplace:
                s.update_chunk(src[c], grads[c], dst[c], t + 1, s.offset_of(c))
                continue
            s.update_chunk(src[c], grads[c], s.next, t + 1, s.offset_of(c))  # in place: the chunk's delta is handed
            fault("parity", t + 1, c)                                          # over before the chunk is replaced
            prot.stage_delta(t + 1, c, src[c], s.next, c == s.n_chunks - 1)
            dst[c].copy_(s.next)
            s.chunk_step[c] = t + 1
        s.buf_step[(t + 1) % n] = t + 1
        s.param_shard.copy_(dst[:, MASTER, :].reshape(-1))
        fault("all-gather", t + 1)
        self.comm.all_gather(s.flat_param, s.param_shard)
        if grads_protected:  # a step completes once its gradients are protected everywhere,
            prot.wait_grad_commit(t + 1)  # so a later failure loses at most the step in flight
        s.step = t + 1
        self.last_loss = float(self._loss.item())
        self._record(tokens)
        self._persist()
        return self.last_loss

    def _gather_rank_state(self, step: int) -> None:
        if self.rank_state.active:
            procs = list(self.plan.proc_of_rank) if self.plan is not None else [str(r) for r in range(self.world_size)]
            self.rank_state.gather(self.comm, step, self.rank, procs)

    def restore_rank_state(self, step: int, lineage: list[str]) -> None:
        """At a recovery to `step` (a collective): buffers and registered state as they were at
        the end of `step` (`lineage`: this process, then those whose rank it continues)."""
        # always a collective: an adopter may not have registered its state yet
        held = self.rank_state.restore(self.comm, step, self.rank, self.world_size, lineage)
        if not held and self.rank_state.buffers:
            raise RecoveryError(f"no member holds the module buffers of step {step}")

    def register_state(self, name: str, obj: Stateful) -> None:
        """Carry `obj` (with `state_dict()`/`load_state_dict()`, e.g. a stateful data loader)
        through recoveries: after one, every rank's object holds what it held at the end of the
        recovery step. Its state is captured after each step's backward pass (so a loader has
        fetched that step's batch) and sent to every rank: keep it small. Register on every
        rank, before its first `step()`; an adopting shadow may register once it has a rank, and
        then receives the state of the rank it adopted. The state must be tensors and plain data
        (dict, list, tuple, str, bytes, int, float, bool, None): anything else is refused here, with
        a TypeError naming where it is (what a peer sends is decoded without running code)."""
        self.rank_state.register(name, obj)

    def extra_state(self) -> dict:
        """This rank's module buffers and registered user state now (for a persistent checkpoint)."""
        return self.rank_state.state()

    def load_extra_state(self, state: dict) -> None:
        self.rank_state.load(state)

    def _record(self, tokens: int) -> None:
        now = time.perf_counter()
        dt, self._t_last = now - self._t_last, now
        if self.rank == 0 and self.job.run_dir is not None:
            rec = {"step": self.step_count, "loss": self.last_loss, "step_s": round(dt, 6),
                   "tokens_per_s": round(tokens / dt, 1) if tokens else None, "time": time.time()}
            if self.max_grad_norm is not None:
                rec["grad_norm"] = round(self.grad_norm, 6)
            if self.protector is not None:  # time the training thread spent on protection
                rec.update({k: round(v, 6) for k, v in self.protector.spent.items()})
                self.protector.spent = dict.fromkeys(self.protector.spent, 0.0)
            runlog.append(self.job.run_dir, rec)
            self.job.store.set(keys.PROGRESS, json.dumps(rec))  # the coordinator's view of progress

    # ----- state
    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter and optimizer tensor, unsharded, in canonical order (a collective)."""
        if self.comm is None:
            raise RuntimeError("not connected")
        return self.sharded.full_state(self.comm, self.world_size)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's plain PyTorch state dict (CPU copies): parameters are replicated on every
        rank and buffers synchronized, so any rank can call it, no collective; load it into the
        model without Leto (`model.load_state_dict(...)`)."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def digest(self) -> str:
        """sha256 of the step, all parameters, all optimizer state and the module buffers;
        independent of sharding."""
        # buffers are the same on every rank
        return state_digest(self.step_count, self.full_state(), self.rank_state.update_digest)

    def finish(self) -> str:
        """Compute the final digest and publish the result to the controller (rank 0)."""
        digest = self.digest()
        if self.rank == 0:
            self.job.store.set(keys.RESULT, json.dumps(
                {"steps": self.step_count, "final_loss": self.last_loss, "digest": digest}))
        return digest

    # ----- persistence (issue 12 item 4): a checkpoint every K steps, and --resume
    def _persist(self) -> None:
        """After a completed step: maybe start this rank's part of a persistent checkpoint
        (a host copy now, the write in DCP's thread)."""
        if self.persister is not None:
            self.persister.after_step(self)

    def _resume(self) -> None:
        """At the start of a `--resume` job: load this rank's state from the checkpoint."""
        target = loader.resume_target()
        if target is None:
            return
        s = self.sharded
        try:
            got = loader.load(*target, self.rank, self.world_size, s.numel, s.n_chunks, s.chunk_elems)
        except CheckpointError as e:  # a corrupt or hostile checkpoint: the job stops with one line
            self.job.store.set(keys.FATAL, f"rank {self.rank}: {RESUME_FAILED} {e}")
            os._exit(1)  # at once: an orderly exit tears down gloo's threads noisily
        s.load(got.shard, got.params, got.step, self.rank)
        self.load_extra_state(got.extra)

    def _wait_for_adoption(self) -> bool:
        """A shadow waits, fully initialized, until a generation names it; False at shutdown."""
        gen = 1
        self.job.store.set(keys.warm(self.job.proc_id), "1")
        while not self.job.shutdown_requested():
            try:  # returns as soon as generation `gen` is announced
                self.job.store.wait([keys.plan(gen)], timedelta(seconds=0.5))
            except RuntimeError:
                continue
            plan = read_plan(self.job.store, gen)
            trace.mark("shadow_plan", generation=gen)
            if plan.rank_of(self.job.proc_id) is None:
                gen += 1
                continue
            self.job.role = "worker"
            self.watch = GenerationWatch(os.environ[rt.ENV_STORE], self.job.proc_id, gen, self.job.timeout_s)
            self.generation = gen
            while True:
                try:
                    self.recoveries.append(join(self, gen))
                    return True
                except RecoveryError as e:
                    self.job.store.set(keys.FATAL, f"rank {self.rank}: {e}")
                    raise
                except PeerFailure:
                    gen = latest_generation(self.job.store, gen)
                    if read_plan(self.job.store, gen).rank_of(self.job.proc_id) is None:
                        return False  # replaced again before it finished adopting
        return False

