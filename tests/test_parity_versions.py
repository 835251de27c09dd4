"""A keeper's applied step is the lowest version of any source chunk it holds parity of.

`Parity.applied_step` is asked after every fold (the commit barrier, the tier-2 receivers), so
it is kept up to date by the folds instead of scanning the version tables; it must always equal
the scan: the lowest of every tier-1 version and of every tier-2 version of a real chunk
(padding offsets of a stripe's segment have no source and never count).
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from leto.protection.layout import Geometry, Layout
from leto.protection.parity import Parity
from leto.protection.shm import KIND_DELTA, Region

# node 2 of this layout holds tier-2 parity of positions with padding offsets; node 0 of the
# second keeps tier-2 pre-images (m = 2)
CASES = [
    (Layout(0, 5, Geometry(3, 16), (0, 1, 1, 2, 2, 2), (2, 1), replicated_grads=True), 2),
    (Layout(0, 5, Geometry(3, 16), (0, 0, 1, 1, 2, 3), (2, 2), replicated_grads=True), 0),
]


@pytest.fixture(params=range(len(CASES)))
def parity(request: pytest.FixtureRequest) -> Iterator[Parity]:
    layout, node = CASES[request.param]
    region = Region(layout, f"pv-{uuid.uuid4().hex[:12]}", node, create=True)
    try:
        yield Parity(region, layout, node)
    finally:
        region.close()
        region.unlink()


def _scanned(parity: Parity) -> int:
    r = parity.region
    low = int(r["v1"].min())
    for (si, p), real in parity.real.items():
        if real.any():
            low = min(low, int(r[f"v2_{si}"][p][real].min()))
    return low


def test_the_applied_step_is_the_lowest_version_of_a_real_source_after_every_fold(parity: Parity) -> None:
    rng = random.Random(0)
    layout = parity.layout
    nbytes = layout.geometry.state_bytes
    body = np.zeros(nbytes, dtype=np.uint8)
    local = [(w, c) for w in range(parity.W) for c in range(layout.geometry.n_chunks)]
    positions = [(si, p) for si, (s, _) in parity.stripes.items() for p in range(len(s.data_nodes))]
    remote = [(si, p, i) for si, p in positions for i in range(layout.segment_len)]
    assert any(not parity.real[(si, p)][i] for si, p, i in remote), "the case has padding offsets"
    assert parity.applied_step() == _scanned(parity)
    for step in range(5, 9):  # every source folded once a step, in a shuffled order, padding too
        folds = [("local", x) for x in local] + [("remote", x) for x in remote]
        rng.shuffle(folds)
        for where, place in folds:
            if where == "local":
                w, c = place
                parity.fold_local(KIND_DELTA, step, w, c, step, body)
            else:
                si, p, i = place
                parity.fold_remote(KIND_DELTA, step, si, p, i, step, body)
            assert parity.applied_step() == _scanned(parity)
        assert parity.applied_step() == step
        assert parity.deltas_complete(step) and not parity.deltas_complete(step + 1)
