"""Shared machinery of `leto bench recovery` and `leto bench productivity`.

Runs one system (Leto, or a baseline through `run_baseline`) on the built-in GPT job while an
injector outside the job kills processes by PID (`leto.baselines.faults`), and reads the run's
timeline back from the evidence every system writes: `metrics.jsonl` step records (rank 0, one per
completed step) and the supervisor's events (`failure`, `restore`, `recovery`, `heal`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import platform
import random
import shutil
import signal
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from leto import config as job_config
from leto.baselines.faults import ExternalInjector, Kill
from leto.baselines.restart import run_baseline
from leto.bench.capacity import RankCapacity
from leto.bench.mesh import mesh_elements, shard_accounting
from leto.bench.throughput import WARMUP_STEPS, steady_step_s
from leto.console import read_jsonl
from leto.control.one_host import run_job
from leto.persistence.resume import DEFAULT_DIR as PERSIST_DIR
from leto.persistence.resume import fresh
from leto.protection.placement import default_code
from leto.training.trainer import DEFAULT_CHUNK_BYTES

LETO = "leto"
WINDOW = 3  # consecutive steps that must run at pre-failure throughput ...
TOLERANCE = 1.25  # ... together in at most this many times their pre-failure median time
# (over a window, not step by step: single protected steps vary by +-40 % on this shared box)
DEFAULT_MTBF_S = 8.0  # the MTBF checkpoint-restart's Young/Daly K is set for (JobConfig.mtbf_s)
SEGMENTS = ("detect", "restart / rebuild", "restore", "recompute", "back to speed")
INTERRUPTED = (130, 143)  # a controller stopped by SIGINT / SIGTERM


class BenchInterrupted(KeyboardInterrupt):
    """The benchmark was interrupted (a controller received SIGINT/SIGTERM)."""


# ----- systems and runs
@dataclass(frozen=True)
class System:
    """One contender: `kind` is "leto" or a `run_baseline` system; `spares` is Leto's shadows."""

    name: str
    kind: str
    spares: int = 1


@dataclass(frozen=True)
class JobConfig:
    """The built-in GPT job, identical for every system."""

    workers: int = 4
    nodes: int = 2
    steps: int = 40
    model: str = "tiny"
    seed: int = 0
    mtbf_s: float = DEFAULT_MTBF_S  # checkpoint-restart: K from Young/Daly for this MTBF
    timeout_s: float = job_config.DEFAULT_TIMEOUT_S  # collective / store timeout inside the job
    max_restarts: int = 3
    tp: int = 1  # tensor-parallel ranks per pipeline stage (world = DP x PP x TP, `leto train --tp`)
    pp: int = 1  # pipeline stages per model replica (`leto train --pp`)
    microbatches: int = 1  # with pp > 1: micro-batches of a replica's batch (`leto train --microbatches`)
    cpu_per_rank: float | None = None  # each rank process's CPU quota (`capacity.RankCapacity`); None: uncapped


class InjectorLike(Protocol):
    """`faults.ExternalInjector` or `NoInjector`: started before the run, stopped after it."""

    kills: list[Kill]
    errors: list[str]

    def start(self) -> object: ...

    def stop(self, timeout_s: float = 5.0) -> None: ...


@dataclass
class Run:
    """What one run left behind."""

    system: str
    run_dir: Path
    t_start: float
    t_end: float
    code: int | None
    error: str | None
    summary: dict
    records: list[dict]
    kills: list[Kill]
    injection_errors: list[str] = field(default_factory=list)
    capacity: dict | None = None  # `RankCapacity.summary()` of a capped run

    @property
    def ok(self) -> bool:
        return self.code == 0 and self.error is None

    def steps(self) -> list[dict]:
        """Step records (not events), in time order."""
        return sorted(
            (r for r in self.records if "event" not in r and isinstance(r.get("step"), int)), key=lambda r: r["time"]
        )

    def events(self, kind: str) -> list[dict]:
        return [r for r in self.records if r.get("event") == kind]


