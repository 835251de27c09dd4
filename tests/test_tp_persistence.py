"""Persistent checkpoints of tensor-parallel jobs: each rank writes its shard of its TP slice
(each slice's first DP rank also the slice's parameters), the markers record tp, a job whose
processes are all SIGKILLed by PID resumes with `--resume` to the digest of a failure-free run,
another `--tp` is refused naming both, and the checkpoint-restart baseline restarts a TP job
after a worker's SIGKILL to the same digest."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import (
    Launcher,
    beyond_ci,
    events,
    processes_left,
    read_procs,
    reference_digest,
    step_records,
    summary,
    train,
    wait_for,
)
from leto.baselines.faults import kill_at_step
from leto.persistence import ckpt_format, loader, resume, safe_dcp
from leto.runtime import linux, plain

STEPS = 12
TP_JOB = ("--tp", "2", "--workers", "4", "--nodes", "2", "--spares", "0", "--steps", str(STEPS), "--seed", "3")
PERSIST = ("--persist", "on", "--persist-every", "3")


def kill_whole_job(run_dir: Path) -> None:
    """SIGKILL the controller, then every process of the job it leaves, each by (pid, start time)."""
    procs = read_procs(run_dir)
    controller = next(p for p in procs if p["role"] == "controller")
    os.kill(controller["pid"], signal.SIGKILL)
    for p in procs:
        if p["role"] != "controller":
            linux.signal_process(p["pid"], p.get("start"), signal.SIGKILL)
    wait_for(lambda: not processes_left(run_dir), 30, "the job's processes to die")


def tensor_in(part: Path, name: str) -> torch.Tensor:
    """Tensor `name` of the checkpoint part `part`."""
    size = safe_dcp.metadata(part).state_dict_metadata[name].size
    return safe_dcp.load({name: torch.empty(size)}, part)[name]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_killed_tp_job_resumes_to_the_failure_free_digest(launcher: Launcher, tmp_path: Path) -> None:
    digest = reference_digest(launcher, tmp_path, *TP_JOB)
    run_dir = tmp_path / "run"
    job = launcher.start("train", "--run-dir", str(run_dir), *TP_JOB, *PERSIST, run_dir=run_dir)
    wait_for(
        lambda: (
            (run_dir / "metrics.jsonl").exists()
            and any(e["step"] >= 6 for e in events(run_dir, "persist_commit"))
            or job.poll() is not None
        ),
        180,
        "a committed checkpoint at step 6",
    )
    assert job.poll() is None, "the job ended before it could be killed"
    kill_whole_job(run_dir)
    job.wait(timeout=30)
    last = max(r["step"] for r in step_records(run_dir))

    # the checkpoint: tp recorded, 4 parts, each TP slice's parameters in its DP rank 0's part
    ck = ckpt_format.complete(run_dir / "checkpoints")[0]
    assert (ck.world_size, ck.tp) == (4, 2)
    ckpt_format.verify(ck)
    assert json.loads((ck.path / ckpt_format.COMMIT).read_text())["tp"] == 2
    has_params = ["params" in safe_dcp.metadata(ckpt_format.part_dir(ck.path, r)).state_dict_metadata for r in range(4)]
    assert has_params == [True, True, False, False]
    params = [tensor_in(ckpt_format.part_dir(ck.path, t), "params") for t in range(2)]
    numel = params[0].numel()
    for t in range(2):  # a part's parameters are its slice's: the master weights of the slice's DP shards
        states = [tensor_in(ckpt_format.part_dir(ck.path, d * 2 + t), "state") for d in range(2)]
        master = torch.cat([st[:, 0, :].reshape(-1) for st in states])[:numel]
        assert torch.equal(params[t], master), t
    assert params[1].numel() == numel and not torch.equal(params[0], params[1])

    # another --tp is refused, naming both: by the command line, and by the checkpoint itself
    res = launcher.run("train", "--resume", str(run_dir), "--tp", "1", timeout=60)
    assert res.returncode == 2, res.stderr
    (error,) = [line for line in res.stderr.splitlines() if "error" in line]
    assert "--tp 1" in error and "--tp 2" in error, error
    fp = resume.fingerprint(json.loads((run_dir / "persist.json").read_text())["command"])
    with pytest.raises(ckpt_format.CheckpointError, match=r"--tp 2 and this job has --tp 1"):
        ckpt_format.choose(run_dir / "checkpoints", fp, print, tp=1)
    with pytest.raises(ckpt_format.CheckpointError, match=r"--tp 2 and this job has --tp 4"):
        loader.load(ck.path, ck.step, 0, 4, numel, 1, numel, tp=4)

    res, s = train(launcher, run_dir, "--resume", str(run_dir), *TP_JOB, *PERSIST)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert s["digest"] == digest and s["steps"] == STEPS
    assert s["resumed_from_step"] % 3 == 0 and 6 <= s["resumed_from_step"] <= last
    assert [r["step"] for r in step_records(run_dir)] == list(range(s["resumed_from_step"] + 1, STEPS + 1))
    assert not processes_left(run_dir)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_tp_checkpoint_loads_into_another_dp_size(tmp_path: Path) -> None:
    """Written by TP2 x DP3 (6 ranks), loaded by TP2 x DP2: each rank's shard is cut from the parts
    of its own slice only, and its parameters are its slice's."""
    import torch.distributed.checkpoint as dcp

    numel, chunk, tp = 1000, 64, 2
    full = [torch.randn(3, numel) for _ in range(tp)]  # each slice's (master, exp_avg, exp_avg_sq)
    ck = ckpt_format.step_dir(tmp_path, 5)

    def shards(dp: int, t: int) -> tuple[int, list[torch.Tensor]]:
        n_chunks = -(-numel // (dp * chunk))
        size = n_chunks * chunk
        padded = torch.zeros(3, dp * size)
        padded[:, :numel] = full[t]
        return n_chunks, [
            padded[:, d * size : (d + 1) * size].reshape(3, n_chunks, chunk).transpose(0, 1).contiguous()
            for d in range(dp)
        ]

    committed = []
    for r in range(6):
        d, t = divmod(r, tp)
        sd = {
            "state": shards(3, t)[1][d],
            "step": torch.tensor(5),
            "extra": torch.frombuffer(bytearray(plain.dumps({"rank": r})), dtype=torch.uint8),
        }
        if d == 0:
            sd["params"] = full[t][0].clone()
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(ckpt_format.part_dir(ck, r))), no_dist=True)
        committed.append(ckpt_format.mark_part(ck, r, 5, 6, "fp", tp))
    assert committed == [False] * 5 + [True]
    (found,) = ckpt_format.complete(tmp_path)
    assert (found.world_size, found.tp) == (6, 2)
    for r in range(4):
        d, t = divmod(r, tp)
        n_chunks, want = shards(2, t)
        got = loader.load(ck, 5, r, 4, numel, n_chunks, chunk, tp)
        assert torch.equal(got.shard, want[d]) and torch.equal(got.params, full[t][0]) and got.extra == {"rank": r}


