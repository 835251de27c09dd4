"""Small file helpers shared by persistence and the checkpoint baselines."""

from __future__ import annotations

import json
from pathlib import Path

from leto.runtime.durable import write_atomic


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write `obj` to `path` so that a reader (or a reboot) sees the old file or the whole new one."""
    write_atomic(path, json.dumps(obj).encode())


def read_json(path: Path) -> dict | None:
    """The JSON object in `path`, or None if it is missing, torn or not an object."""
    try:
        obj = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None
