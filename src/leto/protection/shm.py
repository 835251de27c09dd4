"""The keeper's shared-memory region: one file in /dev/shm per node and generation.

Keeper and workers compute the same array offsets from the `Layout`, so a worker maps its
keeper's region by name and reads tables / writes staging slots in place (no copies beyond the
one hand-off of the bytes themselves).
"""
from __future__ import annotations

import json
import mmap
import os
import platform
import re
import warnings
from pathlib import Path

import numpy as np

from leto.protection.layout import Layout
from leto.runtime import linux

SHM_DIR = Path("/dev/shm")

# header fields (int64)
H_MAGIC, H_GEN, H_BASE, H_GCOMMIT, H_DCOMMIT, H_PID, H_STATE, H_ERROR = range(8)
MAGIC = 0x4C45544F  # "LETO"
STATE_RUNNING, STATE_DRAINED = 1, 2

# staging slot header fields (int64)
S_READY, S_KIND, S_STEP, S_CHUNK, S_CRC, S_SEQ = range(6)
KIND_GRAD, KIND_DELTA = 1, 2
EMPTY = -1  # version of a chunk nothing was folded for yet

# Store order. A staging slot is published with plain stores and no fence (Python has none): the
# worker writes the slot's bytes and header fields, then S_READY = 1 (`Protector._publish`); the
# keeper reads S_READY == 1, then the header and bytes (`Keeper._consume_slots`), and hands the
# slot back with S_READY = 0 after it has read them. This is correct only where another core sees
# one core's stores in program order and loads are not reordered with older loads: total store
# order, x86-64 (each numpy assignment is a separate C call, so neither compiler reorders them
# across one another). On a weaker machine (arm64, POWER) the keeper could fold a slot's stale
# bytes; the checksums recorded with every chunk would then fail at decode, and recovery would
# fall back to tier 2 or stop rather than go on with wrong state, but protection would be lost.
TOTAL_STORE_ORDER = frozenset({"x86_64", "amd64", "i386", "i686"})


def check_store_order() -> None:
    """Warn once where the staging protocol's store-order assumption does not hold (above)."""
    machine = platform.machine().lower()
    if machine not in TOTAL_STORE_ORDER:
        warnings.warn(f"leto: staging slots rely on total store order (x86-64); this machine is {machine}: "
                      f"a reordered slot is caught by its checksum at decode, not prevented", RuntimeWarning,
                      stacklevel=2)


def region_name(job: str, generation: int, node: int) -> str:
    return f"leto-{job}-g{generation}-n{node}"


# ----- leftovers of dead jobs. A job id is "<controller pid>-<store port>" (one host) or
# "<job id>-h<node>" (one host of a multi-host job); the supervisor writes an owner record naming
# its pid and start time, so a reused pid is not taken for it.
_JOB_FILE = re.compile(r"leto-(.+?)-(?:g\d+-n\d+|owner)")
_ONE_HOST_JOB = re.compile(r"(\d+)-\d+")


def owner_path(job: str) -> Path:
    return SHM_DIR / f"leto-{job}-owner"


def write_owner(job: str, pid: int) -> None:
    """Record that `pid` (alive now) owns job `job`'s segments."""
    owner_path(job).write_text(json.dumps({"pid": pid, "start": linux.start_time(pid)}))


def _job_alive(shm_dir: Path, job: str) -> bool:
    try:
        owner = json.loads((shm_dir / owner_path(job).name).read_text())
    except (OSError, ValueError):
        owner = None
    named = _ONE_HOST_JOB.fullmatch(job)
    if isinstance(owner, dict) and isinstance(owner.get("pid"), int):
        pid = owner["pid"]
    elif named is not None:  # no owner record (yet, or an older Leto): a live pid keeps its segments
        return linux.start_time(int(named.group(1))) is not None
    else:
        return True  # nothing says whose they are: keep them
    start = linux.start_time(pid)
    return start is not None and owner.get("start") in (None, start)


def remove_dead_segments(shm_dir: Path | None = None) -> list[str]:
    """Remove the /dev/shm files of jobs whose controller is gone (a SIGKILLed controller
    leaves its keepers' segments behind); a live job's are never touched. Returns their names."""
    shm_dir = SHM_DIR if shm_dir is None else shm_dir
    removed: list[str] = []
    verdict: dict[str, bool] = {}
    for path in shm_dir.glob("leto-*"):
        m = _JOB_FILE.fullmatch(path.name)
        if m is None:
            continue
        job = m.group(1)
        if job not in verdict:
            verdict[job] = _job_alive(shm_dir, job)
        if not verdict[job]:
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return sorted(removed)


