"""Erasure codes that protect optimizer state held in host memory.

Tier 1 uses `XorCode` (k data blocks + 1 XOR parity, across the workers
of one node); tier 2 uses `ReedSolomonCode` (k data + m parity, across
nodes). Both are systematic codes over GF(2^8) defined by an `m x k` parity
matrix: `parity_j = XOR_i  c[j][i] * data_i`. Block indices `0..k-1` are
data blocks and `k..k+m-1` parity blocks.

Buffers are 1-D, C-contiguous `np.ndarray` of dtype `uint8` and equal
length; any length (odd included) works. Outputs are written into
preallocated buffers, never allocated per call (except missing `out` buffers
in `ErasureCode.decode`).

Implementation
--------------
The field is GF(2^8) with polynomial 0x11D. The Reed-Solomon parity matrix is
a Cauchy matrix `1 / (x_j + y_i)` with `y_i = i` and `x_j = k + j`,
rescaled so that parity row 0 and column 0 are all ones; every square
sub-matrix of a Cauchy matrix is invertible and row/column scaling keeps that,
so any k of the k+m blocks recover the data (MDS). The ones matter: a
coefficient of 1 is a plain XOR (~20 GB/s) instead of a table multiply, so
parity 0 is an XOR parity, a single lost data block is rebuilt from parity 0
with XOR only, and RS(k, m) costs (k-1)(m-1) table multiplies per stripe.

Multiply-accumulate by a constant `c` is a table lookup: blocks are viewed
as uint16 and looked up in a 65536-entry table mapping two bytes to both bytes
times `c` (128 KiB, stays in L2), in chunks of 256 KiB so that the
temporaries stay in cache (np.take widens the indices to an intp temporary 4x
the chunk; 1 MiB chunks fall to ~1 GB/s). Loops run chunk-outer, so every data
chunk is read from memory once per encode. Blocks not 2-byte aligned, and the
last byte of odd-length blocks, use a 256-entry table (slower, still correct).

Measured on the 2-core AMD EPYC dev box (2 MiB L2), 64 MiB of data, single
thread, GB/s of data bytes (`python -m leto.protection.codec_bench 64 k+m`):

    memcpy (preallocated)            16-22      checksum (xxh3-64)      ~30
    xor_into                         17-22
    XorCode(2,1) encode / decode     ~28 / ~27  contribute (per block)   ~16
    XorCode(4,1) encode / decode     ~20 / ~20
    RS(2,2) encode / contribute      ~5.0 / ~4.1
    RS(4,2) encode / contribute      ~3.7 / ~3.1
    RS(6,3) encode / contribute      ~1.9 / ~1.65
    RS(4,2) decode, 1 data lost      ~20 (XOR only, via parity 0)
    RS(4,2) decode, data+parity lost ~4.1
    RS decode, m data blocks lost    (2,2) ~1.75, (4,2) ~1.7, (6,3) ~1.1
    one GF multiply-accumulate term  ~2.5-3.2 (8-bit table: ~1.9;
                                     unchunked np.take: ~0.85)
    zfec 1.6 encode, same (k, m)     (2,2) ~0.85, (4,2) ~1.06, (6,3) ~0.84,
                                     (2,1) ~1.6; and it allocates its outputs
    zfec decode, (4,2), 1 data lost  ~2.1

zfec is slower for every shape measured and cannot write into preallocated
buffers, so it is not used at run time; codec_bench still measures it for
comparison.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable, Mapping, MutableMapping, Sequence

import numpy as np

__all__ = [
    "ErasureCode",
    "ReedSolomonCode",
    "UnrecoverableError",
    "XorCode",
    "gf_inv",
    "gf_mul",
    "make_code",
    "parse_ec",
    "words",
    "xor_into",
]

GF_POLY = 0x11D
_CHUNK_BYTES = 1 << 18


class UnrecoverableError(Exception):
    """Too few blocks survive to reconstruct the data."""


# --------------------------------------------------------------------------
# GF(2^8) arithmetic


def _build_field() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    exp = np.zeros(512, dtype=np.int64)
    log = np.zeros(256, dtype=np.int64)
    x = 1
    for i in range(255):
        exp[i] = x
        log[x] = i
        x <<= 1
        if x & 0x100:
            x ^= GF_POLY
    exp[255:510] = exp[0:255]
    mul = exp[(log[:, None] + log[None, :]) % 255].astype(np.uint8)
    mul[0, :] = 0
    mul[:, 0] = 0
    return exp, log, mul


_EXP, _LOG, _MUL = _build_field()
_MUL.flags.writeable = False


def gf_mul(a: int, b: int) -> int:
    """Product of two field elements (ints in 0..255)."""
    return int(_MUL[a, b])


def gf_inv(a: int) -> int:
    """Multiplicative inverse of a non-zero field element."""
    if not 0 < a < 256:
        raise ValueError(f"gf_inv: {a} has no inverse in GF(256)")
    return int(_EXP[(255 - _LOG[a]) % 255])


def _mat_inv(rows: Sequence[Sequence[int]]) -> list[list[int]]:
    """Inverse of a square matrix over GF(256) (Gauss-Jordan)."""
    n = len(rows)
    a = [list(r) + [int(i == j) for j in range(n)] for i, r in enumerate(rows)]
    for col in range(n):
        pivot = next((r for r in range(col, n) if a[r][col]), None)
        if pivot is None:
            raise ValueError("singular matrix over GF(256)")
        a[col], a[pivot] = a[pivot], a[col]
        inv = gf_inv(a[col][col])
        a[col] = [gf_mul(inv, v) for v in a[col]]
        for r in range(n):
            f = a[r][col]
            if r != col and f:
                a[r] = [v ^ gf_mul(f, p) for v, p in zip(a[r], a[col])]
    return [r[n:] for r in a]


@functools.lru_cache(maxsize=64)
def _table16(c: int) -> np.ndarray:
    """uint16 -> uint16 table multiplying both bytes by `c`.

    Byte-wise, so it is independent of the machine's endianness.
    """
    v = np.arange(65536, dtype=np.uint32)
    row = _MUL[c].astype(np.uint32)
    table = (row[v & 0xFF] | (row[v >> 8] << 8)).astype(np.uint16)
    table.flags.writeable = False
    return table


def _table8(c: int) -> np.ndarray:
    return _MUL[c]


# --------------------------------------------------------------------------
# Buffer helpers

_tls = threading.local()


def _scratch() -> np.ndarray:
    buf = getattr(_tls, "scratch", None)
    if buf is None:
        buf = np.empty(_CHUNK_BYTES, dtype=np.uint8)
        _tls.scratch = buf
    return buf


def _check_block(b: object, what: str, *, writable: bool = False) -> np.ndarray:
    if not isinstance(b, np.ndarray):
        raise ValueError(f"{what}: expected np.ndarray of uint8, got {type(b).__name__}")
    if b.dtype != np.uint8 or b.ndim != 1:
        raise ValueError(f"{what}: expected 1-D uint8 array, got {b.ndim}-D {b.dtype}")
    if not b.flags.c_contiguous:
        raise ValueError(f"{what}: array must be contiguous")
    if writable and not b.flags.writeable:
        raise ValueError(f"{what}: array is read-only")
    return b


def _check_lengths(named: Sequence[tuple[str, np.ndarray]]) -> int:
    lengths = {len(b) for _, b in named}
    if len(lengths) > 1:
        desc = ", ".join(f"{name}={len(b)}" for name, b in named)
        raise ValueError(f"blocks must have equal length, got {desc}")
    return lengths.pop() if lengths else 0


def _check_disjoint(outs: Sequence[np.ndarray], ins: Sequence[np.ndarray]) -> None:
    for o in outs:
        for i in ins:
            if np.may_share_memory(o, i):
                raise ValueError("output buffers must not overlap input blocks")


def words(block: np.ndarray) -> np.ndarray:
    """The view of a 1-D uint8 block that XOR runs fastest on: 8-byte words when its length
    allows (numpy handles unaligned words itself). Buffers folded many times keep theirs, so
    that a fold is one `np.bitwise_xor(d, s, out=d)`."""
    return block.view(np.uint64) if len(block) % 8 == 0 else block


def xor_into(dst: np.ndarray, src: np.ndarray) -> None:
    """`dst ^= src` in place, over `words`."""
    _check_block(dst, "xor_into dst", writable=True)
    _check_block(src, "xor_into src")
    if len(dst) != len(src):
        raise ValueError(f"xor_into: length mismatch, dst={len(dst)} src={len(src)}")
    d = words(dst)
    np.bitwise_xor(d, words(src), out=d)


def _lincomb(
    coeffs: Sequence[Sequence[int]],
    srcs: Sequence[np.ndarray],
    dsts: Sequence[np.ndarray],
    accumulate: bool,
) -> None:
    """`dsts[j] (^)= XOR_i coeffs[j][i] * srcs[i]` over GF(256).

    Overwrites `dsts` unless `accumulate`. Inputs are validated by callers.
    """
    n = len(srcs[0]) if srcs else len(dsts[0])
    wide = all(a.ctypes.data % 2 == 0 for a in (*srcs, *dsts))
    n2 = n & ~1 if wide else 0
    if n2:
        _lincomb_words(
            coeffs,
            [a[:n2].view(np.uint16) for a in srcs],
            [a[:n2].view(np.uint16) for a in dsts],
            accumulate,
            _table16,
        )
    if n2 < n:
        _lincomb_words(coeffs, [a[n2:] for a in srcs], [a[n2:] for a in dsts], accumulate, _table8)


def _lincomb_words(
    coeffs: Sequence[Sequence[int]],
    srcs: Sequence[np.ndarray],
    dsts: Sequence[np.ndarray],
    accumulate: bool,
    table: Callable[[int], np.ndarray],
) -> None:
    n = len(dsts[0])
    dtype = dsts[0].dtype
    step = _CHUNK_BYTES // dtype.itemsize
    tmp_all = _scratch().view(dtype)
    tables = [[table(c) if c > 1 else None for c in row] for row in coeffs]
    for s in range(0, n, step):
        e = min(n, s + step)
        tmp = tmp_all[: e - s]
        chunks = [src[s:e] for src in srcs]
        for j, dst in enumerate(dsts):
            d = dst[s:e]
            fresh = not accumulate
            for c, tab, x in zip(coeffs[j], tables[j], chunks):
                if c == 0:
                    continue
                if c == 1:
                    if fresh:
                        np.copyto(d, x)
                    else:
                        np.bitwise_xor(d, x, out=d)
                elif fresh:
                    np.take(tab, x, out=d, mode="wrap")
                else:
                    np.take(tab, x, out=tmp, mode="wrap")
                    np.bitwise_xor(d, tmp, out=d)
                fresh = False
            if fresh:
                d.fill(0)


# --------------------------------------------------------------------------
# Codes


class ErasureCode:
    """Systematic (k data + m parity) erasure code over GF(256).

    Attributes:
        k: number of data blocks.
        m: number of parity blocks.
        parity_matrix: `m x k` coefficients, `parity_j = XOR_i c[j][i]*data_i`.
    """

    k: int
    m: int
    parity_matrix: tuple[tuple[int, ...], ...]

    def __init__(self, k: int, m: int, parity_matrix: Sequence[Sequence[int]]) -> None:
        _validate_km(k, m)
        rows = tuple(tuple(int(c) for c in row) for row in parity_matrix)
        if len(rows) != m or any(len(r) != k for r in rows):
            raise ValueError(f"parity matrix must be {m}x{k}")
        self.k, self.m, self.parity_matrix = k, m, rows
        self._inverse = functools.lru_cache(maxsize=256)(self._decode_matrix)

    @property
    def n(self) -> int:
        """Total number of blocks, k + m."""
        return self.k + self.m

    def __repr__(self) -> str:
        return f"{type(self).__name__}(k={self.k}, m={self.m})"

    # -- encoding ---------------------------------------------------------

    def encode(self, data: Sequence[np.ndarray], out: Sequence[np.ndarray]) -> None:
        """Write the m parity blocks of `data` (k blocks) into `out`."""
        data, out = self._check_encode(data, out)
        _lincomb(self.parity_matrix, data, out, accumulate=False)

    def contribute(self, i: int, block: np.ndarray, out: Sequence[np.ndarray]) -> None:
        """XOR data block `i`'s share into each of the m parity buffers.

        Starting from zeroed `out`, contributing every data block once (any
        order) yields the same parity as `encode`.
        """
        if not 0 <= i < self.k:
            raise ValueError(f"data block index {i} out of range 0..{self.k - 1}")
        block = _check_block(block, f"data block {i}")
        out = self._check_parity_out(out)
        _check_lengths([(f"data {i}", block)] + [(f"out {j}", o) for j, o in enumerate(out)])
        _check_disjoint(out, [block])
        column = [[row[i]] for row in self.parity_matrix]
        _lincomb(column, [block], out, accumulate=True)

    def _check_encode(
        self, data: Sequence[np.ndarray], out: Sequence[np.ndarray]
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        if len(data) != self.k:
            raise ValueError(f"{self!r}.encode needs {self.k} data blocks, got {len(data)}")
        blocks = [_check_block(b, f"data block {i}") for i, b in enumerate(data)]
        outs = self._check_parity_out(out)
        _check_lengths([(f"data {i}", b) for i, b in enumerate(blocks)] + [(f"out {j}", o) for j, o in enumerate(outs)])
        _check_disjoint(outs, blocks)
        return blocks, outs

    def _check_parity_out(self, out: Sequence[np.ndarray]) -> list[np.ndarray]:
        if len(out) != self.m:
            raise ValueError(f"{self!r} needs {self.m} parity buffers, got {len(out)}")
        return [_check_block(o, f"parity buffer {j}", writable=True) for j, o in enumerate(out)]

    # -- decoding ---------------------------------------------------------

    def decode(
        self,
        available: Mapping[int, np.ndarray],
        out: MutableMapping[int, np.ndarray] | None = None,
    ) -> dict[int, np.ndarray]:
        """Return all k data blocks from any k available blocks.

        `available` maps block index (0..k+m-1) to block. Available data
        blocks are returned as-is (same objects). A missing data block `e` is
        written into `out[e]` when `out` holds a buffer for it, else into a
        new array (also stored into `out` when `out` is given).

        Raises:
            UnrecoverableError: fewer than k blocks are available.
        """
        present = self._check_available(available)
        length = _check_lengths([(f"block {i}", available[i]) for i in present])
        missing = [i for i in range(self.k) if i not in available]
        if len(present) < self.k:
            raise UnrecoverableError(self._unrecoverable_message(present))
        result = {i: available[i] for i in range(self.k) if i in available}
        if not missing:
            return result
        targets = self._targets(missing, length, out)
        chosen = [i for i in present if i < self.k]
        chosen += [i for i in present if i >= self.k][: len(missing)]
        inverse = self._inverse(tuple(chosen))
        srcs = [available[i] for i in chosen]
        _check_disjoint(targets, srcs)
        _lincomb([inverse[e] for e in missing], srcs, targets, accumulate=False)
        result.update(zip(missing, targets))
        return dict(sorted(result.items()))

    def recovery_coefficients(self, present: Sequence[int]) -> tuple[list[int], dict[int, list[int]]]:
        """For distributed decoding: (chosen, coeffs) with every missing data block
        `e = XOR_b coeffs[e][b] * block chosen[b]`, so each holder of a chosen block can
        contribute its scaled block to a BXOR reduction.

        Raises:
            UnrecoverableError: fewer than k blocks are present.
        """
        present = sorted(set(int(i) for i in present))
        if len(present) < self.k:
            raise UnrecoverableError(self._unrecoverable_message(present))
        missing = [i for i in range(self.k) if i not in present]
        chosen = [i for i in present if i < self.k]
        chosen += [i for i in present if i >= self.k][: len(missing)]
        inverse = self._inverse(tuple(chosen))
        return chosen, {e: list(inverse[e]) for e in missing}

    def _check_available(self, available: Mapping[int, np.ndarray]) -> list[int]:
        for i, block in available.items():
            if not isinstance(i, (int, np.integer)) or not 0 <= i < self.n:
                raise ValueError(f"block index {i!r} out of range 0..{self.n - 1}")
            _check_block(block, f"block {i}")
        return sorted(available)

    def _targets(
        self,
        missing: Sequence[int],
        length: int,
        out: MutableMapping[int, np.ndarray] | None,
    ) -> list[np.ndarray]:
        targets = []
        for e in missing:
            buf = out.get(e) if out is not None else None
            if buf is None:
                buf = np.empty(length, dtype=np.uint8)
                if out is not None:
                    out[e] = buf
            _check_block(buf, f"out buffer {e}", writable=True)
            if len(buf) != length:
                raise ValueError(f"out buffer {e} has length {len(buf)}, blocks have {length}")
            targets.append(buf)
        return targets

    def _unrecoverable_message(self, present: Sequence[int]) -> str:
        lost = [i for i in range(self.n) if i not in present]
        lost_data = [i for i in lost if i < self.k]
        lost_parity = [i for i in lost if i >= self.k]
        return (
            f"{self!r}: cannot reconstruct data; {len(lost)} blocks missing "
            f"(data {lost_data}, parity {lost_parity}), only {len(present)} of "
            f"{self.n} available but {self.k} are needed (at most {self.m} may be lost)"
        )

    def _decode_matrix(self, chosen: tuple[int, ...]) -> list[list[int]]:
        """Inverse of the generator rows `chosen`: data = inverse * blocks."""
        rows = [[int(i == c) for c in range(self.k)] if i < self.k else self.parity_matrix[i - self.k] for i in chosen]
        return _mat_inv(rows)


class XorCode(ErasureCode):
    """k data blocks + 1 XOR parity block (RAID-5 style); any k >= 1."""

    def __init__(self, k: int, m: int = 1) -> None:
        if m != 1:
            raise ValueError(f"XorCode has exactly one parity block, got m={m}")
        super().__init__(k, 1, [[1] * k])

    def encode(self, data: Sequence[np.ndarray], out: Sequence[np.ndarray]) -> None:
        """Write `data[0] ^ ... ^ data[k-1]` into `out[0]`."""
        data, out = self._check_encode(data, out)
        _xor_all(data, out[0])

    def contribute(self, i: int, block: np.ndarray, out: Sequence[np.ndarray]) -> None:
        """`out[0] ^= block` (data block `i`'s share of the parity)."""
        if not 0 <= i < self.k:
            raise ValueError(f"data block index {i} out of range 0..{self.k - 1}")
        (parity,) = self._check_parity_out(out)
        _check_block(block, f"data block {i}")
        _check_disjoint([parity], [block])
        xor_into(parity, block)

    def decode(
        self,
        available: Mapping[int, np.ndarray],
        out: MutableMapping[int, np.ndarray] | None = None,
    ) -> dict[int, np.ndarray]:
        """Return all k data blocks; a missing one is the XOR of the others."""
        present = self._check_available(available)
        length = _check_lengths([(f"block {i}", available[i]) for i in present])
        if len(present) < self.k:
            raise UnrecoverableError(self._unrecoverable_message(present))
        result = {i: available[i] for i in range(self.k) if i in available}
        missing = [i for i in range(self.k) if i not in available]
        if missing:
            (e,) = missing
            (target,) = self._targets(missing, length, out)
            srcs = [available[i] for i in present]
            _check_disjoint([target], srcs)
            _xor_all(srcs, target)
            result[e] = target
        return dict(sorted(result.items()))


def scale_into(dst: np.ndarray, c: int, src: np.ndarray) -> None:
    """dst ^= c * src over GF(256) (a plain XOR when c == 1)."""
    if c == 1:
        xor_into(dst, src)
    elif c != 0:
        _lincomb([[c]], [src], [dst], accumulate=True)


def _xor_all(srcs: Sequence[np.ndarray], dst: np.ndarray) -> None:
    """`dst = XOR of srcs` (at least one source)."""
    if len(srcs) == 1:
        np.copyto(dst, srcs[0])
        return
    if len(srcs) > 2:
        # Chunk so that dst stays in cache while the sources stream through.
        _lincomb([[1] * len(srcs)], srcs, [dst], accumulate=False)
        return
    np.bitwise_xor(srcs[0], srcs[1], out=dst)


class ReedSolomonCode(ErasureCode):
    """Systematic Reed-Solomon (Cauchy) code, k data + m parity, k + m <= 256."""

    def __init__(self, k: int, m: int) -> None:
        _validate_km(k, m)
        super().__init__(k, m, _cauchy_matrix(k, m))


def _cauchy_matrix(k: int, m: int) -> list[list[int]]:
    rows = [[gf_inv((k + j) ^ i) for i in range(k)] for j in range(m)]
    col_scale = [gf_inv(c) for c in rows[0]]
    rows = [[gf_mul(c, s) for c, s in zip(row, col_scale)] for row in rows]
    return [[gf_mul(c, gf_inv(row[0])) for c in row] for row in rows]


def _validate_km(k: int, m: int) -> None:
    if not isinstance(k, (int, np.integer)) or not isinstance(m, (int, np.integer)):
        raise ValueError(f"k and m must be integers, got k={k!r}, m={m!r}")
    if k < 1 or m < 1:
        raise ValueError(f"erasure code needs k >= 1 and m >= 1, got k={k}, m={m}")
    if k + m > 256:
        raise ValueError(f"GF(256) codes need k + m <= 256, got k={k}, m={m}")


def make_code(k: int, m: int) -> ErasureCode:
    """XorCode when m == 1, else ReedSolomonCode."""
    _validate_km(k, m)
    return XorCode(k) if m == 1 else ReedSolomonCode(k, m)


_EC_SPEC = re.compile(r"\s*([0-9]+)\s*\+\s*([0-9]+)\s*")


def parse_ec(spec: str) -> tuple[int, int]:
    """Parse an erasure-code spec `"k+m"` (e.g. `"2+1"`) into `(k, m)`."""
    match = _EC_SPEC.fullmatch(spec) if isinstance(spec, str) else None
    if match is None:
        raise ValueError(f"bad erasure-code spec {spec!r}: expected 'k+m' such as '2+1' or '4+2'")
    k, m = int(match[1]), int(match[2])
    try:
        _validate_km(k, m)
    except ValueError as exc:
        raise ValueError(f"bad erasure-code spec {spec!r}: {exc}") from None
    return k, m