def torchft_status() -> str | None:
    """None if torchft imports here, else why not (e.g. "not installed")."""
    try:
        importlib.import_module("torchft")
    except ModuleNotFoundError:
        return "not installed"
    except Exception as e:  # installed but broken: say so rather than crash
        return f"not importable ({type(e).__name__}: {e})"
    return None


def _run_leto(system: System, cfg: JobConfig, run_dir: Path) -> int:
    """The built-in job under Leto's controller as `leto train` builds it by default (protection,
    the spares, persistent checkpoints every K steps for the default --mtbf), ending as the peers'
    jobs do: with the digest, no model file and no sample (`--final none`)."""
    command = [
        "-m",
        "leto.training.train_gpt",
        "--steps",
        str(cfg.steps),
        "--seed",
        str(cfg.seed),
        "--model",
        cfg.model,
        *(["--microbatches", str(cfg.microbatches)] if cfg.pp > 1 else []),
        "--final",
        "none",  # the peers' jobs end with the digest too, and write no model and no sample
    ]
    persistence = fresh(run_dir, command, job_config.PersistenceConfig(), persist=True).persistence
    return run_job(
        job_config.JobConfig(
            training=job_config.TrainingConfig(
                command=tuple(command), workers=cfg.workers, nodes=cfg.nodes, steps=cfg.steps
            ),
            persistence=persistence,
            mesh=job_config.MeshConfig(tp=cfg.tp, pp=cfg.pp),
            protection=job_config.ProtectionConfig(enabled=True, ec=default_code(cfg.nodes)),
            recovery=job_config.RecoveryConfig(spares=system.spares),
            timeouts=job_config.Timeouts(collective_s=cfg.timeout_s),
            run_dir=str(run_dir),
            quiet=True,
        )
    )


class RunTimeout(Exception):
    """A run went past its time limit and was stopped."""


class Watchdog:
    """Stops a run that goes past `limit_s`: SIGTERM to this process, every second until the run
    returns. A controller in its supervision loop turns that into a clean stop of all its
    processes (exit 143); anywhere else our own handler raises RunTimeout, whose unwinding stops
    what was started (the torchft harness's `finally`, the restart supervisor's injector)."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s, self.fired = limit_s, False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="leto-bench-watchdog")
        self._old: object = None

    def _run(self) -> None:
        if self._done.wait(self.limit_s):
            return
        self.fired = True
        while not self._done.is_set():
            os.kill(os.getpid(), signal.SIGTERM)
            self._done.wait(1.0)

    def _on_term(self, signum: int, frame: object) -> None:
        if self.fired:
            raise RunTimeout(f"stopped after {self.limit_s:.0f} s")
        raise BenchInterrupted("received SIGTERM")

    def __enter__(self) -> Watchdog:
        self._old = signal.signal(signal.SIGTERM, self._on_term)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=5.0)
        signal.signal(signal.SIGTERM, self._old)  # type: ignore[arg-type]


def run_system(system: System, cfg: JobConfig, run_dir: Path, injector: InjectorLike, limit_s: float) -> Run:
    """Run `system` on the job with `injector` watching `run_dir`, for at most `limit_s` seconds;
    never raises for a failed run (only for an interrupted benchmark)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    code: int | None = None
    error: str | None = None
    t_start = time.time()
    capacity = RankCapacity(run_dir, cfg.cpu_per_rank) if cfg.cpu_per_rank is not None else None
    injector.start()
    watchdog = Watchdog(limit_s)
    try:
        with watchdog, capacity or contextlib.nullcontext():
            if system.kind == LETO:
                code = _run_leto(system, cfg, run_dir)
            else:
                summary = run_baseline(
                    system.kind,
                    workers=cfg.workers,
                    nodes=cfg.nodes,
                    steps=cfg.steps,
                    seed=cfg.seed,
                    model=cfg.model,
                    run_dir=run_dir,
                    inject=None,
                    ckpt_every=None,
                    mtbf_s=cfg.mtbf_s,
                    max_restarts=cfg.max_restarts,
                    timeout_s=cfg.timeout_s,
                    **({"tp": cfg.tp} if cfg.tp > 1 else {}),
                    **({"pp": cfg.pp, "microbatches": cfg.microbatches} if cfg.pp > 1 else {}),
                )
                code = summary.get("exit_code")
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # a run that crashes is a result, reported with the others
        error = f"{type(e).__name__}: {e}"
    finally:
        injector.stop()
    t_end = time.time()
    for ckpt in ("ckpt", PERSIST_DIR):  # disk checkpoints (a baseline's, Leto's): tens of MB per run
        shutil.rmtree(run_dir / ckpt, ignore_errors=True)
    if watchdog.fired:
        error = f"stopped: still running after {limit_s:g} s"
    elif code in INTERRUPTED:
        raise BenchInterrupted(f"{system.name} was interrupted (exit code {code})")
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        summary = {}
    if code not in (0, None) and error is None:
        error = f"exit code {code}"
    return Run(
        system.name,
        run_dir,
        t_start,
        t_end,
        code,
        error,
        summary,
        read_jsonl(run_dir / "metrics.jsonl"),
        sorted(injector.kills, key=lambda k: k.time),
        list(injector.errors),
        None if capacity is None else capacity.summary(),
    )


