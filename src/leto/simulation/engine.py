"""Discrete-event simulation of one synchronous training job under four recovery policies.

The job-level failure stream is the superposition of per-GPU Poisson processes, so it is
drawn directly: `K ~ Poisson(N x rate x horizon)` failure times, uniform on the horizon,
each with a root-cause class drawn from the published mix (vectorised numpy, no per-GPU
loop). All policies see the same stream (common random numbers). The event loop then visits
failures and spare returns only -- a few thousand events for 131,072 GPUs over 30 days.

Policies:

* `checkpoint-restart` -- blocking checkpoints every Daly-optimal interval; a failure
  restarts the whole job (respawn, rendezvous, communicator init over all N ranks, checkpoint
  load) and loses the work since the last checkpoint; a lost node needs a spare or waits.
* `memory-restart` -- Gemini-like: a checkpoint to CPU memory (local + peer copy) every
  step; a failure still restarts the whole job, but loads from memory and loses <= 1 step.
* `torchft` -- replica fault tolerance: a failure of any rank restarts that rank's whole model
  replica (tp x pp GPUs, every stage of its pipeline), which heals from a peer replica while the
  others reconfigure and go on without it, losing the step in flight.
* `leto` -- in place: survivors keep running, a shadow trainer adopts the failed rank(s),
  lost optimizer shards are decoded from tier 1 (inside a node) or tier 2 (across nodes),
  only the communicators containing the failed ranks (its TP, PP and DP groups) are rebuilt;
  with no spare left the job shrinks by the model replica(s) holding the missing node (tp x pp
  GPUs: every stage of a pipeline) and grows back when nodes return. How
  fast it runs while shrunk depends on the training loop (`shrink_throughput`): `balanced`
  re-splits the global batch over the replicas left, `exact` keeps the launch's replicas and
  hosts several on some ranks.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from leto.persistence.interval import daly_interval_s

from .assumptions import Assumptions, assumption_fields
from .calibration import CALIBRATION_UNITS, Calibration, load_calibration
from .failures import DETECTION_CLASSES, LLAMA3_FAILURES, LLAMA3_MTBF_GPU_HOURS, FailureClass, failure_mix
from .scaling import (
    checkpoint_bytes_per_gpu,
    checkpoint_read_s,
    checkpoint_write_s,
    comm_init_s,
    dp_degree,
    optimizer_bytes_per_gpu,
    step_time_s,
    weight_bytes_per_gpu,
)
from .stage_loss import StageLoss, mesh_of, stage_loss
from .units import DAY, GB, HOUR

__all__ = [
    "LOSS_KEYS",
    "POLICIES",
    "FailureStream",
    "PolicyCosts",
    "PolicyResult",
    "SHRINK_MODES",
    "Scenario",
    "SimulationResult",
    "SweepPoint",
    "build_costs",
    "closed_form_checkpoint_restart",
    "d2h_bps",
    "draw_failures",
    "free_host_cores",
    "input_figures",
    "leto_protection",
    "mesh_json",
    "policies_for",
    "shrink_throughput",
    "simulate",
    "stage_loss_cost",
    "sweep",
    "sweep_sizes",
]

POLICIES = ("checkpoint-restart", "memory-restart", "torchft", "leto")
MAX_EXPECTED_FAILURES = 1e7
LOSS_KEYS = ("protection", "lost_work", "detection", "recovery", "waiting_for_spares", "shrink")
SHRINK_MODES = ("balanced", "exact")


def shrink_throughput(mode: str, gpus: int, lost_gpus: int) -> float:
    """Fraction of full-width throughput of a job of `gpus` GPUs running without `lost_gpus`.

    `balanced` (a loss function of the rank's share): the global batch is re-split over the
    replicas left, `(R - s) / R`. `exact` (a loss function of the replica): the R replicas of
    the launch stay, the D = R - s ranks left host ceil or floor of R / D each, and a step
    takes as long as the busiest: `1 / ceil(R / D)`. R / D = gpus / (gpus - lost_gpus).
    """
    if mode == "balanced":
        return max(0.0, 1.0 - lost_gpus / gpus)
    if mode == "exact":
        left = gpus - lost_gpus
        return 1.0 / -(-gpus // left) if left > 0 else 0.0
    raise ValueError(f"unknown shrink mode {mode!r} (choose from {', '.join(SHRINK_MODES)})")


@dataclass(frozen=True)
class Scenario:
    """What to simulate. `spares=None` means ceil(spare_fraction x nodes), at least 1;
    `shrink` is how a shrunk Leto job runs (`shrink_throughput`)."""

    gpus: int = 131072
    gpus_per_node: int = 8
    days: float = 30.0
    mtbf_gpu_hours: float = LLAMA3_MTBF_GPU_HOURS
    spares: int | None = None
    seed: int = 0
    shrink: str = "balanced"
    replica: int = 0
    assumptions: Assumptions = field(default_factory=Assumptions)
    failure_classes: tuple[FailureClass, ...] = LLAMA3_FAILURES

    def validate(self) -> None:
        """Raise ValueError with a user-facing message if the scenario is not simulable."""
        a = self.assumptions
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus <= 0:
            raise ValueError(f"--gpus must be a positive integer, got {self.gpus!r}")
        g = self.gpus_per_node
        if isinstance(g, bool) or not isinstance(g, int) or g <= 0:
            raise ValueError(f"--gpus-per-node must be a positive integer, got {g!r}")
        if self.gpus % g:
            raise ValueError(f"--gpus {self.gpus} is not a multiple of --gpus-per-node {g}")
        replica = a.tp * a.pp
        if self.gpus % replica:
            raise ValueError(
                f"--gpus {self.gpus} is not a multiple of tp*pp = {a.tp}*{a.pp} = {replica} (one model "
                f"replica: a pipeline of --pp {a.pp} stages of --tp {a.tp} GPUs)"
            )
        if not (math.isfinite(self.days) and self.days > 0):
            raise ValueError(f"--days must be a positive number, got {self.days!r}")
        if math.isnan(self.mtbf_gpu_hours) or self.mtbf_gpu_hours <= 0:
            raise ValueError(f"--mtbf-gpu-hours must be > 0 (inf = no failures), got {self.mtbf_gpu_hours!r}")
        if self.spares is not None and (not isinstance(self.spares, int) or self.spares < 0):
            raise ValueError(f"--spares must be an integer >= 0, got {self.spares!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"--seed must be an integer >= 0, got {self.seed!r}")
        if self.shrink not in SHRINK_MODES:
            raise ValueError(f"--shrink must be one of {', '.join(SHRINK_MODES)}, got {self.shrink!r}")
        if free_host_cores(a, g) <= 0:
            raise ValueError(
                f"no host cores left for protection: host_cores_per_node "
                f"{a.host_cores_per_node} - gpus per node {g} x train_cores_per_gpu "
                f"{a.train_cores_per_gpu:g} <= 0 (change with --set)"
            )
        expected = self.horizon_s / self.job_mtbf_s
        if expected > MAX_EXPECTED_FAILURES:
            raise ValueError(
                f"about {expected:.3g} failures expected; more than {MAX_EXPECTED_FAILURES:.0e} "
                f"is too many to simulate, shorten --days"
            )

    @property
    def nodes(self) -> int:
        """Nodes in the job."""
        return self.gpus // self.gpus_per_node

    @property
    def spare_nodes(self) -> int:
        """Size of the spare pool."""
        if self.spares is not None:
            return self.spares
        return max(1, math.ceil(self.assumptions.spare_fraction * self.nodes - 1e-9))

    @property
    def horizon_s(self) -> float:
        """Simulated wall time."""
        return self.days * DAY

    @property
    def job_mtbf_s(self) -> float:
        """Mean time between failures of the whole job: per-GPU MTBF / N."""
        return self.mtbf_gpu_hours * HOUR / self.gpus


# --------------------------------------------------------------------------- failure stream


@dataclass(frozen=True)
class FailureStream:
    """Job-level failures: times (sorted), node-losing flags, detection-class indices."""

    times: np.ndarray
    node_lost: np.ndarray
    detection: np.ndarray


def draw_failures(sc: Scenario) -> FailureStream:
    """Draw the superposed Poisson failure stream of `sc.gpus` GPUs in bulk."""
    rng = np.random.default_rng((sc.seed, sc.replica))
    horizon = sc.horizon_s
    rate = 0.0 if math.isinf(sc.job_mtbf_s) else 1.0 / sc.job_mtbf_s
    count = int(rng.poisson(rate * horizon)) if rate > 0 else 0
    times = np.sort(rng.uniform(0.0, horizon, count))
    weights = np.array([c.count for c in sc.failure_classes], dtype=float)
    cls = rng.choice(len(weights), size=count, p=weights / weights.sum())
    lost = np.array([c.node_lost for c in sc.failure_classes], dtype=bool)[cls]
    det = np.array([DETECTION_CLASSES.index(c.detection) for c in sc.failure_classes])[cls]
    return FailureStream(times, lost, det)


# --------------------------------------------------------------------------- policy costs


@dataclass(frozen=True)
class PolicyCosts:
    """Per-event costs of one policy on one cluster size (seconds).

    `work_s` of useful compute is committed by `commit_s` of protection (checkpoint-restart:
    the Daly interval and the checkpoint; others: one step and its per-step protection).
    A shrink drops `shrink_gpus` GPUs (`shrink_nodes` nodes) until enough nodes are back. With
    `out_s > 0` (torchft) a failure also leaves `out_gpus` GPUs (`out_node_gpus` when the node
    is lost) out of the job for `out_s` after detection, or until a spare node arrives.
    """

    policy: str
    work_s: float
    commit_s: float
    detect_s: tuple[float, float, float]
    recover_s: float
    recover_node_s: float
    shrink: bool = False
    shrink_recover_s: float = 0.0
    grow_s: float = 0.0
    redo_s: float = 0.0
    shrink_nodes: int = 1
    shrink_gpus: int = 0
    shrink_mode: str = "balanced"
    replica_gpus: int = 1
    out_s: float = 0.0
    out_gpus: int = 0
    out_node_gpus: int = 0
    components: dict[str, float] = field(default_factory=dict)


def _replica_unit_gpus(a: Assumptions, gpus_per_node: int) -> int:
    """GPUs that leave the job with a lost node: whole replicas on whole nodes.

    The model replicas holding the lost node go (a replica of tp x pp GPUs spans several nodes,
    whose healthy ones become spares; a node holds several replicas smaller than itself): the
    least common multiple of the replica and the node.
    """
    return math.lcm(a.tp * a.pp, gpus_per_node)


def _exposed(a: Assumptions, background_s: float, step_s: float) -> float:
    """Part of per-step background protection work that the step's compute cannot hide."""
    return max(0.0, background_s - a.protect_overlap * step_s)


def free_host_cores(a: Assumptions, gpus_per_node: int) -> float:
    """Host cores per node that GPU training leaves idle (where the keepers' work runs)."""
    return a.host_cores_per_node - gpus_per_node * a.train_cores_per_gpu


def d2h_bps(a: Assumptions, cal: Calibration) -> float:
    """Device-to-host bytes/s per GPU: measured `d2h_gbps` if a GPU run gave it, else PCIe."""
    return (cal.d2h_gbps if cal.d2h_gbps is not None else a.pcie_gbps) * GB


def leto_protection(sc: Scenario, cal: Calibration) -> dict[str, float]:
    """Leto's per-step protection cost on `sc` from the measured CPU per byte (simulation.md).

    Per GPU: `b` bytes of optimizer state (ZeRO-1), `moved = gamma b` bytes moved a step.
    Host CPU per node `c G moved` spread over the free host cores; device-to-host copy
    `moved / d2h`; tier-2 transfer `tau b tier2_m / net`. The copy is on the critical path
    except its `d2h_overlap` part; host work, tier-2 and the overlapped copy are hidden up to
    `protect_overlap x step` and add beyond it.
    """
    a, n, g = sc.assumptions, sc.gpus, sc.gpus_per_node
    step = step_time_s(a)
    b = optimizer_bytes_per_gpu(a, n)
    moved = cal.protect_moved_per_state_byte * b
    cpu_node = cal.protect_cpu_s_per_byte * g * moved
    cores = free_host_cores(a, g)
    host = cpu_node / cores
    d2h = moved / d2h_bps(a, cal)
    tier2 = cal.protect_tier2_per_state_byte * b * a.tier2_m / (a.net_gbps_per_gpu * GB)
    od = a.d2h_overlap
    background = host + tier2 + od * d2h
    exposed = _exposed(a, background, step)
    return {
        "protect_per_step_s": (1.0 - od) * d2h + exposed,
        "protect_bytes_moved_per_gpu": moved,
        "protect_host_cpu_s_per_node": cpu_node,
        "protect_free_cores_per_node": cores,
        "protect_host_s": host,
        "protect_d2h_s": d2h,
        "protect_tier2_s": tier2,
        "protect_hidden_window_s": a.protect_overlap * step,
        "protect_exposed_background_s": exposed,
    }


def build_costs(policy: str, sc: Scenario, cal: Calibration) -> PolicyCosts:
    """Scale the calibrated component costs to `sc` for `policy`.

    The communicators a failure makes each policy build are the mesh's (`stage_loss`).
    """
    a, n = sc.assumptions, sc.gpus
    net, pcie = a.net_gbps_per_gpu * GB, a.pcie_gbps * GB
    step = step_time_s(a)
    mesh = mesh_of(a, n)
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r} (choose from {', '.join(POLICIES)})")
    loss = stage_loss(policy, mesh)
    unit = _replica_unit_gpus(a, sc.gpus_per_node)
    if policy == "checkpoint-restart":
        delta = checkpoint_write_s(a, cal, n)
        tau = daly_interval_s(delta, sc.job_mtbf_s)
        if math.isinf(tau):  # no failures: never checkpoint
            delta = 0.0
        load = checkpoint_read_s(a, cal, n)
        init = comm_init_s(a, sum(loss.stall_groups))
        restart = cal.cr_restart_fixed_s + init + load
        return PolicyCosts(
            policy,
            tau,
            delta,
            (cal.cr_detect_s or 0.0, a.baseline_node_detect_s, a.baseline_hang_detect_s),
            restart,
            restart,
            components={
                "checkpoint_s": delta,
                "interval_s": tau,
                "restart_fixed_s": cal.cr_restart_fixed_s,
                "comm_init_s": init,
                "load_s": load,
                "restart_s": restart,
            },
        )
    if policy == "memory-restart":
        b = checkpoint_bytes_per_gpu(a, n)
        copy, od = b / d2h_bps(a, cal), a.d2h_overlap  # the same GPU-to-host copy as Leto's
        protect = (1.0 - od) * copy + _exposed(a, od * copy + (a.gemini_replicas - 1) * b / net, step)
        if cal.mr_restore_s and cal.bench_state_bytes:
            local = b * cal.mr_restore_s / cal.bench_state_bytes
        else:
            local = b / cal.host_bps + b / pcie
        remote = b / net + b / pcie
        init = comm_init_s(a, sum(loss.stall_groups))
        fixed = cal.mr_restart_fixed_s
        return PolicyCosts(
            policy,
            step,
            protect,
            (cal.mr_detect_s or 0.0, a.baseline_node_detect_s, a.baseline_hang_detect_s),
            fixed + init + local,
            fixed + init + remote,
            components={
                "protect_per_step_s": protect,
                "restart_fixed_s": fixed,
                "comm_init_s": init,
                "load_local_s": local,
                "load_peer_s": remote,
                "restart_s": fixed + init + local,
            },
        )
    if policy == "torchft":
        reconfigure = cal.torchft_reconfigure_s + comm_init_s(a, sum(loss.stall_groups))
        replica_state = checkpoint_bytes_per_gpu(a, mesh.replica_gpus)  # not sharded across replicas
        heal = replica_state / net
        replica_init = comm_init_s(a, sum(loss.out_groups))
        out = cal.cr_restart_fixed_s + replica_init + heal
        return PolicyCosts(
            policy,
            step,
            0.0,
            (cal.torchft_heartbeat_s, a.torchft_timeout_s, a.torchft_timeout_s),
            reconfigure,
            reconfigure,
            grow_s=reconfigure,
            replica_gpus=mesh.replica_gpus,
            out_s=out,
            out_gpus=loss.out_gpus,
            out_node_gpus=unit,
            components={
                "reconfigure_s": reconfigure,
                "replica_restart_fixed_s": cal.cr_restart_fixed_s,
                "replica_comm_init_s": replica_init,
                "heal_from_peer_s": heal,
                "replica_out_s": out,
            },
        )
    if policy == "leto":
        b = optimizer_bytes_per_gpu(a, n)
        w = weight_bytes_per_gpu(a)
        k1 = a.tier1_group or sc.gpus_per_node
        rebuild = cal.leto_rebuild_fixed_s + comm_init_s(a, sum(loss.stall_groups))
        measured = cal.leto_restore_bps
        tier1 = b / measured if measured else b * k1 / cal.host_bps
        tier2 = b * a.tier2_k / net
        h2d = b / pcie
        weights = w / net
        prot = leto_protection(sc, cal)
        protect = prot["protect_per_step_s"]
        redo = max(0.0, cal.leto_lost_steps - 1.0) * (step + protect)
        return PolicyCosts(
            policy,
            step,
            protect,
            (cal.leto_exit_detect_s, a.heartbeat_s, a.heartbeat_s),
            rebuild + tier1 + h2d + weights,
            rebuild + tier2 + h2d + weights,
            shrink=True,
            shrink_recover_s=rebuild + tier2 + h2d,
            grow_s=rebuild + b / net + h2d + weights,
            redo_s=redo,
            shrink_nodes=unit // sc.gpus_per_node,
            shrink_gpus=unit,
            shrink_mode=sc.shrink,
            replica_gpus=mesh.replica_gpus,
            components={
                **prot,
                "rebuild_s": rebuild,
                "tier1_decode_s": tier1,
                "tier2_decode_s": tier2,
                "weights_from_peer_s": weights,
                "h2d_s": h2d,
                "recover_process_s": rebuild + tier1 + h2d + weights,
                "recover_node_s": rebuild + tier2 + h2d + weights,
            },
        )
    raise AssertionError(policy)


