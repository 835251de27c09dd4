"""Scale laws: the assumptions and the calibration turned into per-event costs on a cluster of
`gpus` GPUs (docs/simulation.md)."""

from __future__ import annotations

from .assumptions import Assumptions
from .calibration import Calibration
from .units import GB


def step_time_s(a: Assumptions) -> float:
    """Training step time: 6 x params x tokens per GPU / achieved FLOP/s per GPU."""
    return 6.0 * a.params * a.tokens_per_gpu_step / (a.achieved_tflops_per_gpu * 1e12)


def dp_degree(a: Assumptions, gpus: int) -> int:
    """Data-parallel replicas: gpus / (tp x pp)."""
    return gpus // (a.tp * a.pp)


def optimizer_bytes_per_gpu(a: Assumptions, gpus: int) -> float:
    """Unique optimizer state per GPU under ZeRO-1 (Leto's erasure-protected bytes)."""
    return a.optimizer_bytes_per_param * a.params / gpus


def weight_bytes_per_gpu(a: Assumptions) -> float:
    """bf16 weights per GPU; replicated across data parallel, so a peer can resend them."""
    return a.weight_bytes_per_param * a.params / (a.tp * a.pp)


def checkpoint_bytes_per_gpu(a: Assumptions, gpus: int) -> float:
    """A full checkpoint (optimizer + one copy of the weights) spread evenly over all GPUs."""
    return (a.optimizer_bytes_per_param + a.weight_bytes_per_param) * a.params / gpus


def checkpoint_write_s(a: Assumptions, c: Calibration, gpus: int) -> float:
    """Blocking checkpoint save: max(per-rank write, aggregate storage bandwidth)."""
    b = checkpoint_bytes_per_gpu(a, gpus)
    return max(b / c.ckpt_write_bps, b * gpus / (a.storage_gbps_aggregate * GB))


def checkpoint_read_s(a: Assumptions, c: Calibration, gpus: int) -> float:
    """Checkpoint load on restart: max(per-rank read, aggregate storage bandwidth)."""
    b = checkpoint_bytes_per_gpu(a, gpus)
    return max(b / c.ckpt_read_bps, b * gpus / (a.storage_gbps_aggregate * GB))


def comm_init_s(a: Assumptions, ranks: int) -> float:
    """Communicator initialisation for a group of `ranks` ranks (linear in ranks)."""
    return a.comm_init_s_per_rank * ranks
