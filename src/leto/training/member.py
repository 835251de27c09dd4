"""This process as a member of the job: its rank, process group, generation and protection.

`RankMember` is what recovery (`leto.recovery.member.Member`), persistence and the baselines
work with; `leto.Trainer` drives it and shows users only the loop.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta

import torch

from leto.persistence import loader
from leto.persistence.ckpt_format import RESUME_FAILED, CheckpointError
from leto.persistence.writer import persister_for
from leto.protection.client import Protector
from leto.protection.layout import Geometry, Layout, ring_slots_for
from leto.protocol import keys
from leto.protocol.messages import Membership, RecoveryRecord
from leto.recovery.inject import InProcessInjector
from leto.recovery.inplace import join, latest_generation, read_message
from leto.recovery.rebuild import RecoveryError
from leto.runtime import env as rt
from leto.runtime import standby, trace
from leto.runtime.comm import Comm, PeerFailure
from leto.runtime.env import Job
from leto.runtime.membership import GenerationWatch, read_membership
from leto.runtime.mesh import Mesh, MeshComms, make_comms
from leto.training.pipeline import stages_gather
from leto.training.protection_modes import Unprotected, mode_for
from leto.training.rank_state import RankState
from leto.training.shard import ShardedState
from leto.training.tp_slices import SliceLayout


class Demoted(Exception):
    """This process's model replica was dropped from a generation: it becomes a shadow."""


def _of_sharded(name: str, doc: str) -> property:
    """A read-only view of `RankMember.sharded.<name>`."""
    return property(lambda self: getattr(self.sharded, name), doc=doc)