def step_injector(run_dir: Path, kind: str, who: int, step: int, timeout_s: float) -> ExternalInjector:
    """The same external SIGKILL for every system: worker `who` (kind "kill") or every process of
    node `who` ("node-kill"), once step `step` is recorded."""
    spec = {
        "kind": kind,
        "rank": who if kind == "kill" else None,
        "node": who if kind == "node-kill" else None,
        "step": step,
    }
    return ExternalInjector(run_dir, [spec], timeout_s=timeout_s)


FIRST_KILL_STEP = WARMUP_STEPS + WINDOW  # the first step a kill may follow: warm-up, then a pre-failure step time
MIN_GAP_STEPS = WINDOW + 2  # between kills, and after the last: the lost step, the back-to-speed window, one spare


def max_failures(steps: int) -> int:
    """How many kills `failure_schedule` can place in a run of `steps` steps."""
    last = steps - MIN_GAP_STEPS
    return 0 if last < FIRST_KILL_STEP else (last - FIRST_KILL_STEP) // MIN_GAP_STEPS + 1


def failure_schedule(failures: int, steps: int, seed: int, workers: int) -> list[dict]:
    """`failures` SIGKILLs of seeded random workers, each once a seeded random step is recorded:
    `faults.ExternalInjector` specs. The steps are `failures` uniform points over
    [FIRST_KILL_STEP, steps - MIN_GAP_STEPS] (a Poisson process over the run's steps, conditioned
    on `failures` points), at least MIN_GAP_STEPS apart: every spaced placement is equally likely.
    A function of its arguments only, never of a run's speed. ValueError if they do not fit
    (`max_failures`)."""
    if not 0 <= failures <= max_failures(steps):
        raise ValueError(f"{failures} failures do not fit in {steps} steps (0 to {max_failures(steps)} do)")
    rng = random.Random(f"leto-bench-failures-{seed}")
    # draw from the steps with the gaps taken out, then put the gaps back: spaced, and uniform
    room = steps - MIN_GAP_STEPS - FIRST_KILL_STEP - (failures - 1) * (MIN_GAP_STEPS - 1)
    picks = sorted(rng.sample(range(room + 1), failures))
    ranks = [rng.randrange(workers) for _ in picks]
    return [
        {"kind": "kill", "rank": rank, "node": None, "step": FIRST_KILL_STEP + p + i * (MIN_GAP_STEPS - 1)}
        for i, (p, rank) in enumerate(zip(picks, ranks, strict=True))
    ]


class NoInjector:
    """A failure-free run."""

    def __init__(self) -> None:
        self.kills: list[Kill] = []
        self.errors: list[str] = []

    def start(self) -> NoInjector:
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        return None


# ----- reading a timeline back
def _first_after(events: list[dict], t: float) -> dict | None:
    later = [e for e in events if e.get("time", 0.0) >= t]
    return min(later, key=lambda e: e["time"]) if later else None


