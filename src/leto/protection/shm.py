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
import stat
import warnings
from pathlib import Path

import numpy as np

from leto.errors import UsageError
from leto.protection.layout import Layout
from leto.runtime import linux

SHM_DIR = Path("/dev/shm")

# header fields (int64)
H_MAGIC, H_GEN, H_BASE, H_GCOMMIT, H_DCOMMIT, H_PID, H_STATE, H_ERROR = range(8)
MAGIC = 0x4C45544F  # "LETO"
STATE_RUNNING, STATE_DRAINED = 1, 2

# staging slot header fields (int64)
S_READY, S_KIND, S_STEP, S_CHUNK, S_CRC, S_SEQ = range(6)
# S_READY: the worker's to fill; staged (the keeper's to take); held by the keeper (its tier-2
# batches send from it), the worker's again once they are sent
SLOT_FREE, SLOT_STAGED, SLOT_HELD = 0, 1, 2
KIND_GRAD, KIND_DELTA = 1, 2
EMPTY = -1  # version of a chunk nothing was folded for yet

# Store order. A staging slot is published with plain stores and no fence (Python has none): the
# worker writes the slot's bytes and header fields, then S_READY = 1 (`Protector._publish`); the
# keeper reads S_READY == 1, then the header and bytes (`Keeper.consume_slots`), and hands the
# slot back with S_READY = 0 once it has folded and sent them (`Keeper.hand_back`). This is
# correct only where another core sees one core's stores in program order and loads are not
# reordered with older loads: total store order, x86-64 (each numpy assignment is a separate C
# call, so neither compiler reorders them across one another). On a weaker machine (arm64, POWER)
# the keeper could fold a slot's stale bytes; the checksums recorded with every chunk would then
# fail at decode, and recovery would fall back to tier 2 or stop rather than go on with wrong
# state, but protection would be lost.
TOTAL_STORE_ORDER = frozenset({"x86_64", "amd64", "i386", "i686"})


def check_store_order() -> None:
    """Warn once where the staging protocol's store-order assumption does not hold (above)."""
    machine = platform.machine().lower()
    if machine not in TOTAL_STORE_ORDER:
        warnings.warn(
            f"leto: staging slots rely on total store order (x86-64); this machine is {machine}: "
            f"a reordered slot is caught by its checksum at decode, not prevented",
            RuntimeWarning,
            stacklevel=2,
        )


# ----- names. A job's files are "leto-<job>-g<generation>-n<node>" (a keeper's region) and
# "leto-<job>-owner" (its supervisor's record), where <job> is "<controller pid>-<store port>"
# (one host) or "<job id>-h<node>" (one host of a multi-host job). A job's id is letters, digits,
# '_', '.' and '-' only, and a name parses to one job only (its suffix is fixed and anchored at
# the end), so `job_files` finds exactly one job's files: never those of job "exp-h0" for job "exp".
_ID = r"[A-Za-z0-9_.-]"
_JOB_ID = re.compile(f"{_ID}{{1,64}}")  # a multi-host job's --job-id
_HOST_JOB = re.compile(f"{_ID}{{1,80}}")  # what names one host's files
_JOB_FILE = re.compile(f"leto-({_ID}+)-(?:g\\d+-n\\d+|owner)")
_ONE_HOST_JOB = re.compile(r"(\d+)-\d+")


class NameTaken(UsageError):
    """A file this job must create in /dev/shm exists already (another job of the same id on
    this host, or a file someone else made): the job does not start."""


def check_job_id(job: str, per_host: bool = False) -> str | None:
    """What is wrong with `job` as a job id (a multi-host job's --job-id; with `per_host`, the
    id that names one host's files), or None if nothing is."""
    if (_HOST_JOB if per_host else _JOB_ID).fullmatch(job):
        return None
    return f"a job id is 1-{80 if per_host else 64} letters, digits, '_', '.' or '-'; got {job[:100]!r}"


def region_name(job: str, generation: int, node: int) -> str:
    return f"leto-{job}-g{generation}-n{node}"


def owner_path(job: str) -> Path:
    return SHM_DIR / f"leto-{job}-owner"


def job_files(job: str, shm_dir: Path | None = None) -> list[Path]:
    """Job `job`'s files in /dev/shm: exactly those whose names parse to `job`."""
    shm_dir = SHM_DIR if shm_dir is None else shm_dir
    out = []
    for name in _listdir(shm_dir):
        m = _JOB_FILE.fullmatch(name)
        if m is not None and m.group(1) == job:
            out.append(shm_dir / name)
    return sorted(out)


