"""examples/pipeline_parallel.py, a user's own model cut into pipeline stages of their own, under
`leto run --pp 2`: it trains to the bits of the same script's data-parallel run (one stage, the
whole model), the full state dict it ends with loads into the plain model with the trained
weights, and a last-stage rank SIGKILLed from outside mid-run is adopted in place by a shadow
(built as stage 0, rebuilt as the last stage) with the failure-free digest."""

from __future__ import annotations

import os
import random
import re
import signal
from pathlib import Path
from typing import NamedTuple

import pytest

from conftest import Launcher, processes_left, read_procs, seeded_random, step_records, summary, wait_for

STEPS = 20
SCRIPT = ("examples/pipeline_parallel.py", "--steps", str(STEPS), "--microbatches", "4")
# DP 2 x PP 2: rank r is (replica, stage) = divmod(r, 2); each node holds one replica's two stages
PP_JOB = ("--workers", "4", "--nodes", "2", "--pp", "2", "--spares", "1", "--persist", "off")
HELD = re.compile(r"rank 0 \(stage (\d+)\) holds (\d+) of the model's (\d+) parameters")
HELD_OUT = re.compile(r"held-out loss of the plain model: untrained (\S+), trained (\S+)")


class Result(NamedTuple):
    share: float  # of the model's parameters, held by rank 0
    untrained: float  # held-out losses of the plain model: initial,
    trained: float  # and loaded from `trainer.state_dict()` at the end
    losses: list[float]  # per step, as recorded
    run_dir: Path


def _run(
    launcher: Launcher, run_dir: Path, *job: str, kill_step: int | None = None, rng: random.Random | None = None
) -> tuple[Result, int | None]:
    """Run the example (with `kill_step`, SIGKILL a last-stage worker chosen by `rng` once that
    step is recorded); what rank 0 printed, and the rank killed."""
    popen = launcher.start("run", *job, "--run-dir", str(run_dir), *SCRIPT, run_dir=run_dir)
    victim = None
    if kill_step is not None:
        wait_for(
            lambda: (run_dir / "metrics.jsonl").exists() and any(r["step"] >= kill_step for r in step_records(run_dir)),
            120,
            f"step {kill_step}",
        )
        last_stage = [p for p in read_procs(run_dir) if p["role"] == "worker" and p["rank"] % 2 == 1]
        proc = (rng or seeded_random()[0]).choice(last_stage)
        victim = proc["rank"]
        os.kill(proc["pid"], signal.SIGKILL)
    out, err = popen.communicate(timeout=240)
    # a worker's error after its last step does not change the job's exit code: look for it
    assert popen.returncode == 0 and "Traceback" not in err, out[-2000:] + err[-3000:]
    ((stage, held, full),), (losses,) = HELD.findall(out), HELD_OUT.findall(out)  # printed by rank 0 only
    assert stage == "0" and summary(run_dir)["steps"] == STEPS and processes_left(run_dir) == []
    recorded = [r["loss"] for r in step_records(run_dir)]
    return Result(int(held) / int(full), *map(float, losses), recorded, run_dir), victim


@pytest.fixture(scope="module")
def pp_run(tmp_path_factory) -> Result:
    """The failure-free DP2 x PP2 run, with a shadow that is never adopted."""
    tmp = tmp_path_factory.mktemp("pp")
    launcher = Launcher(tmp)
    try:
        return _run(launcher, tmp / "run", *PP_JOB)[0]
    finally:
        launcher.cleanup()


def test_the_user_pipeline_trains_to_the_bits_of_the_unsplit_model_and_its_state_dict_loads_into_the_plain_one(
    pp_run: Result, launcher, tmp_path
) -> None:
    assert 0.3 < pp_run.share < 0.7  # rank 0 holds its stage: the input layer and the first block
    assert pp_run.losses[-1] < 0.2 * pp_run.losses[0]
    assert pp_run.trained < 0.2 * pp_run.untrained  # the reassembled model holds the trained weights

    dp, _ = _run(launcher, tmp_path / "dp", "--workers", "2", "--persist", "off")  # --pp 1: one stage, the whole model
    assert dp.share == 1.0 and dp.untrained == pp_run.untrained
    # the same micro-batches through the same layers: the stages compute what the whole model does
    assert dp.losses == pp_run.losses and dp.trained == pp_run.trained
    assert summary(dp.run_dir)["digest"] == summary(pp_run.run_dir)["digest"]


def test_a_killed_last_stage_rank_of_the_user_pipeline_is_rebuilt_in_place(pp_run: Result, launcher, tmp_path) -> None:
    rng, _ = seeded_random()
    killed, victim = _run(launcher, tmp_path / "killed", *PP_JOB, kill_step=rng.randrange(3, STEPS // 2), rng=rng)
    (rec,) = summary(killed.run_dir)["recoveries"]
    assert rec["failed_ranks"] == [victim] and list(rec["adopted_by"]) == [str(victim)]
    assert summary(killed.run_dir)["digest"] == summary(pp_run.run_dir)["digest"]
    assert killed.losses[-1] < 0.2 * killed.losses[0]
    assert (killed.untrained, killed.trained) == (pp_run.untrained, pp_run.trained)