def stage_loss_cost(pc: PolicyCosts, loss: StageLoss, gpus: int) -> dict[str, float]:
    """First-order price of losing one rank of one stage to a process failure (node kept).

    Every GPU stalls for the exit detection, the recovery, the redone steps and on average half
    a commit unit of lost work (half the checkpoint interval for checkpoint-restart, half a step
    for the others); `out_gpus` stay out `out_s` longer and, on rejoining, stall every GPU for
    `grow_s` (torchft). One failure at a time, no spare needed; the event loop charges the rest.
    """
    stall = pc.detect_s[0] + pc.recover_s + pc.redo_s + (pc.work_s + pc.commit_s) / 2
    rejoin = pc.grow_s if loss.out_gpus else 0.0
    gpu_s = gpus * (stall + rejoin) + loss.out_gpus * pc.out_s
    return {
        "restarted_gpus": loss.restarted_gpus,
        "restarted_stages": loss.restarted_stages,
        "rebuilt_group_ranks": sum(loss.stall_groups),
        "stalled_gpus": gpus,
        "stall_s": stall + rejoin,
        "out_gpus": loss.out_gpus,
        "out_s": pc.out_s if loss.out_gpus else 0.0,
        "gpu_hours": gpu_s / HOUR,
    }


RECORDED_ONLY = frozenset(
    {"process_start_s", "restart_new_procs_s", "allreduce_gbps", "encode_gbps", "protect_s_per_step", "memory_overhead"}
)
"""Calibration figures kept for reference that no cost law uses (docs/simulation.md)."""


