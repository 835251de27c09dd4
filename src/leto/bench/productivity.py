"""`leto bench productivity`: the same training work under the same failure schedule, per system.

Work: `steps` steps of the built-in GPT job. Schedule: a Poisson process (MTBF in seconds, time
compressed), the same kill times relative to the start of each run and the same victim ranks
for every system (`runs.failure_schedule`, seeded). Each system runs the work once failure-free
and once under the schedule, interleaved (all failure-free runs, then all runs with failures).

productive fraction = failure-free time of the work / wall time of the work with failures, where
the failure-free time is the fastest system's failure-free run (the common reference: per-step
overheads such as checkpoint writes or protection count as lost time); the fraction against each
system's own failure-free run is reported too.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from leto.bench import plots
from leto.bench.runs import (BenchInterrupted, DEFAULT_MTBF_S, LETO, JobConfig, NoInjector, Run, System, TimedInjector,
                             default_out, failure_schedule, log, machine, productive_fraction, run_system,
                             stdout_to_stderr, torchft_status, work_time_s)
from leto.training.model import PRESETS

DEFAULT_STEPS = 160
SCHEDULE_SEED = 0
HORIZON_S = 3600.0
SYSTEMS = (System(LETO, LETO, 1), System("checkpoint-restart", "checkpoint-restart"),
           System("memory-restart", "memory-restart"), System("torchft", "torchft"))


def pp(a: float | None, b: float | None) -> float | None:
    """a - b in percentage points."""
    return None if a is None or b is None else round(100.0 * (a - b), 2)


def run_all(cfg: JobConfig, out: Path, systems: list[System], schedule: list) -> dict[str, dict[str, Run]]:
    """Failure-free runs of every system, then runs under the schedule (interleaved by system)."""
    runs: dict[str, dict[str, Run]] = {"failure-free": {}, "failures": {}}
    timeout_s = 120.0 + 20.0 * cfg.steps
    for phase in ("failure-free", "failures"):
        for system in systems:
            run_dir = out / "runs" / f"{phase}-{system.name}"
            injector = NoInjector() if phase == "failure-free" else TimedInjector(run_dir, schedule, timeout_s)
            run = run_system(system, cfg, run_dir, injector)
            runs[phase][system.name] = run
            wall = work_time_s(run.records, run.t_start, cfg.steps)
            log(f"[productivity] {phase:12} {system.name:18} "
                + (f"{cfg.steps} steps in {wall:.1f} s, {len(run.kills)} failures" if wall is not None
                   else f"did not finish the work: {run.error}"))
    return runs


def summarize(cfg: JobConfig, runs: dict[str, dict[str, Run]]) -> dict:
    """Per system: failure-free and faulty times of the work, failures seen, productive fractions."""
    free = {name: work_time_s(r.records, r.t_start, cfg.steps) if r.ok else None
            for name, r in runs["failure-free"].items()}
    known = {n: t for n, t in free.items() if t is not None}
    ref_name = min(known, key=lambda n: known[n]) if known else None
    ref = known.get(ref_name) if ref_name else None
    systems: dict[str, dict] = {}
    for name, run in runs["failures"].items():
        wall = work_time_s(run.records, run.t_start, cfg.steps) if run.ok else None
        systems[name] = {
            "failure_free_s": free.get(name), "wall_s": wall, "failures": len(run.kills),
            "productivity": productive_fraction(ref, wall), "productivity_own": productive_fraction(free.get(name), wall),
            "ok": run.ok and wall is not None, "error": run.error,
            "kills": [{"at_s": round(k.time - run.t_start, 3), "rank": k.spec.get("rank"),
                       "scheduled_s": k.spec.get("scheduled_s"), "after_step": k.step} for k in run.kills],
            "run_dir": str(run.run_dir), "failure_free_run_dir": str(runs["failure-free"][name].run_dir)}
    leto = systems.get(LETO, {})
    return {"reference": {"failure_free_s": ref, "system": ref_name,
                          "what": "the fastest system's failure-free run of the same work"},
            "systems": systems,
            "difference_pp": {n: pp(leto.get("productivity"), s["productivity"]) for n, s in systems.items() if n != LETO},
            "difference_pp_own": {n: pp(leto.get("productivity_own"), s["productivity_own"])
                                  for n, s in systems.items() if n != LETO}}


def make_plot(out: Path, report: dict, runs: dict[str, dict[str, Run]], tokens: int) -> list[str]:
    col = []
    for name, s in report["systems"].items():
        run = runs["failures"].get(name)
        if run is None:
            continue
        prod = "-" if s["productivity"] is None else f"{100 * s['productivity']:.1f} %"
        title = (f"{name}: {prod} productive, {s['failures']} failures, work done in "
                 + ("-" if s["wall_s"] is None else f"{s['wall_s']:.0f} s")
                 + ("" if s["failure_free_s"] is None else f" (failure-free {s['failure_free_s']:.0f} s)"))
        marks = [] if s["wall_s"] is None else [(run.t_start + s["wall_s"], "done")]
        col.append(plots.Panel(title, run.steps(), run.t_start, [k.time for k in run.kills], marks))
    if not col:
        return []
    cfg = report["config"]
    path = plots.timeline([col], [f"{cfg['steps']} steps, Poisson failures, MTBF {cfg['mtbf_s']:g} s"], tokens,
                          out / "productivity-timeline.png", "Tokens/s over wall time under the same failure schedule",
                          "seconds since the start of the run", xlim=(0.0, None))
    return [str(path)]


def print_table(report: dict) -> None:
    cfg, ref = report["config"], report["reference"]
    print(f"leto bench productivity: {cfg['steps']} steps of the {cfg['model']} job, {cfg['workers']} workers on "
          f"{cfg['nodes']} nodes; worker SIGKILLs at Poisson times, MTBF {cfg['mtbf_s']:g} s (seed {cfg['seed']})")
    if ref["failure_free_s"] is not None:
        print(f"failure-free reference: {ref['failure_free_s']:.1f} s ({ref['system']}, fastest failure-free run)")
    print(f"  {'system':20} {'failures':>8} {'wall':>8} {'free':>8} {'productive':>10} {'(own ref)':>9} {'leto +pp':>9}")
    for name, s in report["systems"].items():
        if s.get("status"):
            print(f"  {name}: {s['status']}")
            continue
        f = lambda x, unit="s": "-" if x is None else f"{x:.1f}{unit}"  # noqa: E731
        p = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
        d = report["difference_pp"].get(name)
        print(f"  {name:20} {s['failures']:>8} {f(s['wall_s']):>8} {f(s['failure_free_s']):>8} "
              f"{p(s['productivity']):>10} {p(s['productivity_own']):>9} {'' if d is None else f'{d:+.1f}':>9}"
              + ("" if s["ok"] else f"  FAILED: {s['error']}"))
    print(f"plot: {', '.join(report['plots'])}\nraw results: {report['json']}")


def main(args: argparse.Namespace) -> int:
    steps = args.steps or DEFAULT_STEPS
    nodes = min(2, args.workers)
    cfg = JobConfig(workers=args.workers, nodes=nodes, steps=steps, model=args.model, mtbf_s=DEFAULT_MTBF_S,
                    max_restarts=1000)
    out = Path(args.out) if args.out else default_out("productivity")
    out.mkdir(parents=True, exist_ok=True)
    tf = torchft_status()
    systems = [s for s in SYSTEMS if not (s.kind == "torchft" and tf is not None)]
    if tf is not None:
        log(f"torchft: {tf}")
    schedule = failure_schedule(DEFAULT_MTBF_S, HORIZON_S, SCHEDULE_SEED, args.workers)
    info = machine()
    try:
        with stdout_to_stderr():
            runs = run_all(cfg, out, systems, schedule)
    except BenchInterrupted as e:
        log(f"leto bench productivity: {e}; stopped")
        return 130
    info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    longest = max((r.t_end - r.t_start for r in runs["failures"].values()), default=0.0)
    report: dict = {"bench": "productivity", "machine": info,
                    "config": {"workers": cfg.workers, "nodes": cfg.nodes, "model": cfg.model, "steps": steps,
                               "mtbf_s": DEFAULT_MTBF_S, "seed": SCHEDULE_SEED, "trials": 1,
                               "schedule": [{"at_s": round(k.at_s, 3), "rank": k.rank} for k in schedule
                                            if k.at_s <= longest],
                               "schedule_kind": "same kill times after the start of each run, same ranks",
                               "ckpt_mtbf_s": cfg.mtbf_s},
                    "torchft": tf or "installed", **summarize(cfg, runs)}
    if tf is not None:
        report["systems"]["torchft"] = {"status": tf, "productivity": None, "productivity_own": None}
        report["difference_pp"]["torchft"] = report["difference_pp_own"]["torchft"] = None
    report["json"] = str(out / "productivity.json")
    report["plots"] = make_plot(out, report, runs, PRESETS[cfg.model].batch_size * PRESETS[cfg.model].block_size)
    Path(report["json"]).write_text(json.dumps(report, indent=1))
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return 0 if report["systems"][LETO].get("productivity") is not None else 1
