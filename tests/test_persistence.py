"""Persistence, the last line of defence: real jobs write asynchronous DCP checkpoints, the
controller is SIGKILLed by PID or a loss goes beyond the codes, and `--resume` must end with
the digest of a failure-free run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from conftest import (
    JOB,
    Launcher,
    alive,
    events,
    processes_left,
    read_procs,
    reference_digest,
    step_records,
    train,
    wait_for,
    with_flags,
    without_flags,
)
from leto.persistence import ckpt_format, loader, resume
from leto.persistence.interval import daly_interval_s, parse_duration, steps_between
from leto.runtime import plain

SMALL = ("--workers", "2", "--nodes", "1", "--spares", "0", "--steps", "8", "--seed", "0", "--persist-every", "2")


@pytest.fixture(scope="module", autouse=True)
def persistence_on_by_default() -> Iterator[None]:
    """The default of `leto train|run` (conftest turns it off for the rest of the suite)."""
    old = os.environ.pop("LETO_PERSIST_DEFAULT", None)
    try:
        yield
    finally:
        if old is not None:
            os.environ["LETO_PERSIST_DEFAULT"] = old


def committed_steps(run_dir: Path) -> list[int]:
    return sorted(ck.step for ck in ckpt_format.complete(run_dir / "checkpoints"))


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """A failure-free SMALL run that persisted (its digest is the reference): (run dir, digest)."""
    tmp = tmp_path_factory.mktemp("small")
    lx = Launcher(tmp)
    try:
        res, s = train(lx, tmp / "run", *SMALL, "--protection", "off")
        assert res.returncode == 0, res.stderr[-3000:]
        yield tmp / "run", s["digest"]
    finally:
        lx.cleanup()


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_run_keeps_the_last_two_complete_checkpoints(small_run) -> None:
    run_dir, _ = small_run
    commits = [e["step"] for e in events(run_dir, "persist_commit")]
    skipped = {e["step"] for e in events(run_dir, "persist_skipped")}
    # every 2 steps, each commit reported once; a rank whose previous write is still in flight skips
    # one (rank 0 reports its skips), so the first is never skipped
    assert commits == sorted(set(commits)) and commits[0] == 2, commits
    assert set(commits) <= {2, 4, 6, 8} - skipped and len(commits) >= 2, (commits, skipped)
    assert committed_steps(run_dir) == commits[-2:]  # older ones pruned
    ck = ckpt_format.complete(run_dir / "checkpoints")[0]
    assert ck.world_size == 2 and sorted(p.name for p in ck.path.iterdir()) == [
        ckpt_format.COMMIT_CLAIM,
        "COMMIT",
        "rank0",
        "rank0.done",
        "rank1",
        "rank1.done",
    ]
    ckpt_format.verify(ck)


def _damage(newest: Path, damage: str) -> None:
    data = ckpt_format.part_dir(newest, 1) / "__0_0.distcp"
    if damage == "marker":
        (newest / ckpt_format.COMMIT).unlink()
    elif damage == "part-marker":
        ckpt_format.part_marker(newest, 0).unlink()
    elif damage == "corrupt":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif damage == "outside":  # a marker naming a file outside its part (with its true checksum): refused
        outside = newest.parent / "outside"
        outside.write_bytes(b"")
        marker = ckpt_format.part_marker(newest, 0)
        rec = json.loads(marker.read_text())
        rec["files"]["../../outside"] = [0, ckpt_format._file_digest(outside)]
        marker.write_text(json.dumps(rec))
    else:
        data.write_bytes(data.read_bytes()[:-100])


@pytest.mark.parametrize("damage", ["marker", "part-marker", "corrupt", "truncate", "outside"])
def test_a_torn_or_corrupt_newest_checkpoint_is_passed_over(tmp_path: Path, small_run, damage: str) -> None:
    run_dir = copy_run(small_run[0], tmp_path / "run")
    previous, newest = (ck.path for ck in ckpt_format.complete(run_dir / "checkpoints")[::-1])
    _damage(newest, damage)
    said: list[str] = []
    record = json.loads((run_dir / "persist.json").read_text())
    ck = ckpt_format.choose(run_dir / "checkpoints", resume.fingerprint(record["command"]), said.append)
    assert ck.path == previous
    assert any(newest.name in msg and "passed over" in msg for msg in said), said


def test_a_resume_past_a_corrupt_newest_checkpoint_ends_with_the_failure_free_digest(
    launcher, tmp_path: Path, small_run
) -> None:
    run_dir = copy_run(small_run[0], tmp_path / "run")
    previous, newest = (ck.path for ck in ckpt_format.complete(run_dir / "checkpoints")[::-1])
    before = int(previous.name[5:])
    _damage(newest, "corrupt")
    res, s = train(launcher, run_dir, "--resume", str(run_dir), *SMALL, "--protection", "off")
    assert res.returncode == 0, res.stderr[-3000:]
    assert newest.name in res.stderr and "passed over" in res.stderr
    assert s["resumed_from_step"] == before and s["steps_lost"] == 8 - before
    assert s["digest"] == small_run[1] and s["steps"] == 8
    assert [r["step"] for r in step_records(run_dir)] == list(range(before + 1, 9))  # only the steps after it ran


def test_controller_sigkill_then_resume_ends_with_the_failure_free_digest(launcher, tmp_path: Path) -> None:
    """The default job (4 workers, 2 nodes, a shadow, protection on): SIGKILL the controller by
    PID mid-run; its children die with it and leave their /dev/shm segments; `--resume` removes
    them, loads the newest complete checkpoint and finishes the same trajectory."""
    job = with_flags(JOB, steps=20)
    digest = reference_digest(launcher, tmp_path, *job)
    run_dir = tmp_path / "run"
    ctl = launcher.start("train", "--run-dir", str(run_dir), *job, "--persist-every", "3", run_dir=run_dir)
    wait_for(
        lambda: (
            (run_dir / "metrics.jsonl").exists()
            and any(e["step"] >= 6 for e in events(run_dir, "persist_commit"))
            or ctl.poll() is not None
        ),
        120,
        "a committed checkpoint at step 6",
    )
    assert ctl.poll() is None, "the job ended before the controller could be killed"
    procs = read_procs(run_dir)
    controller = next(p for p in procs if p["role"] == "controller")
    os.kill(controller["pid"], signal.SIGKILL)
    ctl.wait(timeout=30)
    wait_for(lambda: not processes_left(run_dir), 30, "the job's processes to die with their controller")
    leftovers = sorted(Path("/dev/shm").glob(f"leto-{controller['job']}-*"))
    assert leftovers, "a SIGKILLed controller leaves its keepers' segments behind"
    last = max(r["step"] for r in step_records(run_dir))

    res, s = train(launcher, run_dir, "--resume", str(run_dir), *job, "--persist-every", "3")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert not [p for p in leftovers if p.exists()], "the next start removes a dead job's segments"
    assert s["digest"] == digest and s["steps"] == 20
    assert s["resumed_from_step"] % 3 == 0 and 6 <= s["resumed_from_step"] <= last
    assert s["steps_lost"] == last - s["resumed_from_step"]
    assert (run_dir / "metrics.jsonl.attempt1").exists()  # the killed attempt's records are kept
    assert not processes_left(run_dir)


def test_a_loss_beyond_the_codes_names_the_checkpoint_and_resume_finishes(launcher, tmp_path: Path, small_run) -> None:
    """Protection off: a worker SIGKILL is a loss nothing in memory can repair. The job stops,
    says which checkpoint to resume from, and `--resume` ends with the failure-free digest."""
    run_dir = tmp_path / "run"
    res, s = train(launcher, run_dir, *SMALL, "--protection", "off", "--inject", "kill:rank=1:step=6:phase=update")
    assert res.returncode == 1
    at = s["resume_from"]["step"]
    assert at in (2, 4) and f"checkpoint is step {at}" in res.stderr and "--resume" in res.stderr
    res, s = train(launcher, run_dir, "--resume", str(run_dir), *SMALL, "--protection", "off")
    assert res.returncode == 0, res.stderr[-3000:]
    assert s["digest"] == small_run[1] and s["resumed_from_step"] == at and s["steps_lost"] == 5 - at


def test_persist_off_writes_nothing_and_a_start_removes_only_dead_jobs_segments(launcher, tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    shm = Path("/dev/shm")
    gone = [
        shm / f"leto-{dead.pid}-1-g0-n0",
        shm / f"leto-{dead.pid}-1-owner",
        shm / f"leto-{os.getpid()}-2-g3-n1",  # a live pid whose owner record names another process
        shm / f"leto-mh{dead.pid}-h1-g0-n1",
        shm / f"leto-mh{dead.pid}-h1-owner",
    ]  # a dead multi-host one
    kept = [
        shm / f"leto-{os.getpid()}-3-g0-n0",
        shm / f"leto-{os.getpid()}-3-g1-n1",  # a live job, no owner record
        shm / f"leto-{os.getpid()}-4-g0-n0",  # a live job whose owner record matches
        shm / f"leto-mh{os.getpid()}-h0-g0-n0",
    ]  # a multi-host one with no owner record: whose is unknown
    made = gone + kept
    try:
        for p in made:
            p.write_text("")
        (shm / f"leto-mh{dead.pid}-h1-owner").write_text(json.dumps({"pid": dead.pid, "start": "1"}))
        (shm / f"leto-{os.getpid()}-2-owner").write_text(json.dumps({"pid": os.getpid(), "start": "0"}))
        made.append(shm / f"leto-{os.getpid()}-2-owner")
        from leto.protection.shm import write_owner

        write_owner(f"{os.getpid()}-4", os.getpid())
        made.append(shm / f"leto-{os.getpid()}-4-owner")
        assert alive(os.getpid()) and not alive(dead.pid)
        run_dir = tmp_path / "run"
        res, s = train(
            launcher, run_dir, "--workers", "1", "--nodes", "1", "--spares", "0", "--steps", "2", "--persist", "off"
        )
        assert res.returncode == 0, res.stderr[-3000:]
        assert not (run_dir / "checkpoints").exists() and not (run_dir / "persist.json").exists()
        assert not events(run_dir, "persist_commit")
        assert [p.name for p in gone if p.exists()] == []
        assert [p.name for p in kept if not p.exists()] == []
        assert (shm / f"leto-{os.getpid()}-4-owner").exists()
    finally:
        for p in made:
            p.unlink(missing_ok=True)


@pytest.mark.parametrize(
    "case, problem",
    [
        ("missing", "is not a folder"),
        ("not-persisted", "has no persist.json"),
        ("other-config", "belong to another configuration"),
        ("all-torn", "no complete checkpoint of this job"),
        ("with-run-dir", "drop --run-dir"),
    ],
)
def test_bad_resume_input_is_one_clear_line(launcher, tmp_path: Path, small_run, case: str, problem: str) -> None:
    run_dir = tmp_path / "run"
    args = list(SMALL)
    if case == "not-persisted":
        run_dir.mkdir()
        (run_dir / "summary.json").write_text("{}")
    elif case == "other-config":
        copy_run(small_run[0], run_dir)
        args[args.index("--seed") + 1] = "1"
    elif case == "all-torn":
        copy_run(small_run[0], run_dir)
        for ck in ckpt_format.complete(run_dir / "checkpoints"):
            (ck.path / ckpt_format.COMMIT).unlink()
    elif case == "with-run-dir":
        args += ["--run-dir", str(tmp_path / "elsewhere")]
    res = launcher.run("train", "--resume", str(run_dir), *args, timeout=60)
    assert res.returncode == 2, res.stderr
    errors = [line for line in res.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and problem in errors[0], res.stderr
    assert "Traceback" not in res.stderr + res.stdout


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_loads_into_another_world_size(tmp_path: Path) -> None:
    """Written by 3 ranks, loaded by 2 (a job that had shrunk, resumed at full size): each new
    rank's shard is cut from the overlapping parts, elements in place."""
    import torch.distributed.checkpoint as dcp

    numel, chunk = 1000, 64
    full = torch.randn(3, numel)
    ck = ckpt_format.step_dir(tmp_path, 5)

    def shards(world: int) -> tuple[int, list[torch.Tensor]]:
        n_chunks = -(-numel // (world * chunk))
        size = n_chunks * chunk
        padded = torch.zeros(3, world * size)
        padded[:, :numel] = full
        return n_chunks, [
            padded[:, r * size : (r + 1) * size].reshape(3, n_chunks, chunk).transpose(0, 1).contiguous()
            for r in range(world)
        ]

    _, old = shards(3)
    committed = []
    for r, state in enumerate(old):
        sd = {
            "state": state,
            "step": torch.tensor(5),
            "extra": torch.frombuffer(bytearray(plain.dumps({"rank": r})), dtype=torch.uint8),
        }
        if r == 0:
            sd["params"] = full[0].clone()
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(ckpt_format.part_dir(ck, r))), no_dist=True)
        committed.append(ckpt_format.mark_part(ck, r, 5, 3, "fp"))
    assert committed == [False, False, True]  # the last part to be marked commits the checkpoint
    assert [c.step for c in ckpt_format.complete(tmp_path)] == [5]
    n_chunks, want = shards(2)
    for r in range(2):
        got = loader.load(ck, 5, r, 2, numel, n_chunks, chunk)
        assert torch.equal(got.shard, want[r]) and torch.equal(got.params, full[0]) and got.extra == {"rank": r}