def _kind(source: str) -> str:
    return "assumed" if ("PLACEHOLDER" in source or "ASSUMED" in source or "ASSUMPTION" in source) else "measured"


def input_figures(sc: Scenario, cal: Calibration) -> dict[str, dict[str, object]]:
    """Every number the simulation starts from: value, unit, measured or assumed, and source.

    `kind` is "measured" for figures from a `leto bench` run (source: file and key, with
    the derivation) and "assumed" for the rest (source: the publication or the reason).
    """
    a = sc.assumptions
    out: dict[str, dict[str, object]] = {
        "mtbf_gpu_hours": {
            "value": sc.mtbf_gpu_hours,
            "unit": "GPU-hours",
            "kind": "assumed",
            "source": (
                "Llama 3 405B: 54 d x 24 h x 16,384 GPUs / 419 unexpected interruptions (Dubey et al. 2024, Sec. 3.3.4)"
                if sc.mtbf_gpu_hours == LLAMA3_MTBF_GPU_HOURS
                else "--mtbf-gpu-hours"
            ),
        },
        "failure_mix_node_lost": {
            "value": failure_mix(sc.failure_classes)["node_lost"],
            "unit": "of failures",
            "kind": "assumed",
            "source": "Llama 3 Table 5 counts (Dubey et al. 2024) with this simulator's "
            "node-lost classification (docs/simulation.md)",
        },
    }
    defaults = Assumptions()
    for name, f in assumption_fields().items():
        value = getattr(a, name)
        source = str(f.metadata["source"])
        if value != getattr(defaults, name):
            source = f"--set {name}={value!r} (default {getattr(defaults, name)!r}: {source})"
        out[name] = {"value": value, "unit": f.metadata["unit"], "kind": "assumed", "source": source}
    for name, source in sorted(cal.sources.items()):
        out[f"calibration.{name}"] = {
            "value": getattr(cal, name),
            "unit": CALIBRATION_UNITS.get(name, ""),
            "kind": _kind(source),
            "used": name not in RECORDED_ONLY,
            "source": source,
        }
    if cal.d2h_gbps is None:
        out["calibration.d2h_gbps"] = {
            "value": a.pcie_gbps,
            "unit": "GB/s",
            "kind": "assumed",
            "source": "no GPU run has measured it ('leto bench overhead' on a GPU host writes "
            "d2h_gbps): the PCIe link rate pcie_gbps, an upper bound (pinned copies "
            "reach less)",
        }
    return out


