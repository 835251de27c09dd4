"""The run directory's two live files, written in one place.

`metrics.jsonl`: one JSON record a line, appended by any process of the job (a step record of
rank 0, or an event with an `event` field); each record is one `write` of a whole line, so
concurrent appenders never interleave. `procs.json`: every live process of the job by role,
replaced atomically so a reader (tests, operators, `leto bench`) sees a whole file.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

METRICS = "metrics.jsonl"
PROCS = "procs.json"


def append(run_dir: Path, record: dict) -> None:
    """Append one record (a step or an event) to `metrics.jsonl`; `time` is added if absent."""
    line = json.dumps(record if "time" in record else {**record, "time": time.time()}) + "\n"
    with open(run_dir / METRICS, "a") as f:
        f.write(line)


def event(run_dir: Path, kind: str, **fields: object) -> dict:
    """Append an event record; returns it."""
    rec = {"event": kind, "time": time.time(), **fields}
    append(run_dir, rec)
    return rec


def rewrite(run_dir: Path, records: list[dict]) -> None:
    """Replace `metrics.jsonl` with `records` (a harness that merges several attempts' logs)."""
    tmp = run_dir / f".{METRICS}.{os.getpid()}.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, run_dir / METRICS)


def write_procs(run_dir: Path, records: list[dict], name: str = PROCS) -> None:
    """Replace `procs.json` (or one host's `name`) with `records` (one per live process) atomically."""
    tmp = run_dir / f".{name}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(records, indent=1))
    os.replace(tmp, run_dir / name)
