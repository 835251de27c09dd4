"""`leto bench recovery --tp 2`: every system that can runs the DP x TP mesh, the others are
skipped with the reason, and the rank kill and the node loss are measured side by side.

No test checks a wall-clock value: those depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from conftest import beyond_ci
from leto.bench import productivity, recovery, runs
from leto.bench.runs import System
from leto.errors import UsageError


def test_nodes_keep_tp_groups_inside_them() -> None:
    assert recovery.job_nodes(4, 1) == 2 and recovery.job_nodes(4, 2) == 2 and recovery.job_nodes(8, 4) == 2
    assert recovery.job_nodes(4, 4) == 1  # one TP group of 4: one node, so no node loss
    assert recovery.job_nodes(6, 2) == 1  # 3 ranks a node would cut TP group 1 (ranks 2-3) in two
    assert recovery.job_nodes(1, 1) == 1


def test_systems_without_tensor_parallelism_are_skipped_with_the_reason() -> None:
    assert recovery.mesh_skipped(1) == {}
    skipped = recovery.mesh_skipped(2)
    assert set(skipped) == {"torchft", "nvrx"}
    assert all("--tp 2" in why for why in skipped.values())


def test_a_mesh_that_does_not_fit_is_refused_before_any_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_run(*a: object, **kw: object) -> object:
        raise AssertionError("no job may run")

    monkeypatch.setattr(recovery, "run_all", no_run)
    with pytest.raises(UsageError, match="multiple of --tp"):
        recovery.main(argparse.Namespace(json=True, steps=8, trials=1, out=tmp_path, workers=4, model="tiny", tp=3))
    with pytest.raises(UsageError, match="--hosts"):
        recovery.main(argparse.Namespace(hosts=3, tp=2, workers=4, model="tiny"))
    with pytest.raises(UsageError, match="--tp"):
        productivity.main(argparse.Namespace(steps=8, trials=1, out=tmp_path, workers=4, model="tiny", tp=2))


@pytest.mark.parametrize("pp", [1, 2])
def test_every_system_gets_the_mesh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pp: int) -> None:
    """Leto's job is built with the mesh, and a baseline is asked for it (not run here); with
    pipeline stages, both get the micro-batches too."""
    seen: dict[str, object] = {}

    def leto_job(config: object) -> int:
        seen["leto"] = config
        return 0

    def baseline(system: str, **kw: object) -> dict:
        seen[system] = kw
        return {"exit_code": 0}

    monkeypatch.setattr(runs, "run_job", leto_job)
    monkeypatch.setattr(runs, "run_baseline", baseline)
    cfg = runs.JobConfig(tp=2) if pp == 1 else runs.JobConfig(workers=8, tp=2, pp=pp, microbatches=4)
    for system in (System("leto", "leto", 1), System("checkpoint-restart", "checkpoint-restart")):
        runs.run_system(system, cfg, tmp_path / system.name, runs.NoInjector(), limit_s=30)
    job = seen["leto"]
    assert (job.mesh.tp, job.mesh.pp, job.training.workers) == (2, pp, cfg.workers)  # type: ignore[attr-defined]
    assert ("--microbatches" in job.training.command) == (pp > 1)  # type: ignore[attr-defined]
    kw = seen["checkpoint-restart"]
    assert (kw["tp"], kw.get("pp", 1), kw.get("microbatches")) == (2, pp, 4 if pp > 1 else None)  # type: ignore[index, attr-defined]
    runs.run_system(System("memory-restart", "memory-restart"), runs.JobConfig(), tmp_path / "m", runs.NoInjector(), 30)
    assert "tp" not in seen["memory-restart"]  # type: ignore[operator]  # a DP-only job is asked as before
    assert runs.state_bytes_per_rank("tiny", 4, 2) > runs.state_bytes_per_rank("tiny", 4)  # a slice's shard over 2


def test_the_table_prints_the_mesh_and_the_ratio_to_checkpoint_restart(capsys: pytest.CaptureFixture[str]) -> None:
    sys_ = lambda x: {"recovery_s": x, "regain_s": x, "detect_s": 0.1, "restore_s": 0.1, "lost_steps": 0}  # noqa: E731
    section = {
        "what": "SIGKILL of rank 1",
        "systems": {
            "leto": {**sys_(1.0), "trials_with_recovery": 1, "trials": [{}]},
            "checkpoint-restart": {**sys_(8.0), "trials_with_recovery": 1, "trials": [{}]},
            "torchft": {"status": "skipped: runs no tensor-parallel job (--tp 2)"},
        },
        "speedup": {"checkpoint-restart": 8.0, "torchft": None},
    }
    cfg = {"workers": 4, "nodes": 2, "tp": 2, "dp": 2, "model": "tiny", "steps": 16, "kill_step": 5, "trials": 1}
    report = {
        "config": {**cfg, "window": 3, "tolerance": 1.25},
        **section,
        "node_loss": {**section, "speedup": {"checkpoint-restart": 6.5}},
        "plots": [],
        "json": "r.json",
    }
    recovery.print_table(report)
    text = capsys.readouterr().out
    assert "4 workers (--tp 2: DP 2 x TP 2) on 2 nodes" in text
    assert "torchft: skipped: runs no tensor-parallel job (--tp 2)" in text
    assert "checkpoint-restart's recovery / Leto's on the same mesh: worker SIGKILL 8.0x, whole-node loss 6.5x" in text


# ----- one short real run: Leto and checkpoint-restart on DP 2 x TP 2, a rank kill and a node loss
@beyond_ci
def test_recovery_bench_tp2_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(
        recovery,
        "systems_for",
        lambda failure: [System(s, s, 1) for s in ("leto", "checkpoint-restart", "torchft", "nvrx")],
    )
    args = argparse.Namespace(json=True, steps=16, trials=1, out=tmp_path / "out", workers=4, model="tiny", tp=2)
    code = recovery.main(args)
    doc = json.loads(capsys.readouterr().out)
    assert (doc["config"]["tp"], doc["config"]["dp"], doc["config"]["nodes"]) == (2, 2, 2)
    assert code == (0 if doc["systems"]["leto"]["recovery_s"] is not None else 1)
    for section in (doc, doc["node_loss"]):
        for name in ("torchft", "nvrx"):
            assert section["systems"][name]["status"] == "skipped: runs no tensor-parallel job (--tp 2)"
            assert section["speedup"][name] is None
        for name in ("leto", "checkpoint-restart"):
            s = section["systems"][name]
            assert s["trials_ok"] == 1, s["trials"]
            trial = s["trials"][0]
            assert trial["regain_s"] is not None and trial["regain_s"] > trial["detect_s"] > 0
            config = json.loads((Path(trial["run_dir"]) / "config.json").read_text())
            assert config["mesh"]["tp"] == 2  # the job ran as the mesh
        leto, cr = section["systems"]["leto"], section["systems"]["checkpoint-restart"]
        assert leto["lost_steps"] == 0 and leto["trials"][0]["tier"] is not None  # in place, from protection
        assert cr["lost_steps"] > 0 or cr["trials"][0]["ckpt_every"] == 1  # restarted from a checkpoint
        if leto["recovery_s"] is not None and cr["recovery_s"] is not None:
            assert section["speedup"]["checkpoint-restart"] == pytest.approx(
                cr["recovery_s"] / leto["recovery_s"], abs=0.01
            )
    assert doc["state_bytes_per_rank"] == runs.state_bytes_per_rank("tiny", 4, 2)
