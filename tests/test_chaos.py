"""A random mix of real failures at random moments, from outside the job, ends with the
failure-free digest.

Each run draws its failures from: a worker SIGKILLed or SIGSTOPped (a hang, fenced after the
heartbeat timeout), a keeper SIGKILLed or SIGSTOPped, an idle shadow SIGKILLed, two workers of two
nodes SIGKILLed a moment apart (the second while the first is being recovered) and, at most once,
a whole node's processes SIGKILLed. Each comes at a random moment of a random step, once the
previous one has been dealt with. `LETO_TEST_SEED` repeats a run.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from conftest import (
    JOB,
    alive,
    events,
    processes_left,
    read_procs,
    reference_digest,
    seeded_random,
    step_records,
    wait_for,
    with_flags,
)
from leto.runtime import linux

STEPS = 48
FAILURES = 5
ARGS = with_flags(JOB, steps=STEPS, spares=3, heartbeat_timeout=1.5)


def _steps_done(run_dir: Path) -> int:
    return max((r["step"] for r in step_records(run_dir)), default=0) if (run_dir / "metrics.jsonl").exists() else 0


def _live(run_dir: Path, role: str) -> list[dict]:
    return [p for p in read_procs(run_dir) if p["role"] == role and alive(p["pid"])]


def _signal(p: dict, sig: int) -> None:
    linux.signal_process(p["pid"], p.get("start"), sig)


def test_a_random_mix_of_failures_ends_with_the_failure_free_digest(launcher, tmp_path: Path) -> None:
    rng, seed = seeded_random()
    run_dir = tmp_path / "run"
    ctl = launcher.start("train", "--run-dir", str(run_dir), *ARGS, run_dir=run_dir)
    node_lost = False
    done: list[str] = []
    for _ in range(FAILURES):
        at = min(_steps_done(run_dir) + rng.randint(2, 8), STEPS - 8)
        wait_for(lambda: _steps_done(run_dir) >= at or ctl.poll() is not None, 120, f"step {at}")
        if ctl.poll() is not None:
            break
        time.sleep(rng.uniform(0, 0.12))
        kinds = ["worker-kill", "worker-stop", "keeper-kill", "keeper-stop", "shadow-kill"]
        nodes = sorted({p["node"] for p in _live(run_dir, "worker")})
        if not node_lost and len(nodes) > 1:
            kinds += ["node-kill", "two-workers"]
        kind = rng.choice(kinds)
        recoveries = len(events(run_dir, "recovery"))
        before = {p["pid"] for p in read_procs(run_dir) if p["role"] == "shadow"}
        if kind == "shadow-kill" and not _live(run_dir, "shadow"):
            kind = "worker-kill"
        if kind in ("worker-kill", "worker-stop"):
            victim = rng.choice(_live(run_dir, "worker"))
            _signal(victim, signal.SIGKILL if kind == "worker-kill" else signal.SIGSTOP)
        elif kind in ("keeper-kill", "keeper-stop"):
            victim = rng.choice(_live(run_dir, "keeper"))
            _signal(victim, signal.SIGKILL if kind == "keeper-kill" else signal.SIGSTOP)
        elif kind == "two-workers":  # one on each of two nodes, the second while the first is recovered
            first = rng.choice(_live(run_dir, "worker"))
            _signal(first, signal.SIGKILL)
            time.sleep(rng.uniform(0, 0.25))
            second = rng.choice([p for p in _live(run_dir, "worker") if p["node"] != first["node"]])
            _signal(second, signal.SIGKILL)
            victim = {"rank": f"{first['rank']} and {second['rank']}"}
        elif kind == "shadow-kill":
            victim = rng.choice(_live(run_dir, "shadow"))
            _signal(victim, signal.SIGKILL)
        else:
            node = rng.choice(nodes)
            victim = {"node": node}
            for p in read_procs(run_dir):
                if p["role"] not in ("controller", "fork-server") and p["node"] == node:
                    _signal(p, signal.SIGKILL)
            node_lost = True
        where = f"rank {victim['rank']}" if "worker" in kind else f"node {victim['node']}"
        done.append(f"{kind} ({where}) after step {at}")
        if kind == "shadow-kill":
            wait_for(
                lambda: ctl.poll() is not None or any(p["pid"] not in before for p in _live(run_dir, "shadow")),
                60,
                f"a replacement shadow (seed {seed}: {done})",
            )
        else:
            wait_for(
                lambda: ctl.poll() is not None or len(events(run_dir, "recovery")) > recoveries,
                60,
                f"a recovery (seed {seed}: {done})",
            )
    out, err = ctl.communicate(timeout=300)
    print(f"seed {seed}: {done}", flush=True)
    assert ctl.returncode == 0, f"seed {seed}: {done}\n" + err[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["digest"] == reference_digest(launcher, tmp_path, *with_flags(JOB, steps=STEPS)), f"seed {seed}: {done}"
    assert not processes_left(run_dir), f"seed {seed}: {done}"
