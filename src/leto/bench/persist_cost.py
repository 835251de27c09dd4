"""What persistent checkpoints cost, measured where they write (`leto bench overhead`).

A persisting run (protection on, checkpoints every K steps at `leto train`'s default K) is long
enough that its measured window holds at least `WINDOW_CHECKPOINTS` checkpoints after the
calibration one. Its steps are split, from the run's own records, into

* checkpoint steps: for each checkpoint of step s, the steps from the one whose time holds the
  host copy (after step s's record) through the one in which the checkpoint committed (the last
  rank's write done), plus `GUARD_STEPS` on either side for the CPU sampler's resolution;
* steps that write nothing: every other step of the window.

A checkpoint's cost is what its steps took beyond as many steps that write nothing of the same
run, by wall time (the step records' clock) and by CPU (the kernel's per-thread accounting,
`leto.bench.cpu`, interpolated at the step records' times; every role and thread group): the
same run, the same load, no difference of two noisy runs. Divided by K it is the cost per step at
the default K. The write thread's own CPU is also reported apart (`persist_threads_cpu_s`).

Steps that write nothing are compared with the protection-on run of the same round (the median
step time, the CPU per step): `leto.bench.noise.within_noise` over the rounds.
"""

from __future__ import annotations

import math
import statistics

from leto.bench.cpu import TICK_S, cumulative_at
from leto.bench.noise import INCOMPLETE, MET, MISS, NOT_MEASURED, measured, on_median, within_noise
from leto.bench.throughput import WARMUP_STEPS
from leto.persistence.writer import CALIBRATE_AFTER

WINDOW_CHECKPOINTS = 2  # checkpoints the measured window of a persisting run must hold
GUARD_STEPS = 1  # steps charged to a checkpoint on either side of its copy-to-commit steps
K_MARGIN = 2.0  # a run's K can exceed the K seen before (seen here: 32 then 47): plan the window for this much more
TAIL_STEPS = 6  # after the last planned checkpoint: its write, the guard step, a spare
TARGET_SHARE = 0.01  # persistence adds at most 1 % of training CPU and of wall time per step
PERSIST_GROUPS = ("worker/persist", "worker/persist-import")  # threads that exist only to persist


def plan_steps(k: int | None, steps: int) -> int:
    """Steps of a persisting run (warm-up included) whose window holds WINDOW_CHECKPOINTS
    checkpoints at K (the largest K seen so far; None: unknown, the plain run's length)."""
    plain = steps + WARMUP_STEPS
    if not k:
        return plain
    planned = CALIBRATE_AFTER + WINDOW_CHECKPOINTS * math.ceil(K_MARGIN * k) + TAIL_STEPS
    return max(plain, planned)


def _roles(cpu: dict[str, float]) -> float:
    """CPU of every process (the role totals, not their thread groups)."""
    return sum(v for k, v in cpu.items() if "/" not in k)


