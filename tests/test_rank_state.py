"""Every bit that shapes a rank's future arithmetic survives recovery: RNG streams, module
buffers and registered user state. A user script under `leto run` is SIGKILLed from outside at a
random step and must end with the digest (parameters, optimizer state, buffers) of a failure-free
run, and with its loader where the failure-free run left it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conftest import REPO, processes_left, run_user_script, seeded_random
from leto.training.rank_state import RankState, persistent_buffers, step_seed

SCRIPT = str(REPO / "tests" / "scripts" / "stateful_model.py")
STEPS = 16


@pytest.mark.parametrize("model", ["dropout", "batchnorm"])
def test_a_model_with_randomness_or_buffers_recovers_to_the_failure_free_digest(launcher, tmp_path, model) -> None:
    args = ("--model", model, "--steps", str(STEPS), "--step-sleep", "0.1")  # the kill lands >= 0.5 s before the end
    ref_out, ref = run_user_script(launcher, tmp_path / "ref", SCRIPT, *args)
    rng, seed = seeded_random()
    kill_step = rng.randrange(2, STEPS - 5)
    out, s = run_user_script(launcher, tmp_path / "run", SCRIPT, *args, kill_step=kill_step, rng=rng)
    assert len(s["recoveries"]) == 1, f"seed {seed}: killed at step {kill_step}: {s['recoveries']}"
    assert s["digest"] == ref["digest"], f"seed {seed}: killed at step {kill_step}"
    if model == "batchnorm":  # every rank's loader ends where the failure-free run's did
        served = sorted(line for line in out.splitlines() if "loader served" in line)
        assert served == sorted(line for line in ref_out.splitlines() if "loader served" in line)
        assert served == [f"rank {r} loader served {STEPS}" for r in (0, 1)]
    assert not processes_left(tmp_path / "run")


def test_step_seeds_are_a_pure_function_of_seed_step_and_rank() -> None:
    assert step_seed(3, 7, 1) == step_seed(3, 7, 1)
    seeds = {step_seed(3, s, r) for s in range(50) for r in range(8)} | {step_seed(4, 0, 0)}
    assert len(seeds) == 50 * 8 + 1 and all(0 <= x < 2**63 for x in seeds)


def test_only_persistent_buffers_are_state() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model.register_buffer("mask", torch.ones(4), persistent=False)
    assert sorted(persistent_buffers(model)) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]


def test_registered_state_needs_state_dict_and_load_state_dict() -> None:
    rs = RankState(nn.Linear(2, 2))
    assert not rs.active
    with pytest.raises(TypeError, match="'loader' must have state_dict"):
        rs.register("loader", object())
    with pytest.raises(TypeError, match="'g' must have state_dict"):
        rs.register("g", torch.Generator())  # get_state/set_state: wrap it
    sched = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1)], lr=1.0), lambda s: 1.0)
    rs.register("sched", sched)
    assert rs.active
    with pytest.raises(ValueError, match="'sched' is registered already"):
        rs.register("sched", sched)