def test_markers_of_a_tp_1_job_do_not_name_tp(tmp_path: Path) -> None:
    """A job without tensor parallelism writes the markers it always wrote; a marker whose tp
    disagrees with the commit's leaves the checkpoint torn."""
    ck = ckpt_format.step_dir(tmp_path, 5)
    for r in range(2):
        ckpt_format.part_dir(ck, r).mkdir(parents=True)
        (ckpt_format.part_dir(ck, r) / "data").write_bytes(b"x")
        ckpt_format.mark_part(ck, r, 5, 2, "fp")
    assert "tp" not in json.loads((ck / ckpt_format.COMMIT).read_text())
    assert "tp" not in json.loads(ckpt_format.part_marker(ck, 0).read_text())
    assert [c.tp for c in ckpt_format.complete(tmp_path)] == [1]
    marker = ckpt_format.part_marker(ck, 1)
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "tp": 2}))
    assert ckpt_format.complete(tmp_path) == []


@beyond_ci
@pytest.mark.parametrize("mode", ["disk", "memory"])
def test_the_checkpoint_baseline_restarts_a_tp_job_to_the_failure_free_digest(
    launcher: Launcher, tmp_path: Path, mode: str
) -> None:
    """The checkpoint-restart baselines' job with --tp 2 (DCP every 4 steps, or Gemini-like
    memory every step): a worker SIGKILLed by PID stops the job (protection off); a fresh job on
    the same mesh loads each rank's shard and its slice's parameters from the newest checkpoint
    and ends with the failure-free digest."""
    digest = reference_digest(launcher, tmp_path, *TP_JOB)
    ckpt_dir = tmp_path / "ckpt"
    mesh = ("--tp", "2", "--workers", "4", "--nodes", "2", "--spares", "0", "--protection", "off")
    job = ("-m", "leto.baselines.ckpt_job", "--steps", str(STEPS), "--seed", "3", "--ckpt-dir", str(ckpt_dir))
    job += ("--ckpt-mode", "disk", "--ckpt-every", "4") if mode == "disk" else ("--ckpt-mode", "memory")

    def attempt(name: str) -> tuple[Path, subprocess.Popen]:
        run_dir = tmp_path / name
        return run_dir, launcher.start("run", *mesh, "--run-dir", str(run_dir), *job, run_dir=run_dir)

    run_dir, popen = attempt("attempt0")
    kill_at_step(run_dir, rank=1, step=6, timeout_s=180)
    popen.communicate(timeout=120)
    assert popen.returncode != 0
    assert not processes_left(run_dir)

    run_dir, popen = attempt("attempt1")
    out, err = popen.communicate(timeout=240)
    assert popen.returncode == 0, out[-2000:] + err[-3000:]
    (restore,) = events(run_dir, "restore")
    assert restore["step"] == 4 if mode == "disk" else restore["step"] >= 5
    assert [r["step"] for r in step_records(run_dir)] == list(range(restore["step"] + 1, STEPS + 1))
    assert summary(run_dir)["digest"] == digest
