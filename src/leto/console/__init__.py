"""What the coordinator shows: a rich progress bar on a terminal, plain lines otherwise; the
notices it shows are in `console/notices.py`."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from leto.console.notices import TO_STDERR, Notice, Recovered, SegmentsRemoved, render

if TYPE_CHECKING:
    from rich.progress import Progress


def parse_records(lines: list[bytes] | list[str]) -> list[dict]:
    """JSON objects from JSON lines; torn or foreign lines are skipped."""
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:  # not JSON, or not UTF-8 (a line torn inside a character)
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def read_jsonl(path: Path) -> list[dict]:
    """Every record of a metrics.jsonl-style file ([] when it does not exist yet); the one
    reader of those files, so that a torn line (an appender that died or ran out of disk
    mid-line, hosts appending to one file on shared storage) is skipped everywhere."""
    try:
        return parse_records(path.read_bytes().splitlines())
    except FileNotFoundError:
        return []


def say(text: str, err: bool = False) -> None:
    """Print one line to stdout (`err`: stderr) now, in one write: processes that share a console
    (a job's ranks) would otherwise interleave a line and its newline. A console that cannot be
    written (redirected to a file on a full disk) loses the line rather than stopping the job."""
    stream = sys.stderr if err else sys.stdout
    try:
        stream.write(text + "\n")
        stream.flush()
    except OSError:
        pass


class StepDisplay:
    """Shows training steps (step/total, ETA, loss, tokens/s, recoveries so far) and events as
    they arrive: a live rich progress bar on a terminal, a plain line every few seconds otherwise."""

    def __init__(self, total: int | None, plain_every_s: float = 2.0, quiet: bool = False) -> None:
        self.total = total
        self.quiet = quiet
        self.live = sys.stdout.isatty() and not quiet
        self.plain_every_s = plain_every_s
        self._last_plain = 0.0
        self._progress: Progress | None = None
        self._task = None
        self.recoveries = 0
        self._first: tuple[int, float] | None = None  # (step, time) of the first step seen: the ETA's base

    def __enter__(self) -> StepDisplay:
        if self.live:  # rich only here: every process of a job imports this module, ~0.1 s of imports
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=Console(stderr=False),
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=self.total, info="")
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.stop()

    def recovered(self) -> None:
        self.recoveries += 1

    def eta_s(self, step: int, now: float) -> float | None:
        """Seconds to the last step at the pace since the first step seen (None: unknown yet)."""
        if self._first is None:
            self._first = (step, now)
        done, t0 = step - self._first[0], self._first[1]
        if not self.total or done <= 0:
            return None
        return max(0.0, (self.total - step) * (now - t0) / done)

    def step(self, rec: dict) -> None:
        tps = rec.get("tokens_per_s")
        info = f"loss {rec['loss']:.4f}" + (f"  {tps:,.0f} tok/s" if tps else "") + f"  recoveries {self.recoveries}"
        now = time.monotonic()
        eta = self.eta_s(rec["step"], now)
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=rec["step"], info=info)
            return
        if self.quiet:
            return
        if now - self._last_plain >= self.plain_every_s or rec["step"] == self.total:
            self._last_plain = now
            of = f"/{self.total}" if self.total else ""
            left = f"  eta {eta:.0f}s" if eta is not None else ""
            say(f"step {rec['step']}{of}{left}  {info}")

    def show(self, notice: Notice) -> None:
        """Say what the coordinator noticed (a recovery also counts in the progress line)."""
        if isinstance(notice, Recovered):
            self.recovered()
        if isinstance(notice, TO_STDERR):
            if not (self.quiet and isinstance(notice, SegmentsRemoved)):
                say(render(notice), err=True)
            return
        self.message(render(notice))

    def message(self, text: str) -> None:
        if self._progress is None:
            say(text)
            return
        try:
            self._progress.console.print(text)
        except OSError:
            pass
