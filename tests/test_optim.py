"""Leto's optimizers give the same bits as torch.optim's single-tensor implementations on the
same gradients, step after step, whether they update a chunk in place or into another buffer."""

from __future__ import annotations

import pytest
import torch

from leto.training.optim import SGD, Adam, AdamW, warmup_cosine

N, STEPS = 1000, 12


def run_torch(make, grads: list[torch.Tensor], w0: torch.Tensor) -> torch.Tensor:
    p = torch.nn.Parameter(w0.clone())
    opt = make([p])
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def run_leto(opt, grads: list[torch.Tensor], w0: torch.Tensor, in_place: bool) -> torch.Tensor:
    state = torch.zeros(2, 3, N)  # ping-pong buffers as the trainer keeps them
    state[0, 0] = w0
    scratch = torch.empty(N)
    for step, g in enumerate(grads, start=1):
        src = state[0] if in_place else state[(step - 1) % 2]
        dst = src if in_place else state[step % 2]
        opt.update(src, g.clone(), dst, step, scratch)
    return (state[0] if in_place else state[STEPS % 2])[0]


CASES = {
    "adamw": (
        AdamW(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
        lambda ps: torch.optim.AdamW(
            ps, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False, fused=False
        ),
    ),
    "adamw-no-decay": (
        AdamW(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0),
        lambda ps: torch.optim.AdamW(
            ps, lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0, foreach=False, fused=False
        ),
    ),
    "adam-l2": (
        Adam(lr=1e-2, weight_decay=0.01),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01, foreach=False, fused=False),
    ),
    "sgd": (SGD(lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=False)),
    "sgd-momentum": (
        SGD(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-3),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-3, foreach=False),
    ),
    "sgd-nesterov": (
        SGD(lr=0.05, momentum=0.9, nesterov=True),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, foreach=False),
    ),
}


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "ping-pong"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_same_bits_as_torch_optim(name: str, in_place: bool) -> None:
    g = torch.Generator().manual_seed(1)
    w0 = torch.randn(N, generator=g)
    grads = [torch.randn(N, generator=g) * 10 ** torch.randint(-4, 2, (N,), generator=g) for _ in range(STEPS)]
    leto_opt, make = CASES[name]
    want = run_torch(make, grads, w0)
    got = run_leto(leto_opt, grads, w0, in_place)
    assert torch.equal(got, want), f"{(got != want).sum().item()} of {N} elements differ"


def test_a_schedule_is_a_function_of_the_step() -> None:
    lr = warmup_cosine(1e-2, warmup=10, total=100)
    opt = AdamW(lr=lr)
    assert opt.lr_at(5) == lr(5) == 5e-3 and opt.lr_at(100) == pytest.approx(1e-3)


def test_nesterov_needs_momentum() -> None:
    with pytest.raises(ValueError, match="Nesterov"):
        SGD(nesterov=True)


def test_a_solo_trainer_with_param_groups_equals_torch_adamw_bit_for_bit() -> None:
    """nanoGPT's groups (decay on matrices, none on biases and norms) over chunks that straddle
    group boundaries: one process, so the same gradients, and the same bits as torch."""
    import leto
    from leto.training.trainer import Trainer

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3))

    def no_decay(m: torch.nn.Module) -> list[torch.nn.Parameter]:
        return [p for p in m.parameters() if p.dim() < 2]

    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(6)]
    ref = model()
    decay = [p for p in ref.parameters() if p.dim() >= 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay(ref), "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=False,
        fused=False,
    )
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        opt.step()

    m = model()
    trainer = Trainer(
        m,
        leto.init("cpu"),
        AdamW(lr=1e-2, weight_decay=0.1),
        chunk_bytes=12 * 40,
        param_groups=[{"params": no_decay(m), "weight_decay": 0.0}],
    )
    for step in trainer.steps(len(data)):
        x, y = data[step]
        trainer.step(lambda: torch.nn.functional.mse_loss(m(x), y))
    for got, want in zip(m.parameters(), ref.parameters()):
        assert torch.equal(got.detach(), want.detach())


def test_param_groups_name_what_is_wrong() -> None:
    from leto.training.param_groups import ParamGroups

    lin = torch.nn.Linear(2, 2)
    params = list(lin.parameters())
    with pytest.raises(ValueError, match="AdamW has no field momentum"):
        ParamGroups(params, AdamW(), [{"params": [lin.bias], "momentum": 0.9}])
    with pytest.raises(ValueError, match="more than one param group"):
        ParamGroups(params, AdamW(), [{"params": [lin.bias]}, {"params": [lin.bias]}])
    with pytest.raises(ValueError, match="not a trainable parameter"):
        ParamGroups(params, AdamW(), [{"params": [torch.zeros(2)]}])
    groups = ParamGroups(params, AdamW(), [{"params": [lin.bias], "weight_decay": 0.0}])
    assert [(lo, hi, o.weight_decay) for lo, hi, o in groups.segments(2, 5)] == [(0, 2, 0.1), (2, 4, 0.0), (4, 5, 0.1)]


def test_the_lion_example_of_the_docs_is_an_optimizer() -> None:
    from conftest import REPO

    text = (REPO / "docs" / "optimizers.md").read_text()
    code = text.split("## A worked example: Lion")[1].split("```python")[1].split("```")[0]
    ns: dict = {}
    exec(compile(code, "docs/optimizers.md", "exec"), ns)
    lion = ns["Lion"](lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(3)
    w, m = torch.randn(N, generator=g), torch.zeros(N)
    state = torch.zeros(3, N)
    state[0] = w
    for step in range(1, STEPS + 1):
        grad = torch.randn(N, generator=g)
        lion.update(state, grad, state, step, torch.empty(N))
        c = (0.9 * m + 0.1 * grad).sign()
        w = w * (1 - 1e-2 * 0.1) - 1e-2 * c
        m = 0.99 * m + 0.01 * grad
    torch.testing.assert_close(state[0], w)
    torch.testing.assert_close(state[1], m)
