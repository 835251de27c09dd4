"""`leto bench recovery` and `leto bench overhead` with `--pp`: the pipeline mesh's protection
accounting (each rank's shard covers its stage's slice, padded to the largest stage), the
checkpoint-restart baselines on the same mesh, and the flags refused before any job runs.

No test checks a wall-clock value: those depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import beyond_ci
from leto import cli
from leto.baselines import ckpt_job
from leto.baselines.restart import BaselineSpec, RestartSupervisor, _job_config, run_baseline
from leto.bench import overhead, recovery, runs
from leto.bench.mesh import mesh_elements, shard_accounting
from leto.bench.runs import System
from leto.errors import UsageError
from leto.training.model import GPT, PRESETS, tensor_parallel_gpt
from leto.training.pipeline import gpt_pipeline
from leto.training.tensor_parallel import PendingGroup

ELEMS = overhead.DEFAULT_CHUNK_BYTES // 12


# ----- the accounting
def test_a_pipeline_slice_by_hand() -> None:
    """tiny (4 blocks) in 2 stages: stage 0 holds the embeddings and blocks 0-1, stage 1 blocks
    2-3, the final LayerNorm and its own copy of the tied embedding; stage 0 is the larger by the
    position embedding less the LayerNorm, which is what each stage-1 rank's shard is padded by."""
    c = PRESETS["tiny"]
    e, model = c.n_embd, mesh_elements("tiny").model
    m = mesh_elements("tiny", 1, 2)
    assert m.pp == 2 and m.model == model and m.tied == c.vocab_size * e
    (s0, r0), (s1, r1) = m.stages
    assert s0 + s1 == model + m.tied and r0 == r1 == 0  # no TP: nothing replicated over a TP group
    assert s0 - s1 == c.block_size * e - 2 * e  # wpe against ln_f (weight and bias)
    assert m.slice == s0 and m.copies == m.tied and m.stage_padding == s0 - s1


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2), (2, 1), (1, 4)])
def test_elements_per_rank_add_up_to_the_model_with_copies_and_padding_counted(tp: int, pp: int) -> None:
    m = mesh_elements("tiny", tp, pp)
    model = mesh_elements("tiny").model
    # a replica's ranks hold the model once, the TP-replicated parameters once more per extra TP
    # rank and the last stage's tied copy once more (per TP rank, replicated over TP)
    assert m.held == tp * sum(n for n, _ in m.stages) == model + m.copies
    assert m.copies == (tp - 1) * sum(r for _, r in m.stages) + m.tied
    assert m.stage_padding == sum(m.slice - n for n, _ in m.stages) * tp >= 0
    workers = 2 * tp * pp
    a = shard_accounting(m, workers, ELEMS)
    assert a["dp"] == 2 and a["shard_elements_per_rank"] % ELEMS == 0
    assert a["shard_elements_per_rank"] * 2 >= m.slice > (a["shard_elements_per_rank"] - ELEMS) * 2
    assert a["protected_elements"] == workers * a["shard_elements_per_rank"]
    assert a["protected_elements"] == (
        model + a["copies_elements"] + a["stage_padding_elements"] + a["chunk_padding_elements"]
    )
    assert a["chunk_padding_elements"] >= 0
    assert runs.state_bytes_per_rank("tiny", workers, tp, pp) == a["shard_elements_per_rank"] * 12


@pytest.mark.parametrize("tp", [1, 2])
def test_the_layout_is_the_trainers_largest_stage(tp: int) -> None:
    """The bench's slice is what the trainer lays every shard out for (`Pipeline.largest_stage`)."""

    def make() -> GPT:
        model = GPT(PRESETS["tiny"])
        if tp > 1:
            tensor_parallel_gpt(model, PendingGroup(0, tp))
        return model

    with torch.device("meta"):
        largest = gpt_pipeline(make, 2, 4).largest_stage()
    assert mesh_elements("tiny", tp, 2).slice == largest


