"""`leto simulate`: project training productivity to large clusters."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from leto.errors import UsageError

from .assumptions import Assumptions, assumption_fields, with_overrides
from .calibration import CalibrationError, load_calibration
from .engine import (
    LOSS_KEYS,
    POLICIES,
    SHRINK_MODES,
    Scenario,
    SimulationResult,
    SweepPoint,
    input_figures,
    mesh_json,
    simulate,
    sweep,
    sweep_sizes,
)
from .failures import LLAMA3_MTBF_GPU_HOURS

PROG = "leto simulate"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if math.isnan(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `leto simulate`."""
    p = _Parser(
        prog=PROG,
        description="Project the productivity of a synchronous training job on a large cluster "
        "under checkpoint-restart, memory-restart, torchft and Leto, from measured component "
        "costs and published failure data (docs/simulation.md).",
    )
    a = Assumptions()
    p.add_argument("--gpus", type=_positive_int, default=131072, help="GPUs in the job (131072)")
    p.add_argument("--gpus-per-node", type=_positive_int, default=8, help="GPUs per node (8)")
    p.add_argument(
        "--tp",
        type=_positive_int,
        default=None,
        help=f"tensor-parallel degree: GPUs of one pipeline stage (as --set tp=; {a.tp})",
    )
    p.add_argument(
        "--pp",
        type=_positive_int,
        default=None,
        help=f"pipeline-parallel degree: stages of one model replica (as --set pp=; {a.pp}); "
        "a replica is tp x pp GPUs and --gpus must be a multiple of it",
    )
    p.add_argument("--days", type=_positive_float, default=30.0, help="simulated wall time (30)")
    p.add_argument(
        "--mtbf-gpu-hours",
        type=_positive_float,
        default=LLAMA3_MTBF_GPU_HOURS,
        help="per-GPU mean time between job interruptions; 'inf' = no failures "
        f"(Llama 3: {LLAMA3_MTBF_GPU_HOURS:,.0f})",
    )
    p.add_argument(
        "--spares",
        type=_nonneg_int,
        default=None,
        help="spare nodes (default: ceil(spare_fraction x nodes), at least 1)",
    )
    p.add_argument(
        "--repair-hours",
        type=_positive_float,
        default=None,
        help="hours until a lost node returns to the spare pool (24)",
    )
    p.add_argument(
        "--shrink",
        choices=SHRINK_MODES,
        default="balanced",
        help="how a shrunk Leto job runs: balanced (a loss function of the rank's share, "
        "the global batch re-split over the replicas left) or exact (a loss function of the "
        "replica, as in 'leto train': the launch's replicas kept, the busiest rank sets the "
        "step) (balanced)",
    )
    p.add_argument(
        "--policy",
        action="append",
        default=None,
        metavar="POLICY",
        help=f"policy to simulate, repeatable or comma-separated: {', '.join(POLICIES)} (default: all; "
        "torchft only with at least two model replicas)",
    )
    p.add_argument(
        "--calibration",
        metavar="BENCH.json",
        help="'leto bench throughput|overhead|recovery --json' output (or a dict "
        "merging them) overriding the shipped calibration",
    )
    p.add_argument("--seed", type=_nonneg_int, default=0, help="random seed (0)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override an assumption, e.g. --set params=70e9 (see --list-assumptions)",
    )
    p.add_argument(
        "--list-assumptions",
        action="store_true",
        help="print every assumption with its value, unit and source, then exit",
    )
    p.add_argument("--sweep", action="store_true", help="also simulate 1,024 .. 131,072 GPUs (powers of two)")
    p.add_argument("--plot", metavar="OUT.png", help="write productivity vs cluster size (1k..131k GPUs) to OUT.png")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def _policies(raw: list[str] | None) -> list[str] | None:
    """The policies named with --policy; None = all that apply to the scenario."""
    if not raw:
        return None
    out: list[str] = []
    for item in raw:
        for name in filter(None, (s.strip() for s in item.split(","))):
            if name not in POLICIES:
                raise UsageError(f"unknown policy {name!r} (choose from {', '.join(POLICIES)})")
            if name not in out:
                out.append(name)
    if not out:
        raise UsageError("--policy needs a policy name")
    return out


