"""Errors shared across layers (raised low, reported by the CLI)."""

from __future__ import annotations


class UsageError(Exception):
    """Bad input from the command line: reported in one line, exit code 2."""


class BadValue(ValueError):
    """A value read from the job's store (or a run file) that does not parse as its message:
    the reader logs it with its key and ignores it or fails that one operation."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key or 'a store value'}: {reason}")
        self.key, self.reason = key, reason
