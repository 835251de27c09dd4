"""The trainer's sharded state and the one flatten/digest, in one process (no job)."""

from __future__ import annotations

import pytest
import torch

from leto.baselines.torchft_job import digest as torchft_digest
from leto.recovery.rebuild import RecoveryError
from leto.training.flat import state_digest
from leto.training.optim import AdamW
from leto.training.param_groups import ParamGroups
from leto.training.shard import STATE_NAMES, ShardedState

CHUNK = 8


def _state(shards: int, **kw) -> tuple[ShardedState, list[torch.nn.Parameter]]:
    torch.manual_seed(0)
    params = list(torch.nn.Linear(5, 7).parameters())  # 42 elements
    opt = AdamW(lr=1e-2)
    flags = {"protection": True, "replicated_grads": False, "protect_every": 1, **kw}
    return ShardedState(params, ParamGroups(params, opt, []), CHUNK, torch.device("cpu"), shards, **flags), params


def test_parameters_become_views_of_one_padded_buffer() -> None:
    s, params = _state(4)
    assert s.geometry.n_chunks == 2 and s.flat_param.numel() == 4 * 2 * CHUNK  # 42 elements, 64 with padding
    with torch.no_grad():
        params[0].add_(1.0)
    assert torch.equal(s.flat_param[: params[0].numel()], params[0].detach().reshape(-1))
    assert params[1].grad.data_ptr() == s.flat_grad[params[0].numel()].data_ptr()


def test_cutting_the_whole_state_into_another_world_size_keeps_every_element() -> None:
    s, _ = _state(4)
    g = s.geometry
    full = torch.randn(4, g.n_chunks, 3, g.chunk_elems)
    rows = full.transpose(1, 2).reshape(4, 3, -1).transpose(0, 1).reshape(3, -1)[:, : s.numel]
    parts = []
    for rank in range(3):
        shard, params = s.cut(full, 3, rank)
        assert shard.shape == (s.geometry_for(3).n_chunks, 3, CHUNK)
        parts.append(shard.transpose(0, 1).reshape(3, -1))
        assert torch.equal(params, rows[0])
    assert torch.equal(torch.cat(parts, dim=1)[:, : s.numel], rows)


def test_a_shard_of_the_wrong_shape_is_refused() -> None:
    s, _ = _state(4)
    with pytest.raises(RecoveryError, match="shape"):
        s.install(torch.zeros(3, 3, CHUNK), 1, 0)


def test_a_survivor_finishes_the_update_of_the_step_whose_gradients_it_holds() -> None:
    s, _ = _state(2)
    s.take_master(1)
    s.gbufs[1].normal_()
    s.gbuf_step[1] = 1
    assert s.reachable_steps() == {0, 1}
    want = torch.empty_like(s.state)
    for c in range(s.n_chunks):
        s.update_chunk(s.bufs[0][c], s.gbufs[1][c], want[c], 1, s.offset_of(c))
    s.bring_to(1)
    s.step = 1
    assert torch.equal(s.state_at(1), want) and s.buf_step == [0, 1]


def test_a_staged_reshard_replaces_the_shard_only_once_its_generation_is_protected() -> None:
    s, _ = _state(4)
    s.take_master(2)
    shard, params = s.cut(torch.zeros(4, s.n_chunks, 3, CHUNK), 3, 1)
    s.stage_reshard(5, 3, 1, shard, params, 7)
    s.settle_reshard(4)  # another generation committed: the staged state is dropped
    assert not s.resharding and s.rank == 2 and s.geometry == s.geometry_for(4)
    s.stage_reshard(5, 3, 1, shard, params, 7)
    s.settle_reshard(5)
    assert s.rank == 1 and s.step == 7 and s.geometry == s.geometry_for(3)


def test_the_digest_is_the_one_every_system_reports() -> None:
    """The torchft baseline and the trainer hash through `state_digest`; its value is pinned
    (the value of the two former implementations), so digests compare across versions too."""
    flat = torch.arange(10, dtype=torch.float32) / 10
    state = torch.arange(30, dtype=torch.float32).view(3, 10) - 7.5
    want = "5df9585dfb881cddd4e3f00f38bc13aefd2364973ebebeda8514dd8d4500360a"
    assert torchft_digest(9, flat, state) == want
    assert state_digest(9, {"params": flat, **dict(zip(STATE_NAMES, state, strict=True))}) == want
