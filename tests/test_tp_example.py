"""examples/tensor_parallel.py, a user's own model cut by a TP plan, under `leto run --tp 2`:
it trains as the DP-only run of the same script does, the full state dict it ends with loads
into the plain model, which computes what the TP model computes, and a TP rank SIGKILLed from
outside is recovered in place with the failure-free digest."""

from __future__ import annotations

import os
import random
import re
import signal
from pathlib import Path
from typing import NamedTuple

import pytest

from conftest import Launcher, processes_left, read_procs, seeded_random, step_records, summary, wait_for

STEPS = 30
SCRIPT = ("examples/tensor_parallel.py", "--steps", str(STEPS))
TP_JOB = ("--workers", "4", "--nodes", "2", "--tp", "2", "--spares", "1", "--persist", "off")
HELD = re.compile(r"rank 0 holds (\d+) of the model's (\d+) parameters")
HELD_OUT = re.compile(r"held-out loss: untrained (\S+), tensor-parallel (\S+), plain (\S+)")


class Result(NamedTuple):
    share: float  # of the model's parameters, held by rank 0
    untrained: float  # held-out losses: the initial model's,
    tp: float  # the TP model's at the end,
    plain: float  # and the plain model's, loaded from `trainer.state_dict()`
    run_dir: Path


def _run(
    launcher: Launcher, run_dir: Path, *job: str, kill_step: int | None = None, rng: random.Random | None = None
) -> Result:
    """Run the example (with `kill_step`, SIGKILL a worker chosen by `rng` once that step is
    recorded) and read what rank 0 printed."""
    popen = launcher.start("run", *job, "--run-dir", str(run_dir), *SCRIPT, run_dir=run_dir)
    if kill_step is not None:
        wait_for(
            lambda: (run_dir / "metrics.jsonl").exists() and any(r["step"] >= kill_step for r in step_records(run_dir)),
            120,
            f"step {kill_step}",
        )
        victim = (rng or seeded_random()[0]).choice([p for p in read_procs(run_dir) if p["role"] == "worker"])
        os.kill(victim["pid"], signal.SIGKILL)
    out, err = popen.communicate(timeout=240)
    # a worker's error after its last step does not change the job's exit code: look for it
    assert popen.returncode == 0 and "Traceback" not in err, out[-2000:] + err[-3000:]
    ((held, full),), (losses,) = HELD.findall(out), HELD_OUT.findall(out)  # printed by rank 0 only
    assert summary(run_dir)["steps"] == STEPS and processes_left(run_dir) == []
    return Result(int(held) / int(full), *map(float, losses), run_dir)


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory) -> Result:
    """The failure-free TP2 x DP2 run, with a shadow that is never adopted."""
    tmp = tmp_path_factory.mktemp("tp")
    launcher = Launcher(tmp)
    try:
        return _run(launcher, tmp / "run", *TP_JOB)
    finally:
        launcher.cleanup()


def test_the_user_tp_model_trains_as_data_parallel_and_its_state_dict_loads_into_the_plain_model(
    tp_run: Result, launcher, tmp_path
) -> None:
    assert 0.5 < tp_run.share < 0.6  # half of every cut linear (most of the model), all of the rest
    assert abs(tp_run.plain - tp_run.tp) <= 1e-5 * tp_run.tp  # the reassembled model computes what its slices did
    assert tp_run.plain < 0.2 * tp_run.untrained  # and it holds the trained weights, not the initial ones

    dp = _run(launcher, tmp_path / "dp", "--workers", "2", "--persist", "off")
    assert dp.share == 1.0 and dp.untrained == tp_run.untrained
    assert abs(tp_run.plain - dp.plain) <= 1e-3 * dp.plain
    tp_losses, dp_losses = ([r["loss"] for r in step_records(r.run_dir)] for r in (tp_run, dp))
    assert len(tp_losses) == len(dp_losses) == STEPS
    assert max(abs(a - b) / b for a, b in zip(tp_losses, dp_losses)) < 1e-3


def test_a_killed_tp_rank_of_the_user_model_is_recovered_in_place(tp_run: Result, launcher, tmp_path) -> None:
    rng, _ = seeded_random()
    killed = _run(launcher, tmp_path / "killed", *TP_JOB, kill_step=rng.randrange(3, STEPS // 2), rng=rng)
    (rec,) = summary(killed.run_dir)["recoveries"]
    assert len(rec["failed_ranks"]) == 1 and list(rec["adopted_by"]) == [str(r) for r in rec["failed_ranks"]]
    assert summary(killed.run_dir)["digest"] == summary(tp_run.run_dir)["digest"]
    assert (killed.tp, killed.plain) == (tp_run.tp, tp_run.plain)
