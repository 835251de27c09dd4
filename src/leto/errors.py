"""Errors shared across layers (raised low, reported by the CLI)."""
from __future__ import annotations


class UsageError(Exception):
    """Bad input from the command line: reported in one line, exit code 2."""