class RankMember:
    """A worker (or a shadow until it adopts a rank): its ZeRO-1 state (`sharded`), module
    buffers and registered state (`rank_state`), process group (`comm`), generation watch and
    membership, the protection mode of its generation (`mode`) and its persistent checkpoints.

    With tensor parallelism (`slices`: its model slice's layout) it also has a TP group
    (`tp_comm`), with pipeline stages a pipeline (`pp_comm`) and, on the first and last stage,
    the embedding group (`embedding_comm`), and a DP group (`dp_comm`), over which `sharded` is
    sharded; with one rank per replica `tp_comm` and `pp_comm` are None and `dp_comm` is `comm`.
    `restage(stage)`, where the trainer sets it, rebuilds the model as another pipeline stage (a
    shadow adopting a rank)."""

    def __init__(
        self,
        job: Job,
        sharded: ShardedState,
        rank_state: RankState,
        backend: str,
        slices: SliceLayout | None = None,
    ) -> None:
        self.job, self.sharded, self.rank_state, self.backend = job, sharded, rank_state, backend
        self.slices = slices
        self.replicated_grads = sharded.replicated_grads
        self.generation = 0
        self.recoveries: list[RecoveryRecord] = []
        self._layout_published: int | None = None  # the generation whose layout this rank 0 published
        specs = list(job.config.recovery.inject)
        self.injector = InProcessInjector(job.store, specs, job.run_dir, job.proc_id) if specs else None
        self.comm: Comm | None = None  # the world's
        self.tp_comm: Comm | None = None
        self.dp_comm: Comm | None = None
        self.pp_comm: Comm | None = None
        self.embedding_comm: Comm | None = None
        self.restage: Callable[[int], None] | None = None
        self.tied_plain: range | None = None  # the last stage's copy of a tied weight, in its plain flat state
        self.replica_comms: dict[int, Comm] = {}  # while shrunk: the group of the launch's replicas
        self.side_comms: list[Comm] = []  # this generation's recovery's own groups (`MeshComms.side`)
        self.watch: GenerationWatch | None = None
        self.membership: Membership | None = None
        self.mode: Unprotected = Unprotected(sharded)
        self._at = ("", 0)  # the last fault point passed: (phase, step)
        self.persister = persister_for(job)

    @property
    def protector(self) -> Protector | None:
        """This generation's protector (None before protection starts, or without keepers)."""
        return self.mode.protector

    # ----- the sharded state, as persistence and the baselines read it
    @property
    def step_count(self) -> int:
        """Optimizer steps applied."""
        return self.sharded.step

    def set_step(self, step: int) -> None:
        """Be at `step`, about to load that step's state into `state` (a harness's checkpoint)."""
        self.sharded.step = step
        self.sharded.mark_held(step)

    state = _of_sharded("state", "This rank's unique state at `step_count`: [n_chunks, 3, chunk_elems].")
    flat_param = _of_sharded("flat_param", "All parameters (views of it), padded to whole shards.")
    param_shard = _of_sharded("param_shard", "This rank's updated parameters, sent by the all-gather.")
    numel = _of_sharded("numel", "Elements of all trainable parameters.")
    chunk_elems = _of_sharded("chunk_elems", "Elements of one protected chunk.")
    n_chunks = _of_sharded("n_chunks", "Chunks of this rank's shard.")
    shard_elems = _of_sharded("shard_elems", "Elements of one rank's shard (whole chunks).")

    # ----- membership
    @property
    def rank(self) -> int:
        if self.job.rank is None:
            raise RuntimeError("a shadow has no rank until it adopts one")
        return self.job.rank

    @property
    def world_size(self) -> int:
        return self.job.world_size

    @property
    def tp(self) -> int:
        """Ranks per TP group (1: no tensor parallelism)."""
        return self.job.config.mesh.tp

    @property
    def pp(self) -> int:
        """Pipeline stages per replica (1: no pipeline)."""
        return self.job.config.mesh.pp

    @property
    def replica_ranks(self) -> int:
        """Ranks per model replica (tp x pp)."""
        return self.job.config.mesh.replica_ranks

    @property
    def dp_rank(self) -> int:
        """This rank's model replica: its shard of the state and its slice of the data."""
        return self.rank // self.replica_ranks

    @property
    def dp_size(self) -> int:
        """Model replicas (the rank's DP group)."""
        return self.world_size // self.replica_ranks

    @property
    def replicas(self) -> int:
        """The model replicas of the launch: the DP size at full width, fixed for the run."""
        return self.job.config.training.workers // self.replica_ranks

    def start(self) -> bool:
        """Before the first step: a zygote forks shadows (and goes on in a fork, a shadow from
        here on), a shadow waits to be adopted, a worker connects. False when this process has
        no steps to run (the zygote's server, or a shadow at shutdown). A standby host's warm
        shadow or zygote first waits, built, for the node it is bound to (`runtime.standby`)."""
        if standby.pending():
            if not standby.bind(self.job):
                return False
            if self.injector is not None:
                self.injector.store, self.injector.proc_id = self.job.store, self.job.proc_id
        if self.job.is_zygote:
            from leto.runtime.zygote import serve

            if not serve(self.job):
                return False
            if self.injector is not None:
                self.injector.store, self.injector.proc_id = self.job.store, self.job.proc_id
        if self.job.is_shadow:
            return self._wait_for_adoption()
        if self.comm is None:
            self.connect()
        return True

    def connect(self) -> None:
        """Join generation 0: its membership, the generation watch, the process group, rank 0's
        initial parameters (a collective; `Trainer.steps()` does it, a harness may do it earlier)."""
        job = self.job
        if job.proc_id != "solo":
            self.membership = read_membership(job.store, 0)
            self.watch = GenerationWatch(os.environ[rt.ENV_STORE], job.proc_id, 0, job.timeout_s)
        abort = self.watch.reason if self.watch else (lambda: None)
        comms = make_comms(self._mesh(), job.store, 0, job.timeout_s, abort, job.device, self.backend, self.replicas)
        self._use(comms, adopt=False)
        self.dp_comm.broadcast(self.flat_param, 0)  # every replica starts from the first one's initialization
        self.sharded.take_master(self.dp_rank)
        self._resume()  # --resume: start from a persistent checkpoint
        self.gather_rank_state(self.step_count)  # rank 0's buffers (resumed ones too) are everyone's
        if job.config.protection.enabled and self.membership is not None:
            self.protect(0, self.step_count)

    def enter(self, generation: int, membership: Membership) -> None:
        """Become `membership`'s member (a recovery or resize): its rank and world size, and new
        process groups (world, and with tensor parallelism TP and DP); the old ones are parked."""
        rank = membership.rank_of(self.job.proc_id)
        if rank is None and self.job.proc_id in membership.demoted:
            raise Demoted(generation)
        if rank is None:  # declared lost (e.g. its host was cut off): the others go on without it
            raise SystemExit(
                f"leto: process {self.job.proc_id} is not part of generation {generation} (it was "
                f"declared lost): it stops"
            )
        self.watch.advance(generation)
        self.generation, self.membership = generation, membership
        self.job.rank, self.job.world_size = rank, len(membership.proc_of_rank)
        adopt = self.comm is None
        if not adopt:
            self._park_groups()
            if self.sharded.grad_step is None:  # its reduction of the step in flight may still be running
                self.sharded.fresh_grads()
        job = self.job
        self._use(
            make_comms(
                self._mesh(),
                job.store,
                generation,
                job.timeout_s,
                self.watch.reason,
                job.device,
                self.backend,
                self.replicas,
            ),
            adopt,
        )

    def _park_groups(self) -> None:
        """Abandon this generation's groups (world, TP, DP, ...; one Comm without TP) and those its
        recovery built beside them."""
        if self.comm is not None:
            MeshComms(
                self.comm,
                self.tp_comm,
                self.dp_comm,
                self.replica_comms,
                self.pp_comm,
                self.embedding_comm,
                self.side_comms,
            ).close(abandon=True)
        self.side_comms = []

    def _mesh(self) -> Mesh:
        if self.world_size % self.replica_ranks:
            raise RecoveryError(
                f"a world of {self.world_size} ranks does not split into replicas of {self.replica_ranks} ranks"
            )
        return Mesh.of(self.rank, self.world_size, self.tp, self.pp)

    def _use(self, comms: MeshComms, adopt: bool) -> None:
        """Train with these groups; the model's slice is the rank's coordinates' (`adopt`: a
        shadow may take over any TP coordinate and pipeline stage)."""
        self.comm, self.tp_comm, self.dp_comm, self.replica_comms = comms.world, comms.tp, comms.dp, comms.replicas
        self.pp_comm, self.embedding_comm = comms.pp, comms.embedding
        if adopt and self.restage is not None:
            self.restage(self._mesh().pp_rank)
        mask = None
        if self.slices is not None and comms.tp is not None:
            self.slices.join(comms.tp if self.injector is None else _FaultingGroup(comms.tp, self._tp_fault), adopt)
            mask = self.slices.norm_mask(self.sharded.flat_param.numel(), self.job.device)
        self.sharded.count_in_norm(mask)

    def protect(self, generation: int, base_step: int, state: torch.Tensor | None = None, wait: bool = True) -> None:
        """Start protection of this generation: encode the full state at `base_step` (this
        rank's current shard, or `state` when the generation shards differently). With
        `wait=False` the commit is awaited by the next step, before its update (every-step
        protection only: until then the previous generation's protection still covers
        `base_step`, see docs/protection.md)."""
        state = self.state if state is None else state
        self.mode.close()
        self.mode = Unprotected(self.sharded)
        self.publish_layout(generation, base_step, state.shape[0])
        layout = read_message(self.job.store, Layout.from_json, keys.layout(generation))
        protector = Protector(
            self.job.store, layout, self.rank, self.job.job_id, self.job.timeout_s, self.watch.reason, self.job.device
        )
        self.mode = mode_for(self.sharded, protector, self.fault)
        trace.mark("protector_ready", generation=generation)
        protector.stage_deltas(base_step, None, state)
        trace.mark("base_staged", generation=generation)
        if wait or layout.protect_every > 1:
            protector.wait_delta_commit(base_step)
            self.sharded.release_kept()
        if layout.protect_every > 1:  # the next protected step's deltas start from here
            self.sharded.snapshot(base_step, state)

    def publish_layout(self, generation: int, base_step: int, state_chunks: int) -> None:
        """Rank 0: publish `generation`'s protection layout, once (a recovery does it as soon as
        the step is agreed, so the keepers set up while the lost state is decoded)."""
        if self.rank != 0 or self._layout_published == generation:
            return
        geometry = Geometry(state_chunks, self.sharded.chunk_elems)
        layout = Layout(
            generation,
            base_step,
            geometry,
            self.membership.node_of_rank,
            self.job.config.protection.ec,
            protect_every=self.job.config.protection.every,
            ring_slots=ring_slots_for(geometry),
            replicated_grads=self.replicated_grads,
        )
        self.job.store.set(keys.layout(generation), layout.to_json())
        self._layout_published = generation

    def recover(self, why: str) -> None:
        """After a peer failure (`why`): join the generation the controller announces, again
        after each further failure during the recovery."""
        while True:
            gen = latest_generation(self.job.store, self.generation)
            if gen == self.generation:  # the failure was seen here first: wait for the controller's membership
                if rt.await_keys(self.job.store, [keys.membership(gen + 1)], self.job.timeout_s) is not None:
                    raise PeerFailure(f"{why}; and no new generation was announced")
                continue
            try:
                self.recoveries.append(join(self, gen))
                return
            except Demoted:
                self._retire(gen)
                self._wait_for_adoption(gen + 1)
                return
            except PeerFailure:
                continue  # another failure during recovery: join the next generation
            except RecoveryError as e:
                self.job.store.set(keys.FATAL, f"rank {self.rank}: {e}")
                raise

    def _retire(self, generation: int) -> None:
        """Its model replica was dropped in `generation` (a shrink by whole TP groups): leave the
        groups and protection; the process stays, a shadow from here on."""
        self._park_groups()
        self.comm = self.tp_comm = self.dp_comm = self.pp_comm = self.embedding_comm = None
        self.replica_comms = {}
        self.mode.close()
        self.mode = Unprotected(self.sharded)
        if self.watch is not None:
            self.watch.stop()
        self.watch, self.generation = None, generation
        self.sharded.fresh_grads()  # whatever it reduced is no step the job will start from
        self.job.rank, self.job.role = None, "shadow"

    def _wait_for_adoption(self, first: int = 1) -> bool:
        """A shadow waits, fully initialized, until a generation from `first` on names it; False
        at shutdown."""
        gen = first
        self.job.store.set(keys.warm(self.job.proc_id), "1")
        while not self.job.shutdown_requested():
            try:  # returns as soon as generation `gen` is announced
                self.job.store.wait([keys.membership(gen)], timedelta(seconds=0.5))
            except RuntimeError:
                continue
            membership = read_membership(self.job.store, gen)
            trace.mark("shadow_plan", generation=gen)
            if membership.rank_of(self.job.proc_id) is None:
                gen += 1
                continue
            self.job.role = "worker"
            self.watch = GenerationWatch(os.environ[rt.ENV_STORE], self.job.proc_id, gen, self.job.timeout_s)
            self.generation = gen
            while True:
                try:
                    self.recoveries.append(join(self, gen))
                    return True
                except Demoted:  # dropped again with its new replica before the job went on
                    self._retire(gen)
                    break
                except RecoveryError as e:
                    self.job.store.set(keys.FATAL, f"rank {self.rank}: {e}")
                    raise
                except PeerFailure:
                    gen = latest_generation(self.job.store, gen)
                    if read_membership(self.job.store, gen).rank_of(self.job.proc_id) is None:
                        return False  # replaced again before it finished adopting
            gen += 1
        return False

    def fault(self, phase: str, step: int, chunk: int | None = None, of: int | None = None) -> None:
        """A fault injection point (--inject): chunk `chunk` of `of` (default: of the shard's)."""
        self._at = (phase, step)
        if self.injector is not None:
            self.injector.at(
                phase,
                step,
                self.rank,
                self.membership.node_of_rank if self.membership else (),
                chunk,
                self.sharded.n_chunks if of is None else of,
            )

    def _tp_fault(self) -> None:
        """The fault point inside a TP all-reduce of the forward or backward pass (in a pipeline
        stage's schedule, where the two interleave, a backward is the one autograd runs)."""
        phase, step = self._at
        if phase.startswith("pp-"):
            which = "forward" if torch.is_grad_enabled() else "backward"
        elif phase in ("forward", "backward"):
            which = phase
        else:
            return
        self.fault(f"tp-{which}", step)
        self._at = (phase, step)

    # ----- module buffers and registered state
    def gather_rank_state(self, step: int) -> None:
        """Rank 0's module buffers and every rank's registered state at `step`, to everyone (a
        collective; nothing when there is nothing to carry)."""
        if self.rank_state.active:
            procs = (
                list(self.membership.proc_of_rank)
                if self.membership is not None
                else [str(r) for r in range(self.world_size)]
            )
            self.rank_state.gather(self.comm, step, self.rank, procs)

    def restore_rank_state(self, step: int, lineage: list[str]) -> None:
        """At a recovery to `step` (a collective): buffers and registered state as they were at
        the end of `step` (`lineage`: this process, then those whose rank it continues)."""
        # always a collective: an adopter may not have registered its state yet
        held = self.rank_state.restore(self.comm, step, self.rank, self.world_size, lineage)
        if not held and self.rank_state.buffers:
            raise RecoveryError(f"no member holds the module buffers of step {step}")

    def extra_state(self) -> dict:
        """This rank's module buffers and registered user state now (for a persistent checkpoint)."""
        return self.rank_state.state()

    def load_extra_state(self, state: dict) -> None:
        self.rank_state.load(state)

    # ----- state
    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter and optimizer tensor, unsharded, in canonical order (a collective)."""
        if self.comm is None:
            raise RuntimeError("not connected")
        full = self.sharded.full_state(self.dp_comm, self.dp_size)
        if self.tp_comm is not None:
            full = self.slices.gather(full, self.tp_comm)
        if self.pp_comm is not None:
            full = stages_gather(full, self.pp_comm, self.tied_plain)
        return full

    def persist(self) -> None:
        """After a completed step: maybe start this rank's part of a persistent checkpoint
        (a host copy now, the write in DCP's thread)."""
        if self.persister is not None:
            self.persister.after_step(self)

    def _resume(self) -> None:
        """At the start of a `--resume` job: load this rank's state from the checkpoint."""
        target = loader.resume_target(self.job)
        if target is None:
            return
        s = self.sharded
        try:  # with tensor parallelism: this rank's slice, sharded over its DP group
            got = loader.load(
                *target, self.rank, self.world_size, s.numel, s.n_chunks, s.chunk_elems, self.replica_ranks
            )
        except CheckpointError as e:  # a corrupt or hostile checkpoint: the job stops with one line
            self.job.store.set(keys.FATAL, f"rank {self.rank}: {RESUME_FAILED} {e}")
            os._exit(1)  # at once: an orderly exit tears down gloo's threads noisily
        s.load(got.shard, got.params, got.step, self.dp_rank)
        self.load_extra_state(got.extra)

    def close(self) -> None:
        """Stop heartbeating, finish persisting and unmap protection; the process group stays
        usable."""
        if self.watch is not None:
            self.watch.stop()
        if self.persister is not None:
            self.persister.close()
        self.mode.close()
        self.mode = Unprotected(self.sharded)


class _FaultingGroup:
    """The TP group as the model's layers see it under --inject: a fault point before each
    all-reduce (the layers' only collective in a step)."""

    def __init__(self, comm: Comm, point: Callable[[], None]) -> None:
        self.comm, self.point = comm, point
        self.rank, self.world_size = comm.rank, comm.world_size

    def all_reduce(self, t: torch.Tensor) -> None:
        self.point()
        self.comm.all_reduce(t)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.comm.all_gather(out, inp)
