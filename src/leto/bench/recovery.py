"""`leto bench recovery`: the same failure in every system, on the same job, in one run.

For each trial, for each failure (a worker SIGKILL; a whole-node loss) and for each system
(interleaved: A, B, C, A, B, C ...), the built-in GPT job runs while `leto.baselines.faults` kills the
process(es) by PID once step `kill_step` is recorded, i.e. at the start of step `kill_step + 1`.
Every number comes from the run's metrics.jsonl (see `runs.analyze_recovery`); medians over
trials are reported, raw values are in the JSON. With `--tp T` and `--pp P` every system runs
the job as a DP x PP x TP mesh (TP groups inside nodes; P stages with `leto train`'s default
2 x P micro-batches); the systems that cannot are skipped with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from leto.baselines.nvrx_job import NVRX_VERSION, nvrx_status
from leto.bench import plots
from leto.bench.mesh import check_mesh, mesh_elements, mesh_flags, mesh_of, mesh_shape, shard_accounting
from leto.bench.runs import (
    LETO,
    SEGMENTS,
    TOLERANCE,
    WINDOW,
    BenchInterrupted,
    JobConfig,
    Run,
    System,
    analyze_recovery,
    default_out,
    log,
    machine,
    median,
    median_index,
    ratio,
    run_system,
    state_bytes_per_rank,
    stdout_to_stderr,
    step_injector,
    torchft_status,
)
from leto.errors import UsageError
from leto.protection.placement import default_code
from leto.runtime.mesh import layout_problem
from leto.training.model import PRESETS
from leto.training.trainer import DEFAULT_CHUNK_BYTES

DEFAULT_STEPS = 40
SPARES_VARIANT = (
    3  # node loss: 1 shadow for 2 lost ranks shrinks the job; 3 (alternating nodes) leave 2 on the survivor
)
FAILURES = {"worker": "kill", "node": "node-kill"}
FAILURE_ORDER = ("worker", "node")
TITLES = {"worker": "worker SIGKILL", "node": "whole-node loss"}
MESH_SYSTEMS = (LETO, "checkpoint-restart", "memory-restart")  # the kinds that run a TP or PP job
KEYS = ("recovery_s", "regain_s", "detect_s", "restore_s", "first_s", "lost_steps", "pre_step_s")


def kill_step(steps: int) -> int:
    """The step after which the failure is injected: 30 % into the run, at least 1."""
    return max(1, min(steps - 1, round(steps * 0.3))) if steps > 1 else 1


def systems_for(failure: str) -> list[System]:
    out = [System(LETO, LETO, 1)]
    if failure == "node":
        out.append(System(f"leto --spares {SPARES_VARIANT}", LETO, SPARES_VARIANT))
    # nvrx: NVRx in-process restart with 1 warm spare rank (a node loss: the spare, then one rank fewer)
    return out + [System(s, s) for s in ("checkpoint-restart", "memory-restart", "torchft", "nvrx")]


def job_nodes(workers: int, tp: int, pp: int = 1) -> int:
    """Nodes (failure domains) for the job: 2 where the TP groups fit inside them (a node loss
    needs a second node), else 1."""
    return 2 if workers >= 2 and layout_problem(workers, 2, tp, pp) is None else 1


def mesh_skipped(tp: int, pp: int = 1) -> dict[str, str]:
    """The systems that cannot run a job in replicas of `pp` stages of `tp` ranks, and why."""
    if tp == 1 and pp == 1:
        return {}
    what = {(True, False): "tensor-parallel", (False, True): "pipeline-parallel"}.get((tp > 1, pp > 1), "TP or PP")
    kinds = {s.kind for f in FAILURE_ORDER for s in systems_for(f)}
    why = f"skipped: runs no {what} job ({mesh_flags(tp, pp)})"
    return {k: why for k in sorted(kinds) if k not in MESH_SYSTEMS}


def configurations(cfg: JobConfig, ec: tuple[int, int] | None) -> dict[str, str]:
    """What each system is, in words: the names the table and the ratio stand for."""
    mesh = f"{cfg.workers} workers, {mesh_shape(cfg.workers, cfg.tp, cfg.pp)}"
    code = f"--ec {ec[0]}+{ec[1]}" if ec else "tier 1 only"
    restart = f"a fresh job of fresh processes on the same mesh ({mesh})"
    return {
        LETO: f"in place: survivors keep their processes, a warm shadow adopts the lost rank, state from "
        f"erasure-coded in-memory protection ({code}), 1 shadow",
        f"leto --spares {SPARES_VARIANT}": f"the same with {SPARES_VARIANT} shadows",
        "checkpoint-restart": f"DCP checkpoint of every rank's shard to local disk every K steps (K from "
        f"Young/Daly for an MTBF of {cfg.mtbf_s:g} s and the measured checkpoint cost), then {restart}",
        "memory-restart": f"every rank's shard copied to /dev/shm every step (Gemini-like), then {restart}",
    }


def evaluate(run: Run, system: System) -> dict:
    """One trial's numbers (raw), from the run's records."""
    rec: dict = {"run_dir": str(run.run_dir), "exit_code": run.code, "ok": run.ok, "error": run.error}
    if not run.kills:
        rec.update(ok=False, error=rec["error"] or f"the failure was not injected ({'; '.join(run.injection_errors)})")
        return rec
    kill = run.kills[0]
    rec.update({"kill_time": kill.time, "killed_pids": kill.pids, "killed_after_step": kill.step})
    rec.update(analyze_recovery(run.records, kill.time))
    if system.kind == "checkpoint-restart":
        rec["ckpt_every"] = (run.summary.get("ckpt") or {}).get("every")
    if system.kind == LETO:
        recs = run.summary.get("recoveries") or []
        rec["tier"] = recs[0].get("tier") if recs else None
        keys = ("detect_s", "restore_s", "total_s", "lost_steps")
        rec["leto_record"] = {k: recs[0].get(k) for k in keys} if recs else None  # Leto's own view
    return rec


def aggregate(trials: list[dict]) -> dict:
    """Medians over the trials that completed (ok), the representative (median) trial, the raw trials."""
    good = [i for i, t in enumerate(trials) if t.get("ok")]
    out: dict = {k: median([trials[i].get(k) for i in good]) for k in KEYS}
    rep = median_index([trials[i].get("recovery_s") for i in good])
    out["representative_trial"] = good[rep] if rep is not None else None
    out["breakdown"] = trials[good[rep]].get("breakdown") if rep is not None else None
    out["trials_ok"] = len(good)
    out["trials_with_recovery"] = sum(1 for i in good if trials[i].get("recovery_s") is not None)
    out["trials"] = trials
    if any("ckpt_every" in t for t in trials):
        out["ckpt_every"] = [t.get("ckpt_every") for t in trials]
    return out


def speedups(systems: dict[str, dict], ref: str, key: str = "recovery_s") -> dict[str, float | None]:
    base = systems.get(ref, {}).get(key)
    return {name: ratio(s.get(key), base) for name, s in systems.items() if name != ref}


def run_all(
    args: argparse.Namespace, cfg: JobConfig, out: Path, failures: list[str], step: int, skipped: dict[str, str]
) -> tuple[dict[str, dict[str, list[dict]]], dict[str, dict[str, list[Run]]]]:
    """Every trial of every system, interleaved; returns (raw results, runs) per failure and system."""
    results: dict[str, dict[str, list[dict]]] = {f: {} for f in failures}
    runs: dict[str, dict[str, list[Run]]] = {f: {} for f in failures}
    timeout_s = 120.0 + 10.0 * cfg.steps
    for trial in range(args.trials):
        for failure in failures:
            who = 1 if failure == "node" else min(1, cfg.workers - 1)
            for system in systems_for(failure):
                if system.kind in skipped:
                    continue
                run_dir = out / "runs" / f"trial{trial}-{failure}-{system.name.replace(' ', '').replace('--', '-')}"
                injector = step_injector(run_dir, FAILURES[failure], who, step, timeout_s)
                run = run_system(system, cfg, run_dir, injector, limit_s=120.0 + 5.0 * cfg.steps)
                res = evaluate(run, system)
                results[failure].setdefault(system.name, []).append(res)
                runs[failure].setdefault(system.name, []).append(run)
                log(
                    f"[recovery] trial {trial + 1}/{args.trials} {TITLES[failure]:15} {system.name:18} "
                    + (
                        f"recovery {res.get('recovery_s')} s, regain {res.get('regain_s')} s, "
                        f"lost {res.get('lost_steps')} steps"
                        if res.get("ok")
                        else f"FAILED: {res.get('error')}"
                    )
                )
    return results, runs


def sections(report: dict) -> list[tuple[str, dict]]:
    """(failure, section) pairs: the worker kill is the top level of the report, the node loss
    is under `node_loss`."""
    out = [("worker", report)]
    return out + ([("node", report["node_loss"])] if "node_loss" in report else [])


def make_plots(out: Path, report: dict, runs: dict[str, dict[str, list[Run]]], tokens: int) -> list[str]:
    columns, titles, bars = [], [], {}
    right = 0.0
    for failure, section in sections(report):
        col = []
        for name, agg in section["systems"].items():
            idx = agg.get("representative_trial")
            if idx is None:
                continue
            run, trial = runs[failure][name][idx], agg["trials"][idx]
            marks = [(trial["kill_time"] + trial["recovery_s"], f"back at speed {trial['recovery_s']:.1f} s")]
            right = max(right, trial["recovery_s"] + 5.0)
            col.append(plots.Panel(name, run.steps(), trial["kill_time"], [trial["kill_time"]], marks))
        columns.append(col)
        titles.append(f"{TITLES[failure]} (kill after step {report['config']['kill_step']})")
        bars[TITLES[failure]] = {
            name: agg.get("breakdown") for name, agg in section["systems"].items() if not agg.get("status")
        }
    paths = []
    if any(columns):
        paths.append(
            plots.timeline(
                columns,
                titles,
                tokens,
                out / "recovery-timeline.png",
                "Tokens/s around the failure (median trial of each system)",
                "seconds since the kill",
                xlim=(-4.0, right),
            )
        )
    paths.append(
        plots.breakdown_bars(
            bars,
            out / "recovery-breakdown.png",
            "Recovery time: kill → back at pre-failure speed (median trial)",
            SEGMENTS,
        )
    )
    return [str(p) for p in paths]


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _steps(x: float | None) -> str:
    return "-" if x is None else f"{x:g}"


def print_table(report: dict) -> None:
    cfg = report["config"]
    tp, pp = cfg.get("tp", 1), cfg.get("pp", 1)
    flags = mesh_flags(tp, pp)
    mesh = f" ({flags}: {mesh_shape(cfg['workers'], tp, pp)})" if flags else ""
    if pp > 1:
        mesh += f", {cfg['microbatches']} micro-batches"
    print(
        f"leto bench recovery: {cfg['workers']} workers{mesh} on {cfg['nodes']} nodes, model {cfg['model']}, "
        f"{cfg['steps']} steps, failure injected after step {cfg['kill_step']}; medians of {cfg['trials']} trials"
    )
    for failure, section in sections(report):
        print(f"\n{TITLES[failure]}: {section['what']}")
        print(
            f"  {'system':20} {'recovery':>9} {'regain':>8} {'detect':>7} {'restore':>8} {'lost steps':>10} "
            f"{'n':>5} {'vs leto':>8}"
        )
        for name, s in section["systems"].items():
            if s.get("status"):
                print(f"  {name}: {s['status']}")
                continue
            sp = section["speedup"].get(name)
            vs = "" if name == LETO else ("-" if sp is None else f"{sp:.1f}x")
            print(
                f"  {name:20} {_fmt(s['recovery_s']):>8}s {_fmt(s['regain_s']):>7}s {_fmt(s['detect_s']):>6}s "
                f"{_fmt(s['restore_s']):>7}s {_steps(s['lost_steps']):>10} "
                f"{s['trials_with_recovery']:>3}/{len(s['trials'])} "
                f"{vs:>8}"
            )
    ratios = [
        f"{TITLES[failure]} {sp:.1f}x"
        for failure, section in sections(report)
        if (sp := section["speedup"].get("checkpoint-restart")) is not None
    ]
    if ratios:
        print(f"\ncheckpoint-restart's recovery / Leto's{' on the same mesh' if flags else ''}: {', '.join(ratios)}")
    _print_configurations(report)
    _print_accounting(report)
    print(
        f"\nrecovery: kill -> the lost work is redone and the next {cfg['window']} steps together ran in at most "
        f"{cfg['tolerance']}x their pre-failure median time; regain: kill -> the step in flight is done; "
        f"n: trials that got back to speed / trials; vs leto: the system's recovery / Leto's"
    )
    print(f"plots: {', '.join(report['plots'])}\nraw results: {report['json']}")


def _print_configurations(report: dict) -> None:
    """Each system that ran, in words; checkpoint-restart's K as its trials chose it."""
    ran = {name for _, section in sections(report) for name, s in section["systems"].items() if not s.get("status")}
    every = sorted(
        {
            k
            for _, section in sections(report)
            for k in section["systems"].get("checkpoint-restart", {}).get("ckpt_every") or []
            if k
        }
    )
    print("systems:")
    for name, what in report.get("configurations", {}).items():
        if name in ran:
            if name == "checkpoint-restart" and every:
                what = what.replace("every K steps", f"every K = {' or '.join(map(str, every))} steps")
            print(f"  {name}: {what}")


