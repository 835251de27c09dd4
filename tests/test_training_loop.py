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
    kill_step = rng.randrange(2, STEPS - 6)
    # a step takes milliseconds: with no pause the kill, sent once the step is recorded, could
    # come after the last step (nothing to recover); a pause between steps leaves it >= 1.5 s
    args = ("--steps", str(STEPS), "--step-sleep", "0.25")
    _, s = run_user_script(launcher, tmp_path / "run", SCRIPT, *args, kill_step=kill_step, rng=rng)
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


def _small_trainer() -> tuple[Trainer, nn.Module]:
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    return Trainer(m, leto.init("cpu"), leto.AdamW(lr=1e-2), chunk_bytes=12 * 8), m


def test_a_loss_function_of_the_replica_is_called_with_each_replica_the_rank_hosts() -> None:
    """One process hosts the one replica of its launch: the function gets its index, its loss
    is weighted by its share, and the step matches the same loss written without arguments."""
    x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), torch.zeros(8, 1)
    trainer, m = _small_trainer()
    assert trainer.replicas == 1
    called: list[int] = []

    def loss(replica: int) -> torch.Tensor:
        called.append(replica)
        return nn.functional.mse_loss(m(x), y)

    got = [trainer.step(loss, weight=lambda replica: 0.5) for _ in trainer.steps(3)]
    assert called == [0, 0, 0]
    plain, pm = _small_trainer()
    want = [plain.step(lambda: nn.functional.mse_loss(pm(x), y), weight=0.5) for _ in plain.steps(3)]
    assert got == want
    assert trainer.digest() == plain.digest()


def test_a_weight_function_needs_a_loss_function_of_the_replica() -> None:
    trainer, m = _small_trainer()
    for _ in trainer.steps(1):
        try:
            trainer.step(lambda: m(torch.zeros(1, 4)).sum(), weight=lambda replica: 1.0)
        except TypeError as e:
            assert "lambda replica" in str(e)
        else:
            raise AssertionError("a weight function with a loss function of no arguments was accepted")
        break