# --------------------------------------------------------------------------- event loop


def _run(
    pc: PolicyCosts, fs: FailureStream, horizon: float, spares: int, repair_s: float, gpus: int
) -> tuple[dict[str, float], dict[str, int]]:
    """Walk failures, spare returns and replica rejoins; return time per category and event counts."""
    acc = dict.fromkeys(("useful", *LOSS_KEYS), 0.0)
    counts = {
        "failures": 0,
        "node_losses": 0,
        "shrinks": 0,
        "grows": 0,
        "waits": 0,
        "replica_restarts": 0,
        "all_replicas_out": 0,
        "max_dropped_replicas": 0,
    }
    times: list[float] = fs.times.tolist()
    lost: list[bool] = fs.node_lost.tolist()
    det: list[int] = fs.detection.tolist()
    unit = pc.work_s + pc.commit_s
    inf = math.inf

    repairs: list[float] = []
    rejoins: list[tuple[float, int]] = []  # (time, GPUs): a restarted replica is back (torchft)
    waiting: list[int] = []  # GPUs of restarting replicas waiting for a spare node (torchft)
    free = spares
    missing = 0  # nodes a restart-based job waits for
    short = 0  # GPUs the job runs without: dropped replicas (leto) or restarting ones (torchft)
    running, run_start = True, 0.0
    d_start = det_end = fill_t = charged = 0.0
    rec = redo = 0.0

    def blocked() -> bool:  # every replica is out: nothing left to run
        return pc.out_s > 0 and short >= gpus

    def charge_run(start: float, end: float, tail: bool) -> None:
        length = end - start
        if length <= 0:
            return
        if unit == 0:  # free, continuous commit
            work, prot, rest = length, 0.0, 0.0
        elif math.isinf(unit):  # never commits (checkpoint-restart without failures)
            work, prot, rest = 0.0, 0.0, length
        else:
            k = math.floor(length / unit)
            work, prot = k * pc.work_s, k * pc.commit_s
            rest = length - k * unit
        if tail:  # observed at the horizon: work in progress counts, the job goes on
            work += min(rest, pc.work_s)
            prot += max(0.0, rest - pc.work_s)
            rest = 0.0
        thr = shrink_throughput(pc.shrink_mode, gpus, min(short, gpus))
        acc["useful"] += work * thr
        acc["shrink"] += work * (1.0 - thr)
        acc["protection"] += prot
        acc["lost_work"] += rest

    def charge_down(t: float) -> None:
        nonlocal charged
        stopped = missing or blocked()
        rs = inf if stopped else max(det_end, fill_t)
        wait = "recovery" if stopped and not missing and rejoins else "waiting_for_spares"
        lo_t = charged
        for lo, hi, key in (
            (d_start, det_end, "detection"),
            (det_end, rs, wait),
            (rs, rs + rec, "recovery"),
            (rs + rec, rs + rec + redo, "lost_work"),
        ):
            span = min(hi, t) - max(lo, lo_t)
            if span > 0:
                acc[key] += span
        charged = t

    def note_dropped() -> None:
        counts["max_dropped_replicas"] = max(counts["max_dropped_replicas"], short // pc.replica_gpus)

    i, n = 0, len(times)
    while True:
        tf = times[i] if i < n else inf
        tr = repairs[0] if repairs else inf
        tj = rejoins[0][0] if rejoins else inf
        tu = inf if running or missing or blocked() else max(det_end, fill_t) + rec + redo
        t = min(tf, tr, tj, tu)
        if t >= horizon:
            if running:
                charge_run(run_start, horizon, tail=True)
            else:
                charge_down(horizon)
            break
        if t == tu:
            charge_down(tu)
            running, run_start = True, tu
            continue
        if t == tj:
            counts["grows"] += 1
            if running:  # taken back at the next quorum, between steps: the step in flight counts
                charge_run(run_start, tj, tail=True)
                running, rec, redo = False, pc.grow_s, 0.0
                d_start = det_end = fill_t = charged = tj
            else:  # rejoins within the recovery under way
                charge_down(tj)
                if blocked():
                    fill_t = tj
            short -= heapq.heappop(rejoins)[1]
            continue
        if t == tr:
            heapq.heappop(repairs)
            if missing:
                missing -= 1
                if not missing:
                    fill_t = tr
                continue
            if waiting:  # a replica waiting for a node restarts on it
                if not running:
                    charge_down(tr)  # the job may have waited for this node
                heapq.heappush(rejoins, (tr + pc.out_s, waiting.pop(0)))
                continue
            free += 1
            if pc.shrink and short and free >= pc.shrink_nodes:
                counts["grows"] += 1
                if running:  # grow back: charge at the old throughput, then reconfigure
                    charge_run(run_start, tr, tail=False)
                    running, rec, redo = False, pc.grow_s, 0.0
                    d_start = det_end = fill_t = charged = tr
                # while down, the replica rejoins within the recovery under way
                free -= pc.shrink_nodes
                short -= pc.shrink_gpus
            continue
        # a failure
        i += 1
        counts["failures"] += 1
        if running:
            charge_run(run_start, tf, tail=False)
        else:
            charge_down(tf)
        new_rec = pc.recover_s
        detected = tf + pc.detect_s[det[i - 1]]
        if lost[i - 1]:
            counts["node_losses"] += 1
            heapq.heappush(repairs, tf + repair_s)
        if pc.out_s > 0:  # the failed rank's replica restarts and stays out until healed
            counts["replica_restarts"] += 1
            out = pc.out_node_gpus if lost[i - 1] else pc.out_gpus
            if not lost[i - 1]:
                heapq.heappush(rejoins, (detected + pc.out_s, out))
            elif free:
                free -= 1
                heapq.heappush(rejoins, (detected + pc.out_s, out))
            else:
                waiting.append(out)
                counts["waits"] += 1
            short += out
            counts["all_replicas_out"] += blocked()
            note_dropped()
        elif lost[i - 1]:
            if free:
                free -= 1
                new_rec = pc.recover_node_s
            elif pc.shrink and short + pc.shrink_gpus < gpus:
                short += pc.shrink_gpus
                free += pc.shrink_nodes - 1  # healthy nodes of the dropped replica
                counts["shrinks"] += 1
                note_dropped()
                new_rec = pc.shrink_recover_s
            else:
                missing += 1
                counts["waits"] += 1
                new_rec = pc.recover_node_s
        rec = new_rec if running else max(rec, new_rec)
        redo = pc.redo_s
        running = False
        d_start = charged = tf
        det_end = detected
        if not missing:
            fill_t = tf
    return acc, counts


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class PolicyResult:
    """Outcome of one policy: productivity and lost time as fractions of wall time; what losing
    one rank of a stage costs it (`stage_loss_cost`)."""

    policy: str
    productivity: float
    lost: dict[str, float]
    events: dict[str, int]
    costs: dict[str, float]
    stage_loss: dict[str, float] = field(default_factory=dict)

    @property
    def dominant_loss(self) -> str:
        """The loss category that cost the most wall time ("none" if nothing was lost)."""
        key = max(self.lost, key=lambda k: self.lost[k])
        return key if self.lost[key] > 0 else "none"


def mesh_json(sc: Scenario) -> dict[str, int]:
    """The job's mesh: tp x pp GPUs a replica (one pipeline of pp stages), dp replicas."""
    m = mesh_of(sc.assumptions, sc.gpus)
    return {"tp": m.tp, "pp": m.pp, "dp": m.dp, "replica_gpus": m.replica_gpus}


@dataclass(frozen=True)
class SimulationResult:
    """All policies on one scenario."""

    scenario: Scenario
    results: dict[str, PolicyResult]
    failures: int
    node_losing_failures: int

    def to_json(self) -> dict[str, object]:
        """The `--json` document (see docs/simulation.md for the schema)."""
        sc = self.scenario
        doc: dict[str, object] = {
            "gpus": sc.gpus,
            "gpus_per_node": sc.gpus_per_node,
            "nodes": sc.nodes,
            "days": sc.days,
            "seed": sc.seed,
            "mtbf_gpu_hours": sc.mtbf_gpu_hours,
            "job_mtbf_s": sc.job_mtbf_s,
            "spares": sc.spare_nodes,
            "repair_hours": sc.assumptions.repair_hours,
            "shrink": sc.shrink,
            "mesh": mesh_json(sc),
            "step_s": step_time_s(sc.assumptions),
            "failures": self.failures,
            "node_losing_failures": self.node_losing_failures,
            "productivity": {p: r.productivity for p, r in self.results.items()},
            "lost": {p: r.lost for p, r in self.results.items()},
            "dominant_loss": {p: r.dominant_loss for p, r in self.results.items()},
            "events": {p: r.events for p, r in self.results.items()},
            "costs_s": {p: r.costs for p, r in self.results.items()},
            "stage_loss": {p: r.stage_loss for p, r in self.results.items()},
        }
        cr = self.results.get("checkpoint-restart")
        if cr is not None:
            doc["gap_vs_checkpoint_restart"] = {
                p: r.productivity - cr.productivity for p, r in self.results.items() if p != "checkpoint-restart"
            }
        return doc


def policies_for(sc: Scenario) -> tuple[str, ...]:
    """The policies that apply to `sc`: torchft heals a replica from a peer, so it needs two."""
    if dp_degree(sc.assumptions, sc.gpus) < 2:
        return tuple(p for p in POLICIES if p != "torchft")
    return POLICIES


def simulate(
    sc: Scenario, policies: Sequence[str] | None = None, calibration: Calibration | None = None
) -> SimulationResult:
    """Simulate `policies` (default: those that apply, `policies_for`) on one shared failure
    stream of `sc`."""
    sc.validate()
    policies = policies_for(sc) if policies is None else policies
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"unknown policy {p!r} (choose from {', '.join(POLICIES)})")
    if "torchft" in policies and "torchft" not in policies_for(sc):
        a = sc.assumptions
        raise ValueError(
            f"torchft heals a restarted replica from a peer and needs at least 2 model replicas: "
            f"--gpus {sc.gpus} holds one replica of tp*pp = {a.tp * a.pp} GPUs"
        )
    cal = calibration if calibration is not None else load_calibration()
    fs = draw_failures(sc)
    horizon = sc.horizon_s
    repair_s = sc.assumptions.repair_hours * HOUR
    results: dict[str, PolicyResult] = {}
    for p in policies:
        pc = build_costs(p, sc, cal)
        acc, counts = _run(pc, fs, horizon, sc.spare_nodes, repair_s, sc.gpus)
        lost = {k: acc[k] / horizon for k in LOSS_KEYS}
        price = stage_loss_cost(pc, stage_loss(p, mesh_of(sc.assumptions, sc.gpus)), sc.gpus)
        results[p] = PolicyResult(p, acc["useful"] / horizon, lost, counts, pc.components, price)
    return SimulationResult(sc, results, len(fs.times), int(fs.node_lost.sum()))


