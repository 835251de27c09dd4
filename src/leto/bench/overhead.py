"""`leto bench overhead`: the default job with protection off and on, interleaved in one run.

Besides the default job, the same off/on ratio over a curve of compute per protected byte (more
rows of the global batch on the same model, and a larger preset), the bytes protection moves per
protected element and step, encode throughput next to memcpy on this machine, and the memory
protection costs: every buffer that exists for protection, wherever it lives, per protected byte
(computed from the same layout and constants the keepers and workers allocate by), and the
measured resident memory of the processes that exist only for protection. With `--tp T` and
`--pp P` the job is a DP x PP x TP mesh: the same figures, plus what protection costs per element
of the model (`mesh`: each TP rank also protects its copy of the replicated parameters, the last
stage its copy of the tied embedding, and every shard is padded to the largest stage's) and the
whole job's memory with protection against without it (`memory_all_in`). docs/benchmarks.md
("Protection overhead") describes the method and the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from leto.bench import persist_cost, protection_cpu
from leto.bench.floor import floor
from leto.bench.floor import sample as floor_sample
from leto.bench.mesh import MeshElements, check_mesh, mesh_elements, mesh_flags, mesh_shape, shard_accounting
from leto.bench.noise import MET, MISS, NOT_MEASURED, noise_word
from leto.bench.throughput import WARMUP_STEPS, run_job, steady_step_s, wall_step_s
from leto.errors import UsageError
from leto.persistence.resume import DEFAULT_MTBF
from leto.protection import dataplane
from leto.protection.accounting import FLOAT_BYTES, STATE_BUFFERS, bytes_per_element_per_step
from leto.protection.codec_bench import measure_codec
from leto.protection.layout import Geometry, Layout, ring_slots_for
from leto.protection.placement import default_code
from leto.protection.shm import specs
from leto.protection.transport import batch_buffer_bytes
from leto.protocol.messages import node_of_rank
from leto.training.model import PRESETS
from leto.training.trainer import DEFAULT_CHUNK_BYTES

STATE_BYTES = FLOAT_BYTES * len(STATE_BUFFERS)  # unique state per element: master, exp_avg, exp_avg_sq
ROUNDS = 5  # interleaved off/on rounds of the default job (median of the paired ratios)
NODES = 2
CURVES = {"none": (), "default": ("512",), "full": ("128", "512", "small")}  # besides the default job
CURVE_ROUNDS = 3  # interleaved rounds of every other curve point (--curve-rounds)
CURVE_STEPS = 12  # measured steps per run of every other curve point (--curve-steps)
RSS_STEPS = 30  # steps of the run whose processes' memory is read (--rss on)
RSS_EVERY_S = 0.5
TARGET_RATIO_DEFAULT = 1.03  # overhead_ratio on the default job
TARGET_RATIO_ROWS, TARGET_ROWS = 1.01, 512  # overhead_ratio at 512 rows of the default model
TARGET_MEMORY = 3.0  # all-in memory_overhead on the default job
TARGET_CPU_FLOOR = 1.5  # protection's whole CPU a step (keepers and workers) / the cold physical floor
PROTECTION_ROLES = ("keeper", "zygote")  # processes that exist only for protection
RECOVERY_ROLES = ("shadow",)  # warm spares: for recovery, reported apart


# ----- memory, counted whole
# part -> (where it lives, whether it grows with the model: the others are bounded by constants)
PARTS = {
    "tier1_parity": ("keeper shm", True),
    "tier2_parity": ("keeper shm", True),
    "gradient_parity": ("keeper shm", True),
    "parity_preimages": ("keeper shm", True),
    "tables": ("keeper shm", True),
    "staging_slots": ("keeper shm", False),
    "tier2_batch_buffers": ("keeper heap", False),
    "worker_second_state": ("worker heap", True),
    "worker_second_grads": ("worker heap", True),
    "worker_snapshot": ("worker heap", True),
    "worker_chunk_scratch": ("worker heap", False),
}


def job_layout(
    model: str,
    workers: int,
    nodes: int,
    ec: tuple[int, int] | None,
    *,
    tp: int = 1,
    pp: int = 1,
    replicated_grads: bool = True,
    protect_every: int = 1,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> tuple[Layout, int]:
    """The generation-0 layout the built-in job's trainer builds (and the model's parameter
    count): `replicated_grads` is the CPU/gloo path, where every rank holds the reduced gradient;
    with `tp` or `pp` > 1 each rank's shard is of its slice, over its DP group, laid out for the
    largest stage's slice."""
    elements = mesh_elements(model, tp, pp)
    elems = chunk_bytes // STATE_BYTES
    n_chunks = shard_accounting(elements, workers, elems)["shard_elements_per_rank"] // elems
    geometry = Geometry(n_chunks, elems)
    layout = Layout(
        0,
        0,
        geometry,
        tuple(node_of_rank(r, workers, nodes) for r in range(workers)),
        ec,
        protect_every=protect_every,
        ring_slots=ring_slots_for(geometry),
        replicated_grads=replicated_grads,
    )
    return layout, elements.model


def _region_part(name: str) -> str:
    """Which part of the memory accounting an array of a keeper's region is (shm.specs names)."""
    if name in ("slot_hdr", "slot_data"):
        return "staging_slots"
    if re.fullmatch(r"p1|p2_\d+", name):
        return "tier1_parity" if name == "p1" else "tier2_parity"
    if re.fullmatch(r"p(1|2_\d+)_pre", name):
        return "parity_preimages"
    if re.fullmatch(r"g(1|2_\d+)", name):
        return "gradient_parity"
    return "tables"  # header, versions, checksums, gradient steps and counts


def worker_copy_bytes(layout: Layout) -> dict[str, int]:
    """What one worker holds only because its state is protected (`ShardedState.allocate`, with
    protection on). Where gradients are replicated and every step is protected (gloo), the shard
    is updated in place, chunk by chunk through one scratch chunk (`_next`), each chunk's delta
    handed over before the chunk is replaced; otherwise it keeps a second version of its shard
    (ping-pong by step parity). Where the keepers protect gradients (NCCL), a second gradient
    shard (the reduce-scatter output exists anyway); under --protect-every > 1 the snapshot of
    the last protected step. Chunks a recovery replaces in place are kept until the next
    generation commits: transient, not counted."""
    g = layout.geometry
    shard, gshard = g.n_chunks * g.state_bytes, g.n_chunks * g.grad_bytes
    inplace = layout.replicated_grads and layout.protect_every == 1  # ShardedState.inplace
    return {
        "worker_second_state": 0 if inplace else shard,
        "worker_second_grads": gshard if layout.protects_grads else 0,
        "worker_snapshot": shard if layout.protect_every > 1 else 0,
        "worker_chunk_scratch": g.state_bytes if inplace else 0,
    }


