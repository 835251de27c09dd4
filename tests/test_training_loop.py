"""The training loops users already have: clipping, accumulation, bf16 autocast, schedules and
parameter groups keep exact recovery, and match what plain PyTorch computes."""

from __future__ import annotations

import torch
import torch.nn as nn

import leto
from conftest import REPO, processes_left, run_user_script, seeded_random, step_records
from leto.training.trainer import Trainer

SCRIPT = str(REPO / "tests" / "scripts" / "recipe_model.py")
STEPS = 16


def test_a_clipped_accumulated_bf16_recipe_recovers_to_the_failure_free_digest(launcher, tmp_path) -> None:
    _, ref = run_user_script(launcher, tmp_path / "ref", SCRIPT, "--steps", str(STEPS))
    norms = [r["grad_norm"] for r in step_records(tmp_path / "ref")]
    assert len(norms) == STEPS and max(norms) > 0.05  # the clip was active
    rng, seed = seeded_random()
    kill_step = rng.randrange(2, STEPS - 3)
    _, s = run_user_script(launcher, tmp_path / "run", SCRIPT, "--steps", str(STEPS), kill_step=kill_step, rng=rng)
    assert len(s["recoveries"]) == 1 and s["digest"] == ref["digest"], f"seed {seed}: killed at step {kill_step}"
    assert not processes_left(tmp_path / "run")


def test_clipping_and_accumulation_match_torch() -> None:
    """One process: the trainer's clipped, accumulated step against clip_grad_norm_ and
    torch.optim.AdamW (the norms are summed in another order: equal to float rounding)."""

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

    g = torch.Generator().manual_seed(5)
    data = [[(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(3)] for _ in range(5)]
    ref = model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    norms = []
    for micro in data:
        opt.zero_grad()
        for x, y in micro:
            (nn.functional.mse_loss(ref(x), y) / len(micro)).backward()
        norms.append(float(nn.utils.clip_grad_norm_(ref.parameters(), 0.1, foreach=False)))
        opt.step()
    m = model()
    trainer = Trainer(m, leto.init("cpu"), leto.AdamW(lr=1e-2), chunk_bytes=12 * 40, max_grad_norm=0.1)
    got = []
    for step in trainer.steps(len(data)):
        trainer.step([lambda x=x, y=y: nn.functional.mse_loss(m(x), y) for x, y in data[step]])
        got.append(trainer.grad_norm)
    assert min(norms) > 0.1  # every step was clipped
    torch.testing.assert_close(torch.tensor(got), torch.tensor(norms), rtol=1e-6, atol=0)
    for a, b in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
