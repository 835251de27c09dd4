"""Specification tests for leto.protection.placement."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leto.protection.codec import make_code
from leto.protection.placement import (
    Stripe,
    lost_summary,
    padded_size,
    place_stripes,
    segment_bounds,
)

layouts = st.tuples(st.integers(1, 5), st.integers(1, 3), st.integers(1, 3)).map(
    lambda t: (t[0], t[1], t[2] * (t[0] + t[1]))  # (k, m, num_nodes)
)
FAST = settings(max_examples=30, deadline=None)


@FAST
@given(layout=layouts)
def test_stripe_shape_and_roles(layout: tuple[int, int, int]) -> None:
    k, m, num_nodes = layout
    stripes = place_stripes(num_nodes, k, m)
    assert len(stripes) == num_nodes
    assert [s.index for s in stripes] == list(range(num_nodes))
    for s in stripes:
        assert len(s.data_nodes) == k and len(s.parity_nodes) == m
        assert not set(s.data_nodes) & set(s.parity_nodes)
        assert len(set(s.nodes)) == k + m
        group = {node // (k + m) for node in s.nodes}
        assert len(group) == 1  # a stripe stays within its group


@FAST
@given(layout=layouts)
def test_every_segment_covered_exactly_once(layout: tuple[int, int, int]) -> None:
    k, m, num_nodes = layout
    stripes = place_stripes(num_nodes, k, m)
    covered = Counter((node, s.segment_of(node)) for s in stripes for node in s.data_nodes)
    assert covered == Counter({(node, seg): 1 for node in range(num_nodes) for seg in range(k)})
    parity_load = Counter(node for s in stripes for node in s.parity_nodes)
    assert parity_load == Counter({node: m for node in range(num_nodes)})  # overhead m/k


@FAST
@given(layout=layouts)
def test_survives_up_to_m_losses_in_a_group(layout: tuple[int, int, int]) -> None:
    k, m, num_nodes = layout
    n = k + m
    stripes = place_stripes(num_nodes, k, m)
    for group in range(num_nodes // n):
        nodes = range(group * n, (group + 1) * n)
        for count in range(m + 1):
            for lost in itertools.combinations(nodes, count):
                summary = lost_summary(stripes, set(lost))
                assert "not survivable" not in summary, summary
        # One loss per group everywhere at once is also fine.
    assert "not survivable" not in lost_summary(stripes, {g * n for g in range(num_nodes // n)})


@FAST
@given(layout=layouts, data=st.data())
def test_losing_m_plus_one_of_a_stripe_is_fatal(layout: tuple[int, int, int], data: st.DataObject) -> None:
    k, m, num_nodes = layout
    stripes = place_stripes(num_nodes, k, m)
    victim = data.draw(st.sampled_from(stripes))
    lost = set(data.draw(st.permutations(victim.nodes))[: m + 1])
    summary = lost_summary(stripes, lost)
    assert f"stripe {victim.index} " in summary and "not survivable" in summary


def test_rotation_layout_2_plus_1() -> None:
    assert place_stripes(3, 2, 1) == [
        Stripe(0, (0, 1), (2,), (0, 1)),
        Stripe(1, (1, 2), (0,), (0, 1)),
        Stripe(2, (2, 0), (1,), (0, 1)),
    ]
    assert place_stripes(6, 2, 1)[3] == Stripe(3, (3, 4), (5,), (0, 1))


@pytest.mark.parametrize(("num_nodes", "k", "m"), [(4, 2, 1), (5, 2, 2), (1, 1, 1), (0, 2, 1)])
def test_bad_node_count_explains(num_nodes: int, k: int, m: int) -> None:
    with pytest.raises(ValueError) as info:
        place_stripes(num_nodes, k, m)
    assert f"{num_nodes} nodes" in str(info.value) and f"k+m={k + m}" in str(info.value)


def test_bad_node_count_suggests_specs() -> None:
    with pytest.raises(ValueError, match="3\\+1"):
        place_stripes(4, 2, 1)


@FAST
@given(nbytes=st.integers(0, 10_000), k=st.integers(1, 8), align=st.sampled_from([1, 2, 8, 64]))
def test_segment_bounds(nbytes: int, k: int, align: int) -> None:
    bounds = segment_bounds(nbytes, k, align=align)
    assert len(bounds) == k
    length = bounds[0][1] - bounds[0][0]
    assert all(end - start == length for start, end in bounds)
    assert bounds[0][0] == 0 and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert length % align == 0
    assert nbytes <= padded_size(nbytes, k, align=align) == k * length < nbytes + k * align + k


def test_end_to_end_recovery_of_lost_nodes() -> None:
    """Encode every stripe from node segments, lose m nodes, rebuild them."""
    k, m, num_nodes, nbytes = 3, 2, 5, 1001
    code = make_code(k, m)
    rng = np.random.default_rng(0)
    size = padded_size(nbytes, k)
    bounds = segment_bounds(nbytes, k)
    memory = {node: np.zeros(size, np.uint8) for node in range(num_nodes)}
    for buf in memory.values():
        buf[:nbytes] = rng.integers(0, 256, nbytes, dtype=np.uint8)
    seg = lambda node, s: memory[node][bounds[s][0] : bounds[s][1]]  # noqa: E731
    stripes = place_stripes(num_nodes, k, m)
    parity = {s.index: [np.zeros(bounds[0][1], np.uint8) for _ in range(m)] for s in stripes}
    for s in stripes:
        for p, node in enumerate(s.data_nodes):  # distributed: each node contributes
            code.contribute(p, seg(node, s.segment_of(node)), parity[s.index])
    lost = {1, 3}
    assert "not survivable" not in lost_summary(stripes, lost)
    for node in lost:
        rebuilt = np.zeros(size, np.uint8)
        for s in stripes:
            if node not in s.data_nodes:
                continue
            available = {s.nodes.index(d): seg(d, s.segment_of(d)) for d in s.data_nodes if d not in lost}
            available.update({s.nodes.index(pn): parity[s.index][j] for j, pn in enumerate(s.parity_nodes)})
            for pn in set(s.parity_nodes) & lost:
                del available[s.nodes.index(pn)]
            block = code.decode(available)[s.data_nodes.index(node)]
            start, end = bounds[s.segment_of(node)]
            rebuilt[start:end] = block
        np.testing.assert_array_equal(rebuilt, memory[node])