def sweep_sizes(sc: Scenario, lo: int = 1024, hi: int = 131072) -> list[int]:
    """Powers of two from `lo` to `hi`, rounded down to whole nodes and model replicas, at
    least two replicas (what every policy needs)."""
    replica = sc.assumptions.tp * sc.assumptions.pp
    unit = math.lcm(sc.gpus_per_node, replica)
    smallest = math.lcm(sc.gpus_per_node, 2 * replica)
    sizes: list[int] = []
    n = lo
    while n <= hi:
        sizes.append(max(smallest, n // unit * unit))
        n *= 2
    return sorted(set(sizes))


@dataclass(frozen=True)
class SweepPoint:
    """Mean over `replicas` independent runs of one cluster size."""

    gpus: int
    spares: int
    replicas: int
    failures: float
    productivity: dict[str, float]
    lost: dict[str, dict[str, float]]


def sweep(
    sc: Scenario,
    sizes: Iterable[int],
    policies: Sequence[str] = POLICIES,
    calibration: Calibration | None = None,
    min_failures: int = 2000,
    max_replicas: int = 64,
) -> list[SweepPoint]:
    """Simulate `sc` at each cluster size (spares per the scenario's rule).

    Small clusters see few failures in `sc.days`; each size is repeated with independent
    streams (replicas 0, 1, ...) until about `min_failures` failures are averaged over.
    """
    cal = calibration if calibration is not None else load_calibration()
    points: list[SweepPoint] = []
    for n in sizes:
        base = dataclasses.replace(sc, gpus=n)
        expected = base.horizon_s / base.job_mtbf_s
        reps = max(1, min(max_replicas, math.ceil(min_failures / max(expected, 1e-12))))
        runs = [simulate(dataclasses.replace(base, replica=r), policies, cal) for r in range(reps)]
        prod = {p: sum(r.results[p].productivity for r in runs) / reps for p in policies}
        lost = {p: {k: sum(r.results[p].lost[k] for r in runs) / reps for k in LOSS_KEYS} for p in policies}
        points.append(SweepPoint(n, base.spare_nodes, reps, sum(r.failures for r in runs) / reps, prod, lost))
    return points


# --------------------------------------------------------------------------- closed form


def closed_form_checkpoint_restart(sc: Scenario, calibration: Calibration | None = None) -> float:
    """Exact renewal-theory productivity of checkpoint-restart with unlimited spares.

    With failure rate l, interval tau, checkpoint d and per-class downtime D_c = detection_c +
    restart R (a failure during downtime starts a new one), the expected wall time to commit
    one interval is (e^{l(tau+d)} - 1) / (l E[e^{-l D}]), so productivity is
    `l tau E[e^{-l D}] / (e^{l (tau + d)} - 1)`. See docs/simulation.md.
    """
    cal = calibration if calibration is not None else load_calibration()
    pc = build_costs("checkpoint-restart", sc, cal)
    if math.isinf(sc.job_mtbf_s):
        return 1.0
    lam = 1.0 / sc.job_mtbf_s
    total = sum(c.count for c in sc.failure_classes)
    mgf = sum(
        c.count / total * math.exp(-lam * (pc.detect_s[DETECTION_CLASSES.index(c.detection)] + pc.recover_s))
        for c in sc.failure_classes
    )
    return lam * pc.work_s * mgf / math.expm1(lam * (pc.work_s + pc.commit_s))
