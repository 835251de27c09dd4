"""Side-by-side throughput of the protection primitives on this machine.

Run `python -m leto.protection.codec_bench [nbytes_mib] [k+m]`.
All buffers are preallocated; each figure is the median of `repeats` runs,
in GB/s (1e9 bytes per second) of data bytes processed.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from leto.protection.codec import ErasureCode, ReedSolomonCode, make_code, parse_ec, xor_into
from leto.protection.integrity import checksum

__all__ = ["measure_codec"]


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: page faults, table construction
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _code_rates(code: ErasureCode, data: list[np.ndarray], repeats: int, prefix: str) -> dict[str, float]:
    """Encode, contribute and worst-case decode rates, per data byte."""
    length = len(data[0])
    total = length * code.k
    parity = [np.empty(length, dtype=np.uint8) for _ in range(code.m)]
    encode_s = _median_seconds(lambda: code.encode(data, parity), repeats)
    rates = {f"{prefix}encode_gbps": _gbps(total, encode_s)}

    def contribute_all() -> None:
        for p in parity:
            p.fill(0)
        for i, block in enumerate(data):
            code.contribute(i, block, parity)

    rates[f"{prefix}contribute_gbps"] = _gbps(total, _median_seconds(contribute_all, repeats))
    code.encode(data, parity)
    lost = min(code.m, code.k)
    available = {i: b for i, b in enumerate(data) if i >= lost}
    available.update({code.k + j: p for j, p in enumerate(parity)})
    out = {i: np.empty(length, dtype=np.uint8) for i in range(lost)}
    decode_s = _median_seconds(lambda: code.decode(available, out), repeats)
    rates[f"{prefix}decode_gbps"] = _gbps(total, decode_s)
    return rates


def _zfec_encode_gbps(data: list[np.ndarray], k: int, m: int, repeats: int) -> float:
    try:
        import zfec
    except ImportError:
        return float("nan")
    encoder = zfec.Encoder(k, k + m)
    blocks, wanted = tuple(data), tuple(range(k, k + m))
    return _gbps(len(data[0]) * k, _median_seconds(lambda: encoder.encode(blocks, wanted), repeats))


def measure_codec(nbytes: int = 64 << 20, k: int = 2, m: int = 1, repeats: int = 3) -> dict[str, float]:
    """Measure memcpy, XOR, erasure coding and checksum throughput in GB/s.

    `nbytes` of data are split into k equal blocks for the (k, m) code.
    Keys: memcpy_gbps, xor_gbps, checksum_gbps, encode_gbps,
    contribute_gbps, decode_gbps (min(k, m) data blocks lost),
    zfec_encode_gbps (reference), and rs2p2_encode_gbps /
    rs2p2_decode_gbps for ReedSolomonCode(2, 2).
    """
    if nbytes < k or repeats < 1:
        raise ValueError(f"need nbytes >= k and repeats >= 1, got nbytes={nbytes}, k={k}, repeats={repeats}")
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    results = {
        "memcpy_gbps": _gbps(nbytes, _median_seconds(lambda: np.copyto(dst, src), repeats)),
        "xor_gbps": _gbps(nbytes, _median_seconds(lambda: xor_into(dst, src), repeats)),
        "checksum_gbps": _gbps(nbytes, _median_seconds(lambda: checksum(src), repeats)),
    }
    length = nbytes // k
    data = [src[i * length : (i + 1) * length] for i in range(k)]
    results.update(_code_rates(make_code(k, m), data, repeats, ""))
    results["zfec_encode_gbps"] = _zfec_encode_gbps(data, k, m, repeats)
    if (k, m) != (2, 2):
        half = nbytes // 2
        pair = [src[:half], src[half : 2 * half]]
        rs = _code_rates(ReedSolomonCode(2, 2), pair, repeats, "rs2p2_")
        results["rs2p2_encode_gbps"] = rs["rs2p2_encode_gbps"]
        results["rs2p2_decode_gbps"] = rs["rs2p2_decode_gbps"]
    return results


def main(argv: list[str] | None = None) -> None:
    """Print `measure_codec` results."""
    args = sys.argv[1:] if argv is None else argv
    nbytes = int(args[0]) << 20 if args else 64 << 20
    k, m = parse_ec(args[1]) if len(args) > 1 else (2, 1)
    for name, value in measure_codec(nbytes, k, m).items():
        print(f"{name:24s} {value:8.2f}")


if __name__ == "__main__":
    main()
