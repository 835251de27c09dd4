"""The code passes the linter and is formatted: `ruff check` and `ruff format --check` with the
configuration in pyproject.toml (`[tool.ruff]`), so CI fails on either."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).parent / "ruff"


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(RUFF), *args, "src", "tests"], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_finds_nothing() -> None:
    res = _ruff("check", "--no-cache")
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]


def test_the_code_is_formatted() -> None:
    res = _ruff("format", "--check", "--no-cache")
    assert res.returncode == 0, "`ruff format src tests` formats these:\n" + res.stdout[-6000:] + res.stderr[-2000:]