def system_restore_s(records: list[dict], t_kill: float) -> tuple[float | None, bool]:
    """The system's own restore time of the first recovery after the kill, and whether it is on
    the critical path: checkpoint load (`restore`) and Leto's decode and install (`recovery`) are;
    a torchft replacement's heal (`heal`) is not (the survivors go on without it)."""
    for kind in ("restore", "recovery", "heal"):
        ev = _first_after([r for r in records if r.get("event") == kind and r.get("restore_s") is not None], t_kill)
        if ev is not None:
            return float(ev["restore_s"]), kind != "heal"
    return None, False


def analyze_recovery(records: list[dict], t_kill: float, *, window: int = WINDOW, tolerance: float = TOLERANCE) -> dict:
    """Recovery metrics of the failure at `t_kill` from a run's metrics records (steps + events).

    * `failed_at`: last step recorded before the kill; the step in flight is `failed_at + 1`.
    * `pre_step_s`: median step time before the kill, after the warm-up steps (`steady_step_s`).
    * `detect_s`: kill -> the supervisor's `failure` event.
    * `first_s`: kill -> end of the first step completed after the kill (any step number).
    * `regain_s`: kill -> end of the first step beyond `failed_at` (the step in flight, redone).
    * `recovery_s`: kill -> end of the first step beyond `failed_at` (the lost work is redone)
      after which the next `window` steps together took at most `window` x `tolerance` x
      `pre_step_s`: from then on the job runs at no less than 1/`tolerance` of its pre-failure
      throughput. None if that never happened. (A step's `step_s` runs from the previous step's
      end, so the first step after the failure carries the outage; it is never inside the window.)
    * `lost_steps`: steps completed before the kill that were completed again after it.
    * `breakdown`: recovery_s split into SEGMENTS (restore taken from the system's own records).
    """
    steps = sorted((r for r in records if "event" not in r and isinstance(r.get("step"), int)), key=lambda r: r["time"])
    before = [r for r in steps if r["time"] <= t_kill]
    after = [r for r in steps if r["time"] > t_kill]
    failed_at = max((r["step"] for r in before), default=0)
    pre = steady_step_s(before) if before else None
    fail = _first_after([r for r in records if r.get("event") == "failure"], t_kill)
    detect_s = fail["time"] - t_kill if fail else None
    first = after[0] if after else None
    new = [i for i, r in enumerate(after) if r["step"] > failed_at]
    regain = after[new[0]] if new else None
    recovered = None
    if pre is not None and new:
        limit = tolerance * pre
        for i in range(new[0], len(after) - window):
            if sum(r["step_s"] for r in after[i + 1 : i + 1 + window]) <= limit * window:
                recovered = after[i]
                break
    restore_s, critical = system_restore_s(records, t_kill)
    out = {
        "failed_at": failed_at,
        "pre_step_s": _round(pre),
        "detect_s": _round(detect_s),
        "restore_s": _round(restore_s),
        "first_s": _round(first["time"] - t_kill if first else None),
        "regain_s": _round(regain["time"] - t_kill if regain else None),
        "recovery_s": _round(recovered["time"] - t_kill if recovered else None),
        "lost_steps": len({r["step"] for r in after if r["step"] <= failed_at}),
    }
    out["breakdown"] = breakdown(
        t_kill,
        fail["time"] if fail else None,
        first["time"] if first else None,
        regain["time"] if regain else None,
        recovered["time"] if recovered else None,
        restore_s if critical else 0.0,
    )
    return out


def breakdown(
    t_kill: float,
    t_detect: float | None,
    t_first: float | None,
    t_regain: float | None,
    t_recovered: float | None,
    restore_s: float | None,
) -> dict[str, float] | None:
    """Split kill -> recovered into SEGMENTS that add up to recovery_s.

    detect: kill -> failure recorded; restart / rebuild: failure recorded -> first step after the
    kill completed, less the restore; restore: the system's own restore time (clipped to that
    span); recompute: redoing steps lost by the failure; back to speed: the step in flight done ->
    the first step of the full-speed window done.
    """
    if t_detect is None or t_first is None or t_regain is None or t_recovered is None:
        return None
    t_detect = min(max(t_detect, t_kill), t_first)
    span = t_first - t_detect
    rest = min(max(restore_s or 0.0, 0.0), span)
    parts = {
        "detect": t_detect - t_kill,
        "restart / rebuild": span - rest,
        "restore": rest,
        "recompute": t_regain - t_first,
        "back to speed": t_recovered - t_regain,
    }
    return {k: round(max(v, 0.0), 4) for k, v in parts.items()}


