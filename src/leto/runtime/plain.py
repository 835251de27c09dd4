"""Tensors and plain data to bytes and back, where reading never runs code.

What one process hands another (a rank's registered state, a checkpoint's extra state) is
encoded with `torch.save` and decoded with `torch.load(weights_only=True)`, torch's restricted
unpickler: it builds tensors and containers and refuses any other object, so bytes from a peer
or a file cannot name a function to call. `check` refuses, on the sending side and with a path
to the offending value, anything but the plain types below: sets too (their order of iteration
differs between processes, so they would not restore bit for bit).
"""

from __future__ import annotations

import io
import re
from collections import OrderedDict
from typing import Any

import torch

SCALARS = (str, bytes, int, float, bool, type(None))
_ZIP = b"PK\x03\x04"  # torch.save writes a zip archive
ALLOWED = "tensors, dict, list, tuple, str, bytes, int, float, bool and None"


class NotPlainData(TypeError):
    """A value that is not tensors and plain data (the message names where it is)."""


def check(obj: Any, where: str) -> None:
    """Raise NotPlainData unless `obj` is built only of tensors and plain data; `where` names it."""
    todo: list[tuple[Any, str]] = [(obj, where)]
    while todo:
        value, path = todo.pop()
        kind = type(value)  # exact types: a subclass (numpy's float64, an IntEnum) pickles as itself
        if kind in SCALARS or kind in (torch.Tensor, torch.nn.Parameter):
            continue
        if kind in (list, tuple):
            todo.extend((v, f"{path}[{i}]") for i, v in enumerate(value))
        elif kind in (dict, OrderedDict):
            for k, v in value.items():
                if type(k) not in SCALARS:
                    raise NotPlainData(f"{path} has a key of type {type(k).__name__}; keys must be plain scalars")
                todo.append((v, f"{path}[{k!r}]"))
        else:
            raise NotPlainData(f"{path} is {_describe(value)}; only {ALLOWED} can be carried")


def _describe(value: Any) -> str:
    kind = type(value)
    name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return f"of type {name}"


def dumps(obj: Any) -> bytes:
    """The bytes of `obj` (tensors and plain data; see `check`)."""
    f = io.BytesIO()
    torch.save(obj, f)
    return f.getvalue()


def loads(data: bytes, what: str) -> Any:
    """Decode bytes from `dumps` without running code; NotPlainData (naming `what` and the
    problem) if they hold anything but tensors and plain data, or are not such bytes at all."""
    if not data.startswith(_ZIP):  # torch's legacy formats would take other paths through pickle
        raise NotPlainData(f"{what} is not in torch.save's format, refused")
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 - the unpickler raises several kinds; one clear error
        raise NotPlainData(f"{what} is not tensors and plain data, refused: {_reason(e)}") from None


def _reason(e: Exception) -> str:
    """The line of torch's message that names the problem (it is wrapped in advice to trust the file)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    named = [line for line in lines if re.search(r"GLOBAL|Unsupported|WeightsUnpickler", line)]
    return ((named or lines or [type(e).__name__])[0])[:300]
