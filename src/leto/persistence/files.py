"""Small file helpers shared by persistence and the checkpoint baselines."""
from __future__ import annotations

import json
import os
from pathlib import Path


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write `obj` to `path` so that a reader sees the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    """The JSON object in `path`, or None if it is missing, torn or not an object."""
    try:
        obj = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None
