"""What the controller shows: a rich progress bar on a terminal, plain lines otherwise."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def parse_records(lines: list[bytes] | list[str]) -> list[dict]:
    """JSON objects from JSON lines; torn or foreign lines are skipped."""
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def read_jsonl(path: Path) -> list[dict]:
    """Every record of a metrics.jsonl-style file ([] when it does not exist yet)."""
    try:
        return parse_records(path.read_text().splitlines())
    except FileNotFoundError:
        return []


class MetricsTail:
    """Reads the records appended to a metrics.jsonl since the last call."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, b""

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        return parse_records(lines)


class StepDisplay:
    """Shows training steps (step, loss, tokens/s) and events as they arrive."""

    def __init__(self, total: int | None, plain_every_s: float = 2.0, quiet: bool = False) -> None:
        self.total = total
        self.quiet = quiet
        self.console = Console(stderr=False)
        self.live = sys.stdout.isatty() and not quiet
        self.plain_every_s = plain_every_s
        self._last_plain = 0.0
        self._progress: Progress | None = None
        self._task = None

    def __enter__(self) -> StepDisplay:
        if self.live:
            self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                      console=self.console, transient=False)
            self._progress.start()
            self._task = self._progress.add_task("train", total=self.total, info="")
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.stop()

    def step(self, rec: dict) -> None:
        tps = rec.get("tokens_per_s")
        info = f"loss {rec['loss']:.4f}" + (f"  {tps:,.0f} tok/s" if tps else "")
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=rec["step"], info=info)
            return
        now = time.monotonic()
        if self.quiet:
            return
        if now - self._last_plain >= self.plain_every_s or rec["step"] == self.total:
            self._last_plain = now
            of = f"/{self.total}" if self.total else ""
            print(f"step {rec['step']}{of}  {info}", flush=True)

    def message(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(text, flush=True)
