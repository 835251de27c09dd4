"""Checksums that detect corrupted protection data.

:func:`checksum` is CRC-32 (``zlib.crc32``): deterministic across processes
and machines, detects every burst error up to 32 bits (so every single
flipped bit). Measured ~6.8 GB/s on the 2-core dev box (64 MiB buffer);
adler32 was ~4 GB/s, blake2b ~1.3 GB/s, sha1 ~2.1 GB/s. zlib releases the GIL
on large buffers, so checksums can overlap other threads' work.
"""

from __future__ import annotations

import zlib

import numpy as np

__all__ = ["CorruptionError", "checksum", "verify"]

Buffer = np.ndarray | memoryview | bytes | bytearray


def checksum(buf: Buffer) -> int:
    """CRC-32 (unsigned, 0..2**32-1) of the raw bytes of ``buf``.

    Non-contiguous arrays are copied to contiguous memory first (slow path).
    """
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            buf = np.ascontiguousarray(buf)
        data: object = buf.reshape(-1).view(np.uint8) if buf.size else b""
    elif isinstance(buf, memoryview):
        data = buf if buf.c_contiguous else buf.tobytes()
    else:
        data = buf
    return zlib.crc32(data) & 0xFFFFFFFF  # type: ignore[arg-type]


class CorruptionError(Exception):
    """Stored data does not match its checksum.

    Attributes:
        what: description of the corrupt data (e.g. "tier-1 parity").
        expected: checksum recorded when the data was written.
        actual: checksum of the data as found.
        owner: rank or node owning the data, if known.
        chunk: chunk index, if known.
        step: training step the data belongs to, if known.
    """

    def __init__(
        self,
        what: str,
        expected: int,
        actual: int,
        *,
        owner: int | None = None,
        chunk: int | None = None,
        step: int | None = None,
    ) -> None:
        self.what, self.expected, self.actual = what, expected, actual
        self.owner, self.chunk, self.step = owner, chunk, step
        where = ", ".join(
            f"{name} {value}"
            for name, value in (("owner", owner), ("chunk", chunk), ("step", step))
            if value is not None
        )
        super().__init__(
            f"corrupt {what}{f' ({where})' if where else ''}: "
            f"checksum {actual:#010x}, expected {expected:#010x}"
        )


def verify(
    buf: Buffer,
    expected: int,
    what: str,
    *,
    owner: int | None = None,
    chunk: int | None = None,
    step: int | None = None,
) -> None:
    """Raise :class:`CorruptionError` if ``checksum(buf) != expected``."""
    actual = checksum(buf)
    if actual != expected:
        raise CorruptionError(what, expected, actual, owner=owner, chunk=chunk, step=step)
