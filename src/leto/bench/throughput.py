"""`leto bench throughput`: step time and tokens/s of the default job, the reference for overheads."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from leto.bench.cpu import CpuSampler
from leto.bench.mesh import refuse_tp
from leto.config import (
    JobConfig,
    MeshConfig,
    PersistenceConfig,
    ProtectionConfig,
    RecoveryConfig,
    TrainingConfig,
)
from leto.console import read_jsonl
from leto.control import one_host
from leto.training.model import PRESETS

WARMUP_STEPS = 5


def run_job(
    workers: int,
    steps: int,
    model: str,
    run_dir: Path,
    extra: list[str] | None = None,
    spares: int = 0,
    nodes: int = 1,
    protection: bool = False,
    ec: tuple[int, int] | None = None,
    module: str | None = None,
    memory_every_s: float | None = None,
    persist: bool = False,
    tp: int = 1,
    pp: int = 1,
) -> dict:
    """Run the built-in job quietly (or `module`, a wrapper taking the same arguments); returns
    its summary, per-step records, the CPU seconds per step each role used over the steps after
    the warm-up, the sampler's cumulative CPU by role and thread group (`cpu_timeline`), the job's
    events and, with `memory_every_s`, every process's memory at the moment the job held the most
    (`CpuSampler.memory_at_peak`). `persist`: persistent checkpoints as `leto train` writes them by
    default (every K steps, K from Young/Daly for the default --mtbf). `tp`, `pp`: tensor-parallel ranks
    per pipeline stage and stages per model replica (`leto train --tp`, `--pp`; the stages'
    `--microbatches` go in `extra`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    command = ["-m", module or "leto.training.train_gpt", "--steps", str(steps), "--model", model, *(extra or [])]
    persistence = PersistenceConfig()
    if persist:
        from leto.persistence.resume import fresh

        persistence = fresh(run_dir, command, persistence, persist=True).persistence
    config = JobConfig(
        training=TrainingConfig(command=tuple(command), workers=workers, nodes=nodes),
        mesh=MeshConfig(tp=tp, pp=pp),
        protection=ProtectionConfig(enabled=protection, ec=ec),
        recovery=RecoveryConfig(spares=spares),
        persistence=persistence,
        run_dir=str(run_dir),
        quiet=True,
    )
    with CpuSampler(run_dir, memory_every_s=memory_every_s) as cpu:
        code = one_host.run_job(config)
    if code != 0:
        raise RuntimeError(f"benchmark job failed with exit code {code}; see {run_dir}")
    records = read_jsonl(run_dir / "metrics.jsonl")
    steps_ = [r for r in records if "event" not in r]
    measured = steps_[WARMUP_STEPS - 1 :] if len(steps_) > WARMUP_STEPS else steps_
    used = cpu.between(measured[0]["time"], measured[-1]["time"]) if len(measured) > 1 else {}
    per_step = {role: round(v / (len(measured) - 1), 5) for role, v in used.items()}
    return {
        "summary": json.loads((run_dir / "summary.json").read_text()),
        "steps": steps_,
        "events": [r for r in records if "event" in r],
        "cpu_s_per_step": per_step,
        "cpu_timeline": {"times": cpu.times, "samples": cpu.samples},  # cumulative CPU by role and thread group
        "memory": cpu.memory_at_peak(),
    }


def steady_step_s(steps: list[dict]) -> float:
    """Median step time after the warm-up steps."""
    return statistics.median(r["step_s"] for r in steps[WARMUP_STEPS:] or steps)


def wall_step_s(steps: list[dict]) -> float:
    """Wall time per step after the warm-up, from the step records' clock: it charges everything
    between steps too (a checkpoint's copy), which a median of step times would not see."""
    measured = steps[WARMUP_STEPS - 1 :] if len(steps) > WARMUP_STEPS else steps
    return (measured[-1]["time"] - measured[0]["time"]) / max(1, len(measured) - 1)


def main(args: argparse.Namespace) -> int:
    refuse_tp(args, "throughput")
    cfg = PRESETS[args.model]
    args.steps = args.steps or 40
    with tempfile.TemporaryDirectory(prefix="leto-bench-") as tmp:
        res = run_job(args.workers, args.steps + WARMUP_STEPS, args.model, Path(tmp), nodes=2)
    step_s = steady_step_s(res["steps"])
    tokens = cfg.batch_size * cfg.block_size
    out = {
        "model": args.model,
        "workers": args.workers,
        "steps": args.steps,
        "step_s": round(step_s, 5),
        "tokens_per_step": tokens,
        "tokens_per_s": round(tokens / step_s, 1),
        "wall_s": res["summary"]["wall_s"],
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(
            f"model {args.model}, {args.workers} workers: median step {step_s * 1e3:.1f} ms, "
            f"{out['tokens_per_s']:,.0f} tokens/s ({tokens} tokens per step)"
        )
    return 0