def test_overhead_accounting_of_the_pipeline_mesh(capsys: pytest.CaptureFixture[str]) -> None:
    lay, numel = overhead.job_layout("tiny", 8, 2, (1, 1), tp=2, pp=2)
    m = mesh_elements("tiny", 2, 2)
    assert numel == m.model and lay.world_size == 8
    assert lay.geometry.n_chunks == -(-m.slice // (2 * ELEMS))  # the largest stage's slice over a DP group of 2
    f = overhead.mesh_figures(lay, m)
    assert (f["tp"], f["pp"], f["dp"]) == (2, 2, 2)
    assert f["stage_slice_elements"] == [n for n, _ in m.stages] and f["stage_padding_elements"] > 0
    assert f["protected_elements"] == 8 * lay.geometry.n_chunks * ELEMS
    assert f["state_bytes_per_rank"] == lay.geometry.n_chunks * overhead.DEFAULT_CHUNK_BYTES
    tp_only = overhead.mesh_figures(*[overhead.job_layout("tiny", 4, 2, (1, 1), tp=2)[0], mesh_elements("tiny", 2)])
    assert f["copies_elements"] > tp_only["copies_elements"]  # the tied copy on top of TP's replicas
    cost = overhead.memory_cost("tiny", 8, 2, (1, 1), tp=2, pp=2)
    assert cost["protected_elements"] == f["protected_elements"]
    overhead._print_mesh({"mesh": f, "workers": 8})
    text = capsys.readouterr().out
    assert f"stage slices {m.stages[0][0]:,} / {m.stages[1][0]:,} elements" in text
    assert f"stage padding ({f['stage_padding_elements']:,})" in text
    assert f"the last stage's copy of the tied embedding {m.tied:,}" in text


# ----- the flags
def bench(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = cli.main(["bench", *argv])
    return code, capsys.readouterr().err


def test_bad_pp_is_refused_before_any_job(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    def no_job(*a: object, **kw: object) -> object:
        raise AssertionError("no job may run")

    monkeypatch.setattr(recovery, "run_all", no_job)
    monkeypatch.setattr(overhead, "_measure", no_job)
    for what in ("recovery", "overhead"):
        code, err = bench(capsys, what, "--workers", "8", "--tp", "2", "--pp", "3")
        assert code == 2 and "--workers (8) must be a multiple of --tp x --pp (2 x 3 = 6)" in err
        code, err = bench(capsys, what, "--pp", "0")
        assert code == 2 and "--pp must be at least 1, got 0" in err
        code, err = bench(capsys, what, "--workers", "8", "--pp", "8")
        assert code == 2 and "--pp 8: 4 blocks do not split into 8 pipeline stages" in err
    code, err = bench(capsys, "recovery", "--workers", "32", "--pp", "2")
    assert code == 2 and "--pp 2 runs 4 micro-batches, more than the 2 rows of a replica's batch" in err
    for what in ("throughput", "productivity"):
        code, err = bench(capsys, what, "--pp", "2")
        assert code == 2 and "--pp 2: this benchmark runs data-parallel jobs only" in err
    with pytest.raises(UsageError, match="--tp and --pp are for one host"):
        recovery.main(argparse.Namespace(hosts=3, tp=1, pp=2, workers=4, model="tiny"))


def test_systems_without_a_pipeline_are_skipped_with_the_reason() -> None:
    assert recovery.mesh_skipped(1, 2) == {
        k: "skipped: runs no pipeline-parallel job (--pp 2)" for k in ("nvrx", "torchft")
    }
    assert set(recovery.mesh_skipped(2, 2).values()) == {"skipped: runs no TP or PP job (--tp 2 --pp 2)"}
    assert recovery.job_nodes(8, 2, 2) == 2 and recovery.job_nodes(4, 1, 2) == 2
    assert recovery.job_nodes(4, 4, 2) == 1  # a TP group of 4 fills both halves of 4 ranks: one node


# ----- every system on the mesh
def test_the_restart_supervisor_runs_the_pipeline(tmp_path: Path) -> None:
    spec = BaselineSpec("checkpoint-restart", 8, 2, 10, tmp_path / "b", tp=2, pp=2, microbatches=4)
    assert "--microbatches 4" in " ".join(RestartSupervisor(spec).command())
    mesh = _job_config(["-m", "x"], spec).mesh
    assert (mesh.tp, mesh.pp) == (2, 2)


def test_a_checkpoint_keys_the_parameters_by_slice() -> None:
    """Ranks of different stages with the same TP coordinate hold different parameters: their key
    is the slice (rank % ranks per replica), not the TP rank."""
    keys = set()
    for rank in range(8):
        member = SimpleNamespace(rank=rank, replica_ranks=4, state=torch.zeros(1), flat_param=torch.zeros(1))
        keys |= {k for k in ckpt_job.DiskCheckpointer._state_dict(None, member, 0) if k.startswith("flat_param")}  # type: ignore[arg-type]
    assert keys == {f"flat_param/slice{s}" for s in range(4)}


def test_the_table_names_the_mesh_and_the_configurations(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = runs.JobConfig(workers=8, tp=2, pp=2, microbatches=4)
    sys_ = lambda x: {"recovery_s": x, "regain_s": x, "detect_s": 0.1, "restore_s": 0.1, "lost_steps": 0}  # noqa: E731
    skipped = recovery.mesh_skipped(2, 2)
    section = {
        "what": "SIGKILL of rank 1",
        "systems": {
            "leto": {**sys_(1.0), "trials_with_recovery": 1, "trials": [{}]},
            "checkpoint-restart": {**sys_(12.0), "trials_with_recovery": 1, "trials": [{}], "ckpt_every": [7]},
            **{k: {"status": why} for k, why in skipped.items()},
        },
        "speedup": {"checkpoint-restart": 12.0},
    }
    report = {
        "config": {
            "workers": 8, "nodes": 2, "tp": 2, "pp": 2, "dp": 2, "microbatches": 4, "model": "tiny",
            "steps": 16, "kill_step": 5, "trials": 1, "window": 3, "tolerance": 1.25,
        },
        **section,
        "skipped": skipped,
        "state_bytes_per_rank": runs.state_bytes_per_rank("tiny", 8, 2, 2),
        "mesh": shard_accounting(mesh_elements("tiny", 2, 2), 8, ELEMS),
        "configurations": recovery.configurations(cfg, (1, 1)),
        "plots": [],
        "json": "r.json",
    }  # fmt: skip
    recovery.print_table(report)
    text = capsys.readouterr().out
    assert "8 workers (--tp 2 --pp 2: DP 2 x PP 2 x TP 2), 4 micro-batches on 2 nodes" in text
    assert "torchft: skipped: runs no TP or PP job (--tp 2 --pp 2)" in text
    assert "checkpoint-restart's recovery / Leto's on the same mesh: worker SIGKILL 12.0x" in text
    assert "checkpoint-restart: DCP checkpoint of every rank's shard to local disk every K = 7 steps" in text
    assert "torchft: skipped" in text and "  torchft: " not in text.split("systems:")[1]  # what ran is named
    assert "same mesh (8 workers, DP 2 x PP 2 x TP 2)" in text
    assert "leto: in place" in text and "--ec 1+1" in text
    assert "stage padding 15,872" in text  # tp x (wpe - ln_f) of tiny


# ----- real jobs
def test_checkpoint_restart_of_a_pipeline_resumes_to_the_failure_free_digest(tmp_path: Path) -> None:
    """DP 2 x PP 2: a stage-1 rank is SIGKILLed, fresh processes load every rank's shard and its
    stage's parameters from the DCP checkpoint (and from /dev/shm, memory-restart), and the job
    ends with the digest of the run without a failure."""
    job = {"workers": 4, "nodes": 2, "steps": 8, "seed": 0, "model": "tiny", "mtbf_s": None, "pp": 2}
    job.update(microbatches=4, timeout_s=30.0)
    free = run_baseline("checkpoint-restart", run_dir=tmp_path / "free", inject=None, ckpt_every=3, **job)
    assert free["exit_code"] == 0 and free["restarts"] == 0 and free["steps"] == 8
    kill = [{"kind": "kill", "rank": 3, "node": None, "step": 4}]
    for system in ("checkpoint-restart", "memory-restart"):
        s = run_baseline(system, run_dir=tmp_path / system, inject=kill, ckpt_every=3, **job)
        assert s["exit_code"] == 0 and s["restarts"] == 1, system
        (rec,) = s["recoveries"]
        if system == "checkpoint-restart":  # the checkpoint of step 3, the newest before the kill
            assert rec["restored_step"] == 3, rec
        else:  # every step is copied: at most the step the killed rank had not yet copied is lost
            assert rec["failed_at_step"] - rec["restored_step"] in (0, 1), rec
        assert s["digest"] == free["digest"], system
        config = json.loads((tmp_path / system / "config.json").read_text())
        assert config["mesh"]["pp"] == 2


@beyond_ci
def test_recovery_bench_pp2_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`leto bench recovery --tp 1 --pp 2 --workers 4`, Leto and checkpoint-restart: a rank kill
    and a node loss, each recovered on the pipeline mesh."""
    monkeypatch.setattr(
        recovery,
        "systems_for",
        lambda failure: [System(s, s, 1) for s in ("leto", "checkpoint-restart", "torchft", "nvrx")],
    )
    args = argparse.Namespace(json=True, steps=16, trials=1, out=tmp_path / "out", workers=4, model="tiny", tp=1, pp=2)
    code = recovery.main(args)
    doc = json.loads(capsys.readouterr().out)
    assert (doc["config"]["pp"], doc["config"]["dp"], doc["config"]["microbatches"]) == (2, 2, 4)
    assert code == (0 if doc["systems"]["leto"]["recovery_s"] is not None else 1)
    assert doc["mesh"]["stage_padding_elements"] > 0 and doc["mesh"]["tied_copy_elements"] > 0
    assert doc["state_bytes_per_rank"] == runs.state_bytes_per_rank("tiny", 4, 1, 2)
    for section in (doc, doc["node_loss"]):
        for name in ("torchft", "nvrx"):
            assert section["systems"][name]["status"] == "skipped: runs no pipeline-parallel job (--pp 2)"
        for name in ("leto", "checkpoint-restart"):
            s = section["systems"][name]
            assert s["trials_ok"] == 1, s["trials"]
            config = json.loads((Path(s["trials"][0]["run_dir"]) / "config.json").read_text())
            assert config["mesh"]["pp"] == 2
        assert section["systems"]["leto"]["trials"][0]["tier"] is not None  # in place, from protection