def _print_accounting(report: dict) -> None:
    m = report.get("mesh")
    if not m:
        return
    n, stages = m["model_elements"], m["stage_slice_elements"]
    print(
        f"state per rank: a ZeRO-1 shard of {m['shard_elements_per_rank']:,} elements "
        f"({report['state_bytes_per_rank'] / 2**20:.2f} MiB: master, exp_avg, exp_avg_sq) of its slice"
        + (
            f" (stages {' / '.join(f'{x:,}' for x in stages)} elements, laid out for the largest)"
            if len(stages) > 1
            else ""
        )
        + f"; the job protects {m['protected_elements']:,} elements for a model of {n:,}: "
        f"copies {m['copies_elements']:,}, stage padding {m['stage_padding_elements']:,}, "
        f"chunk padding {m['chunk_padding_elements']:,} ({m['protected_per_model_element']:.3f} per model element)"
    )


def section_for(failure: str, step: int, trials: dict[str, list[dict]], skipped: dict[str, str]) -> dict:
    """Medians, speedups and raw trials of one failure."""
    systems = {name: aggregate(t) for name, t in trials.items()}
    for name, why in skipped.items():
        systems[name] = {"status": why, **{k: None for k in KEYS}, "trials": []}
    who = "rank 1" if failure == "worker" else "node 1 (its workers, shadows and keeper)"
    section = {
        "what": f"SIGKILL of {who} once step {step} is recorded",
        "systems": systems,
        "speedup": speedups(systems, LETO),
        "speedup_regain": speedups(systems, LETO, "regain_s"),
    }
    if failure == "node":
        section["speedup_vs_spares3"] = speedups(systems, f"leto --spares {SPARES_VARIANT}")
    return section