def work_time_s(records: list[dict], t_start: float, steps: int) -> float | None:
    """Start of the run -> the first time step `steps` (the last of the work) was recorded."""
    done = [r["time"] for r in records if "event" not in r and r.get("step") == steps]
    return round(min(done) - t_start, 4) if done else None


def in_run_failure_free_s(records: list[dict], t_start: float, steps: int, kill_times: list[float]) -> float | None:
    """The same run's failure-free time, estimated from its own records (so under its own load):
    its wall time for the work, less what each failure cost. Around each kill, from the kill to the
    moment the run is back at speed (`analyze_recovery`; the end of the work if never), every step
    completed counts as that kill's pre-failure median step, steps completed twice count once, and
    the rest of that span is lost; outside those spans every step counts as it ran. None if the
    work was not finished."""
    done = sorted((r for r in records if "event" not in r and isinstance(r.get("step"), int)), key=lambda r: r["time"])
    finish = min((r["time"] for r in done if r["step"] == steps), default=None)
    if finish is None:
        return None
    spans: list[tuple[float, float, float]] = []  # (from, to, normal step time)
    for t_kill in sorted(kill_times):
        if t_kill >= finish:
            break
        r = analyze_recovery(records, t_kill)
        end = finish if r["recovery_s"] is None else min(finish, t_kill + r["recovery_s"])
        if spans and t_kill <= spans[-1][1]:  # a failure before the last one was over: one span
            spans[-1] = (spans[-1][0], max(spans[-1][1], end), spans[-1][2])
        else:
            spans.append((t_kill, end, r["pre_step_s"] or statistics.median(x["step_s"] for x in done)))
    lost = 0.0
    for t0, t1, normal in spans:
        before = {r["step"] for r in done if r["time"] <= t0}
        new = {r["step"] for r in done if t0 < r["time"] <= t1} - before
        lost += max(0.0, (t1 - t0) - normal * len(new))
    return round(finish - t_start - lost, 4)


def productive_fraction(failure_free_s: float | None, wall_s: float | None) -> float | None:
    """Failure-free time of the work / wall time of the same work with failures."""
    if not failure_free_s or not wall_s:
        return None
    return round(failure_free_s / wall_s, 4)


# ----- small helpers shared by both benchmarks
def _round(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def median(values: list[float | None]) -> float | None:
    """Median of the values that are not None (None if there are none)."""
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 4) if vals else None


def ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 2) if num is not None and den else None


def median_index(values: list[float | None]) -> int | None:
    """Index of the (lower) median of the non-None values: the representative trial."""
    present = [(v, i) for i, v in enumerate(values) if v is not None]
    idx = [i for _, i in sorted(present)]
    return idx[(len(idx) - 1) // 2] if idx else None


def state_bytes_per_rank(model: str, workers: int, tp: int = 1, pp: int = 1) -> int:
    """Bytes of unique optimizer state per rank (ZeRO-1 shard of its slice over its DP group,
    laid out for the largest stage's slice: master, exp_avg, exp_avg_sq)."""
    elems = DEFAULT_CHUNK_BYTES // 12
    return shard_accounting(mesh_elements(model, tp, pp), workers, elems)["shard_elements_per_rank"] * 12


def machine() -> dict:
    """Where the numbers came from."""
    import torch

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "backend": "gloo over loopback (CPU)",
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


def default_out(kind: str) -> Path:
    return Path("runs") / f"bench-{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send fd 1 (the jobs' children's) and sys.stdout (the controllers' messages) to stderr, so
    stdout carries only the result."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