def remove_job_segments(job: str, shm_dir: Path | None = None) -> list[str]:
    """Remove job `job`'s files (this user's only); returns their names."""
    return [p.name for p in job_files(job, shm_dir) if _unlink_own(p)]


def _listdir(d: Path) -> list[str]:
    try:
        return os.listdir(d)
    except OSError:
        return []


def _unlink_own(path: Path) -> bool:
    """Remove `path` (never followed, if a link) if this user owns it; whether it did."""
    try:
        if os.lstat(path).st_uid != os.getuid():
            return False
        path.unlink()
        return True
    except OSError:
        return False


def _taken(path: Path, what: str) -> NameTaken:
    try:
        st = os.lstat(path)
        whose = f"a symbolic link of user {st.st_uid}" if stat.S_ISLNK(st.st_mode) else f"made by user {st.st_uid}"
    except OSError:
        whose = "gone again"
    return NameTaken(
        f"leto: {what} {path} exists already ({whose}): another job with this id runs on this host, "
        f"or someone else made it; remove it or choose another job id"
    )


def write_owner(job: str, pid: int) -> None:
    """Record that `pid` (alive now) owns job `job`'s segments: a new file, mode 0600, never
    through a link; `NameTaken` if the name exists already."""
    path = owner_path(job)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise _taken(path, "the owner record") from None
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"pid": pid, "start": linux.start_time(pid)}))


def _read_own(path: Path) -> str | None:
    """The text of a regular file of this user at `path` (never through a link), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size > 4096:
            return None
        try:
            return f.read()
        except (OSError, ValueError):
            return None


def _job_alive(shm_dir: Path, job: str) -> bool:
    try:
        owner = json.loads(_read_own(shm_dir / owner_path(job).name) or "null")
    except ValueError:
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
    for name in _listdir(shm_dir):
        m = _JOB_FILE.fullmatch(name)
        if m is None:
            continue
        job = m.group(1)
        if job not in verdict:
            verdict[job] = _job_alive(shm_dir, job)
        if not verdict[job] and _unlink_own(shm_dir / name):
            removed.append(name)
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
        out += [
            ("g1", (2, g.n_chunks, g.grad_bytes), np.uint8),
            ("g1_step", (2, g.n_chunks), np.int64),
            ("g1_count", (2, g.n_chunks), np.int64),
            ("gcrc1", (w, 2, g.n_chunks), np.int64),
        ]
    if layout.tier2 is not None:
        k = layout.tier2[0].k
        L = layout.segment_len
        for s, _ in layout.parity_stripes(node):
            i = s.index
            out += [
                (f"p2_{i}", (L, g.state_bytes), np.uint8),
                (f"v2_{i}", (k, L), np.int64),
                (f"crc2_{i}", (k, L), np.int64),
            ]
            if layout.tier2_preimages:
                out += _preimage_specs(f"p2_{i}", f"crc2_{i}", (k,), L, g.state_bytes)
            if not interval and grads:
                out += [
                    (f"g2_{i}", (2, L, g.grad_bytes), np.uint8),
                    (f"g2_step_{i}", (2, L), np.int64),
                    (f"g2_count_{i}", (2, L), np.int64),
                    (f"gcrc2_{i}", (k, 2, L), np.int64),
                ]
    return out


def _preimage_specs(
    parity: str, crc: str, sources: tuple[int, ...], rows: int, row_bytes: int
) -> list[tuple[str, tuple[int, ...], type]]:
    """A parity array's pre-image: its rows at the step all their sources last agreed on, with
    those sources' checksums and that step (`<parity>_pre`, `<crc>_pre`, `<parity>_pre_step`)."""
    return [
        (f"{parity}_pre", (rows, row_bytes), np.uint8),
        (f"{crc}_pre", (*sources, rows), np.int64),
        (f"{parity}_pre_step", (rows,), np.int64),
    ]


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
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        if create:
            try:
                fd = os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                raise _taken(self.path, "the shared-memory segment") from None
            os.ftruncate(fd, size)
        else:
            fd = os.open(self.path, flags)
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode) or st.st_size != size:
                os.close(fd)
                raise RuntimeError(
                    f"shared region {self.path} is not this job's region of generation "
                    f"{layout.generation} (its owner, type or size differ)"
                )
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