def microbatches_for(model: str, workers: int, tp: int, pp: int) -> int:
    """`leto train`'s default micro-batches for `pp` stages (2 x P; 1 without stages), or
    UsageError if a replica's batch has fewer rows."""
    if pp == 1:
        return 1
    rows = PRESETS[model].batch_size // (workers // (tp * pp))
    if rows < 2 * pp:
        raise UsageError(
            f"leto bench recovery: error: --pp {pp} runs {2 * pp} micro-batches, more than the {rows} rows of a "
            f"replica's batch of {model} with --workers {workers}"
        )
    return 2 * pp


def main(args: argparse.Namespace) -> int:
    tp, pp = mesh_of(args)
    if getattr(args, "hosts", None):
        if tp > 1 or pp > 1:
            raise UsageError(
                "leto bench recovery: error: --hosts runs data-parallel jobs only; --tp and --pp are for one host"
            )
        from leto.bench import hosts

        return hosts.main(args)
    steps = args.steps or DEFAULT_STEPS
    nodes = job_nodes(args.workers, tp, pp)
    problem = check_mesh(args.model, args.workers, nodes, tp, pp)
    if problem is not None:
        raise UsageError(f"leto bench recovery: error: {problem}")
    microbatches = microbatches_for(args.model, args.workers, tp, pp)
    if nodes < 2:
        log(f"--workers {args.workers} {mesh_flags(tp, pp)}: one node (TP groups inside nodes), so no node loss")
    cfg = JobConfig(
        workers=args.workers, nodes=nodes, steps=steps, model=args.model, tp=tp, pp=pp, microbatches=microbatches
    )
    step = kill_step(steps)
    out = Path(args.out) if args.out else default_out("recovery")
    out.mkdir(parents=True, exist_ok=True)
    skipped: dict[str, str] = mesh_skipped(tp, pp)
    for name, why in skipped.items():
        log(f"{name}: {why}")
    tf = None if "torchft" in skipped else torchft_status()
    if tf is not None:
        skipped["torchft"] = tf
        log(f"torchft: {tf}")
    needs_nvrx = "nvrx" not in skipped and any(s.kind == "nvrx" for f in FAILURE_ORDER for s in systems_for(f))
    nv = nvrx_status() if needs_nvrx else None
    if nv is not None:
        skipped["nvrx"] = f"nvidia-resiliency-ext=={NVRX_VERSION} {nv}"
        log(f"nvrx: {skipped['nvrx']}")
    failures = [f for f in FAILURE_ORDER if f == "worker" or nodes >= 2]  # a node loss needs a second node
    info = machine()
    try:
        with stdout_to_stderr():
            results, runs = run_all(args, cfg, out, failures, step, skipped)
    except BenchInterrupted as e:
        log(f"leto bench recovery: {e}; stopped")
        return 130
    info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    report: dict = {
        "bench": "recovery",
        "machine": info,
        "config": {
            "workers": cfg.workers,
            "nodes": cfg.nodes,
            "tp": cfg.tp,
            "pp": cfg.pp,
            "dp": cfg.workers // (cfg.tp * cfg.pp),
            "microbatches": cfg.microbatches,
            "model": cfg.model,
            "seed": cfg.seed,
            "steps": steps,
            "kill_step": step,
            "trials": args.trials,
            "window": WINDOW,
            "tolerance": TOLERANCE,
            "ckpt_mtbf_s": cfg.mtbf_s,
            "order": "for each trial, for each failure, each system in turn",
        },
        "state_bytes_per_rank": state_bytes_per_rank(cfg.model, cfg.workers, cfg.tp, cfg.pp),
        "mesh": shard_accounting(mesh_elements(cfg.model, cfg.tp, cfg.pp), cfg.workers, DEFAULT_CHUNK_BYTES // 12),
        "configurations": configurations(cfg, default_code(cfg.nodes)),
        "torchft": skipped.get("torchft", "installed"),
        "nvrx": skipped.get("nvrx", "installed"),
        "skipped": skipped,
        **section_for("worker", step, results["worker"], skipped),
    }
    if "node" in failures:
        report["node_loss"] = section_for("node", step, results["node"], skipped)
    report["json"] = str(out / "recovery.json")
    report["plots"] = make_plots(out, report, runs, PRESETS[cfg.model].batch_size * PRESETS[cfg.model].block_size)
    Path(report["json"]).write_text(json.dumps(report, indent=1))
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return 0 if report["systems"].get(LETO, {}).get("recovery_s") is not None else 1
