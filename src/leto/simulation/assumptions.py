"""The projected cluster and model (sizes, bandwidths, timeouts): every field carries `unit`
and `source` metadata; override with `--set KEY=VALUE`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


def _f(default: Any, unit: str, source: str) -> Any:
    return field(default=default, metadata={"unit": unit, "source": source})


@dataclass(frozen=True)
class Assumptions:
    """The projected cluster and model. Override any field with `--set KEY=VALUE`."""

    # model and parallelism
    params: float = _f(405e9, "parameters", "Llama 3 405B (Dubey et al. 2024), the run the failure data comes from")
    tp: int = _f(8, "GPUs", "tensor-parallel degree of Llama 3 405B (Dubey et al. 2024, Table 4)")
    pp: int = _f(16, "GPUs", "pipeline-parallel degree of Llama 3 405B (Dubey et al. 2024, Table 4)")
    tokens_per_gpu_step: float = _f(
        1024.0, "tokens", "16M tokens per step / 16,384 GPUs (Dubey et al. 2024, Table 4); held per GPU (weak scaling)"
    )
    achieved_tflops_per_gpu: float = _f(
        400.0, "TFLOP/s", "BF16 throughput per GPU at 16,384 GPUs (Dubey et al. 2024, Table 4)"
    )
    optimizer_bytes_per_param: float = _f(
        12.0,
        "bytes",
        "mixed-precision Adam: fp32 master + momentum + variance, K=12 "
        "(Rajbhandari et al. 2020, ZeRO, Sec. 3.1); sharded over data parallel (ZeRO-1)",
    )
    weight_bytes_per_param: float = _f(2.0, "bytes", "bf16 parameters, replicated across data parallel")
    # hardware
    net_gbps_per_gpu: float = _f(50.0, "GB/s", "400 Gb/s RoCE/InfiniBand per GPU (Dubey et al. 2024, Sec. 3.3.1)")
    pcie_gbps: float = _f(63.0, "GB/s", "PCIe 5.0 x16 per direction: 32 GT/s x 16 lanes x 128/130 / 8 (PCI-SIG spec)")
    storage_gbps_aggregate: float = _f(
        2000.0, "GB/s", "Tectonic sustained throughput 2 TB/s for Llama 3 checkpoints (Dubey et al. 2024, Sec. 3.3.1)"
    )
    comm_init_s_per_rank: float = _f(
        265.0 / 96000,
        "s/rank",
        "stock NCCL cold init ~265 s at 96k GPUs (Si et al. 2025, NCCLX, arXiv:2510.20171, via a "
        "secondary summary), linearised through the origin; an assumption below 96k",
    )
    # failures and repair
    repair_hours: float = _f(24.0, "h", "ASSUMPTION: time to repair or replace a node and return it to the spare pool")
    spare_fraction: float = _f(0.01, "of nodes", "ASSUMPTION: default spare pool = ceil(1% of nodes), at least 1")
    # detection
    heartbeat_s: float = _f(2.0, "s", "Leto heartbeat timeout for hangs and lost hosts (configurable; default 2 s)")
    baseline_node_detect_s: float = _f(
        15.0,
        "s",
        "torchrun c10d rendezvous keep-alive: 5 s interval x 3 missed beats "
        "(torch/distributed/elastic/rendezvous/dynamic_rendezvous.py)",
    )
    baseline_hang_detect_s: float = _f(
        600.0,
        "s",
        "ProcessGroupNCCL default timeout, 10 min "
        "(torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp; pytorch PR #110947)",
    )
    torchft_timeout_s: float = _f(
        60.0,
        "s",
        "torchft Manager default timeout for collectives and quorum, 60 s (torchft/manager.py, "
        "Manager(timeout=timedelta(seconds=60))): how long torchft's survivors wait on a lost host or a hang",
    )
    # Leto protection layout
    tier1_group: int = _f(0, "ranks", "tier-1 erasure group inside a node; 0 = gpus per node (decode reads the group)")
    tier2_k: int = _f(8, "nodes", "ASSUMPTION: tier-2 Reed-Solomon data nodes per stripe")
    tier2_m: int = _f(2, "nodes", "ASSUMPTION: tier-2 parity nodes per stripe")
    protect_overlap: float = _f(
        1.0,
        "of a step",
        "ASSUMPTION: fraction of a step during which per-step background "
        "protection (host CPU work on idle host cores, tier-2 / replica transfers) runs hidden: "
        "on a GPU host the step computes on the GPU while the keepers process the previous "
        "step's deltas (docs/protection.md), so that work is hidden when it fits in one step "
        "and adds when it does not; not measurable on the CPU-only bench machine (no idle "
        "cores there); 0 = all of it on the critical path",
    )
    d2h_overlap: float = _f(
        0.0,
        "of the copy",
        "ASSUMPTION: fraction of the per-step device-to-host copy of the "
        "protected bytes that overlaps compute; 0 = on the critical path (conservative: the "
        "copy takes the state between one update and the next, and Leto has no GPU copy-stream "
        "path yet)",
    )
    host_cores_per_node: int = _f(
        112,
        "cores",
        "2 x 56-core Intel Xeon Platinum 8480C per 8-GPU H100 host (NVIDIA DGX H100 user guide, hardware overview)",
    )
    train_cores_per_gpu: float = _f(
        4.0,
        "cores",
        "ASSUMPTION: host cores GPU training keeps busy per GPU (the training "
        "thread, NCCL's proxy thread, data loading); the rest run protection",
    )
    # memory-restart (Gemini-like)
    gemini_replicas: int = _f(
        2,
        "copies",
        "ASSUMPTION: in-CPU-memory checkpoint copies (local + 1 peer), as in "
        "Gemini's group placement (Wang et al., SOSP'23)",
    )


def assumption_fields() -> dict[str, dataclasses.Field[Any]]:
    """Field name -> dataclass field (with `unit`/`source` metadata)."""
    return {f.name: f for f in dataclasses.fields(Assumptions)}


def with_overrides(base: Assumptions, overrides: Mapping[str, str]) -> Assumptions:
    """Return `base` with `KEY=VALUE` string overrides applied; ValueError names a bad key."""
    fields = assumption_fields()
    changes: dict[str, Any] = {}
    for key, text in overrides.items():
        if key not in fields:
            raise ValueError(f"unknown assumption {key!r} (known: {', '.join(sorted(fields))})")
        kind = type(fields[key].default)
        try:
            value = int(text) if kind is int else float(text)
        except ValueError:
            raise ValueError(f"assumption {key}: expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"assumption {key}: must be a finite number >= 0, got {text!r}")
        changes[key] = value
    result = dataclasses.replace(base, **changes)
    for key in ("protect_overlap", "d2h_overlap"):
        if getattr(result, key) > 1:
            raise ValueError(f"assumption {key}: must be between 0 and 1")
    for key in (
        "params",
        "tp",
        "pp",
        "tokens_per_gpu_step",
        "achieved_tflops_per_gpu",
        "net_gbps_per_gpu",
        "pcie_gbps",
        "storage_gbps_aggregate",
        "tier2_k",
        "tier2_m",
        "gemini_replicas",
        "host_cores_per_node",
    ):
        if getattr(result, key) <= 0:
            raise ValueError(f"assumption {key}: must be > 0")
    return result
