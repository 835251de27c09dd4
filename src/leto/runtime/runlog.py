"""The run directory's live files, written in one place, through a full or failing disk.

`metrics.jsonl`: one JSON record a line, appended by any process of the job (a step record of
rank 0, or an event with an `event` field); each record is one `write` of a whole line, so
concurrent appenders never interleave. `procs.json`: every live process of the job by role,
replaced atomically so a reader (tests, operators, `leto bench`) sees a whole file.

A write that fails because of the disk (full, out of quota, failing, read-only: `DISK_ERRORS`)
never stops the process that makes it: the process says so once on stderr, keeps the records it
could not append in memory (at most `BACKLOG_MAX`, the oldest dropped first) and appends them,
after a `log_gap` event that says how many were late and how many lost, at its first append that
succeeds. A procs file that could not be replaced is reported the same way, and its writer tries
again (`write_procs` returns False). `summary.json` is written atomically and durably, and tried
again a few times before the one line that says it could not be. Any other error (a path that
is a folder, a missing run directory) is raised: it is no disk's doing.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import threading
import time
from collections import deque
from pathlib import Path

from leto.console import say
from leto.runtime.durable import write_atomic
from leto.runtime.linux import start_time

METRICS = "metrics.jsonl"
PROCS = "procs.json"
SUMMARY = "summary.json"
DISK_ERRORS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG})
BACKLOG_MAX = 10_000  # records one process keeps while it cannot append (~3 MB of step records)
RETRY_S = 1.0  # a file that could not be written is tried again at most this often


def is_disk_error(e: BaseException) -> bool:
    """Is `e` the disk's failure (full, out of quota, failing, read-only)?"""
    return isinstance(e, OSError) and e.errno in DISK_ERRORS


class _Trouble:
    """One file this process could not write: said once on stderr, and again once written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.since: float | None = None  # time.time() of the first failure, while failing
        self.cause = ""
        self.next_try = 0.0

    def failed(self, e: OSError, what: str) -> None:
        self.next_try = time.monotonic() + RETRY_S
        if self.since is None:
            self.since, self.cause = time.time(), e.strerror or str(e)
            say(f"leto: cannot write {self.path} ({self.cause}); the job goes on, {what}", err=True)

    def due(self) -> bool:
        return self.since is None or time.monotonic() >= self.next_try


class _Appender(_Trouble):
    """This process's appends to one JSON-lines file."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.backlog: deque[str] = deque()
        self.lost = 0
        self.torn = False  # a write ended inside a line: the next one starts a new line
        self.lock = threading.RLock()  # the training thread and a checkpoint writer's thread append

    def append(self, line: str) -> None:
        with self.lock:
            self._append(line)

    def _append(self, line: str) -> None:
        if self.since is None:
            try:
                if self._write([line]) == 1:
                    return
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            except OSError as e:
                if not is_disk_error(e):
                    raise
                self.failed(e, f"keeping up to {BACKLOG_MAX} records in memory to write once it can")
                atexit.register(self.flush, final=True)
        if len(self.backlog) == BACKLOG_MAX:
            self.backlog.popleft()
            self.lost += 1
        self.backlog.append(line)
        if self.due():
            self.flush()

    def flush(self, final: bool = False) -> None:
        """Write the records kept back, after a `log_gap` event; at the end (`final`) say what is lost."""
        with self.lock:
            self._flush(final)

    def _flush(self, final: bool) -> None:
        if self.since is None:
            return
        gap = {
            "event": "log_gap",
            "file": self.path.name,
            "cause": self.cause,
            "since": round(self.since, 4),
            "until": round(time.time(), 4),
            "late": len(self.backlog),
            "lost": self.lost,
            "pid": os.getpid(),
            "time": time.time(),
        }
        lines = [json.dumps(gap) + "\n", *self.backlog]
        cause = os.strerror(errno.ENOSPC)
        try:
            whole = self._write(lines)
        except OSError as e:
            if not is_disk_error(e) and not final:
                raise
            whole, cause = 0, e.strerror or str(e)
        if whole == len(lines):
            self.backlog.clear()
            self.since, self.lost = None, 0
            atexit.unregister(self.flush)
            say(f"leto: {self.path} is written again: {gap['late']} records written late, {gap['lost']} lost", err=True)
            return
        if whole:  # the gap event is out: what is left is a new gap
            for _ in range(whole - 1):
                self.backlog.popleft()
            self.lost = 0
        self.next_try = time.monotonic() + RETRY_S
        if final:
            say(
                f"leto: {len(self.backlog) + self.lost} records for {self.path} could not be written ({cause}) "
                f"and are lost",
                err=True,
            )

    def _write(self, lines: list[str]) -> int:
        """Append `lines` in one write; how many of them were written whole (a full disk may
        take part of a write: the next write then starts a new line)."""
        prefix = b"\n" if self.torn else b""
        chunks = [line.encode() for line in lines]
        data = prefix + b"".join(chunks)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            n = os.write(fd, data)
        finally:
            os.close(fd)
        end, whole = len(prefix), 0
        for chunk in chunks:
            if end + len(chunk) > n:
                break
            end += len(chunk)
            whole += 1
        if n >= len(prefix):
            self.torn = n > end
        return whole