def memory_parts(layout: Layout) -> dict[str, int]:
    """Bytes of every buffer that exists for protection in the whole job, by part (PARTS)."""
    parts = dict.fromkeys(PARTS, 0)
    for n in layout.nodes:
        for name, shape, dtype in specs(layout, n):
            parts[_region_part(name)] += int(np.prod(shape)) * np.dtype(dtype).itemsize
        parts["tier2_batch_buffers"] += batch_buffer_bytes(layout, n)
    for part, b in worker_copy_bytes(layout).items():
        parts[part] += layout.world_size * b
    return parts


def protected_bytes(layout: Layout) -> int:
    """Unique state of the job (master, exp_avg, exp_avg_sq of every shard, padded to chunks)."""
    return layout.world_size * layout.geometry.n_chunks * layout.geometry.state_bytes


def memory_summary(layout: Layout) -> dict:
    """The all-in figure and its parts, per protected byte, and what it tends to for a larger
    model (the parts that grow with it; staging slots and batch buffers stay constant)."""
    parts, protected = memory_parts(layout), protected_bytes(layout)
    return {
        "memory_overhead": round(sum(parts.values()) / protected, 4),
        "memory_overhead_large_model_limit": round(sum(b for p, b in parts.items() if PARTS[p][1]) / protected, 4),
        "memory_parts": {
            p: {
                "bytes": b,
                "per_protected_byte": round(b / protected, 4),
                "where": PARTS[p][0],
                "scales_with_model": PARTS[p][1],
            }
            for p, b in parts.items()
        },
    }


def memory_cost(
    model: str,
    workers: int,
    nodes: int,
    ec: tuple[int, int] | None,
    replicated_grads: bool = True,
    tp: int = 1,
    pp: int = 1,
) -> dict:
    """Bytes of protection per byte of protected (unique) state, from the layout and constants
    the keepers and workers allocate by. Headline `memory_overhead`: all of it; the figure of the
    keepers' shared regions alone (what was reported before) stays as
    `memory_overhead_without_batches_and_copies`."""
    layout, _ = job_layout(model, workers, nodes, ec, tp=tp, pp=pp, replicated_grads=replicated_grads)
    by_kind = {"parity": 0, "gradient_parity": 0, "staging": 0, "tables": 0}
    for n in layout.nodes:
        for name, shape, dtype in specs(layout, n):
            size = int(np.prod(shape)) * np.dtype(dtype).itemsize
            kind = (
                "parity"
                if name.startswith(("p1", "p2_"))
                else "gradient_parity"
                if name.startswith(("g1", "g2_")) and "step" not in name and "count" not in name
                else "staging"
                if name.startswith("slot")
                else "tables"
            )
            by_kind[kind] += size
    protected = protected_bytes(layout)
    copies = layout.world_size * sum(worker_copy_bytes(layout).values())
    region = sum(by_kind.values())
    summary = memory_summary(layout)
    nccl, _ = job_layout(model, workers, nodes, ec, tp=tp, pp=pp, replicated_grads=False)
    nccl_summary = memory_summary(nccl)
    return {
        "protected_bytes": protected,
        "protected_elements": layout.world_size * layout.geometry.n_chunks * layout.geometry.chunk_elems,
        "keeper_bytes": region,
        "keeper_breakdown": by_kind,
        "keeper_batch_buffer_bytes": summary["memory_parts"]["tier2_batch_buffers"]["bytes"],
        "worker_second_copies_bytes": copies,
        **summary,
        "memory_overhead_without_batches_and_copies": round(region / protected, 4),
        "memory_overhead_with_worker_copies": round((region + copies) / protected, 4),
        "memory_overhead_by_path": {
            "gloo": {k: summary[k] for k in ("memory_overhead", "memory_overhead_large_model_limit")},
            "nccl": {k: nccl_summary[k] for k in ("memory_overhead", "memory_overhead_large_model_limit")},
        },
        "memory_layout": {
            "replicated_grads": layout.replicated_grads,
            "protects_grads": layout.protects_grads,
            "n_chunks": layout.geometry.n_chunks,
            "chunk_elems": layout.geometry.chunk_elems,
            "ring_slots": layout.ring_slots,
        },
    }


def rss_summary(peaks: dict[int, dict]) -> dict:
    """Measured memory of a job's processes by role, at the moment the job held the most
    (`CpuSampler.memory_at_peak`). A process's own cost is its proportional set size without the
    shared regions (those are counted in the memory parts): Pss - Pss_Shmem (VmRSS - RssShmem
    without smaps_rollup). Per node: the sum of a role's processes on a node, the largest node."""
    per_node: dict[str, dict[int, int]] = {}
    by_role: dict[str, dict[str, int]] = {}
    for rec in peaks.values():
        own = rec["pss"] - rec.get("pss_shmem", 0) if "pss" in rec else rec["vm_rss"] - rec.get("rss_shmem", 0)
        role = rec["role"]
        nodes = per_node.setdefault(role, {})
        nodes[rec.get("node") or 0] = nodes.get(rec.get("node") or 0, 0) + own
        r = by_role.setdefault(
            role, {"processes": 0, "own_bytes": 0, "vm_rss_bytes": 0, "rss_shmem_bytes": 0, "pss_bytes": 0}
        )
        r["processes"] += 1
        r["own_bytes"] += own
        r["vm_rss_bytes"] += rec["vm_rss"]
        r["rss_shmem_bytes"] += rec.get("rss_shmem", 0)
        r["pss_bytes"] += rec.get("pss", 0)
    return {
        "fixed_rss_bytes_per_node": {r: max(per_node[r].values()) for r in PROTECTION_ROLES if r in per_node},
        "recovery_rss_bytes_per_node": {r: max(per_node[r].values()) for r in RECOVERY_ROLES if r in per_node},
        "rss_by_role": dict(sorted(by_role.items())),
    }