def test_the_last_parts_written_together_commit_once(tmp_path: Path) -> None:
    """The last two ranks to finish a checkpoint both see every part marked: both write the
    commit marker, and exactly one of them reports it (one persist_commit event, one prune)."""
    ck = ckpt_format.step_dir(tmp_path, 5)
    for r in range(2):
        ckpt_format.part_dir(ck, r).mkdir(parents=True)
        (ckpt_format.part_dir(ck, r) / "data").write_bytes(b"x")
    marked = [ckpt_format.part_marker(ck, r) for r in range(2)]
    for r in range(2):  # both markers first, as when the two writes end together
        ckpt_format.mark_part(ck, r, 5, 2, "fp")
        assert marked[r].exists()
    (ck / ckpt_format.COMMIT).unlink()
    (ck / ckpt_format.COMMIT_CLAIM).unlink()
    assert [ckpt_format.mark_part(ck, r, 5, 2, "fp") for r in range(2)] == [True, False]
    assert [c.step for c in ckpt_format.complete(tmp_path)] == [5]


def test_interval_helpers() -> None:
    assert parse_duration("5m") == 300 and parse_duration("90") == 90 and parse_duration("1.5h") == 5400
    for bad in ("", "soon", "-1m", "0s"):
        with pytest.raises(ValueError):
            parse_duration(bad)
    assert steps_between(daly_interval_s(0.5, 300.0), 0.1) == round(daly_interval_s(0.5, 300.0) / 0.1)