def _assumptions(sets: list[str], repair_hours: float | None, mesh: dict[str, int | None]) -> Assumptions:
    overrides: dict[str, str] = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key.strip()] = value.strip()
    if repair_hours is not None:
        overrides["repair_hours"] = repr(repair_hours)
    for key, value in mesh.items():
        if value is None:
            continue
        if key in overrides and overrides[key] != str(value):
            raise UsageError(f"--{key} {value} and --set {key}={overrides[key]} disagree")
        overrides[key] = str(value)
    try:
        return with_overrides(Assumptions(), overrides)
    except ValueError as e:
        raise UsageError(f"--set: {e}") from None


def _jsonable(obj: object) -> object:
    """Replace non-finite floats by None (JSON has no infinity; inf MTBF = no failures)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    return obj


def _pct(x: float) -> str:
    return f"{100 * x:6.2f} %"


def format_table(res: SimulationResult, runtime_s: float) -> str:
    """Human-readable report of one simulation."""
    sc = res.scenario
    mesh = mesh_json(sc)
    lines = [
        f"{PROG}: {sc.gpus:,} GPUs ({sc.nodes:,} nodes x {sc.gpus_per_node}), {sc.days:g} days, seed {sc.seed}",
        f"mesh: tp {mesh['tp']} x pp {mesh['pp']} = {mesh['replica_gpus']:,} GPUs a replica (a pipeline of "
        f"{mesh['pp']} stages of {mesh['tp']} GPUs), dp {mesh['dp']:,} replicas",
        f"failures: {res.failures:,} ({res.node_losing_failures:,} lose the node); per-GPU MTBF "
        f"{sc.mtbf_gpu_hours:,.0f} h -> job MTBF {sc.job_mtbf_s / 60:,.1f} min; spares "
        f"{sc.spare_nodes:,}, repair {sc.assumptions.repair_hours:g} h, shrink {sc.shrink}",
        "",
        "lost wall time by cause (fractions of wall time):",
    ]
    heads = ["policy", "productivity", *LOSS_KEYS, "dominant loss"]
    rows = [
        [p, _pct(r.productivity), *(_pct(r.lost[k]) for k in LOSS_KEYS), r.dominant_loss]
        for p, r in res.results.items()
    ]
    lines.extend(_aligned(heads, rows))
    cr = res.results.get("checkpoint-restart")
    if cr is not None:
        for p, r in res.results.items():
            if p != "checkpoint-restart":
                lines.append(f"{p} vs checkpoint-restart: {100 * (r.productivity - cr.productivity):+.2f} points")
    lines.append("")
    lines.extend(_stage_loss_table(res))
    lines.append("")
    lines.append("per-event costs at this size (s):")
    for p, r in res.results.items():
        parts = ", ".join(f"{k}={v:.4g}" for k, v in r.costs.items())
        lines.append(f"  {p}: {parts}")
    lines.append(f"(simulated in {runtime_s:.2f} s)")
    return "\n".join(lines)


def _aligned(heads: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(heads)]
    return [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        for row in (heads, *rows)
    ]


def _stage_loss_table(res: SimulationResult) -> list[str]:
    """What losing one rank of one pipeline stage costs each policy (first order)."""
    heads = ["policy", "restarts GPUs", "stages", "group ranks built", "all GPUs stall", "out GPUs", "out for", "GPU-h"]
    rows = []
    for p, r in res.results.items():
        c = r.stage_loss
        rows.append(
            [
                p,
                f"{int(c['restarted_gpus']):,}",
                f"{int(c['restarted_stages'])} of {res.scenario.assumptions.pp}",
                f"{int(c['rebuilt_group_ranks']):,}",
                f"{c['stall_s']:.2f} s",
                f"{int(c['out_gpus']):,}" if c["out_gpus"] else "-",
                f"{c['out_s']:.2f} s" if c["out_gpus"] else "-",
                f"{c['gpu_hours']:,.1f}",
            ]
        )
    return [
        "losing one rank of one pipeline stage (a process failure, node kept; first order, docs/simulation.md):",
        *_aligned(heads, rows),
    ]


def write_plot(path: Path, points: list[SweepPoint], sc: Scenario, policies: Sequence[str]) -> None:
    """Productivity against cluster size, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [pt.gpus for pt in points]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for p in policies:
        ax.plot(sizes, [100 * pt.productivity[p] for pt in points], marker="o", label=p)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([f"{s // 1024}k" if s % 1024 == 0 else str(s) for s in sizes])
    ax.set_xlabel("GPUs in the job")
    ax.set_ylabel("productivity (% of wall time)")
    ax.set_title(
        f"Projected productivity, {sc.days:g} days, per-GPU MTBF {sc.mtbf_gpu_hours:,.0f} h, seed {sc.seed}",
        fontsize=10,
    )
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _list_assumptions() -> str:
    a = Assumptions()
    lines = []
    for name, f in assumption_fields().items():
        lines.append(f"{name} = {getattr(a, name)!r} [{f.metadata['unit']}]: {f.metadata['source']}")
    return "\n".join(lines)


