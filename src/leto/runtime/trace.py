"""An optional timeline of what every process of a job does around a recovery.

`LETO_TRACE=FILE` (inherited by every process of the job, on every host) makes `mark` append one
JSON line per call to FILE: wall time, pid, this process's role and id, and what happened. Each
line is one `write` to a file opened with O_APPEND, so lines of concurrent processes never
interleave. Off (the default) a mark costs one dictionary lookup. `scripts/trace-timeline.py`
prints a merged timeline relative to a chosen event.
"""

from __future__ import annotations

import json
import os
import time

ENV_TRACE = "LETO_TRACE"
_fd: int | None = None


def mark(what: str, **fields: object) -> None:
    """Record that `what` happened now (no-op unless LETO_TRACE is set)."""
    path = os.environ.get(ENV_TRACE)
    if not path:
        return
    global _fd
    if _fd is None:
        _fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    line = {
        "t": round(time.time(), 6),
        "pid": os.getpid(),
        "role": os.environ.get("LETO_ROLE", "supervisor"),
        "proc": os.environ.get("LETO_PROC_ID", ""),
        "node": os.environ.get("LETO_NODE", ""),
        "what": what,
        **fields,
    }
    os.write(_fd, (json.dumps(line, default=str) + "\n").encode())
