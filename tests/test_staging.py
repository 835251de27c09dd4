"""Host staging: on the CPU a chunk's bytes are a view; through the staging buffers (the GPU
path: device-to-host copies) they are the same bytes, and a delta's two chunks coexist."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch

from leto.protection.staging import HostStaging, as_bytes


def test_cpu_chunks_are_views_not_copies() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = HostStaging(t[0].numel() * 4, torch.device("cpu")).host(t[1])
    assert np.shares_memory(b, t.numpy()) and b.tobytes() == t[1].numpy().tobytes()
    assert as_bytes(t[2]).tobytes() == t[2].numpy().tobytes()


def test_a_tensor_s_bytes_are_a_view_of_any_dtype_and_a_strided_one_has_none() -> None:
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6).requires_grad_()
    b = as_bytes(t[1])
    assert b.dtype == np.uint8 and b.tobytes() == t[1].detach().numpy().tobytes()
    assert np.shares_memory(b, t.detach().numpy())
    h = torch.arange(8, dtype=torch.bfloat16)  # no numpy dtype: still a view of its bytes
    assert as_bytes(h).tobytes() == h.view(torch.uint8).numpy().tobytes()
    with pytest.raises(ValueError, match=r"non-contiguous tensor of shape \(4,\) has no byte view"):
        as_bytes(t[:, 0])  # a column: its bytes are not one run, and a copy would not be the chunk


def test_a_cpu_chunk_s_view_is_made_once_and_always_shows_the_bytes_now_at_its_address() -> None:
    st = HostStaging(64, torch.device("cpu"))
    state = torch.zeros(4, 16)
    first = st.host(state[2])
    assert st.host(state[2]) is first  # the step asks for the same chunks every step
    state[2] = 7.0
    assert first.tobytes() == state[2].numpy().tobytes()  # a view, not a snapshot
    assert not np.shares_memory(st.host(state[1]), first)
    # another tensor at the address with the size (memory freed and allocated again, here a
    # numpy-backed tensor over the same bytes) is handed the view, which shows its bytes
    again = torch.from_numpy(state.numpy()[2].copy())
    state[2] = again + 1.0
    other = torch.from_numpy(state.numpy()[2])
    assert other.data_ptr() == state[2].data_ptr() and other is not state
    assert st.host(other) is first and first.tobytes() == (again + 1.0).numpy().tobytes()
    with pytest.raises(ValueError, match="non-contiguous"):
        st.host(torch.zeros(4, 16)[:, 0])
    temporary = torch.ones(16)
    st.host(temporary)
    gone = weakref.ref(temporary)
    del temporary
    assert gone() is None  # the table holds no chunk's memory alive (a decoded chunk, a resharded state)


def test_the_copying_path_gives_the_same_bytes_in_two_slots_at_once() -> None:
    old, new = torch.randn(256), torch.randn(256)
    st = HostStaging(256 * 4, torch.device("cpu"), copy=True)
    a, b = st.host(old, 0), st.host(new, 1)
    assert not np.shares_memory(a, old.numpy()) and not np.shares_memory(b, new.numpy())
    assert a.tobytes() == old.numpy().tobytes() and b.tobytes() == new.numpy().tobytes()  # both still valid
    delta = np.bitwise_xor(a, b)
    assert np.array_equal(np.bitwise_xor(delta, a), as_bytes(new))  # what the keeper folds in is exact


@pytest.mark.parametrize("copy", [False, True])
def test_a_chunks_address_is_where_its_host_bytes_lie_on_either_path(copy: bool) -> None:
    """The native staging copy reads the bytes by address: those `host` returned, for each slot."""
    old, new = torch.randn(256), torch.randn(256)
    st = HostStaging(256 * 4, torch.device("cpu"), copy=copy)
    a, b = st.host(old, 0), st.host(new, 1)
    assert (st.address(old, 0), st.address(new, 1)) == (a.ctypes.data, b.ctypes.data)


def test_a_chunk_larger_than_the_buffer_is_an_error_not_a_truncation() -> None:
    st = HostStaging(16, torch.device("cpu"), copy=True)
    with pytest.raises(ValueError, match="does not fit"):
        st.host(torch.zeros(8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (scripts/gpu-check.sh runs it)")
def test_device_chunks_reach_the_host_through_pinned_buffers() -> None:
    dev = torch.device("cuda")
    t = torch.randn(4, 1024, device=dev)
    st = HostStaging(1024 * 4, dev)
    assert st.bufs[0].is_pinned()
    assert st.host(t[2], 0).tobytes() == t[2].cpu().numpy().tobytes()
    assert as_bytes(t[3]).tobytes() == t[3].cpu().numpy().tobytes()
