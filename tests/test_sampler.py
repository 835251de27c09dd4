"""The batch of (seed, step, rank, world size) is a pure function; ranks split one global batch."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leto.training.data import Sampler, split_rows

TOKENS = np.frombuffer(bytes(range(256)) * 40, dtype=np.uint8)


@given(rows=st.integers(1, 64), world=st.integers(1, 16))
def test_rank_slices_partition_the_global_batch(rows: int, world: int) -> None:
    slices = [split_rows(rows, world, r) for r in range(world)]
    assert [i for s in slices for i in s] == list(range(rows))
    assert max(map(len, slices)) - min(map(len, slices)) <= 1


@settings(max_examples=30)
@given(seed=st.integers(0, 2**32 - 1), step=st.integers(0, 10**6), world=st.integers(1, 8))
def test_batch_is_a_pure_function_and_independent_of_world_size(seed: int, step: int, world: int) -> None:
    s1, s2 = Sampler(TOKENS, 16, 8, seed), Sampler(TOKENS, 16, 8, seed)
    whole_x, whole_y, w = s1.batch(step, 0, 1)
    assert w == 1.0
    parts = [s2.batch(step, r, world) for r in range(world)]
    assert torch.equal(torch.cat([p[0] for p in parts]), whole_x)
    assert torch.equal(torch.cat([p[1] for p in parts]), whole_y)
    assert abs(sum(p[2] for p in parts) - 1.0) < 1e-12
    assert torch.equal(whole_x[:, 1:], whole_y[:, :-1])  # targets are inputs shifted by one


def test_different_steps_and_seeds_give_different_batches() -> None:
    s = Sampler(TOKENS, 16, 8, seed=0)
    assert not torch.equal(s.batch(0, 0, 1)[0], s.batch(1, 0, 1)[0])
    assert not torch.equal(s.batch(0, 0, 1)[0], Sampler(TOKENS, 16, 8, seed=1).batch(0, 0, 1)[0])
