"""The DP x PP x TP mesh: coordinates, layouts refused at launch, and its communicators across
real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, beyond_ci
from leto.config import JobConfig, MeshConfig
from leto.runtime.env import LOOPBACK, loopback_store, network_env
from leto.runtime.mesh import Mesh


def test_coordinates_of_a_4_rank_world_with_tp_2() -> None:
    meshes = [Mesh.of(r, 4, 2) for r in range(4)]
    assert [(m.dp_rank, m.tp_rank) for m in meshes] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [m.tp_group for m in meshes] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [m.dp_group for m in meshes] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert all((m.tp, m.dp, m.world_size) == (2, 2, 4) for m in meshes)
    assert [m.rank for m in meshes] == [0, 1, 2, 3]


def test_coordinates_of_an_8_rank_world_with_tp_4() -> None:
    m = Mesh.of(6, 8, 4)
    assert (m.tp, m.dp, m.tp_rank, m.dp_rank) == (4, 2, 2, 1)
    assert m.tp_group == (4, 5, 6, 7) and m.dp_group == (2, 6)
    for r in range(8):  # TP innermost: rank = dp_rank * tp + tp_rank
        m = Mesh.of(r, 8, 4)
        assert m.dp_rank * 4 + m.tp_rank == r == m.rank
        assert r in m.tp_group and r in m.dp_group
        assert m.tp_group[m.tp_rank] == r and m.dp_group[m.dp_rank] == r


def test_coordinates_of_an_8_rank_world_with_tp_2_and_pp_2() -> None:
    """DP outermost, then the stage, TP innermost: a replica (a pipeline) is 4 contiguous ranks."""
    meshes = [Mesh.of(r, 8, 2, 2) for r in range(8)]
    assert [(m.dp_rank, m.pp_rank, m.tp_rank) for m in meshes] == [
        (d, p, t) for d in range(2) for p in range(2) for t in range(2)
    ]
    m = meshes[5]  # replica 1, stage 0, TP rank 1
    assert m.tp_group == (4, 5) and m.pp_group == (5, 7) and m.dp_group == (1, 5)
    assert (m.slice, m.replica_ranks, m.world_size, m.rank) == (1, 4, 8, 5)
    for r, m in enumerate(meshes):
        assert m.rank == r and m.tp_group[m.tp_rank] == r and m.pp_group[m.pp_rank] == r
        assert m.dp_group[m.dp_rank] == r and r % 4 == m.slice


def test_tp_1_is_data_parallel_only() -> None:
    m = Mesh.of(2, 4, 1)
    assert (m.tp, m.dp, m.tp_rank, m.dp_rank) == (1, 4, 0, 2)
    assert m.tp_group == (2,) and m.dp_group == (0, 1, 2, 3)


@pytest.mark.parametrize(
    "rank, world, tp, pp",
    [(0, 4, 3, 1), (4, 4, 2, 1), (-1, 4, 2, 1), (0, 4, 0, 1), (0, 0, 1, 1), (0, 6, 2, 2), (0, 4, 1, 0)],
)
def test_a_bad_mesh_is_a_value_error(rank: int, world: int, tp: int, pp: int) -> None:
    with pytest.raises(ValueError):
        Mesh.of(rank, world, tp, pp)


def test_the_mesh_is_a_config_section_of_its_own() -> None:
    assert JobConfig().mesh == MeshConfig(tp=1)
    cfg = JobConfig(mesh=MeshConfig(tp=2))
    assert JobConfig.from_json(cfg.to_json()) == cfg
    assert JobConfig.from_dict({}).mesh.tp == 1  # a config written before the section


@pytest.mark.parametrize(
    "args, line",
    [
        (["train", "--tp", "3"], "leto train: error: --workers (4) must be a multiple of --tp (3)"),
        (["train", "--tp", "0"], "leto train: error: --tp must be at least 1, got 0"),
        (["train", "--pp", "0"], "leto train: error: --pp must be at least 1, got 0"),
        (
            ["train", "--workers", "6", "--tp", "2", "--pp", "2"],
            "leto train: error: --workers (6) must be a multiple of --tp x --pp (2 x 2 = 4)",
        ),
        (["train", "--pp", "5"], "leto train: error: --pp 5: model 'tiny' has 4 blocks, fewer than the stages"),
        (
            ["train", "--microbatches", "2"],
            "leto train: error: --microbatches is for a pipeline: it needs --pp 2 or more",
        ),
        (
            ["train", "--pp", "2", "--microbatches", "17"],
            "leto train: error: --microbatches 17 exceeds the 16 rows of a replica's batch (--rows 32 over 2 replicas)",
        ),
        (
            ["train", "--tp", "4", "--protection", "off"],
            "leto train: error: --tp 4: TP group 0 (ranks 0-3) spans nodes 0-1 of --nodes 2, and a TP group "
            "must lie inside one node; valid --nodes for --workers 4 --tp 4: 1",
        ),
        (
            ["run", "--workers", "6", "--nodes", "4", "--tp", "2", "--protection", "off", "examples/minimal.py"],
            "leto run: error: --tp 2: TP group 1 (ranks 2-3) spans nodes 1-2 of --nodes 4, and a TP group "
            "must lie inside one node; valid --nodes for --workers 6 --tp 2: 1, 3",
        ),
    ],
)
def test_a_bad_layout_is_refused_at_launch(launcher, tmp_path: Path, args: list[str], line: str) -> None:
    res = launcher.run(*args, "--run-dir", str(tmp_path / "r"), timeout=60)
    assert res.returncode == 2
    assert res.stderr.strip() == line
    assert not (tmp_path / "r" / "procs.json").exists()


def test_the_world_tp_and_dp_comms_of_a_4_rank_tp_2_world_reduce_within_their_groups() -> None:
    """Four real processes join generation 0's groups: an all-reduce of 10**rank over TP sums
    only its TP group's ranks, over DP only its DP group's."""
    got = _mesh_ranks(4, 2, 1)
    for r in range(4):
        m = Mesh.of(r, 4, 2)
        assert got[r]["sums"] == {
            "world": 1111,
            "tp": sum(10**q for q in m.tp_group),
            "dp": sum(10**q for q in m.dp_group),
        }
        assert got[r]["ranks"] == {"world": [r, 4], "tp": [m.tp_rank, 2], "dp": [m.dp_rank, 2]}


@beyond_ci
def test_the_pipeline_and_embedding_comms_of_a_tp_2_pp_2_world_reduce_within_their_groups() -> None:
    """Eight real processes (DP 2 x PP 2 x TP 2): over the pipeline an all-reduce of 10**rank
    sums the rank's stages of its replica at its TP coordinate; the embedding group is the
    first and the last stage of that pipeline; DP the same slice of both replicas."""
    got = _mesh_ranks(8, 2, 2)
    for r in range(8):
        m = Mesh.of(r, 8, 2, 2)
        want = {"world": sum(10**q for q in range(8))}
        for name in ("tp", "pp", "dp"):
            want[name] = sum(10**q for q in getattr(m, f"{name}_group"))
        want["embedding"] = sum(10**q for q in m.pp_group)  # two stages: the first is the last's neighbour
        assert got[r]["sums"] == want
        assert got[r]["ranks"]["pp"] == [m.pp_rank, 2] and got[r]["ranks"]["embedding"] == [m.pp_rank, 2]


def _mesh_ranks(world: int, tp: int, pp: int) -> dict[int, dict]:
    """Run `world` real processes of `tests/scripts/mesh_comms.py` on a fresh loopback store;
    what each printed, by rank. Whatever is left of them is killed and reaped."""
    store = loopback_store(60)
    env = dict(os.environ, **network_env(LOOPBACK))
    script = str(REPO / "tests" / "scripts" / "mesh_comms.py")
    procs = [
        subprocess.Popen(
            [sys.executable, script, f"{LOOPBACK}:{store.port}", str(r), str(world), str(tp), str(pp)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * world, [err for _, err in outs]
    return {r["rank"]: r for r in (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)}