def _sum(per_step: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in per_step:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out


def analyze_run(records: list[dict], events: list[dict], timeline: dict | None) -> dict | None:
    """One persisting run: its window, checkpoint steps and steps that write nothing, and what
    each checkpoint cost beyond as many steps that write nothing (module docstring). `timeline`:
    the CPU sampler's {"times", "samples"} (None: no CPU figures). None if the run chose no K."""
    interval = next((e for e in events if e["event"] == "persist_interval"), None)
    if interval is None:
        return None
    k, first = int(interval["every"]), int(interval["first"])
    recs = sorted((r for r in records if "step" in r and "time" in r), key=lambda r: r["step"])
    commits = sorted((e for e in events if e["event"] == "persist_commit"), key=lambda e: e["step"])
    calibrated = max([interval["time"], *(c["time"] for c in commits if c["step"] < first)])
    start = next(
        (i for i in range(max(WARMUP_STEPS, 1), len(recs)) if recs[i - 1]["time"] >= calibrated),
        len(recs),
    )
    index = {r["step"]: i for i, r in enumerate(recs)}
    done = {c["step"]: c for c in commits}
    skipped = {e["step"] for e in events if e["event"] == "persist_skipped"}  # due while a write went on
    cut = len(recs)  # from here on a write was in flight at the end (or failed): neither kind of step
    spans: list[tuple[int, int, dict]] = []
    for s in range(first, recs[-1]["step"] + 1 if recs else first, k):
        i = index.get(s)
        if i is None or s in skipped:
            continue
        c = done.get(s)
        j = next((j for j in range(i + 1, len(recs)) if recs[j]["time"] >= c["time"]), None) if c else None
        if j is None:
            cut = i + 1 - GUARD_STEPS
            break
        spans.append((i + 1 - GUARD_STEPS, min(j + GUARD_STEPS, len(recs) - 1), c))
    for lo, hi, _ in spans:  # a checkpoint that began before the window: the window starts after it
        if lo < start <= hi:
            start = hi + 1
    charged: dict[int, int] = {}  # step index -> the checkpoint (its position) it is charged to
    ckpts: list[dict] = []
    for lo, hi, c in spans:
        if lo < start or hi >= cut:
            continue
        for x in range(lo, hi + 1):
            charged.setdefault(x, len(ckpts))
        ckpts.append({"step": c["step"], "stage_s": c.get("stage_s"), "write_s": c.get("write_s")})
    window = list(range(start, cut))
    wall = {i: recs[i]["time"] - recs[i - 1]["time"] for i in window}
    cpu: dict[int, dict[str, float]] = {}
    if timeline and timeline.get("times"):
        at = [cumulative_at(timeline["times"], timeline["samples"], r["time"]) for r in recs]
        cpu = {i: {g: v - at[i - 1].get(g, 0.0) for g, v in at[i].items()} for i in window}
    nothing = [i for i in window if i not in charged]
    if not window or not nothing:
        # every step is a checkpoint's (K shorter than a write and its guard steps): no baseline to charge against
        return {"k": k, "checkpoints_in_window": len(ckpts), "steps_in_window": len(window), "nothing_steps": 0}
    base_wall = statistics.fmean(wall[i] for i in nothing)
    base_cpu = {g: v / len(nothing) for g, v in _sum([cpu[i] for i in nothing]).items()} if cpu else {}
    for pos, c in enumerate(ckpts):
        mine = [i for i in window if charged.get(i) == pos]
        n = len(mine)
        c["steps"] = [recs[i]["step"] for i in mine]
        c["wall_excess_s"] = round(sum(wall[i] for i in mine) - n * base_wall, 5)
        if cpu:
            used = _sum([cpu[i] for i in mine])
            by_group = {
                g: round(used.get(g, 0.0) - n * base_cpu.get(g, 0.0), 5) for g in sorted(set(used) | set(base_cpu))
            }
            c["cpu_excess_s"] = round(_roles(by_group), 5)
            c["cpu_excess_by_group_s"] = by_group
            c["persist_threads_cpu_s"] = round(sum(used.get(g, 0.0) for g in PERSIST_GROUPS), 5)
    out: dict = {
        "k": k,
        "first": first,
        "window_steps": [recs[start]["step"], recs[window[-1]]["step"]],
        "steps_in_window": len(window),
        "checkpoints_in_window": len(ckpts),
        "checkpoints": ckpts,
        "wall_s_per_step": round((recs[window[-1]]["time"] - recs[start - 1]["time"]) / len(window), 6),
        "nothing_steps": len(nothing),
        "nothing_wall_s_per_step": round(base_wall, 6),
        "nothing_median_step_s": round(statistics.median(wall[i] for i in nothing), 6),
    }
    if ckpts:
        out["wall_excess_s_per_step_at_k"] = round(statistics.fmean(c["wall_excess_s"] for c in ckpts) / k, 6)
        out["wall_share"] = round(out["wall_excess_s_per_step_at_k"] / base_wall, 5)
    if cpu:
        out["nothing_cpu_s_per_step"] = round(_roles(base_cpu), 6)
        out["nothing_cpu_s_per_step_by_group"] = {g: round(v, 6) for g, v in sorted(base_cpu.items())}
        out["nothing_persist_threads_cpu_s"] = round(
            sum(base_cpu.get(g, 0.0) for g in PERSIST_GROUPS) * len(nothing), 5
        )
        if ckpts:
            out["cpu_excess_s_per_step_at_k"] = round(statistics.fmean(c["cpu_excess_s"] for c in ckpts) / k, 6)
    return out


def round_entry(analysis: dict | None, training_cpu_s: float | None, on_step_s: float, on_cpu: dict) -> dict:
    """One round's persistence figures: the persisting run's `analyze_run`, its CPU share of the
    training's (the workers' CPU per step in the same round's unprotected run), and the same
    round's protection-on run for the steps that write nothing (its median step, its CPU per step)."""
    a = dict(analysis or {})
    excess = a.get("cpu_excess_s_per_step_at_k")
    a["training_cpu_s_per_step"] = training_cpu_s
    a["cpu_share"] = round(excess / training_cpu_s, 5) if excess is not None and training_cpu_s else None
    a["on_median_step_s"] = round(on_step_s, 6)
    a["on_cpu_s_per_step"] = round(_roles(on_cpu), 6) if on_cpu else None
    return a


def _spread(values: list[float | None]) -> list[float] | None:
    got = measured(values)
    return [min(got), max(got)] if got else None


def summarize(rounds: list[dict]) -> dict:
    """Medians and [min, max] over rounds, the noise flags of the steps that write nothing, and
    whether every round's window held WINDOW_CHECKPOINTS checkpoints."""
    held = [r.get("checkpoints_in_window", 0) for r in rounds]
    out: dict = {
        "checkpoints_in_window": min(held) if held else 0,
        "checkpoints_in_window_runs": held,
        "window_ok": bool(held) and min(held) >= WINDOW_CHECKPOINTS,
    }
    for key in (
        "cpu_share",
        "wall_share",
        "cpu_excess_s_per_step_at_k",
        "wall_excess_s_per_step_at_k",
        "nothing_wall_s_per_step",
        "nothing_median_step_s",
        "nothing_cpu_s_per_step",
        "nothing_persist_threads_cpu_s",
        "on_median_step_s",
        "on_cpu_s_per_step",
    ):
        values = [r.get(key) for r in rounds]
        got = measured(values)
        out[key] = round(statistics.median(got), 6) if got else None
        out[f"{key}_spread"] = _spread(values)
    per_ckpt = [c for r in rounds for c in r.get("checkpoints", [])]
    for key in ("wall_excess_s", "cpu_excess_s", "persist_threads_cpu_s", "stage_s", "write_s"):
        got = measured([c.get(key) for c in per_ckpt])
        out[f"per_checkpoint_{key}"] = round(statistics.median(got), 6) if got else None
    out["nothing_steps_within_noise"] = {
        "wall": within_noise(
            [r.get("nothing_median_step_s") for r in rounds], [r.get("on_median_step_s") for r in rounds]
        ),
        "cpu": within_noise(
            [r.get("nothing_cpu_s_per_step") for r in rounds], [r.get("on_cpu_s_per_step") for r in rounds]
        ),
    }
    out["rounds"] = rounds
    return out


def targets(summary: dict) -> dict[str, dict]:
    """Persistence's targets: CPU and wall time per step at the default K, each <= TARGET_SHARE
    on the median over rounds (met only if every round's window held WINDOW_CHECKPOINTS
    checkpoints), and nothing measurable on a step that writes nothing: the persistence threads'
    CPU there under one clock tick in every round, and the steps' median time and CPU not above
    the protection-on runs' beyond noise (below them is the load, not a cost)."""
    rounds = summary.get("rounds", [])
    n = len(rounds)
    full = [r for r in rounds if r.get("checkpoints_in_window", 0) >= WINDOW_CHECKPOINTS]
    out = {}
    for name, key in (
        ("persistence_cpu_share_per_step", "cpu_share"),
        ("persistence_wall_share_per_step", "wall_share"),
    ):
        v = summary.get(key)
        k = len(measured([r.get(key) for r in full]))
        out[name] = {
            "value": v,
            "target": f"<= {TARGET_SHARE}",
            "per_round": [r.get(key) for r in rounds],
            # a share measured on windows of fewer checkpoints is INCOMPLETE, never met
            "result": NOT_MEASURED if v is None else on_median(v, v <= TARGET_SHARE, max(k, 1), n) if k else INCOMPLETE,
        }
    threads = [r.get("nothing_persist_threads_cpu_s") for r in rounds]
    flags = summary.get("nothing_steps_within_noise", {})
    slower = {  # beyond noise and slower than protection alone (faster is the load, not a cost)
        "wall": flags.get("wall") is False and summary["nothing_median_step_s"] > summary["on_median_step_s"],
        "cpu": flags.get("cpu") is False and summary["nothing_cpu_s_per_step"] > summary["on_cpu_s_per_step"],
    }
    if not measured(threads) or None in flags.values():
        result = NOT_MEASURED  # no CPU timeline, or fewer than 2 rounds: no spread to judge by
    elif any(t >= TICK_S for t in measured(threads)) or any(slower.values()):
        result = MISS
    else:
        result = MET
    out["persistence_nothing_on_steps_that_write_nothing"] = {
        "value": {"persist_threads_cpu_s": threads, "within_noise": flags, "slower_beyond_noise": slower},
        "target": f"persist threads < {TICK_S:g} s CPU; steps not slower nor more CPU than protection alone "
        "beyond noise",
        "result": result,
    }
    return out