# ----- the mesh: per element of the model, and the whole job's memory
def mesh_figures(layout: Layout, elements: MeshElements) -> dict:
    """What protection costs per element of the model's state rather than per protected element:
    the ranks of a TP group each protect their copy of the replicated parameters, the last
    pipeline stage its copy of the tied embedding, every shard is padded to the largest stage's
    slice and to whole chunks, so a model element is protected `protected_per_model_element`
    times (1 plus chunk padding with neither TP nor PP). The protected elements are the model's
    + `copies_elements` + `stage_padding_elements` + `chunk_padding_elements`."""
    figures = shard_accounting(elements, layout.world_size, layout.geometry.chunk_elems)
    protected = layout.world_size * layout.geometry.n_chunks * layout.geometry.chunk_elems
    if figures["protected_elements"] != protected:
        raise ValueError(f"a layout of {protected} protected elements is not the mesh's {figures}")
    per_model = protected / elements.model
    moved = bytes_per_element_per_step(layout)["total"]
    parts = memory_parts(layout)
    return {
        **figures,
        "state_bytes_per_rank": figures["shard_elements_per_rank"] * STATE_BYTES,
        "bytes_per_model_element_per_step": {k: round(v * per_model, 4) for k, v in moved.items()},
        "memory_overhead_per_model_byte": round(sum(parts.values()) / (elements.model * STATE_BYTES), 4),
    }


def job_memory(peaks: dict[int, dict]) -> dict:
    """The whole job's memory at the moment it held the most (`CpuSampler.memory_at_peak`): the
    sum of proportional set sizes, which counts each shared page once among the processes that
    map it (the fork server's, the keepers' regions); VmRSS where smaps_rollup is missing (it
    counts shared pages in every process)."""
    by_role: dict[str, int] = {}
    measure = "pss" if peaks and all("pss" in r for r in peaks.values()) else "vm_rss"
    for rec in peaks.values():
        by_role[rec["role"]] = by_role.get(rec["role"], 0) + rec.get(measure, rec["vm_rss"])
    return {
        "measure": measure,
        "processes": len(peaks),
        "bytes_by_role": dict(sorted(by_role.items())),
        "bytes": sum(by_role.values()),
    }


def memory_all_in(on: dict[int, dict], off: dict[int, dict], model_elements: int) -> dict:
    """The protected job (workers, keepers, zygotes, shadows and their regions) against the same
    job unprotected (workers alone), measured: the ratio and the difference per byte of the
    model's state."""
    a, b = job_memory(on), job_memory(off)
    extra = a["bytes"] - b["bytes"]
    return {
        "protected": a,
        "unprotected": b,
        "ratio": round(a["bytes"] / b["bytes"], 4) if b["bytes"] else None,
        "extra_bytes": extra,
        "extra_per_model_state_byte": round(extra / (model_elements * STATE_BYTES), 2),
    }


# ----- the curve of compute per protected byte
@dataclass(frozen=True)
class Point:
    """One point of the curve: `rows` of the global batch of `model` (None: the preset's own)."""

    model: str
    rows: int | None = None

    @property
    def global_rows(self) -> int:
        return self.rows if self.rows is not None else PRESETS[self.model].batch_size

    @property
    def label(self) -> str:
        return f"{self.model} x{self.global_rows} rows"


def parse_curve(spec: str, model: str, workers: int) -> list[Point]:
    """The curve points besides the default job: none | default | full, or a comma-separated
    list of row counts (of `model`) and preset names (at their own batch)."""
    tokens = CURVES.get(spec, tuple(t.strip() for t in spec.split(",") if t.strip()))
    points: list[Point] = []
    for t in tokens:
        if t in PRESETS:
            p = Point(t)
        elif t.isdigit():
            p = Point(model, int(t))
            if p.global_rows < workers:
                raise ValueError(f"--curve {spec}: {t} rows cannot be split over {workers} workers")
        else:
            raise ValueError(
                f"--curve {spec}: {t!r} is neither a row count nor a preset "
                f"({', '.join(PRESETS)}); or none, default, full"
            )
        if (p.model, p.global_rows) != (model, PRESETS[model].batch_size) and p not in points:
            points.append(p)  # the default job itself is always measured
    return points


def _median_by_role(runs: list[dict[str, float]]) -> dict[str, float]:
    roles = sorted({r for run in runs for r in run})
    return {r: round(statistics.median(run.get(r, 0.0) for run in runs), 5) for r in roles}


def paired_ratio(off: list[float], on: list[float]) -> float:
    """The median over rounds of on/off, each round's two runs back to back: on a shared machine
    whose speed drifts from minute to minute (seen here: the same run 0.16 s and 0.27 s a step a
    minute apart), pairing cancels the drift that a ratio of the two medians keeps."""
    return statistics.median(b / a for a, b in zip(off, on))


def ratio_by_order(off: list[float], on: list[float]) -> dict[str, list[float]]:
    """Each round's on / off by which of the two ran first (`round_order`): were the second run of
    a round slowed by what the first left behind or by a drift, the two groups would differ by
    twice that effect, and the paired median would sit between them."""
    out: dict[str, list[float]] = {"off_first": [], "on_first": []}
    for i, (a, b) in enumerate(zip(off, on)):
        out[f"{round_order(('off', 'on'), i)[0]}_first"].append(round(b / a, 4))
    return out


def curve_entry(
    point: Point,
    numel: int,
    layout: Layout,
    off: list[float],
    on: list[float],
    cpu_off: list[dict[str, float]],
    cpu_on: list[dict[str, float]],
    steps: int,
    prot_rounds: list[list[dict]] | None = None,
) -> dict:
    """One curve entry from its runs (median of each run's steady step time, median CPU by role
    and thread over the rounds; `prot_rounds`: each protected round's step records)."""
    step_off, step_on = statistics.median(off), statistics.median(on)
    tokens = point.global_rows * PRESETS[point.model].block_size
    prot = [r for rnd in prot_rounds or [] for r in rnd]
    cpu_in = {k: [r[k] for r in prot if k in r] for k in ("stage_cpu_s", "wait_cpu_s")}  # the training thread's
    return {
        "label": point.label,
        "model": point.model,
        "rows": point.global_rows,
        "step_s_off": round(step_off, 5),
        "step_s_on": round(step_on, 5),
        "overhead_ratio": round(paired_ratio(off, on), 4),
        "overhead_ratio_of_medians": round(step_on / step_off, 4),
        "cpu_s_per_step_off": _median_by_role(cpu_off),
        "cpu_s_per_step_on": _median_by_role(cpu_on),
        "bytes_per_element_per_step": bytes_per_element_per_step(layout),
        "tokens_per_param_per_step": float(f"{tokens / numel:.4g}"),
        "tokens_per_step": tokens,
        "params": numel,
        "protected_elements": layout.world_size * layout.geometry.n_chunks * layout.geometry.chunk_elems,
        "rounds": len(on),
        "steps_per_run": steps,
        "step_s_off_runs": [round(x, 5) for x in off],
        "step_s_on_runs": [round(x, 5) for x in on],
        "protection_stage_s_per_step": round(statistics.mean(r.get("stage_s", 0) for r in prot), 6) if prot else None,
        "protection_wait_s_per_step": round(statistics.mean(r.get("wait_s", 0) for r in prot), 6) if prot else None,
        "protection_wait_slot_s_per_step": (
            round(statistics.mean(r.get("wait_slot_s", 0) for r in prot), 6) if prot else None
        ),
        **{f"protection_{k}_per_step": round(statistics.mean(v), 6) if v else None for k, v in cpu_in.items()},
    }


