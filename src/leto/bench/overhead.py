"""`leto bench overhead`: the default job with protection off and on, interleaved in one run.

Also: encode throughput next to memcpy on this machine, and the memory protection costs
(protection bytes / protected bytes), computed from the buffers the keepers and workers allocate.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

from leto.bench.throughput import WARMUP_STEPS, run_job, steady_step_s
from leto.protection.codec_bench import measure_codec
from leto.protection.layout import Geometry, Layout
from leto.protection.placement import default_code
from leto.protection.shm import specs
from leto.training.model import GPT, PRESETS
from leto.training.trainer import DEFAULT_CHUNK_BYTES

ROUNDS = 3
NODES = 2


def memory_cost(model: str, workers: int, nodes: int, ec: tuple[int, int] | None) -> dict:
    """Bytes of protection per byte of protected (unique) state, from the real allocations."""
    numel = sum(p.numel() for p in GPT(PRESETS[model]).parameters())
    elems = DEFAULT_CHUNK_BYTES // 12
    n_chunks = -(-numel // (workers * elems))
    node_of_rank = tuple(r * nodes // workers for r in range(workers))
    layout = Layout(0, 0, Geometry(n_chunks, elems), node_of_rank, ec)
    by_kind = {"parity": 0, "gradient_parity": 0, "staging": 0, "tables": 0}
    for n in layout.nodes:
        for name, shape, dtype in specs(layout, n):
            size = int(np.prod(shape)) * np.dtype(dtype).itemsize
            kind = ("parity" if name.startswith(("p1", "p2_")) else "gradient_parity" if name.startswith(("g1", "g2_"))
                    and "step" not in name and "count" not in name else "staging" if name.startswith("slot")
                    else "tables")
            by_kind[kind] += size
    protected = workers * n_chunks * layout.geometry.state_bytes
    # workers keep a second copy of their shard and of their gradient shard (docs/protection.md)
    second_copies = workers * n_chunks * (layout.geometry.state_bytes + layout.geometry.grad_bytes)
    keeper = sum(by_kind.values())
    return {"protected_bytes": protected, "keeper_bytes": keeper, "keeper_breakdown": by_kind,
            "worker_second_copies_bytes": second_copies,
            "memory_overhead": round(keeper / protected, 4),
            "memory_overhead_with_worker_copies": round((keeper + second_copies) / protected, 4)}


def _median_by_role(runs: list[dict[str, float]]) -> dict[str, float]:
    roles = sorted({r for run in runs for r in run})
    return {r: round(statistics.median(run.get(r, 0.0) for run in runs), 5) for r in roles}


def main(args: argparse.Namespace) -> int:
    steps = args.steps or 40
    ec = default_code(NODES)
    off, on, prot = [], [], []
    cpu: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="leto-bench-") as tmp:
        for i in range(ROUNDS):  # interleaved so that machine load hits both alike
            for protection, sink in ((False, off), (True, on)):
                d = Path(tmp) / f"{i}-{protection}"
                res = run_job(args.workers, steps + WARMUP_STEPS, args.model, d, nodes=NODES, protection=protection,
                              ec=ec if protection else None)
                sink.append(steady_step_s(res["steps"]))
                cpu[protection].append(res["cpu_s_per_step"])
                if protection:
                    prot += res["steps"][WARMUP_STEPS:]
    step_off, step_on = statistics.median(off), statistics.median(on)
    codec = measure_codec(nbytes=32 << 20, k=args.workers // NODES, m=1)
    mem = memory_cost(args.model, args.workers, NODES, ec)
    out = {"model": args.model, "workers": args.workers, "nodes": NODES, "ec": f"{ec[0]}+{ec[1]}",
           "steps_per_run": steps, "rounds": ROUNDS,
           "step_s_off": round(step_off, 5), "step_s_on": round(step_on, 5),
           "overhead_ratio": round(step_on / step_off, 4),
           "step_s_off_runs": [round(x, 5) for x in off], "step_s_on_runs": [round(x, 5) for x in on],
           "protection_stage_s_per_step": round(statistics.mean(r.get("stage_s", 0) for r in prot), 6),
           "protection_wait_s_per_step": round(statistics.mean(r.get("wait_s", 0) for r in prot), 6),
           "encode_gbps": round(codec["encode_gbps"], 2), "xor_gbps": round(codec["xor_gbps"], 2),
           "checksum_gbps": round(codec["checksum_gbps"], 2), "memcpy_gbps": round(codec["memcpy_gbps"], 2),
           "cpu_s_per_step_off": _median_by_role(cpu[False]), "cpu_s_per_step_on": _median_by_role(cpu[True]),
           **{k: v for k, v in mem.items()}}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"default job ({args.model}, {args.workers} workers, {NODES} nodes, --ec {out['ec']}), "
          f"{ROUNDS} interleaved rounds of {steps} steps")
    print(f"  step time off {step_off * 1e3:.1f} ms, on {step_on * 1e3:.1f} ms: overhead ratio {out['overhead_ratio']:.3f}")
    print(f"  protection on the training thread per step: staging {out['protection_stage_s_per_step'] * 1e3:.2f} ms, "
          f"waiting for keepers {out['protection_wait_s_per_step'] * 1e3:.2f} ms (rank 0)")
    c_off, c_on = out["cpu_s_per_step_off"], out["cpu_s_per_step_on"]
    print(f"  CPU per step: workers {c_off.get('worker', 0) * 1e3:.0f} ms off, {c_on.get('worker', 0) * 1e3:.0f} ms on; "
          f"keepers {c_on.get('keeper', 0) * 1e3:.0f} ms (all processes of a role, median of {ROUNDS} rounds)")
    parts = sorted(((k.split("/", 1)[1], v) for k, v in c_on.items() if k.startswith("keeper/")), key=lambda kv: -kv[1])
    if parts:
        print("  keepers by thread: " + ", ".join(f"{name} {v * 1e3:.1f} ms" for name, v in parts))
    print(f"  encode {out['encode_gbps']:.1f} GB/s, XOR {out['xor_gbps']:.1f} GB/s, crc32 {out['checksum_gbps']:.1f} GB/s, "
          f"memcpy {out['memcpy_gbps']:.1f} GB/s")
    print(f"  memory: keepers hold {out['memory_overhead']:.2f} B per protected B "
          f"({', '.join(f'{k} {v / 2**20:.1f} MiB' for k, v in mem['keeper_breakdown'].items())}); "
          f"with the workers' second copies {out['memory_overhead_with_worker_copies']:.2f}")
    return 0