def specs(layout: Layout, node: int) -> list[tuple[str, tuple[int, ...], type]]:
    """(name, shape, dtype) of every array in `node`'s region, in file order."""
    g = layout.geometry
    w = len(layout.local_ranks(node))
    r = layout.ring_slots
    out: list[tuple[str, tuple[int, ...], type]] = [
        ("header", (16,), np.int64),
        ("slot_hdr", (w, r, 8), np.int64),
        ("slot_data", (w, r, g.state_bytes), np.uint8),
        ("p1", (g.n_chunks, g.state_bytes), np.uint8),
        ("v1", (w, g.n_chunks), np.int64),
        ("crc1", (w, g.n_chunks), np.int64),
    ]
    # an interval keeps parity pre-images instead of gradients ("Protection interval"); replicated
    # gradients (gloo) need neither
    interval, grads = layout.protect_every > 1, layout.protects_grads
    if interval:
        out += _preimage_specs("p1", "crc1", (w,), g.n_chunks, g.state_bytes)
    elif grads:
        out += [("g1", (2, g.n_chunks, g.grad_bytes), np.uint8), ("g1_step", (2, g.n_chunks), np.int64),
                ("g1_count", (2, g.n_chunks), np.int64), ("gcrc1", (w, 2, g.n_chunks), np.int64)]
    if layout.tier2 is not None:
        k = layout.tier2[0].k
        L = layout.segment_len
        for s, _ in layout.parity_stripes(node):
            i = s.index
            out += [(f"p2_{i}", (L, g.state_bytes), np.uint8), (f"v2_{i}", (k, L), np.int64),
                    (f"crc2_{i}", (k, L), np.int64)]
            if layout.tier2_preimages:
                out += _preimage_specs(f"p2_{i}", f"crc2_{i}", (k,), L, g.state_bytes)
            if not interval and grads:
                out += [(f"g2_{i}", (2, L, g.grad_bytes), np.uint8), (f"g2_step_{i}", (2, L), np.int64),
                        (f"g2_count_{i}", (2, L), np.int64), (f"gcrc2_{i}", (k, 2, L), np.int64)]
    return out


def _preimage_specs(parity: str, crc: str, sources: tuple[int, ...], rows: int,
                    row_bytes: int) -> list[tuple[str, tuple[int, ...], type]]:
    """A parity array's pre-image: its rows at the step all their sources last agreed on, with
    those sources' checksums and that step (`<parity>_pre`, `<crc>_pre`, `<parity>_pre_step`)."""
    return [(f"{parity}_pre", (rows, row_bytes), np.uint8), (f"{crc}_pre", (*sources, rows), np.int64),
            (f"{parity}_pre_step", (rows,), np.int64)]


class Region:
    """Named numpy views over one node's shared-memory file."""

    def __init__(self, layout: Layout, job: str, node: int, create: bool) -> None:
        self.layout, self.node = layout, node
        self.path = SHM_DIR / region_name(job, layout.generation, node)
        arrays = specs(layout, node)
        offsets, size = [], 0
        for _, shape, dtype in arrays:
            size = -(-size // 64) * 64  # cache-line aligned arrays
            offsets.append(size)
            size += int(np.prod(shape)) * np.dtype(dtype).itemsize
        self.nbytes = size
        if create:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, size)
        else:
            fd = os.open(self.path, os.O_RDWR)
            if os.fstat(fd).st_size != size:
                os.close(fd)
                raise RuntimeError(f"shared region {self.path} has the wrong size for generation {layout.generation}")
        try:
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.arrays: dict[str, np.ndarray] = {}
        for (name, shape, dtype), off in zip(arrays, offsets):
            self.arrays[name] = np.ndarray(shape, dtype=dtype, buffer=self._mm, offset=off)
        if create:
            for name, arr in self.arrays.items():
                if name in ("v1", "g1_step") or name.startswith(("v2_", "g2_step_")) or name.endswith("_pre_step"):
                    arr[...] = EMPTY

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]

    @property
    def header(self) -> np.ndarray:
        return self.arrays["header"]

    def close(self) -> None:
        self.arrays.clear()
        try:
            self._mm.close()
        except BufferError:  # a view is still referenced somewhere; the mapping goes with the process
            pass

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)