def test_young_daly_k_is_chosen_from_measured_costs_and_shared(launcher, tmp_path: Path) -> None:
    """No --persist-every: a calibration checkpoint 5 steps in, then rank 0's K for --mtbf."""
    run_dir = tmp_path / "run"
    res, s = train(
        launcher,
        run_dir,
        *without_flags(SMALL, "persist-every"),
        "--steps",
        "14",
        "--mtbf",
        "3s",
        "--protection",
        "off",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    (membership,) = events(run_dir, "persist_interval")
    k = max(
        steps_between(daly_interval_s(membership["write_s"], 3.0), membership["step_s"]),
        -(-membership["write_s"] // membership["step_s"]) + 1,
    )
    assert abs(membership["every"] - k) <= 1 and membership["mtbf_s"] == 3.0  # the event's times are rounded
    k = membership["every"]
    commits = [e["step"] for e in events(run_dir, "persist_commit")]
    schedule = range(membership["first"], 14 + 1, k)  # the steps every rank writes at, once K is shared
    assert commits == sorted(set(commits)) and commits[0] == 5, commits
    assert set(commits[1:]) <= set(schedule) and (commits[1:] or not schedule), (membership, commits)


def test_leto_run_resumes_a_user_script(launcher, tmp_path: Path) -> None:
    """A write still in flight skips the next checkpoint (it never blocks a step), so a busy machine
    may keep fewer checkpoints: the resume starts from the one the run's checkpoints say it must."""
    job = ("--workers", "2", "--persist-every", "4", "examples/minimal.py", "--steps", "12")
    run_dir = tmp_path / "run"
    res = launcher.run("run", "--run-dir", str(run_dir), *job, run_dir=run_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    digest = json.loads((run_dir / "summary.json").read_text())["digest"]
    kept = ckpt_format.complete(run_dir / "checkpoints")
    assert {ck.step for ck in kept} <= {4, 8, 12} and len(kept) in (1, 2), kept
    if len(kept) == 2:  # the newest torn: the resume passes over it
        (kept.pop(0).path / ckpt_format.COMMIT).unlink()
    assert kept[0].step < 12, kept  # the first write (step 4) is never skipped
    res = launcher.run("run", "--resume", str(run_dir), *job, run_dir=run_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["digest"] == digest and s["resumed_from_step"] == kept[0].step and s["steps"] == 12


def test_a_resumed_job_still_recovers_in_place(launcher, tmp_path: Path, small_run) -> None:
    """Protection starts from the resumed step: a worker SIGKILLed after the resume is adopted
    by a shadow and decoded from the keepers, and the digest is still the failure-free one."""
    run_dir = copy_run(small_run[0], tmp_path / "run")
    newest, previous = ckpt_format.complete(run_dir / "checkpoints")
    (newest.path / ckpt_format.COMMIT).unlink()
    assert previous.step < 7  # the older of two kept of steps 2, 4, 6, 8
    args = [*SMALL, "--protection", "on"]  # the run had it off: a resume may turn it on
    args[args.index("--spares") + 1] = "1"
    res, s = train(launcher, run_dir, "--resume", str(run_dir), *args, "--inject", "kill:rank=1:step=7:phase=update")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert s["resumed_from_step"] == previous.step and s["digest"] == small_run[1]
    (rec,) = s["recoveries"]
    assert rec["failed_ranks"] == [1] and rec["tier"] == "tier1" and rec["lost_steps"] == 0
