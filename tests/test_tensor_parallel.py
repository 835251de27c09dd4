"""Megatron-style tensor parallelism of the built-in GPT: two real processes over gloo equal the
full model (loss, every gradient slice, the reassembled state, a few SGD steps)."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from conftest import REPO
from leto.training.model import GPT, GPTConfig, tensor_parallel_gpt
from leto.training.tensor_parallel import (
    Sharded,
    shard,
    shard_state_dict,
    tp_layout,
    unshard,
    unshard_state_dicts,
)

CFG = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=256)


class LocalGroup:
    """A TP group of `world_size` ranks in which only `rank` computes: enough for what needs no
    collective (building, layouts); a world of one is the plain model."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.rank, self.world_size = rank, world_size

    def all_reduce(self, t: torch.Tensor) -> None:
        assert self.world_size == 1

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        assert self.world_size == 1
        out.copy_(inp)


def test_two_tp_ranks_equal_the_full_model() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    script = REPO / "tests" / "scripts" / "tp_check.py"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), "2", str(store.port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"rank {rank}: ok" in out, out[-3000:]


def test_one_tp_rank_is_the_plain_model() -> None:
    torch.manual_seed(0)
    plain = GPT(CFG)
    torch.manual_seed(0)
    tp = tensor_parallel_gpt(GPT(CFG), LocalGroup())
    x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=torch.Generator().manual_seed(1))
    assert torch.equal(tp(x, x), plain(x, x))
    assert [(n, p.shape) for n, p in tp.named_parameters()] == [(n, p.shape) for n, p in plain.named_parameters()]


def test_layout_names_the_sharded_parameters() -> None:
    torch.manual_seed(0)
    plain = GPT(CFG)
    layout = tp_layout(tensor_parallel_gpt(GPT(CFG), LocalGroup(0, 2)))
    assert list(layout) == [n for n, _ in plain.named_parameters()]
    assert layout["blocks.0.attn.weight"] == Sharded(0, parts=3)
    assert layout["blocks.0.attn.bias"] == Sharded(0, parts=3)
    assert layout["blocks.1.fc.weight"] == Sharded(0) and layout["blocks.1.fc.bias"] == Sharded(0)
    assert layout["blocks.0.proj.weight"] == Sharded(1) and layout["blocks.0.fc_proj.weight"] == Sharded(1)
    replicated = {n for n, s in layout.items() if s is None}
    assert {"wte.weight", "wpe.weight", "ln_f.weight", "blocks.0.proj.bias", "blocks.1.fc_proj.bias"} <= replicated
    assert {"blocks.0.ln_1.weight", "blocks.0.ln_2.bias"} <= replicated


def test_slices_of_every_rank_reassemble_the_plain_model() -> None:
    torch.manual_seed(0)
    plain = GPT(CFG)
    slices = []
    for r in range(2):
        torch.manual_seed(0)
        slices.append(tensor_parallel_gpt(GPT(CFG), LocalGroup(r, 2)).state_dict())
    layout = tp_layout(tensor_parallel_gpt(GPT(CFG), LocalGroup(0, 2)))
    full = unshard_state_dicts(slices, layout)
    assert full.keys() == plain.state_dict().keys()
    assert all(torch.equal(full[k], v) for k, v in plain.state_dict().items())
    for r in range(2):  # and back: a full checkpoint loads into each TP rank
        cut = shard_state_dict(plain.state_dict(), layout, r, 2)
        assert all(torch.equal(cut[k], v) for k, v in slices[r].items())
        tensor_parallel_gpt(GPT(CFG), LocalGroup(r, 2)).load_state_dict(cut)


def test_fused_qkv_is_split_per_block_by_heads() -> None:
    c, tp = 8, 2
    full = torch.arange(3 * c * 2.0).view(3 * c, 2)  # rows: q 0-7, k 8-15, v 16-23
    spec = Sharded(0, parts=3)
    rank1 = shard(full, spec, 1, tp)
    assert torch.equal(rank1[:, 0] // 2, torch.tensor([4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23.0]))
    assert torch.equal(unshard([shard(full, spec, r, tp) for r in range(tp)], spec), full)
    cols = Sharded(1)
    wide = torch.randn(3, 8)
    assert torch.equal(unshard([shard(wide, cols, r, 4) for r in range(4)], cols), wide)


def test_heads_must_split_over_the_tp_ranks() -> None:
    with pytest.raises(ValueError, match="4 attention heads do not split over 3"):
        tensor_parallel_gpt(GPT(CFG), LocalGroup(0, 3))
