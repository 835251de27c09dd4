"""What protection costs in CPU, per step, measured part by part and set against the floor.

Per paired round of `leto bench overhead`: the keepers' CPU, by thread, from the kernel's
per-thread accounting (`CpuSampler`); the workers' protection part measured directly, not as a
difference of two runs: the CPU their training threads spend inside protection (`Protector`:
staging, i.e. the copy back, the XOR into the slot and the checksum, and waiting for the keepers;
`time.thread_time()` around each call, in rank 0's step records, times the workers: every rank
stages as many chunks) plus every thread protection adds to a worker (`WORKER_PROTECTION_GROUPS`).
Training's CPU is the protected run's workers' CPU without that part; the unprotected run's
stands beside it. The headline is protection CPU / training CPU; every part is reported as the
median and [min, max] over the rounds, and next to its terms of the physical floor
(`bench/floor.py`).
"""

from __future__ import annotations

import statistics

from leto.bench.cpu import WORKER_PROTECTION_GROUPS
from leto.bench.noise import measured as present

STAGING, WAITING = "worker/staging", "worker/waiting"  # the training thread's CPU inside protection
# each measured part -> (what of the measured figures it is, the floor terms it is set against)
FLOOR_PARTS = {
    "worker staging": ((STAGING,), ("worker: ",)),
    "keeper fold": (("keeper/main",), ("keeper: ",)),
    "tier 2": (("keeper/gloo", "keeper/tier2-threads"), ("tier 2: ",)),
}


def round_cpu(cpu_on: dict[str, float], cpu_off: dict[str, float], records: list[dict], workers: int) -> dict | None:
    """CPU seconds per step of one round: `cpu_on`/`cpu_off` the protected and unprotected runs'
    CPU by role and thread group (`run_job`'s `cpu_s_per_step`), `records` the protected run's
    step records of the same window (rank 0's, with `stage_cpu_s`, `wait_cpu_s`). None where the
    records carry no protection CPU (nothing to measure the workers' part by)."""
    timed = [r for r in records if "stage_cpu_s" in r]
    if not timed:
        return None
    stage = workers * statistics.fmean(r["stage_cpu_s"] for r in timed)
    wait = workers * statistics.fmean(r.get("wait_cpu_s", 0.0) for r in timed)
    added = {f"worker/{g}": cpu_on.get(f"worker/{g}", 0.0) for g in WORKER_PROTECTION_GROUPS}
    worker = stage + wait + sum(added.values())
    keeper = cpu_on.get("keeper", 0.0)
    training = cpu_on.get("worker", 0.0) - worker
    return {
        "total": keeper + worker,
        "keeper": keeper,
        **{k: v for k, v in cpu_on.items() if k.startswith("keeper/")},
        "worker": worker,
        STAGING: stage,
        WAITING: wait,
        **added,
        "training": training,
        "training_unprotected": cpu_off.get("worker", 0.0),
        "ratio": (keeper + worker) / training if training > 0 else None,
    }


def spread(values: list[float | None], nd: int = 6) -> dict[str, float] | None:
    """Median, min and max of the values present (None if none is)."""
    vals = present(values)
    if not vals:
        return None
    return {"median": round(statistics.median(vals), nd), "min": round(min(vals), nd), "max": round(max(vals), nd)}


def _floor_ms(fl: dict, prefixes: tuple[str, ...], key: str) -> float:
    return sum(t[key] for name, t in fl["terms"].items() if name.startswith(prefixes))


def summarize(rounds: list[dict | None], fl: dict) -> dict:
    """Every part's median and [min, max] over the rounds (seconds a step), the headline ratio,
    and each part against its floor terms (`floor()`'s output): measured / floor per round, in
    cache and cold, and the whole against the cold floor (`total_vs_cold_floor`, and each round's
    own figure in `total_vs_cold_floor_by_round`)."""
    got = [r for r in rounds if r is not None]
    if not got:
        return {"status": "not measured: no step record carries the training thread's protection CPU"}
    keys = [k for k in got[0] if k != "ratio"] + sorted({k for r in got for k in r} - set(got[0]))
    parts = {k: spread([r.get(k, 0.0) for r in got]) for k in keys if k != "ratio"}
    vs_floor = {}
    for name, (measured, prefixes) in FLOOR_PARTS.items():
        warm, cold = _floor_ms(fl, prefixes, "cpu_ms_per_step"), _floor_ms(fl, prefixes, "cold_cpu_ms_per_step")
        per_round = [sum(r.get(k, 0.0) for k in measured) * 1e3 for r in got]
        vs_floor[name] = _against(measured, per_round, warm, cold)
    per_round = [r["total"] * 1e3 for r in got]
    vs_floor["total"] = _against(("total",), per_round, fl["total_cpu_ms_per_step"], fl["cold_total_cpu_ms_per_step"])
    return {
        "status": "measured",
        "rounds": [{k: round(v, 6) if v is not None else None for k, v in r.items()} for r in got],
        "cpu_s_per_step": parts,
        "ratio_to_training_cpu": spread([r["ratio"] for r in got], 4),
        "vs_floor": vs_floor,
        "total_vs_cold_floor": vs_floor["total"]["cold_ratio"],
        "total_vs_cold_floor_by_round": [round(m / fl["cold_total_cpu_ms_per_step"], 3) for m in per_round]
        if fl["cold_total_cpu_ms_per_step"] > 0
        else None,
    }


def _against(measured: tuple[str, ...], per_round_ms: list[float], warm_ms: float, cold_ms: float) -> dict:
    return {
        "measured": list(measured),
        "measured_ms": spread(per_round_ms, 3),
        "floor_ms": round(warm_ms, 3),
        "cold_floor_ms": round(cold_ms, 3),
        "ratio": spread([m / warm_ms for m in per_round_ms], 3) if warm_ms > 0 else None,
        "cold_ratio": spread([m / cold_ms for m in per_round_ms], 3) if cold_ms > 0 else None,
    }


def headline(pc: dict) -> float | None:
    """The median protection CPU / training CPU, None if not measured."""
    r = pc.get("ratio_to_training_cpu")
    return None if r is None else r["median"]


def fmt_spread(s: dict | None, scale: float = 1.0, unit: str = "", nd: int = 2) -> str:
    """`median [min, max]` of a `spread`, scaled."""
    if s is None:
        return "-"
    return f"{s['median'] * scale:.{nd}f}{unit} [{s['min'] * scale:.{nd}f}, {s['max'] * scale:.{nd}f}]"
