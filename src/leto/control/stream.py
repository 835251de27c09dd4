"""The job's two append-only streams in the store: commands (coordinator to supervisors) and
reports (supervisors to coordinator).

An entry is written in two steps: its number is reserved on the stream's counter, then the
entry is created under that number. A writer killed between the two (its host lost) leaves a
number reserved and never written, and a reader that takes the entries in order would wait at
it for good: a joined host's supervisor would never start what the next coordinator asks of
it. So a reader that finds a number reserved and unwritten for `HOLE_S` fills it with
`TOMBSTONE`, create-if-absent (`Store.compare_set` with an empty expected value), and passes
over it; a writer creates its entry the same way, and one that finds its number filled (it
was slower than `HOLE_S`, not dead) appends the entry again under a new number. Nothing is lost
and no reader waits for a dead writer.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch.distributed as dist

from leto.errors import BadValue
from leto.protocol.messages import parse_int

HOLE_S = 3.0  # a number reserved this long and still unwritten: its writer is taken for dead
TOMBSTONE = b"\x00hole"  # not JSON: no message of the streams reads as it
APPEND_TRIES = 3  # a writer slower than HOLE_S three times running: the store is failing


class StreamStalled(RuntimeError):
    """A writer's entry was filled as a hole every time it tried: the store answered it slower
    than `HOLE_S` between reserving a number and writing it, `APPEND_TRIES` times running."""


def append(store: dist.Store, counter: str, entry: Callable[[int], str], value: str) -> int:
    """Append `value` to the stream counted by `counter`, with entries at `entry(number)`; its number."""
    data = value.encode()
    for _ in range(APPEND_TRIES):
        seq = store.add(counter, 1) - 1
        if store.compare_set(entry(seq), "", data) == data:
            return seq
    raise StreamStalled(
        f"{counter}: {APPEND_TRIES} entries were taken for holes before they could be written (the store "
        f"answered slower than {HOLE_S:g}s between reserving a number and writing it)"
    )


class Reader:
    """Takes a stream's entries in order from number `first` on, passing over holes (see the module)."""

    def __init__(self, store: dist.Store, counter: str, entry: Callable[[int], str], first: int = 0) -> None:
        self.store, self.counter, self.entry = store, counter, entry
        self.next = first
        self._hole_since: float | None = None  # when `next` was first seen reserved and unwritten
        self._counter_read = float("-inf")

    def skip_to(self, seq: int) -> None:
        """Go on from number `seq` (a takeover that has read the entries before it)."""
        if seq > self.next:
            self.next, self._hole_since = seq, None

    def take(self) -> tuple[str, bytes] | None:
        """The next entry written, key and value, taken (None while there is none yet); holes
        are passed over."""
        while True:
            key = self.entry(self.next)
            if self.store.check([key]):
                value = self.store.get(key)
            elif self._is_hole():
                value = self.store.compare_set(key, "", TOMBSTONE)  # a late writer's entry, if it won
            else:
                return None
            self.next += 1
            self._hole_since = None
            if value != TOMBSTONE:
                return key, value

    def _is_hole(self) -> bool:
        """Whether the next number has been reserved and unwritten for `HOLE_S` (the counter is
        read at most twice a `HOLE_S` while the stream is idle)."""
        now = time.monotonic()
        if self._hole_since is not None:
            return now - self._hole_since >= HOLE_S
        if now - self._counter_read < HOLE_S / 2:
            return False
        self._counter_read = now
        if not self.store.check([self.counter]):
            return False
        try:
            reserved = parse_int(self.store.get(self.counter), self.counter, minimum=0)
        except BadValue:  # a malformed counter: its readers say so; no hole is taken from it
            return False
        if reserved > self.next:
            self._hole_since = now
        return False
