"""`--resume RUN_DIR` alone continues a run with the configuration it recorded, as an operator
who has the run folder but not the command line would use it after a crash or a reboot: the
controller is SIGKILLed by PID, `--resume RUN_DIR` with nothing else, three times in a row, and
the run ends with the digest of the same configuration run without failures."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import Launcher, beyond_ci, processes_left, read_procs, reference_digest, wait_for
from leto.console import read_jsonl
from leto.runtime import linux

# every flag that shapes the run differs from its default, so a resume that fell back to the
# defaults would load nothing (another configuration) or end with another digest
FLAGS = (
    "--workers",
    "2",
    "--nodes",
    "1",
    "--spares",
    "0",
    "--seed",
    "3",
    "--lr",
    "2e-3",
    "--rows",
    "64",
    "--steps",
    "60",
)  # steps long enough for a kill to land mid-run


@pytest.fixture(autouse=True)
def persistence_on_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default of `leto train|run` (conftest turns it off for the rest of the suite)."""
    monkeypatch.delenv("LETO_PERSIST_DEFAULT", raising=False)


def commits(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("event") == "persist_commit"]


def crash(popen: subprocess.Popen, run_dir: Path, past: int) -> int:
    """Once this attempt has committed a checkpoint past step `past`, SIGKILL its controller by
    PID (its children die with it); returns the newest step it committed."""
    wait_for(
        lambda: any(s > past for s in commits(run_dir)) or popen.poll() is not None,
        180,
        f"a checkpoint past step {past}",
    )
    assert popen.poll() is None, "the attempt ended before its controller could be killed"
    controller = next(p for p in read_procs(run_dir) if p["role"] == "controller")
    os.kill(controller["pid"], signal.SIGKILL)
    popen.wait(timeout=30)
    wait_for(lambda: not processes_left(run_dir), 30, "the attempt's processes to die with their controller")
    return max(commits(run_dir))


def stand_in(run_dir: Path, keep_start: bool) -> subprocess.Popen:
    """A live process that takes over the dead controller's pid in procs.json, as a pid reused
    after the controller died (or after a reboot): with the dead one's start time kept, or with
    no start time in a record written before the process started."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    path = run_dir / "procs.json"
    records = json.loads(path.read_text())
    for r in records:
        if r["role"] == "controller":
            r["pid"] = proc.pid
            if not keep_start:
                del r["start"]
    path.write_text(json.dumps(records))
    if not keep_start:
        before = time.time() - 10
        os.utime(path, (before, before))
    return proc


@beyond_ci
def test_three_crashes_each_resumed_with_only_the_run_dir_end_with_the_failure_free_digest(
    launcher: Launcher, tmp_path: Path
) -> None:
    digest = reference_digest(launcher, tmp_path, *FLAGS, "--persist", "off")
    run_dir = tmp_path / "run"
    popen = launcher.start(
        "train", "--run-dir", str(run_dir), *FLAGS, "--protection", "off", "--persist-every", "3", run_dir=run_dir
    )
    newest = crash(popen, run_dir, 0)
    stand_ins: list[subprocess.Popen] = []
    try:
        for attempt in range(3):
            if attempt:  # its pid now names another live process: not the run's controller
                stand_ins.append(stand_in(run_dir, keep_start=attempt == 1))
            popen = launcher.start("train", "--resume", str(run_dir), run_dir=run_dir)
            if attempt < 2:
                newest = crash(popen, run_dir, newest)
        out, err = popen.communicate(timeout=240)
    finally:
        for proc in stand_ins:
            proc.kill()
            proc.wait()
    assert popen.returncode == 0, out[-2000:] + err[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["digest"] == digest and s["steps"] == 60
    config = json.loads((run_dir / "config.json").read_text())
    assert (config["training"]["workers"], config["recovery"]["spares"], config["protection"]["enabled"]) == (
        2,
        0,
        False,
    )
    assert sorted(p.name for p in run_dir.glob("metrics.jsonl.attempt*")) == [
        f"metrics.jsonl.attempt{k}" for k in (1, 2, 3)
    ]


def test_leto_run_resumes_its_script_and_arguments_from_the_record(launcher: Launcher, tmp_path: Path) -> None:
    """`leto run --resume RUN_DIR` without the script: the script and its arguments are the run's."""
    script = tmp_path / "slow.py"
    script.write_text(
        (Path(__file__).parent.parent / "examples" / "minimal.py")
        .read_text()
        .replace("    loss = trainer.step(", "    __import__('time').sleep(0.2)\n    loss = trainer.step(")
    )
    job = ("--workers", "2", "--persist-every", "3", str(script), "--steps", "30")
    ref = launcher.run("run", "--run-dir", str(tmp_path / "reference"), "--persist", "off", *job)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run_dir = tmp_path / "run"
    crash(launcher.start("run", "--run-dir", str(run_dir), *job, run_dir=run_dir), run_dir, 0)
    res = launcher.run("run", "--resume", str(run_dir), run_dir=run_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["digest"] == json.loads((tmp_path / "reference" / "summary.json").read_text())["digest"]
    assert s["steps"] == 30 and s["resumed_from_step"] >= 3


def _recorded_run(tmp_path: Path, procs: list[dict] | None = None) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    flags = {"cmd": "train", "workers": 2, "nodes": 1, "seed": 3, "steps": 24}
    (run_dir / "persist.json").write_text(json.dumps({"dir": "checkpoints", "command": [], "flags": flags}))
    if procs is not None:
        (run_dir / "procs.json").write_text(json.dumps(procs))
    return run_dir


@pytest.mark.parametrize(
    "flag, value, named",
    [
        ("--workers", "3", "--workers 3 differs from the run's --workers 2"),
        ("--seed", "4", "--seed 4 differs from the run's --seed 3"),
    ],
)
def test_a_flag_that_contradicts_the_record_is_named_and_refused(
    launcher: Launcher, tmp_path: Path, flag: str, value: str, named: str
) -> None:
    res = launcher.run("train", "--resume", str(_recorded_run(tmp_path)), flag, value, timeout=60)
    assert res.returncode == 2, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0] and "Traceback" not in res.stderr, res.stderr


def test_a_run_whose_controller_lives_is_not_resumed(launcher: Launcher, tmp_path: Path) -> None:
    """The same pid and start time: the run's controller still runs, so nothing is resumed."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        wait_for(lambda: linux.start_time(proc.pid), 10, "the process to start")
        procs = [{"role": "controller", "pid": proc.pid, "start": linux.start_time(proc.pid)}]
        res = launcher.run("train", "--resume", str(_recorded_run(tmp_path, procs)), timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert res.returncode == 2 and f"its controller, pid {proc.pid}, is alive" in res.stderr, res.stderr[-3000:]
