"""Chunk-level transactions: a worker SIGKILLed at every chunk boundary of one update (and of
the gradient and parity hand-offs around it) is rebuilt byte for byte; corruption is caught."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest

from conftest import processes_left, read_procs, reference_digest, step_records, train, wait_for
from leto.protection.layout import Layout
from leto.protection.shm import Region
from leto.protocol import keys
from leto.runtime.env import connect

CHUNK_BYTES = str(12 * 65536)  # 4 chunks per rank for the tiny model on 4 ranks
SMALL = ("--workers", "4", "--nodes", "2", "--spares", "1", "--steps", "6", "--seed", "1", "--chunk-bytes", CHUNK_BYTES)


# gloo's default: gradients are replicated on every rank, not staged; `--protect-grads on` runs
# the protocol of a real reduce-scatter (NCCL), which stages them, on the same CPU job
MODES = {"replicated-grads": (), "protected-grads": ("--protect-grads", "on")}


# every hand-off at the last of 4 chunks (which completes the step; the update's in one mode: its
# path does not depend on where the gradient came from); the first chunk (nothing of the step
# handed over yet) of the in-place update and of the gradient staging
@pytest.mark.parametrize(
    "chunk, mode, phase",
    [
        (3, "replicated-grads", "update"),
        (3, "replicated-grads", "parity"),
        (3, "protected-grads", "grads"),
        (3, "protected-grads", "parity"),
        (0, "replicated-grads", "update"),
        (0, "protected-grads", "grads"),
    ],
)
def test_kill_at_every_chunk_boundary_rebuilds_the_exact_state(
    launcher, tmp_path: Path, mode: str, phase: str, chunk: int
) -> None:
    digest = reference_digest(launcher, tmp_path, *SMALL)  # the same digest in both modes
    rank = 1 + chunk % 2  # vary the victim: rank 1 (node 0) or rank 2 (node 1)
    res, s = train(
        launcher,
        tmp_path / "run",
        *SMALL,
        *MODES[mode],
        "--inject",
        f"kill:rank={rank}:step=4:phase={phase}:chunk={chunk}",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert s["digest"] == digest
    (rec,) = s["recoveries"]
    assert rec["failed_ranks"] == [rank] and rec["step"] in (2, 3, 4)
    assert not processes_left(tmp_path / "run")


def _corrupt_tier1_parity(run_dir: Path, node: int) -> None:
    """Flip one byte of node `node`'s tier-1 parity in the keeper's shared memory."""
    ctl = next(p for p in read_procs(run_dir) if p["role"] == "controller")
    job_id = ctl["job"]
    store = connect(ctl["store"], 10.0)
    layout = Layout.from_json(store.get(keys.layout(0)))
    region = Region(layout, job_id, node, create=False)
    region["p1"][0, 100] ^= np.uint8(0x5A)
    region.close()


def test_a_corrupted_parity_chunk_is_detected_and_repaired_from_tier2(launcher, tmp_path: Path) -> None:
    job = ("--workers", "4", "--nodes", "2", "--spares", "1", "--steps", "12", "--seed", "2")
    digest = reference_digest(launcher, tmp_path, *job)
    run_dir = tmp_path / "run"
    ctl = launcher.start("train", "--run-dir", str(run_dir), *job, run_dir=run_dir)
    wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(step_records(run_dir)) >= 3, 120, "step 3")
    _corrupt_tier1_parity(run_dir, node=0)
    victim = next(p for p in read_procs(run_dir) if p["role"] == "worker" and p["rank"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)
    out, err = ctl.communicate(timeout=240)
    assert ctl.returncode == 0, err[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["digest"] == digest
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (rec,) = [e for e in events if e.get("event") == "recovery"]
    assert rec["tier"] == "tier2" and any("node 0" in r and "checksum" in r for r in rec["repaired"])
    assert not processes_left(run_dir)


def test_corruption_with_no_redundancy_left_stops_the_job(launcher, tmp_path: Path) -> None:
    job = ("--workers", "4", "--nodes", "2", "--spares", "1", "--steps", "40", "--seed", "2", "--ec", "none")
    run_dir = tmp_path / "run"
    ctl = launcher.start("train", "--run-dir", str(run_dir), *job, run_dir=run_dir)
    wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(step_records(run_dir)) >= 3, 120, "step 3")
    _corrupt_tier1_parity(run_dir, node=0)
    victim = next(p for p in read_procs(run_dir) if p["role"] == "worker" and p["rank"] == 0)
    os.kill(victim["pid"], signal.SIGKILL)
    out, err = ctl.communicate(timeout=240)
    assert ctl.returncode == 1
    assert "cannot recover" in out and "checksums" in out and "node 0" in out
    assert not processes_left(run_dir)
