"""`--protect-every N`: only every N-th step is protected; a failure rolls every rank back to the
last protected step, loses at most N steps, and the job still ends with the failure-free digest."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import JOB, processes_left, reference_digest, step_records, train

EVERY = ("--protect-every", "3")


def check_rolled_back(res, s: dict, digest: str, run_dir: Path) -> dict:
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert s["digest"] == digest
    (rec,) = s["recoveries"]
    assert rec["step"] % 3 == 0 and rec["lost_steps"] <= 3, rec
    assert [r["step"] for r in step_records(run_dir)][-1] == 10
    assert not processes_left(run_dir)
    return rec


@pytest.mark.parametrize(
    "inject",
    [
        "kill:rank=1:step=8:phase=update",  # deltas of step 6 committed: back to 6
        "kill:rank=2:step=7:phase=parity",  # mid-staging of step 6's deltas: parity pre-images, back to 3
        "kill:rank=3:step=5:phase=backward",
    ],
)
def test_a_killed_worker_rolls_back_to_the_last_protected_step(launcher, tmp_path: Path, inject: str) -> None:
    digest = reference_digest(launcher, tmp_path, *JOB)
    res, s = train(launcher, tmp_path / "run", *JOB, *EVERY, "--inject", inject)
    rec = check_rolled_back(res, s, digest, tmp_path / "run")
    assert rec["failed_ranks"] == [int(inject.split("rank=")[1][0])] and rec["tier"] == "tier1"


def test_a_whole_node_lost_rolls_back_through_tier2(launcher, tmp_path: Path) -> None:
    """Three shadows: both lost ranks are adopted (with fewer the job shrinks, another digest)."""
    digest = reference_digest(launcher, tmp_path, *JOB)
    res, s = train(launcher, tmp_path / "run", *JOB, "--spares", "3", *EVERY, "--inject", "node-kill:node=1:step=7")
    rec = check_rolled_back(res, s, digest, tmp_path / "run")
    assert rec["failed_nodes"] == [1] and rec["failed_ranks"] == [2, 3] and rec["tier"] == "tier2"