def _run(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.list_assumptions:
        print(_list_assumptions())
        return 0
    chosen = _policies(args.policy)
    assumptions = _assumptions(args.set, args.repair_hours, {"tp": args.tp, "pp": args.pp})
    plot = Path(args.plot) if args.plot else None
    if plot is not None:
        if plot.suffix.lower() not in {".png", ".pdf", ".svg"}:
            raise UsageError(f"--plot {args.plot!r}: use a .png, .pdf or .svg file name")
        if not plot.parent.is_dir():
            raise UsageError(f"--plot {args.plot!r}: directory {str(plot.parent)!r} does not exist")
    try:
        calibration = load_calibration(args.calibration)
    except CalibrationError as e:
        raise UsageError(str(e)) from None
    sc = Scenario(
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        days=args.days,
        mtbf_gpu_hours=args.mtbf_gpu_hours,
        spares=args.spares,
        seed=args.seed,
        shrink=args.shrink,
        assumptions=assumptions,
    )
    started = time.perf_counter()
    try:
        res = simulate(sc, chosen, calibration)
    except ValueError as e:
        raise UsageError(str(e)) from None
    runtime = time.perf_counter() - started
    policies = list(res.results)
    series: list[SweepPoint] = []
    if args.sweep or plot is not None:
        series = sweep(sc, sweep_sizes(sc), policies, calibration)
    if plot is not None:
        try:
            write_plot(plot, series, sc, policies)
        except OSError as e:
            raise UsageError(f"--plot {args.plot!r}: {e.strerror or e}") from None

    if args.json:
        doc = res.to_json()
        doc["runtime_s"] = runtime
        doc["calibration_sources"] = dict(calibration.sources)
        doc["calibration_notes"] = list(calibration.notes)
        doc["inputs"] = input_figures(sc, calibration)
        if calibration.details:
            doc["protection_calibration"] = dict(calibration.details)
        if series:
            doc["sweep"] = [dataclasses.asdict(pt) for pt in series]
        if plot is not None:
            doc["plot"] = str(plot)
        print(json.dumps(_jsonable(doc), indent=2, allow_nan=False))
    else:
        print(format_table(res, runtime))
        if calibration.notes:
            print("\ncalibration notes (what the file left out and what stands in):")
            for note in calibration.notes:
                print(f"  {note}")
        if series:
            print("\nproductivity vs cluster size (mean of independent runs):")
            print("  " + "gpus".rjust(8) + "runs".rjust(6) + "".join(p.rjust(20) for p in policies))
            for pt in series:
                print(
                    "  "
                    + f"{pt.gpus:8d}{pt.replicas:6d}"
                    + "".join(_pct(pt.productivity[p]).rjust(20) for p in policies)
                )
        if plot is not None:
            print(f"plot written to {plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `leto simulate`; returns the exit code (2 on bad input)."""
    try:
        return _run(argv)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
