"""Bad input: a one-line error naming the problem, exit code 2, no traceback, nothing started."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import REPO


@pytest.mark.parametrize(
    "args, problem",
    [
        (["train", "--workers", "0"], "--workers must be at least 1"),
        (["train", "--workers", "2", "--nodes", "3"], "--nodes (3) cannot exceed --workers (2)"),
        (["train", "--steps", "-5"], "--steps must be at least 1"),
        (["train", "--spares", "-1"], "--spares cannot be negative"),
        (["train", "--model", "huge"], "unknown --model 'huge'"),
        (["train", "--chunk-bytes", "1000"], "--chunk-bytes must be a positive multiple of 12"),
        (["train", "--protect-every", "0"], "--protect-every must be at least 1, got 0"),
        (
            ["run", "--protect-every", "2.5", "examples/minimal.py"],
            "argument --protect-every: invalid int value: '2.5'",
        ),
        (["train", "--bogus"], "unrecognized arguments: --bogus"),
        (["train", "--workers", "many"], "invalid int value: 'many'"),
        (["run", "no/such/script.py"], "script 'no/such/script.py' not found"),
        (["run", "-m", "no_such_module_xyz"], "module 'no_such_module_xyz' not found"),
        (["run", "--workers", "2", "--nodes", "0", "examples/minimal.py"], "--nodes must be at least 1"),
        (["run", "--run-dir", "/proc/leto-cannot-write-here", "examples/minimal.py"], "is not writable"),
        (["bench", "nothing"], "invalid choice: 'nothing'"),
        ([], "the following arguments are required"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(launcher, args: list[str], problem: str) -> None:
    res = launcher.run(*args, timeout=60)
    assert res.returncode == 2
    assert problem in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "Traceback" not in res.stderr + res.stdout


def test_no_process_starts_on_bad_input(launcher, tmp_path: Path) -> None:
    res = launcher.run("train", "--workers", "2", "--nodes", "5", "--run-dir", str(tmp_path / "r"), timeout=60)
    assert res.returncode == 2
    assert not (tmp_path / "r" / "procs.json").exists()


def test_missing_corpus_is_named(launcher, tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = dict(os.environ, LETO_DATA_DIR=str(tmp_path / "empty"))
    res = subprocess.run(
        [sys.executable, "-m", "leto.cli", "train", "--steps", "1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert "corpus not prepared" in res.stderr and "leto data prepare" in res.stderr


def test_an_unknown_data_plane_in_the_environment_is_named(launcher, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LETO_DATA_PLANE", "fast")
    res = launcher.run("train", "--steps", "1", timeout=60)
    assert res.returncode == 2
    assert "$LETO_DATA_PLANE must be one of native, python, got 'fast'" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
