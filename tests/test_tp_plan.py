"""A tensor-parallel plan by module names (`tp_plan.parallelize`): two TP ranks, as two threads
summing through a shared buffer, compute the plain model's output and gradients, and their
slices reassemble into its state dict; a plan that does not fit the model is refused."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn

from leto.training.model import GPT, GPTConfig, tensor_parallel_gpt
from leto.training.tensor_parallel import (
    ColumnParallelLinear,
    PendingGroup,
    RowParallelLinear,
    gather_full_state_dict,
    tp_layout,
    unshard,
)
from leto.training.tp_plan import Colwise, parallelize

PLAN = {"blocks.*.fc": "colwise", "blocks.*.proj": "rowwise"}


class Mlp(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.fc, self.proj = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.tanh(self.fc(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([Mlp(8), Mlp(8)])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def plain() -> Net:
    torch.manual_seed(0)
    return Net()


class ThreadGroup:
    """One rank of a TP group whose ranks are threads of this process."""

    def __init__(self, rank: int, world_size: int, slots: list, barrier: threading.Barrier) -> None:
        self.rank, self.world_size, self._slots, self._barrier = rank, world_size, slots, barrier

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self._slots[self.rank] = t.clone()
        self._barrier.wait()
        got = list(self._slots)
        self._barrier.wait()  # every rank has read before any writes the next
        return got

    def all_reduce(self, t: torch.Tensor) -> None:
        got = self._exchange(t)
        t.copy_(sum(got[1:], got[0].clone()))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        out.copy_(torch.cat(self._exchange(inp)))


def on_threads(tp: int, fn) -> list:
    """`fn(group)` on `tp` threads, one per TP rank; their results by rank."""
    slots, barrier = [None] * tp, threading.Barrier(tp, timeout=30)
    results, errors = [None] * tp, []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(ThreadGroup(rank, tp, slots, barrier))
        except BaseException as e:
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return results


def test_the_plan_cuts_the_named_linears_and_keeps_the_rest() -> None:
    model = parallelize(plain(), PLAN, PendingGroup(1, 2))
    for block in model.blocks:
        assert isinstance(block.fc, ColumnParallelLinear) and block.fc.weight.shape == (16, 8)
        assert isinstance(block.proj, RowParallelLinear) and block.proj.weight.shape == (8, 16)
    assert type(model.inp) is nn.Linear and type(model.head) is nn.Linear
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain().named_parameters()]
    assert torch.equal(model.blocks[1].fc.weight, plain().blocks[1].fc.weight[16:])  # rank 1's half


def test_two_tp_ranks_compute_the_plain_model_and_reassemble_it() -> None:
    ref = plain()
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    ref(x).square().sum().backward()

    fulls = [plain(), plain()]  # built here: the threads would share torch's global generator

    def rank(group: ThreadGroup) -> tuple[torch.Tensor, dict, dict]:
        model = parallelize(fulls[group.rank], PLAN, group)
        y = model(x)
        y.square().sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        return y.detach(), grads, gather_full_state_dict(model, group)

    results = on_threads(2, rank)
    layout = tp_layout(parallelize(plain(), PLAN, PendingGroup(0, 2)))
    for y, _, state in results:
        torch.testing.assert_close(y, ref(x).detach())
        assert state.keys() == ref.state_dict().keys()
        for k, v in ref.state_dict().items():
            assert torch.equal(state[k], v), k
    for name, p in ref.named_parameters():
        spec = layout[name]
        if spec is None:  # replicated: the same gradient on both ranks
            assert torch.equal(results[0][1][name], results[1][1][name]), name
            grad = results[0][1][name]
        else:
            grad = unshard([r[1][name] for r in results], spec)
        torch.testing.assert_close(grad, p.grad, msg=name)


def test_one_tp_rank_is_the_plain_model() -> None:
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(2))
    assert torch.equal(parallelize(plain(), PLAN, PendingGroup(0, 1))(x), plain()(x))


def test_a_wildcard_matches_one_part_of_a_name() -> None:
    with pytest.raises(ValueError, match="names no module"):
        parallelize(plain(), {"*.fc": "colwise"}, PendingGroup(0, 2))  # fc is at blocks.N.fc


def test_a_fused_projection_is_cut_per_block_as_the_built_in_gpt_is() -> None:
    """A plan with `Colwise(parts=3)` for the fused [q; k; v] cuts the built-in GPT into the
    slices `tensor_parallel_gpt` gives it."""
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=256)
    plan = {"blocks.*.attn": Colwise(parts=3), "blocks.*.proj": "rowwise", "blocks.*.fc": "colwise"}
    plan["blocks.*.fc_proj"] = "rowwise"
    for rank in range(2):
        torch.manual_seed(0)
        ours = dict(parallelize(GPT(cfg), plan, PendingGroup(rank, 2)).named_parameters())
        torch.manual_seed(0)
        ref = dict(tensor_parallel_gpt(GPT(cfg), PendingGroup(rank, 2)).named_parameters())
        assert ours.keys() == ref.keys()
        for name, p in ref.items():
            assert torch.equal(ours[name], p), name


@pytest.mark.parametrize(
    "plan, error, match",
    [
        ({"blocks.*.fc": "sequence"}, ValueError, "neither 'colwise' nor 'rowwise'"),
        ({"blocks.*.gate": "colwise"}, ValueError, "names no module"),
        ({"blocks.0.norm": "colwise"}, TypeError, "LayerNorm, not a plain nn.Linear"),
        ({"blocks.*.fc": "colwise", "blocks.0.fc": Colwise(parts=2)}, ValueError, "cut both as"),
    ],
)
def test_a_plan_that_does_not_fit_the_model_is_refused(plan: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        parallelize(plain(), plan, PendingGroup(0, 2))
