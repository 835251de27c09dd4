"""The keeper's two data planes: the native one (`dataplane.c`) serves the layouts whose tier-2
contributions are the chunks themselves and that protect deltas only; the Python one serves
every layout. Both recover a lost node to the failure-free digest."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import JOB, check_recovered, reference_digest, train
from leto.protection import dataplane
from leto.protection.layout import Geometry, Layout

GEOMETRY = Geometry(n_chunks=2, chunk_elems=16)


def _layout(nodes: int, ec: tuple[int, int] | None, **kw: object) -> Layout:
    ranks = tuple(n for n in range(nodes) for _ in range(2))
    return Layout(0, 0, GEOMETRY, ranks, ec, **{"replicated_grads": True, **kw})  # type: ignore[arg-type]


def test_the_native_data_plane_is_built_with_the_package() -> None:
    assert dataplane.library() is not None, "the install did not build leto.protection._dataplane (a C compiler?)"


def test_a_library_built_from_other_constants_is_said_once_and_not_used(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A build older than its source (a record layout or a slot state changed since) would read
    the region and the wire wrongly: the keepers run their Python plane instead."""
    monkeypatch.setattr(dataplane, "_lib", None)
    monkeypatch.setattr(dataplane, "_unusable", None)
    monkeypatch.setattr(dataplane, "CONSTANTS", (*dataplane.CONSTANTS[:-1], 99))
    assert dataplane.library() is None and dataplane.library() is None
    err = capsys.readouterr().err
    assert err.count("cannot be used") == 1 and "reinstall the package" in err, err
    assert dataplane.serves(_layout(2, (1, 1))) is False


@pytest.mark.parametrize("offset", [0, 1, 13])
@pytest.mark.parametrize("nbytes", [0, 15, 64, 200, 4096 + 7])
def test_a_workers_native_staging_writes_old_xor_new_or_new_and_nothing_else(offset: int, nbytes: int) -> None:
    """Whatever the slot's alignment and the chunk's length (streaming stores cover whole aligned
    blocks; the head and tail are written byte by byte), the slot gets exactly the delta."""
    stage = dataplane.stager()
    assert stage is not None
    rng = np.random.default_rng(nbytes + offset)
    old, new = (rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(2))
    slot = np.full(nbytes + offset + 32, 0xA5, dtype=np.uint8)
    base = slot.ctypes.data + offset
    stage(base, old.ctypes.data, new.ctypes.data, nbytes)
    assert np.array_equal(slot[offset : offset + nbytes], old ^ new)
    assert (slot[:offset] == 0xA5).all() and (slot[offset + nbytes :] == 0xA5).all()
    stage(base, 0, new.ctypes.data, nbytes)
    assert np.array_equal(slot[offset : offset + nbytes], new)
    assert (slot[:offset] == 0xA5).all() and (slot[offset + nbytes :] == 0xA5).all()


def test_the_python_plane_stages_with_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dataplane.ENV_DATA_PLANE, "python")
    assert dataplane.stager() is None


@pytest.mark.parametrize(
    ("layout", "served"),
    [
        (_layout(2, (1, 1)), True),
        (_layout(4, (3, 1)), True),  # one parity block: every coefficient is 1
        (_layout(1, None), True),  # tier 1 only
        (_layout(4, (2, 2)), False),  # Reed-Solomon coefficients, and torn rows' pre-images
        (_layout(2, (1, 1), replicated_grads=False), False),  # gradients are staged too
        (_layout(2, (1, 1), protect_every=2), False),  # an interval keeps pre-images
    ],
)
def test_the_native_plane_serves_deltas_under_codes_of_one_parity_block(
    layout: Layout, served: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(dataplane.ENV_DATA_PLANE, raising=False)
    assert dataplane.serves(layout) is served
    monkeypatch.setenv(dataplane.ENV_DATA_PLANE, "python")
    assert dataplane.serves(layout) is False


@pytest.mark.parametrize("plane", ["native", "python"])
def test_each_data_plane_recovers_a_lost_node_to_the_failure_free_digest(
    launcher, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plane: str
) -> None:
    monkeypatch.setenv(dataplane.ENV_DATA_PLANE, plane)
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("LETO_TRACE", str(trace))
    digest = reference_digest(launcher, tmp_path, *JOB)
    res, s = train(launcher, tmp_path / "run", *JOB, "--inject", "node-kill:node=1:step=5")
    rec = check_recovered(res, s, digest, tmp_path / "run")[0]
    assert rec["tier"] == "tier2" and rec["failed_nodes"] == [1], rec
    ready = [json.loads(line) for line in trace.read_text().splitlines() if '"keeper_ready"' in line]
    assert ready and {r["data_plane"] for r in ready} == {plane}, ready