def check_tokens(records: list[dict], tokens: int, run_dir: Path) -> None:
    """The job trained on the global batch asked for: each step record's tokens/s x step time
    is its tokens per step (a rows knob that did not take would otherwise pass unseen)."""
    seen = {round(r["tokens_per_s"] * r["step_s"]) for r in records if r.get("tokens_per_s") and r.get("step_s")}
    if not seen or any(abs(t - tokens) > max(2, tokens // 100) for t in seen):
        raise RuntimeError(
            f"benchmark job trained {sorted(seen)[:3]} tokens per step, expected {tokens}; see {run_dir}"
        )


def _measure(
    point: Point,
    default_rows: int,
    rounds: int,
    steps: int,
    workers: int,
    ec: tuple[int, int] | None,
    tmp: Path,
    persist: dict | None = None,
    tp: int = 1,
    pp: int = 1,
    floor_samples: list[dict] | None = None,
) -> tuple[list[float], list[float], list[dict], list[dict], list[list[dict]]]:
    """`rounds` interleaved off/on runs of one point (`round_order`): step times, CPU by role, each
    protected round's step records of its measured window.
    With `persist` (a dict to fill), each round also runs protection + persistence at its default
    K, and the wall time per step of all three goes into it. With `floor_samples` (a list to
    fill), the physical floor's operations are measured after each round (`floor.sample`)."""
    off, on, cpu_off, cpu_on, prot = [], [], [], [], []
    rows_flag = point.rows is not None and point.rows != default_rows
    extra = (["--rows", str(point.rows)] if rows_flag else []) + pipeline_flags(pp)
    variants = ("off", "on", "persist") if persist is not None else ("off", "on")
    k_seen: int | None = None
    if persist is not None:
        k_seen = persist["k_calibration"] = calibrate_k(workers, point.model, tmp / "calibrate", ec, extra, tp, pp)
    for i in range(rounds):  # interleaved so that machine load hits all alike
        for v in round_order(variants, i):
            protection = v != "off"
            d = tmp / f"{point.model}-{point.global_rows}-{i}-{v}"
            n_steps = persist_cost.plan_steps(k_seen, steps) if v == "persist" else steps + WARMUP_STEPS
            res = run_job(
                workers,
                n_steps,
                point.model,
                d,
                nodes=NODES,
                protection=protection,
                ec=ec if protection else None,
                extra=extra,
                persist=v == "persist",
                tp=tp,
                **({"pp": pp} if pp > 1 else {}),
            )
            check_tokens(res["steps"], point.global_rows * PRESETS[point.model].block_size, d)
            if v == "persist":
                a = persist_cost.analyze_run(res["steps"], res["events"], res.get("cpu_timeline"))
                k_seen = max(k_seen or 0, a["k"]) if a else k_seen
                entry = persist_cost.round_entry(a, cpu_off[-1].get("worker"), on[-1], cpu_on[-1])
                persist.setdefault("rounds", []).append({"run_steps": n_steps, **entry})
                persist.setdefault("wall_step_s_persist", []).append(
                    a["wall_s_per_step"] if a and "wall_s_per_step" in a else wall_step_s(res["steps"])
                )
                persist.setdefault("every", []).extend(
                    e["every"] for e in res["events"] if e["event"] == "persist_interval"
                )
                held = entry.get("checkpoints_in_window", 0)
                if a and held < persist_cost.WINDOW_CHECKPOINTS:
                    print(
                        f"leto bench overhead: WARNING: round {i + 1}'s persisting run ({n_steps} steps, K {a['k']}) "
                        f"held {held} checkpoint(s) in its measured window, fewer than "
                        f"{persist_cost.WINDOW_CHECKPOINTS}: its persistence figures do not count",
                        file=sys.stderr,
                        flush=True,
                    )
                continue
            if persist is not None:
                persist.setdefault(f"wall_step_s_{v}", []).append(wall_step_s(res["steps"]))
            (on if protection else off).append(steady_step_s(res["steps"]))
            (cpu_on if protection else cpu_off).append(res["cpu_s_per_step"])
            if protection:  # the records of run_job's CPU window (each carries its step's protection time)
                prot.append(res["steps"][WARMUP_STEPS:])
        if floor_samples is not None:
            floor_samples.append(floor_sample())
    return off, on, cpu_off, cpu_on, prot


def round_order(variants: tuple[str, ...], i: int) -> tuple[str, ...]:
    """The order of round `i`'s runs: off and on swap places every other round (the persisting
    run, which reads both, stays last), so that whatever the run before leaves behind (processes
    still ending, a warm page cache) and a drift within a round fall on each side alike."""
    return variants if i % 2 == 0 else (variants[1], variants[0], *variants[2:])


CALIBRATION_TAIL = 10  # steps after the calibration checkpoint: its write ends and K is chosen


def calibrate_k(
    workers: int, model: str, run_dir: Path, ec: tuple[int, int] | None, extra: list[str], tp: int, pp: int
) -> int | None:
    """K as a persisting job of this point chooses it (a short run to its calibration checkpoint
    and a little beyond), so the measured runs can be long enough to hold their checkpoints;
    None if the job chose none."""
    res = run_job(
        workers,
        persist_cost.CALIBRATE_AFTER + CALIBRATION_TAIL,
        model,
        run_dir,
        nodes=NODES,
        protection=True,
        ec=ec,
        extra=extra,
        persist=True,
        tp=tp,
        **({"pp": pp} if pp > 1 else {}),
    )
    return next((int(e["every"]) for e in res["events"] if e["event"] == "persist_interval"), None)


def persistence_entry(runs: dict) -> dict:
    """The default job with persistent checkpoints at the default K: where they write
    (`persist_cost`: the checkpoint steps' cost by wall time and by CPU, the steps that write
    nothing against protection alone), and, as before, the wall time per step of the whole window
    against no protection. A job that chose no interval wrote no checkpoint (then nothing was
    measured, and the figures are None with the reason)."""
    off, on, per = runs["wall_step_s_off"], runs["wall_step_s_on"], runs["wall_step_s_persist"]
    wrote = bool(runs.get("every"))
    return {
        "status": "measured" if wrote else "not measured: the job wrote no persistent checkpoint",
        "mtbf": DEFAULT_MTBF,
        "every": runs.get("every", []),
        "k_calibration": runs.get("k_calibration"),
        **persist_cost.summarize(runs.get("rounds", [])),
        "wall_step_s_off_runs": [round(x, 5) for x in off],
        "wall_step_s_on_runs": [round(x, 5) for x in on],
        "wall_step_s_persist_runs": [round(x, 5) for x in per],
        "overhead_ratio_wall": round(paired_ratio(off, on), 4),
        "overhead_ratio_with_persistence": round(paired_ratio(off, per), 4) if wrote else None,
    }


def pipeline_flags(pp: int) -> list[str]:
    """The built-in job's flags for `pp` stages: `leto train`'s default micro-batches, 2 x P."""
    return ["--microbatches", str(2 * pp)] if pp > 1 else []


# ----- targets
def verdict(value: float | None, limit: float) -> str:
    """met / MISS of a measured value against an upper limit; never assumed when not measured."""
    if value is None:
        return NOT_MEASURED
    return MET if value <= limit else MISS


def targets(out: dict) -> dict[str, dict]:
    at_rows = next(
        (e["overhead_ratio"] for e in out.get("curve", []) if e["model"] == out["model"] and e["rows"] == TARGET_ROWS),
        None,
    )
    checks = {
        "overhead_ratio_default_job": (out.get("overhead_ratio"), TARGET_RATIO_DEFAULT),
        "overhead_ratio_default_job_with_persistence": (
            out.get("persistence", {}).get("overhead_ratio_with_persistence"),
            TARGET_RATIO_DEFAULT,
        ),
        f"overhead_ratio_{TARGET_ROWS}_rows": (at_rows, TARGET_RATIO_ROWS),
        "memory_overhead_default_job": (out.get("memory_overhead"), TARGET_MEMORY),
        "memory_overhead_per_model_byte": (out.get("mesh", {}).get("memory_overhead_per_model_byte"), TARGET_MEMORY),
        "protection_cpu_vs_cold_floor": (
            ((out.get("protection_cpu") or {}).get("total_vs_cold_floor") or {}).get("median"),
            TARGET_CPU_FLOOR,
        ),
    }
    judged = {
        name: {"value": v, "target": f"<= {limit}", "result": verdict(v, limit)} for name, (v, limit) in checks.items()
    }
    by_round = (out.get("protection_cpu") or {}).get("total_vs_cold_floor_by_round")
    if by_round:  # judged on the median; how many rounds alone meet it says how far noise could move that
        judged["protection_cpu_vs_cold_floor"]["rounds"] = by_round
        judged["protection_cpu_vs_cold_floor"]["rounds_met"] = sum(r <= TARGET_CPU_FLOOR for r in by_round)
    fl = out.get("physical_floor") or {}
    if "floor_overhead_ratio" in fl:  # what the data movement alone costs in wall time here
        for name in ("overhead_ratio_default_job", "overhead_ratio_default_job_with_persistence"):
            judged[name]["floor"] = {
                "in_cache": fl["floor_overhead_ratio"],
                "cold": fl["cold_floor_overhead_ratio"],
                "placed": fl.get("placed_floor_overhead_ratio"),
            }
    return {**judged, **persist_cost.targets(out.get("persistence") or {})}


# ----- the benchmark
def main(args: argparse.Namespace) -> int:
    steps = args.steps or 40

    def flag(name: str, default: object) -> object:  # None: not given
        value = getattr(args, name, None)
        return default if value is None else value

    rounds, curve_rounds, curve_steps = (
        flag("rounds", ROUNDS),
        flag("curve_rounds", CURVE_ROUNDS),
        flag("curve_steps", CURVE_STEPS),
    )
    curve_spec, rss = flag("curve", "default"), flag("rss", "on") == "on"
    tp, pp = flag("tp", 1), flag("pp", 1)
    if rounds < 1 or curve_rounds < 1 or curve_steps < 2:
        raise UsageError("leto bench overhead: error: --rounds and --curve-rounds must be >= 1, --curve-steps >= 2")
    try:
        points = parse_curve(curve_spec, args.model, args.workers // max(tp * pp, 1))
    except ValueError as e:
        raise UsageError(f"leto bench overhead: error: {e}") from e
    for model in dict.fromkeys([args.model, *(p.model for p in points)]):
        problem = check_mesh(model, args.workers, NODES, tp, pp)
        if problem is not None:
            raise UsageError(f"leto bench overhead: error: {model}: {problem}")
    ec = default_code(NODES)
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else (lambda msg: print(msg, flush=True))
    default = Point(args.model)
    layout, numel = job_layout(args.model, args.workers, NODES, ec, tp=tp, pp=pp)
    curve = []
    rss_out: dict = {}
    all_in: dict | None = None
    with tempfile.TemporaryDirectory(prefix="leto-bench-") as tmp:
        log(f"default job: {rounds} interleaved rounds of {steps} steps: off, on, on with persistence")
        persist: dict = {}
        floor_samples: list[dict] = []
        off, on, cpu_off, cpu_on, prot = _measure(
            default, default.global_rows, rounds, steps, args.workers, ec, Path(tmp), persist, tp, pp, floor_samples
        )
        curve.append(curve_entry(default, numel, layout, off, on, cpu_off, cpu_on, steps, prot))
        for p in points:
            log(f"curve: {p.label}: {curve_rounds} interleaved off/on rounds of {curve_steps} steps")
            p_layout, p_numel = job_layout(p.model, args.workers, NODES, ec, tp=tp, pp=pp)
            p_off, p_on, p_cpu_off, p_cpu_on, p_prot = _measure(
                p, PRESETS[p.model].batch_size, curve_rounds, curve_steps, args.workers, ec, Path(tmp), tp=tp, pp=pp
            )
            curve.append(curve_entry(p, p_numel, p_layout, p_off, p_on, p_cpu_off, p_cpu_on, curve_steps, p_prot))
        if rss:
            log(
                f"memory: one protected run of {RSS_STEPS} steps with a shadow and zygotes (--spares 1), "
                "one unprotected run without them"
            )
            runs = {
                on_: run_job(
                    args.workers,
                    RSS_STEPS,
                    args.model,
                    Path(tmp) / f"rss-{'on' if on_ else 'off'}",
                    spares=1 if on_ else 0,
                    nodes=NODES,
                    protection=on_,
                    ec=ec if on_ else None,
                    memory_every_s=RSS_EVERY_S,
                    extra=pipeline_flags(pp),
                    tp=tp,
                    **({"pp": pp} if pp > 1 else {}),
                )
                for on_ in (True, False)
            }
            rss_out = {
                "rss_run": {"steps": RSS_STEPS, "spares": 1, "every_s": RSS_EVERY_S},
                **rss_summary(runs[True]["memory"]),
            }
            all_in = memory_all_in(runs[True]["memory"], runs[False]["memory"], numel)
    step_off, step_on = statistics.median(off), statistics.median(on)
    codec = measure_codec(nbytes=32 << 20, k=args.workers // NODES, m=1)
    mem = memory_cost(args.model, args.workers, NODES, ec, tp=tp, pp=pp)
    protected_per_node = mem["protected_bytes"] / NODES
    if rss_out.get("fixed_rss_bytes_per_node"):
        rss_out["fixed_rss_per_protected_byte"] = round(
            sum(rss_out["fixed_rss_bytes_per_node"].values()) / protected_per_node, 2
        )
    physical_floor = floor(layout, step_off, os.cpu_count() or 1, floor_samples)
    pc = protection_cpu.summarize(
        [protection_cpu.round_cpu(a, b, r, args.workers) for a, b, r in zip(cpu_on, cpu_off, prot)], physical_floor
    )
    out = {
        "model": args.model,
        "workers": args.workers,
        "tp": tp,
        "pp": pp,
        "dp": args.workers // (tp * pp),
        "microbatches": 2 * pp if pp > 1 else None,
        "nodes": NODES,
        "ec": f"{ec[0]}+{ec[1]}",
        "data_plane": "native" if dataplane.serves(layout) else "python",  # the keepers' (dataplane.py)
        "steps_per_run": steps,
        "rounds": rounds,
        "step_s_off": round(step_off, 5),
        "step_s_on": round(step_on, 5),
        "overhead_ratio": round(paired_ratio(off, on), 4),
        "overhead_ratio_of_medians": round(step_on / step_off, 4),
        "overhead_ratio_by_order": ratio_by_order(off, on),
        "step_s_off_runs": [round(x, 5) for x in off],
        "step_s_on_runs": [round(x, 5) for x in on],
        "protection_stage_s_per_step": curve[0]["protection_stage_s_per_step"],
        "protection_wait_s_per_step": curve[0]["protection_wait_s_per_step"],
        "protection_wait_slot_s_per_step": curve[0]["protection_wait_slot_s_per_step"],
        "encode_gbps": round(codec["encode_gbps"], 2),
        "xor_gbps": round(codec["xor_gbps"], 2),
        "checksum_gbps": round(codec["checksum_gbps"], 2),
        "memcpy_gbps": round(codec["memcpy_gbps"], 2),
        "cpu_s_per_step_off": curve[0]["cpu_s_per_step_off"],
        "cpu_s_per_step_on": curve[0]["cpu_s_per_step_on"],
        "bytes_per_element_per_step": bytes_per_element_per_step(layout),
        "protection_cpu_to_training_cpu": protection_cpu.headline(pc),
        "protection_cpu": pc,
        "protection_cpu_s_per_step": _protection_cpu(curve[0], pc),
        "physical_floor": physical_floor,
        "persistence": persistence_entry(persist),
        **mem,
        "mesh": mesh_figures(layout, mesh_elements(args.model, tp, pp)),
        "memory_all_in": all_in,
        **rss_out,
        "curve_mode": curve_spec,
        "curve_rounds": curve_rounds if points else None,
        "curve_steps_per_run": curve_steps if points else None,
        "curve": curve,
    }
    out["targets"] = targets(out)
    if args.json:
        print(json.dumps(out))
        return 0
    _print(out, mem)
    return 0


def _protection_cpu(entry: dict, pc: dict) -> dict[str, float | None]:
    """CPU seconds per step protection costs (medians over the rounds, `protection_cpu`): the
    keepers', the workers' part measured on their threads, their sum and its share of training's
    CPU; beside them the workers' difference between protected and unprotected runs (noisy on a
    shared machine: the figure this one replaces)."""
    on, off = entry["cpu_s_per_step_on"], entry["cpu_s_per_step_off"]
    parts = pc.get("cpu_s_per_step", {})

    def med(key: str) -> float | None:
        return None if parts.get(key) is None else round(parts[key]["median"], 5)

    return {
        "keeper": med("keeper"),
        "worker": med("worker"),
        "total": med("total"),
        "share_of_training_cpu": protection_cpu.headline(pc),
        "worker_difference": round(on.get("worker", 0.0) - off.get("worker", 0.0), 5),
    }


def _print_mesh(out: dict) -> None:
    m = out["mesh"]
    b = m["bytes_per_model_element_per_step"]
    n = m["model_elements"]
    stages = m["stage_slice_elements"]
    of_slice = (
        f"stage slices {' / '.join(f'{x:,}' for x in stages)} elements, every shard laid out for the largest"
        if len(stages) > 1
        else f"a slice of {m['slice_elements']:,} elements"
    )
    print(
        f"  per rank: a ZeRO-1 shard of {m['shard_elements_per_rank']:,} elements, "
        f"{m['state_bytes_per_rank'] / 2**20:.2f} MiB of state ({of_slice}, over a DP group of {m['dp']})"
    )
    print(
        f"  per element of the model ({n:,}): {m['protected_per_model_element']:.3f} protected = 1 + "
        f"{m['copies_elements'] / n:.3f} copies ({m['copies_elements']:,}: replicated on every TP rank"
        + (
            f", the last stage's copy of the tied embedding {m['tied_copy_elements']:,}"
            if m["tied_copy_elements"]
            else ""
        )
        + f") + {m['stage_padding_elements'] / n:.3f} stage padding ({m['stage_padding_elements']:,}) + "
        f"{m['chunk_padding_elements'] / n:.3f} chunk padding ({m['chunk_padding_elements']:,}); "
        f"staged {b['staged']:g} B, checksummed {b['checksummed']:g} B, tier-2 sent {b['tier2_sent']:g} B a step; "
        f"protection memory {m['memory_overhead_per_model_byte']:.2f} B per byte of the model's state"
    )


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f} ms"


def _share(x: float | None, rng: list[float] | None) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.2f} %" + (
        "" if rng is None or rng[0] == rng[1] else f" [{100 * rng[0]:.2f}..{100 * rng[1]:.2f}]"
    )


def _print_persistence(pe: dict) -> None:
    if pe["overhead_ratio_with_persistence"] is None:
        print(f"  with persistent checkpoints too: {pe['status']}")
        return
    print(
        f"  with persistent checkpoints too (default --mtbf {pe['mtbf']}, K {sorted(set(pe['every']))}, "
        f"checkpoints in each round's measured window {pe['checkpoints_in_window_runs']}): overhead ratio "
        f"{pe['overhead_ratio_with_persistence']:.3f} by wall time per step "
        f"(protection alone, same clock: {pe['overhead_ratio_wall']:.3f})"
    )
    if not pe["window_ok"]:
        print(
            f"  WARNING: a persisting run's window held {pe['checkpoints_in_window']} checkpoint(s), fewer than "
            f"{persist_cost.WINDOW_CHECKPOINTS}: the persistence targets cannot be met on it"
        )
    print(
        f"  a checkpoint, where it writes (median): {_ms(pe['per_checkpoint_wall_excess_s'])} wall and "
        f"{_ms(pe['per_checkpoint_cpu_excess_s'])} CPU beyond as many steps that write nothing (the write thread "
        f"{_ms(pe['per_checkpoint_persist_threads_cpu_s'])}, the copy in the step {_ms(pe['per_checkpoint_stage_s'])});"
        f" per step at the default K: CPU {_share(pe['cpu_share'], pe['cpu_share_spread'])} of training's, wall "
        f"{_share(pe['wall_share'], pe['wall_share_spread'])}"
    )
    flags = pe["nothing_steps_within_noise"]
    print(
        f"  steps that write nothing: median step {_ms(pe['nothing_median_step_s'])} against protection alone "
        f"{_ms(pe['on_median_step_s'])} ({noise_word(flags['wall'])}), CPU a step {_ms(pe['nothing_cpu_s_per_step'])} "
        f"against {_ms(pe['on_cpu_s_per_step'])} ({noise_word(flags['cpu'])}); persistence threads there "
        f"{_ms(pe['nothing_persist_threads_cpu_s'])} a round"
    )


def _print_protection_cpu(out: dict) -> None:
    """The headline (protection CPU / training CPU, the wall-clock ratio beside it), then every
    part by role and thread and against its floor terms: median [min, max] over the rounds."""
    pc, fmt = out["protection_cpu"], protection_cpu.fmt_spread
    if pc["status"] != "measured":
        print(f"  protection CPU / training CPU: {pc['status']}; wall-clock overhead ratio {out['overhead_ratio']:.3f}")
        return
    parts = pc["cpu_s_per_step"]
    print(
        f"  protection CPU / training CPU {fmt(pc['ratio_to_training_cpu'], 100, ' %')} "
        f"(median [min, max] of {len(pc['rounds'])} rounds); wall-clock overhead ratio {out['overhead_ratio']:.3f}"
    )
    print(
        f"  CPU a step, ms: protection {fmt(parts['total'], 1e3)} = keepers {fmt(parts['keeper'], 1e3)} + workers "
        f"{fmt(parts['worker'], 1e3)}; training {fmt(parts['training'], 1e3)} (unprotected run "
        f"{fmt(parts['training_unprotected'], 1e3)})"
    )
    for key in sorted(k for k in parts if k.startswith(("keeper/", "worker/"))):
        print(f"    {key:<22} {fmt(parts[key], 1e3)} ms")
    print("  against the physical floor (in cache / cold), ms a step and measured / cold floor:")
    for name, v in pc["vs_floor"].items():
        print(
            f"    {name:<22} {fmt(v['measured_ms'], nd=1)} vs {v['floor_ms']:.2f} / {v['cold_floor_ms']:.2f}: "
            f"{fmt(v['cold_ratio'])} x ({' + '.join(v['measured'])})"
        )


def _curve_worker_cpu(e: dict, workers: int) -> str:
    """A curve point's workers' protection CPU a step: their training threads' inside protection
    (rank 0's, times the workers), else the difference of the protected and unprotected runs."""
    stage, wait = e.get("protection_stage_cpu_s_per_step"), e.get("protection_wait_cpu_s_per_step")
    if stage is not None:
        return f"{(stage + (wait or 0.0)) * workers * 1e3:.1f} ms inside protection"
    diff = e["cpu_s_per_step_on"].get("worker", 0) - e["cpu_s_per_step_off"].get("worker", 0)
    return f"{diff * 1e3:+.0f} ms (difference of the runs)"


def _print(out: dict, mem: dict) -> None:
    flags = mesh_flags(out["tp"], out["pp"])
    mesh = f", {flags} ({mesh_shape(out['workers'], out['tp'], out['pp'])})" if flags else ""
    print(
        f"default job ({out['model']}, {out['workers']} workers{mesh}, {out['nodes']} nodes, --ec {out['ec']}, "
        f"the keepers' {out.get('data_plane', 'python')} data plane), "
        f"{out['rounds']} interleaved rounds of {out['steps_per_run']} steps"
    )
    _print_protection_cpu(out)
    print(
        f"  step time off {out['step_s_off'] * 1e3:.1f} ms, on {out['step_s_on'] * 1e3:.1f} ms: "
        f"overhead ratio {out['overhead_ratio']:.3f}"
    )
    by = out.get("overhead_ratio_by_order")
    if by and by["on_first"]:
        print(
            "    by round, with off run first: "
            + ", ".join(f"{r:.3f}" for r in by["off_first"])
            + "; with on run first: "
            + ", ".join(f"{r:.3f}" for r in by["on_first"])
        )
    _print_persistence(out["persistence"])
    print(
        f"  protection on the training thread per step: staging {out['protection_stage_s_per_step'] * 1e3:.2f} ms, "
        f"waiting for keepers {out['protection_wait_s_per_step'] * 1e3:.2f} ms, of which for a free staging slot "
        f"{(out.get('protection_wait_slot_s_per_step') or 0.0) * 1e3:.2f} ms (rank 0)"
    )
    c_off, c_on = out["cpu_s_per_step_off"], out["cpu_s_per_step_on"]
    print(
        f"  CPU per step: workers {c_off.get('worker', 0) * 1e3:.0f} ms off, {c_on.get('worker', 0) * 1e3:.0f} ms on; "
        f"keepers {c_on.get('keeper', 0) * 1e3:.0f} ms (all processes of a role, median of {out['rounds']} rounds)"
    )
    parts = sorted(((k.split("/", 1)[1], v) for k, v in c_on.items() if k.startswith("keeper/")), key=lambda kv: -kv[1])
    if parts:
        print("  keepers by thread: " + ", ".join(f"{name} {v * 1e3:.1f} ms" for name, v in parts))
    groups = sorted({k.split("/", 1)[1] for k in (*c_off, *c_on) if k.startswith("worker/")})
    if groups:
        print(
            "  workers by thread, off / on: "
            + ", ".join(
                f"{g} {c_off.get(f'worker/{g}', 0) * 1e3:.1f} / {c_on.get(f'worker/{g}', 0) * 1e3:.1f} ms"
                for g in groups
            )
        )
    b = out["bytes_per_element_per_step"]["total"]
    print(
        f"  moved per protected element and step: staged {b['staged']:g} B, checksummed {b['checksummed']:g} B, "
        f"tier-2 sent {b['tier2_sent']:g} B ({out['protected_elements']:,} protected elements)"
    )
    _print_mesh(out)
    print(
        f"  encode {out['encode_gbps']:.1f} GB/s, XOR {out['xor_gbps']:.1f} GB/s, "
        f"checksum {out['checksum_gbps']:.1f} GB/s, memcpy {out['memcpy_gbps']:.1f} GB/s"
    )
    fl = out["physical_floor"]
    samples = fl.get("samples") or []
    if len(samples) > 1:
        warm, cold = sorted(x["cpu_ms_per_step"] for x in samples), sorted(x["cold_cpu_ms_per_step"] for x in samples)
        when = (
            f"measured after each of {len(samples)} rounds, each operation's median; one measurement alone "
            f"gave {warm[0]:.1f}-{warm[-1]:.1f} in cache, {cold[0]:.1f}-{cold[-1]:.1f} from memory"
        )
    else:
        when = "measured now"
    print(
        f"  physical floor (data movement alone, {when}): {fl['total_cpu_ms_per_step']:.1f} ms CPU a step "
        f"in cache, {fl['cold_total_cpu_ms_per_step']:.1f} ms from memory: ratio >= {fl['floor_overhead_ratio']:.3f} "
        f"/ {fl['cold_floor_overhead_ratio']:.3f}; by term (in cache / from memory):"
    )
    for name, t in sorted(fl["terms"].items(), key=lambda kv: -kv[1]["cold_cpu_ms_per_step"]):
        print(
            f"    {name}: {t['bytes_per_step'] / 1e6:.1f} MB x {t['ns_per_byte']:.3f} / {t['cold_ns_per_byte']:.3f} "
            f"ns/B = {t['cpu_ms_per_step']:.2f} / {t['cold_cpu_ms_per_step']:.2f} ms"
        )
    if fl.get("placed_total_cpu_ms_per_step") is not None:
        print(
            f"  where the protocol leaves the bytes (the worker's chunk in cache into a cold slot, the keeper's fold "
            f"of a slot another core just wrote, TCP from such slots, a received buffer into cold parity rows): "
            f"{fl['placed_total_cpu_ms_per_step']:.1f} ms CPU a step, "
            f"ratio >= {fl['placed_floor_overhead_ratio']:.3f}; "
            + ", ".join(
                f"{name.split(': ', 1)[1]} {t['placed_cpu_ms_per_step']:.2f}"
                for name, t in sorted(fl["terms"].items(), key=lambda kv: -kv[1]["placed_cpu_ms_per_step"])
            )
        )
    if fl.get("handoff_fold_ns_per_byte") is not None:
        print(
            f"    (the cold fold stands for a slot another core has just written: folding one measured "
            f"{fl['handoff_fold_ns_per_byte']:.3f} ns/B now, against the cold fold's "
            f"{fl['cold_operation_ns_per_byte']['fold']:.3f})"
        )
    if len(out["curve"]) > 1:
        print(
            f"curve of compute per protected byte (other points: {out['curve_rounds']} rounds of "
            f"{out['curve_steps_per_run']} steps)"
        )
        for e in out["curve"]:
            print(
                f"  {e['label']:>18}: {e['tokens_per_param_per_step']:.4g} tokens/param/step, off "
                f"{e['step_s_off'] * 1e3:.1f} ms, on {e['step_s_on'] * 1e3:.1f} ms: ratio {e['overhead_ratio']:.3f}; "
                f"CPU keepers {e['cpu_s_per_step_on'].get('keeper', 0) * 1e3:.0f} ms, workers "
                + _curve_worker_cpu(e, out["workers"])
            )
    print(
        f"  memory, all in: {out['memory_overhead']:.2f} B per protected B ("
        + ", ".join(f"{k} {v['per_protected_byte']:.2f}" for k, v in mem["memory_parts"].items() if v["bytes"])
        + f"); for a larger model it tends to {out['memory_overhead_large_model_limit']:.2f}; the keepers' "
        f"regions alone {out['memory_overhead_without_batches_and_copies']:.2f}"
    )
    fixed = out.get("fixed_rss_bytes_per_node")
    if fixed is not None:
        print(
            "  processes that exist only for protection, per node: "
            + (", ".join(f"{r} {v / 2**20:.0f} MiB" for r, v in fixed.items()) or "none seen")
            + "; warm shadows (recovery) "
            + (
                ", ".join(f"{r} {v / 2**20:.0f} MiB" for r, v in out["recovery_rss_bytes_per_node"].items())
                or "none seen"
            )
        )
    a = out.get("memory_all_in")
    if a is not None:
        print(
            f"  the whole job, measured ({a['protected']['measure']} of every process, at the job's peak): protected "
            f"{a['protected']['bytes'] / 2**20:.0f} MiB ("
            + ", ".join(f"{r} {b / 2**20:.0f}" for r, b in a["protected"]["bytes_by_role"].items())
            + f"), unprotected {a['unprotected']['bytes'] / 2**20:.0f} MiB: ratio "
            + ("-" if a["ratio"] is None else f"{a['ratio']:.2f}")
            + f", {a['extra_per_model_state_byte']:.1f} B more per byte of the model's state"
        )
    for name, t in out["targets"].items():
        v = t["value"]
        shown = "-" if v is None else f"{v:.4f}" if isinstance(v, float) else json.dumps(v)
        floor = t.get("floor")
        note = (
            ""
            if floor is None
            else f" (the physical floor alone would cost {floor['in_cache']:.3f} in cache, {floor['cold']:.3f} cold"
            + ("" if floor.get("placed") is None else f", {floor['placed']:.3f} where the bytes lie")
            + ")"
        )
        if "rounds" in t:
            note += (
                f" (median of {len(t['rounds'])} rounds; {t['rounds_met']} of them meet it alone: "
                + ", ".join(f"{r:.2f}" for r in t["rounds"])
                + ")"
            )
        print(f"  target {name} {t['target']}: {shown} {t['result']}{note}")
