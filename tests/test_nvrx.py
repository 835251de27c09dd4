"""The NVRx baseline (NVIDIA's in-process restart with a warm spare): a worker SIGKILLed from
outside by PID, the spare promoted inside the running job, the failure-free digest at the end.

Real processes: `run_baseline` starts the harness's ranks; the fault injector (`leto.baselines.faults`)
kills a worker by the PID procs.json names. Skipped where nvidia-resiliency-ext 0.7.0 is not
installed (docs/baselines.md says how it is installed).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from conftest import alive, read_procs
from leto.baselines.nvrx_job import ShardCheckpoint, nvrx_status
from leto.baselines.restart import run_baseline

STEPS = 8

needs_nvrx = pytest.mark.skipif(nvrx_status() is not None, reason=f"nvidia-resiliency-ext: {nvrx_status()}")


def monitor_pids(run_dir: Path) -> list[int]:
    """NVRx's monitor processes (daemons, outside the harness's process tree)."""
    out = []
    for f in (run_dir / "nvrx").glob("monitor-*.pid"):
        try:
            out.append(int(f.read_text()))
        except ValueError:
            pass
    return out


def job_pids(run_dir: Path) -> list[int]:
    return monitor_pids(run_dir) + [p["pid"] for p in read_procs(run_dir) if p["role"] != "controller"]


@pytest.fixture
def nvrx_runs() -> Iterator[list[Path]]:
    """Run folders whose NVRx processes are killed at the end, whatever happened."""
    dirs: list[Path] = []
    try:
        yield dirs
    finally:
        for d in dirs:
            for pid in job_pids(d):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if alive(pid) and b"leto.baselines.nvrx_job" in cmd:
                    os.kill(pid, signal.SIGKILL)


def run(system: str, run_dir: Path, inject: list[dict] | None = None, **options: object) -> dict:
    return run_baseline(
        system,
        workers=2,
        nodes=1,
        steps=STEPS,
        seed=5,
        model="tiny",
        run_dir=run_dir,
        inject=inject,
        ckpt_every=None,
        mtbf_s=None,
        **options,
    )


@needs_nvrx
def test_spare_takes_over_a_sigkilled_worker(nvrx_runs: list[Path], tmp_path: Path) -> None:
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "nvrx"
    nvrx_runs.append(run_dir)
    reference = run("memory-restart", ref_dir)  # exact and failure-free
    assert reference["exit_code"] == 0 and reference["steps"] == STEPS

    # the fault injector SIGKILLs the process procs.json names as worker rank 1, once step 3 is recorded
    s = run("nvrx", run_dir, [{"kind": "kill", "rank": 1, "node": None, "step": 3}], spares=1)

    assert s["exit_code"] == 0 and not s["injection_errors"]
    assert s["steps"] == STEPS and s["digest"] == reference["digest"]  # reloaded every restart: exact
    assert s["restarts"] == 1 and s["final_world_size"] == 2
    assert s["exits"] == [{"initial_rank": 1, "code": -signal.SIGKILL}]
    (rec,) = s["recoveries"]
    assert rec["injected"]["rank"] == 1 and rec["failed_initial_ranks"] == [1]
    assert rec["promoted_spares"] == [2] and rec["world_size_after"] == 2  # the spare took rank 1's place
    # every rank copies its shard right after each step: a rank killed between finishing the step
    # rank 0 recorded and committing its own copy makes the job redo that one step
    assert rec["failed_at_step"] >= 3 and rec["lost_steps"] in (0, 1)
    assert rec["restored_step"] == rec["failed_at_step"] - rec["lost_steps"]
    assert rec["detect_s"] is not None and rec["total_s"] is not None
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ups = [e for e in events if e.get("event") == "job_up"]
    assert [u["assignment"] for u in ups] == [{"0": 0, "1": 1}, {"0": 0, "2": 1}]
    assert [e for e in events if e.get("event") == "failure"], "NVRx's detection is recorded"
    assert len(monitor_pids(run_dir)) == 3  # 3 ranks, 3 NVRx monitor processes ...
    assert not [pid for pid in job_pids(run_dir) if alive(pid)]  # ... and nothing outlives the run


@needs_nvrx
def test_a_run_dir_given_relative_to_the_working_directory_runs(
    nvrx_runs: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVRx takes only absolute paths for its monitors' logs (the benches pass relative ones)."""
    monkeypatch.chdir(tmp_path)
    nvrx_runs.append(tmp_path / "nvrx")
    s = run("nvrx", Path("nvrx"))
    assert s["exit_code"] == 0 and s["steps"] == STEPS


class _Comm:
    """One process standing in for every rank: agreements agree, gathers fill in this rank's part."""

    def all_reduce(self, t: torch.Tensor, op: object = None) -> None:
        pass

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        out.zero_()


class _Trainer:
    """The parts of `RankMember` a checkpoint reads and writes: ZeRO-1 over `world` ranks."""

    def __init__(self, numel: int, chunk_elems: int, world: int, rank: int) -> None:
        self.numel, self.chunk_elems, self.world_size, self.rank = numel, chunk_elems, world, rank
        self.n_chunks = -(-numel // (world * chunk_elems))
        self.shard_elems = self.n_chunks * chunk_elems
        self.state = torch.zeros(self.n_chunks, 3, chunk_elems)
        self.param_shard = torch.zeros(self.shard_elems)
        self.flat_param = torch.zeros(world * self.shard_elems)
        self.comm = _Comm()
        self.step_count = 0

    def set_step(self, step: int) -> None:
        self.step_count = step

    def rows(self) -> torch.Tensor:
        return self.state.transpose(0, 1).reshape(3, -1)


def test_checkpoint_reshards_to_fewer_ranks(tmp_path: Path) -> None:
    numel, ce = 1000, 64
    full = torch.zeros(3, 4 * -(-numel // (4 * ce)) * ce)
    full[:, :numel] = torch.randn(3, numel)
    old = [_Trainer(numel, ce, 4, r) for r in range(4)]
    for t in old:  # 4 ranks save step 7, then rank 2 dies before its step-8 copy is committed
        t.state.copy_(
            full[:, t.rank * t.shard_elems : (t.rank + 1) * t.shard_elems].view(3, t.n_chunks, ce).transpose(0, 1)
        )
        writer = ShardCheckpoint(tmp_path, "fp")
        for step in (7, 8):
            t.step_count = step
            if not (step == 8 and t.rank == 2):
                writer.save(t)
        writer.close()
    ck = ShardCheckpoint(tmp_path, "fp")
    assert ck.newest() == (7, 4)
    same = _Trainer(numel, ce, 4, 1)
    assert ck.restore(same) == (7, 4) and same.step_count == 7 and torch.equal(same.state, old[1].state)
    new = [_Trainer(numel, ce, 3, r) for r in range(3)]
    for t in new:
        assert ck.restore(t) == (7, 4)
    got = torch.cat([t.rows() for t in new], dim=1)
    assert torch.equal(got[:, :numel], full[:, :numel]) and not got[:, numel:].any()  # padding stays zero
    assert ShardCheckpoint(tmp_path, "another job").newest() is None
    (tmp_path / "w4.rank3.slot1.commit").unlink()  # a torn step-7 copy of rank 3: nothing complete is left
    assert ShardCheckpoint(tmp_path, "fp").newest() is None
