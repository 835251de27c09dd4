"""The restart supervisor of the checkpoint-restart baselines, as torchrun would do it.

It runs `leto.baselines.ckpt_job` as a Leto job without protection (`control.one_host.run_job`); when
the job returns non-zero because a worker died (it has already reaped every process), it starts a
fresh job with fresh processes, which load the newest checkpoint, up to `max_restarts` times.
Each failure gets a recovery record with its breakdown; the metrics of all attempts end up in one
metrics.jsonl.

    python -m leto.baselines.restart --system checkpoint-restart --workers 4 --nodes 2 \
        --steps 300 --mtbf-s 600 --kill 1@100 --run-dir runs/ckpt
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from leto.baselines.ckpt_job import DEFAULT_SHM
from leto.baselines.faults import ExternalInjector, Kill
from leto.config import (
    DEFAULT_TIMEOUT_S,
    JobConfig,
    MeshConfig,
    ProtectionConfig,
    Timeouts,
    TrainingConfig,
)
from leto.console import read_jsonl
from leto.control.one_host import run_job
from leto.runtime import runlog

__all__ = ["SYSTEMS", "BaselineSpec", "RestartSupervisor", "main", "run_baseline"]

SYSTEMS = ("checkpoint-restart", "memory-restart", "torchft", "nvrx")
DEFAULT_MTBF_S = 600.0  # disk K from Young/Daly when neither K nor an MTBF is given
ATTEMPTS = "attempts"


@dataclass
class BaselineSpec:
    """One baseline run."""

    system: str
    workers: int
    nodes: int
    steps: int
    run_dir: Path
    seed: int = 0
    model: str = "tiny"
    ckpt_every: int | None = None
    mtbf_s: float | None = None
    async_save: bool = False
    ckpt_dir: Path | None = None  # default: run_dir/ckpt (disk), /dev/shm/leto-ckpt-... (memory)
    max_restarts: int = 3
    timeout_s: float = DEFAULT_TIMEOUT_S
    quiet: bool = True
    job_args: list[str] = field(default_factory=list)  # more flags for the job (--lr, --chunk-bytes)
    tp: int = 1  # tensor-parallel ranks per pipeline stage; every restart keeps the mesh
    pp: int = 1  # pipeline stages per model replica
    microbatches: int = 1  # with pp > 1: micro-batches of a replica's batch in the pipeline schedule

    @property
    def mode(self) -> str:
        return {"checkpoint-restart": "disk", "memory-restart": "memory"}[self.system]


def _job_config(command: list[str], spec: BaselineSpec) -> JobConfig:
    # a baseline runs without Leto's keepers and in-memory protection
    return JobConfig(
        training=TrainingConfig(command=tuple(command), workers=spec.workers, nodes=spec.nodes, steps=spec.steps),
        mesh=MeshConfig(tp=spec.tp, pp=spec.pp),
        protection=ProtectionConfig(enabled=False),
        timeouts=Timeouts(collective_s=spec.timeout_s),
        run_dir=str(spec.run_dir),
        quiet=spec.quiet,
    )


@dataclass
class Attempt:
    n: int
    start: float
    end: float = 0.0
    code: int | None = None
    records: list[dict] = field(default_factory=list)  # metrics.jsonl of this attempt
    result: dict = field(default_factory=dict)  # the controller's summary.json

    def steps(self) -> list[dict]:
        return [r for r in self.records if "event" not in r and "step" in r]

    def events(self, kind: str) -> list[dict]:
        return [r for r in self.records if r.get("event") == kind]


class RestartSupervisor:
    """Runs the checkpointing job, restarting it from scratch processes after each failure."""

    def __init__(self, spec: BaselineSpec, injector: ExternalInjector | None = None) -> None:
        if spec.system not in ("checkpoint-restart", "memory-restart"):
            raise ValueError(f"the restart supervisor runs checkpoint-restart or memory-restart, not {spec.system!r}")
        self.spec, self.injector = spec, injector
        self.attempts: list[Attempt] = []
        self.own_ckpt_dir = spec.ckpt_dir is None
        if spec.ckpt_dir is None:
            spec.ckpt_dir = (
                spec.run_dir / "ckpt" if spec.mode == "disk" else DEFAULT_SHM / f"leto-ckpt-{uuid.uuid4().hex[:12]}"
            )
        if spec.mode == "disk" and spec.ckpt_every is None and spec.mtbf_s is None:
            spec.mtbf_s = DEFAULT_MTBF_S

    def command(self) -> list[str]:
        s = self.spec
        cmd = [
            "-m",
            "leto.baselines.ckpt_job",
            "--steps",
            str(s.steps),
            "--seed",
            str(s.seed),
            "--model",
            s.model,
            "--ckpt-dir",
            str(s.ckpt_dir),
            "--ckpt-mode",
            s.mode,
            *(["--microbatches", str(s.microbatches)] if s.pp > 1 else []),
            *s.job_args,
        ]
        if s.mode == "disk":
            cmd += ["--ckpt-every", str(s.ckpt_every)] if s.ckpt_every is not None else ["--mtbf-s", str(s.mtbf_s)]
            cmd += ["--async-save"] if s.async_save else []
        return cmd

    def run(self) -> dict:
        """Run to the end (or until restarts run out); returns and writes summary.json."""
        s = self.spec
        s.run_dir.mkdir(parents=True, exist_ok=True)
        (s.run_dir / ATTEMPTS).mkdir(exist_ok=True)
        if self.own_ckpt_dir and s.ckpt_dir is not None:
            shutil.rmtree(s.ckpt_dir, ignore_errors=True)  # this run's checkpoints start empty
        t0 = time.time()
        try:
            while True:
                attempt = self._run_attempt(len(self.attempts))
                if attempt.code != 1 or len(self.attempts) > s.max_restarts:
                    break  # success, a signal to the supervisor, or out of restarts
        finally:
            if self.injector is not None:
                self.injector.stop()
            if self.own_ckpt_dir and s.mode == "memory" and s.ckpt_dir is not None:
                shutil.rmtree(s.ckpt_dir, ignore_errors=True)
        summary = self._summary(time.time() - t0)
        self._write_metrics()
        (s.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary

    def _run_attempt(self, n: int) -> Attempt:
        s = self.spec
        attempt = Attempt(n, time.time())
        self.attempts.append(attempt)
        code = run_job(_job_config(self.command(), s))
        attempt.end, attempt.code = time.time(), code
        # the next controller starts a new metrics.jsonl: keep this attempt's
        for name in ("metrics.jsonl", "summary.json"):
            src = s.run_dir / name
            if src.exists():
                src.replace(s.run_dir / ATTEMPTS / f"{Path(name).stem}-{n}{Path(name).suffix}")
        attempt.records = read_jsonl(s.run_dir / ATTEMPTS / f"metrics-{n}.jsonl")
        summary = s.run_dir / ATTEMPTS / f"summary-{n}.json"
        attempt.result = json.loads(summary.read_text()) if summary.exists() else {}
        return attempt

    # ----- results
    def _kills(self) -> list[Kill]:
        return sorted(self.injector.kills, key=lambda k: k.time) if self.injector else []

    def recoveries(self) -> list[dict]:
        """One record per failure that was followed by a restart."""
        out = []
        for prev, nxt in zip(self.attempts, self.attempts[1:]):
            out.append(self._recovery(prev, nxt))
        return out

    def _recovery(self, prev: Attempt, nxt: Attempt) -> dict:
        failures = prev.events("failure")
        fail = failures[0] if failures else {"time": prev.end, "cause": f"exit code {prev.code}"}
        t_det = fail["time"]
        kills = [k for k in self._kills() if prev.start <= k.time <= t_det]
        kill = kills[-1] if kills else None
        t_fail = kill.time if kill else t_det
        done = [r["step"] for r in prev.steps() if r.get("time", 0) <= t_fail]
        failed_at = max(done, default=0)
        ups = nxt.events("job_up")
        restores = nxt.events("restore")
        restored = restores[0]["step"] if restores else 0
        first = min((r["time"] for r in nxt.steps()), default=None)
        regain = [r["time"] for r in nxt.steps() if r["step"] == failed_at + 1]
        rnd = lambda x: round(x, 3) if x is not None else None  # noqa: E731
        ranks = sorted({f["rank"] for f in failures if f.get("rank") is not None})
        nodes = sorted({f["node"] for f in failures if f.get("node") is not None})
        return {
            "cause": _cause(failures, fail),
            "injected": kill.spec if kill else None,
            "rank": fail.get("rank"),
            "node": fail.get("node"),
            "failed_ranks": ranks,
            "failed_nodes": nodes,
            "failed_at_step": failed_at,
            "restored_step": restored,
            "lost_steps": failed_at - restored,
            "detect_s": rnd(t_det - t_fail) if kill else None,
            "teardown_s": rnd(prev.end - t_det),
            "restart_s": rnd(ups[0]["time"] - t_det) if ups else None,
            "restore_s": rnd(restores[0]["restore_s"]) if restores else 0.0,
            "first_step_s": rnd(first - t_fail) if first is not None else None,
            "total_s": rnd(regain[0] - t_fail) if regain else None,
            "time": t_fail,
        }

    def _ckpt_stats(self) -> dict:
        saves = [r for a in self.attempts for r in a.events("ckpt_save")]
        commits = [r for a in self.attempts for r in a.events("ckpt_commit")]
        intervals = [r for a in self.attempts for r in a.events("ckpt_interval")]
        restores = [r for a in self.attempts for r in a.events("restore")]
        med = lambda xs: round(statistics.median(xs), 6) if xs else None  # noqa: E731
        every = (
            1
            if self.spec.mode == "memory"
            else (
                self.spec.ckpt_every
                if self.spec.ckpt_every is not None
                else (intervals[-1]["every"] if intervals else None)
            )
        )
        return {
            "mode": self.spec.mode,
            "dir": str(self.spec.ckpt_dir),
            "every": every,
            "async": self.spec.async_save if self.spec.mode == "disk" else False,
            "mtbf_s": self.spec.mtbf_s,
            "young_daly": intervals[-1] if intervals else None,
            "saves": len(saves),
            "save_s_median": med([r["save_s"] for r in saves]),
            "save_s_total": round(sum(r["save_s"] for r in saves), 6),
            "commit_s_median": med([r["total_s"] for r in commits]),
            "restore_s": [r["restore_s"] for r in restores],
        }

    def _summary(self, wall_s: float) -> dict:
        last = self.attempts[-1]
        res = last.result
        return {
            "steps": res.get("steps"),
            "final_loss": res.get("final_loss"),
            "digest": res.get("digest"),
            "wall_s": round(wall_s, 3),
            "workers": self.spec.workers,
            "spares": 0,
            "nodes": self.spec.nodes,
            "exit_code": last.code,
            "system": self.spec.system,
            "restarts": len(self.attempts) - 1,
            "ckpt": self._ckpt_stats(),
            "recoveries": self.recoveries(),
            "injection_errors": list(self.injector.errors) if self.injector else [],
        }

    def _write_metrics(self) -> None:
        recs: list[tuple[float, int, dict]] = []
        for a in self.attempts:
            recs.append((a.start, len(recs), {"event": "attempt_start", "time": a.start, "attempt": a.n}))
            recs += [(r.get("time", a.start), len(recs) + i, {**r, "attempt": a.n}) for i, r in enumerate(a.records)]
            recs.append((a.end, len(recs), {"event": "attempt_end", "time": a.end, "attempt": a.n, "code": a.code}))
        for k in self._kills():
            recs.append(
                (k.time, len(recs), {"event": "fault", "time": k.time, **k.spec, "pids": k.pids, "at_step": k.step})
            )
        for r in self.recoveries():
            recs.append((r["time"], len(recs), {"event": "recovery", **r}))
        recs.sort(key=lambda x: (x[0], x[1]))
        runlog.rewrite(self.spec.run_dir, [rec for _, _, rec in recs])


def _cause(failures: list[dict], first: dict) -> str:
    if len(failures) <= 1:
        who = (
            f"{first.get('role', 'worker')} rank {first['rank']}"
            if first.get("rank") is not None
            else f"{first.get('role', 'process')} on node {first.get('node')}"
        )
        return f"{who} {first.get('cause', '')}".strip()
    ranks = ", ".join(str(r) for r in sorted(f["rank"] for f in failures if f.get("rank") is not None))
    nodes = ", ".join(sorted({str(f.get("node")) for f in failures}))
    causes = "; ".join(sorted({f.get("cause", "") for f in failures}))
    return f"workers {ranks} (node {nodes}): {causes}"


def run_baseline(
    system: str,
    *,
    workers: int,
    nodes: int,
    steps: int,
    seed: int,
    model: str,
    run_dir: Path,
    inject: list[dict] | None,
    ckpt_every: int | None,
    mtbf_s: float | None,
    quiet: bool = True,
    **options: object,
) -> dict:
    """Run one baseline on the built-in GPT job and return its summary (with `recoveries`).

    `inject`: `[{"kind": "kill"|"node-kill", "rank": R|None, "node": N|None, "step": S}]`, executed
    by `leto.baselines.faults` from background threads. `options`: more `BaselineSpec` fields
    (async_save, ckpt_dir, max_restarts, timeout_s, job_args; nvrx: spares).
    """
    if system not in SYSTEMS:
        raise ValueError(f"unknown baseline {system!r}; choose from {', '.join(SYSTEMS)}")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    injector = ExternalInjector(run_dir, inject or []).start() if inject else None
    if system in ("torchft", "nvrx"):
        if system == "torchft":
            from leto.baselines.torchft_job import run
        else:
            from leto.baselines.nvrx_job import run
        try:
            return run(
                workers=workers,
                nodes=nodes,
                steps=steps,
                seed=seed,
                model=model,
                run_dir=run_dir,
                injector=injector,
                quiet=quiet,
                **options,
            )
        finally:
            if injector is not None:
                injector.stop()
    spec = BaselineSpec(system, workers, nodes, steps, run_dir, seed, model, ckpt_every, mtbf_s, quiet=quiet, **options)  # type: ignore[arg-type]
    return RestartSupervisor(spec, injector).run()


# ----- command line
def _at(text: str) -> tuple[int, int]:
    who, _, step = text.partition("@")
    try:
        return int(who), int(step)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WHO@STEP (e.g. 1@50), got {text!r}") from None


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m leto.baselines.restart",
        description="Run a checkpoint-restart baseline on the built-in GPT job.",
    )
    p.add_argument("--system", choices=SYSTEMS, default="checkpoint-restart")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="tiny")
    p.add_argument("--tp", type=int, default=1, help="checkpoint/memory-restart: tensor-parallel ranks per stage [1]")
    p.add_argument("--pp", type=int, default=1, help="checkpoint/memory-restart: pipeline stages per replica [1]")
    p.add_argument(
        "--microbatches", type=int, default=None, help="with --pp: micro-batches of a replica's batch [2 x --pp]"
    )
    p.add_argument("--run-dir", type=Path, default=None)
    p.add_argument(
        "--ckpt-dir",
        type=Path,
        default=None,
        help="where checkpoints go (kept, and resumed from if it holds one); default: a fresh one",
    )
    p.add_argument("--ckpt-every", type=int, default=None, help="disk: every K steps [Young/Daly]")
    p.add_argument("--mtbf-s", type=float, default=None, help=f"disk: MTBF for Young/Daly [{DEFAULT_MTBF_S:g}]")
    p.add_argument("--async-save", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--spares", type=int, default=1, help="nvrx: spare ranks beside the workers [1]")
    p.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help=f"collective and store timeout [{DEFAULT_TIMEOUT_S:g}]"
    )
    p.add_argument(
        "--kill",
        type=_at,
        action="append",
        default=[],
        metavar="RANK@STEP",
        help="SIGKILL worker RANK once STEP is recorded (repeatable)",
    )
    p.add_argument(
        "--node-kill",
        type=_at,
        action="append",
        default=[],
        metavar="NODE@STEP",
        help="SIGKILL every process of NODE once STEP is recorded (repeatable)",
    )
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    return p.parse_args(argv)


_SHOWN = ("detect_s", "teardown_s", "restart_s", "restore_s", "first_step_s", "total_s", "rejoin_s")


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    run_dir = a.run_dir or Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{a.system}"
    inject = [{"kind": "kill", "rank": r, "node": None, "step": s} for r, s in a.kill] + [
        {"kind": "node-kill", "rank": None, "node": n, "step": s} for n, s in a.node_kill
    ]
    summary = run_baseline(
        a.system,
        workers=a.workers,
        nodes=a.nodes,
        steps=a.steps,
        seed=a.seed,
        model=a.model,
        run_dir=run_dir,
        inject=inject or None,
        ckpt_every=a.ckpt_every,
        mtbf_s=a.mtbf_s,
        quiet=a.quiet,
        async_save=a.async_save,
        ckpt_dir=a.ckpt_dir,
        max_restarts=a.max_restarts,
        timeout_s=a.timeout,
        **({"spares": a.spares} if a.system == "nvrx" else {}),
        **({"tp": a.tp} if a.tp > 1 else {}),
        **({"pp": a.pp, "microbatches": a.microbatches or 2 * a.pp} if a.pp > 1 else {}),
    )
    if a.json:
        print(json.dumps(summary))
    else:
        ck = summary.get("ckpt")
        saves = f"; checkpoint every {ck['every']} steps, median save {ck['save_s_median']}s" if ck else ""
        print(
            f"{a.system}: {summary['steps']} steps in {summary['wall_s']:.1f}s, exit {summary['exit_code']}, "
            f"{summary.get('restarts', 0)} restarts, digest {str(summary['digest'])[:16]}{saves}"
        )
        for r in summary["recoveries"]:
            parts = [f"{k.removesuffix('_s')} {r[k]}s" for k in _SHOWN if r.get(k) is not None]
            print(f"  {r['cause']} at step {r['failed_at_step']}: {', '.join(parts)}, lost {r['lost_steps']} steps")
        print(f"summary: {run_dir / 'summary.json'}")
    return int(summary["exit_code"] or 0)


if __name__ == "__main__":
    sys.exit(main())
