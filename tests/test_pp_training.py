"""Training in pipeline stages: `leto train --tp 2 --pp 2` (8 workers, DP 2) computes what the
data-parallel run of the same seed and global batch computes. Its losses (the mean over
micro-batches and replicas) and its clipped global gradient norms (over every stage and TP
shard, the tied embedding counted once) track that run's, and the model it saves is the whole
plain GPT."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import Launcher, step_records, train
from leto.training.model import GPT, PRESETS

STEPS = 20
COMMON = ("--steps", str(STEPS), "--seed", "0", "--protection", "off", "--persist", "off", "--max-grad-norm", "1.0")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The pipeline job and the data-parallel one, each run once for this module's tests."""
    tmp = tmp_path_factory.mktemp("pp")
    launcher = Launcher(tmp)
    try:
        out = {}
        for name, layout in (("mesh", ("--tp", "2", "--pp", "2", "--spares", "0")), ("dp", ("--workers", "2"))):
            res, _ = train(launcher, tmp / name, *layout, *COMMON)
            assert res.returncode == 0, res.stderr[-3000:]
            out[name] = tmp / name
        return out
    finally:
        launcher.cleanup()


def _by_step(run_dir: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in step_records(run_dir)}


def test_tp_2_pp_2_losses_track_the_data_parallel_run_within_1e_3(runs) -> None:
    mesh, dp = _by_step(runs["mesh"], "loss"), _by_step(runs["dp"], "loss")
    assert sorted(mesh) == sorted(dp) == list(range(1, STEPS + 1))
    worst = max(abs(mesh[s] - dp[s]) / dp[s] for s in dp)
    assert worst <= 1e-3, f"losses differ by {worst:.2e} relative"
    assert mesh[STEPS] < mesh[1]


def test_the_global_gradient_norm_covers_every_stage_and_shard_once(runs) -> None:
    """Clipped at 1.0 from the first step: a norm missing a stage or counting the tied embedding
    twice would differ by far more than float rounding."""
    mesh, dp = _by_step(runs["mesh"], "grad_norm"), _by_step(runs["dp"], "grad_norm")
    assert all(dp[s] > 1.0 for s in (1, 2))  # clipping is in effect
    worst = max(abs(mesh[s] - dp[s]) / dp[s] for s in dp)
    assert worst <= 1e-3, f"gradient norms differ by {worst:.2e} relative"


def test_the_saved_model_is_the_whole_plain_gpt_and_matches_the_data_parallel_one(runs) -> None:
    got = torch.load(runs["mesh"] / "model.pt", weights_only=True)
    want = torch.load(runs["dp"] / "model.pt", weights_only=True)
    plain = GPT(PRESETS["tiny"]).state_dict()
    assert list(got) == list(want) == list(plain)
    assert all(got[k].shape == plain[k].shape for k in plain)
    worst = max(float((got[k] - want[k]).abs().max()) for k in plain)
    assert worst <= 1e-3, f"parameters differ by up to {worst:.2e}"
