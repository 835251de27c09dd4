"""A job's `summary.json`: its result, its recoveries, resizes and degradations, its configuration."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist

from leto.config import JobConfig
from leto.errors import BadValue
from leto.protocol import keys
from leto.protocol.messages import JobResult, Refusals
from leto.runtime import runlog


def write_summary(
    store: dist.Store,
    config: JobConfig,
    run_dir: Path,
    events: list[dict],
    wall_s: float,
    code: int,
    extra: dict,
    refused: Refusals,
) -> None:
    """`summary.json` (atomically and durably; retried a few times on a full disk, else said
    on stderr: the job's exit code stays the job's). `events`: the job's events so far; `extra`:
    fields a caller adds; a malformed result is said through `refused`."""
    result: dict = {"steps": None, "final_loss": None, "digest": None}
    if store.check([keys.RESULT]):
        value = store.get(keys.RESULT)
        try:
            result.update(asdict(JobResult.from_json(value, keys.RESULT)))
        except BadValue as e:
            refused.refuse(e, value)
    t = config.training
    summary = {
        **result,
        "wall_s": round(wall_s, 3),
        "workers": t.workers,
        "spares": config.recovery.spares,
        "nodes": t.nodes,
        "exit_code": code,
        "recoveries": [e for e in events if e["event"] == "recovery"],
        "resizes": [e for e in events if e["event"] == "resize"],
        "degraded": [e for e in events if e["event"] == "degraded"],
        "restored": [e for e in events if e["event"] == "restored"],
        "hosts_joined": [e for e in events if e["event"] == "host_joined"],
        "fatal": next((e["cause"] for e in events if e["event"] == "fatal"), None),
        **extra,
        "config": config.to_dict(),
    }
    runlog.flush()
    runlog.write_summary(run_dir, summary)