_appenders: dict[Path, _Appender] = {}
_replaced: dict[Path, _Trouble] = {}


def append(run_dir: Path, record: dict) -> None:
    """Append one record (a step or an event) to `metrics.jsonl`; `time` is added if absent."""
    line = json.dumps(record if "time" in record else {**record, "time": time.time()}) + "\n"
    path = run_dir / METRICS
    appender = _appenders.get(path) or _appenders.setdefault(path, _Appender(path))
    appender.append(line)


def event(run_dir: Path, kind: str, **fields: object) -> dict:
    """Append an event record; returns it."""
    rec = {"event": kind, "time": time.time(), **fields}
    append(run_dir, rec)
    return rec


def flush() -> None:
    """Write what this process kept back, if the disk lets it now (also done at its next append)."""
    for appender in _appenders.values():
        appender.flush()


def rewrite(run_dir: Path, records: list[dict]) -> None:
    """Replace `metrics.jsonl` with `records` (a harness that merges several attempts' logs)."""
    write_atomic(run_dir / METRICS, "".join(json.dumps(r) + "\n" for r in records).encode())


def write_procs(run_dir: Path, records: list[dict], name: str = PROCS) -> bool:
    """Replace `procs.json` (or one host's `name`) with `records` (one per live process)
    atomically. False if the disk refused it (said once): call again later. A record without
    its process's start time ("start": with the pid, it names the process) gets it here."""
    records = [r if "start" in r else {**r, "start": start_time(r["pid"])} for r in records]
    path = run_dir / name
    trouble = _replaced.get(path) or _replaced.setdefault(path, _Trouble(path))
    if not trouble.due():
        return False
    try:
        write_atomic(path, json.dumps(records, indent=1).encode(), sync=False)  # live: no fsync
    except OSError as e:
        if not is_disk_error(e):
            raise
        trouble.failed(e, "it is written again once it can")
        return False
    trouble.since = None
    return True


def write_summary(run_dir: Path, summary: dict, tries: int = 3) -> bool:
    """Write `summary.json` atomically and durably, `tries` times `RETRY_S` apart while the disk
    refuses it; False (said on stderr, with the job's result) if it never could."""
    data = json.dumps(summary, indent=1).encode()
    for i in range(tries):
        try:
            write_atomic(run_dir / SUMMARY, data)
            return True
        except OSError as e:
            if not is_disk_error(e):
                raise
            if i == tries - 1:
                say(
                    f"leto: could not write {run_dir / SUMMARY} ({e.strerror or e}); the job ended with exit "
                    f"code {summary.get('exit_code')}, digest {summary.get('digest')}",
                    err=True,
                )
                return False
            time.sleep(RETRY_S)
    return False
