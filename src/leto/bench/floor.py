"""The physical floor of protection on this machine: bytes per step x measured speed, per operation.

What every-step protection must do to a byte of unique state, whatever the implementation
(docs/protection.md, "What each step moves"; in place, replicated gradients): the worker writes
the chunk's next value aside and back (a copy), XORs it with the old one into a staging slot and
checksums it; the keeper folds the slot into tier-1 parity; each tier-2 byte crosses one TCP
connection (the kernel copies it in on one end, from the slot, and out on the other) and is
folded into the parity node's tier-2 parity. Each operation is timed here, CPU
seconds per byte, on chunk-sized buffers (192 KiB: the worker's side sees its chunk in cache) and
on buffers far larger than the caches (`cold`: what the keepers see, reading slots another core
wrote and parity rows last touched a step ago), so that the floor is a measurement of this machine
while the benchmark runs, not an estimate: the true floor lies between the two. A third total
prices each term where the protocol leaves its bytes (`PLACED`: a chunk in cache into a cold
slot, the fold of a slot another core just wrote, TCP from such slots, a buffer in cache into
cold parity rows): the floor of this protocol on this machine.
"""

from __future__ import annotations

import itertools
import os
import queue
import socket
import statistics
import threading
import time
from collections.abc import Callable

import numpy as np

from leto.protection.accounting import bytes_per_element_per_step
from leto.protection.codec import words, xor_into
from leto.protection.dataplane import stager
from leto.protection.integrity import checksum
from leto.protection.layout import Layout

CHUNK = 12 * 16384  # bytes: the default chunk (192 KiB)
COLD = 64 << 20  # bytes: larger than any cache here
TCP_MESSAGE = 1 << 20  # bytes per send: the tier-2 batch size


def _cpu_s_per_byte(op: Callable[[], None], nbytes: int, min_s: float = 0.2) -> float:
    """Median over 5 batches of the CPU seconds (this process, all threads) per byte of `op`."""
    samples = []
    for _ in range(5):
        n, t0, c0 = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < min_s / 5:
            op()
            n += 1
        samples.append((time.process_time() - c0) / (n * nbytes))
    return sorted(samples)[2]


def tcp_cpu_s_per_byte(total: int = 16 << 20, samples: int = 5, source_bytes: int = TCP_MESSAGE) -> float:
    """CPU seconds per byte for one byte to cross a loopback TCP connection (send and receive,
    both ends in this process, so both kernel copies are counted): the median of `samples`
    transfers of `total` bytes (one transfer varies by a quarter from run to run here). The
    messages are sent from `source_bytes` of memory in turn, at least one message (for the cold
    term more than the caches hold, as a keeper sends from slots another core wrote), and
    received into one message's buffer, as a keeper's receiver reuses its batch buffer."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    source = np.zeros(max(source_bytes, TCP_MESSAGE) // TCP_MESSAGE * TCP_MESSAGE, dtype=np.uint8)
    messages = [source[at : at + TCP_MESSAGE] for at in range(0, source.size, TCP_MESSAGE)]
    sink = bytearray(TCP_MESSAGE)

    def receive(conn: socket.socket) -> None:
        view, left = memoryview(sink), total
        while left > 0:
            got = conn.recv_into(view, min(len(view), left))
            if not got:
                return
            left -= got

    per_byte, sent = [], 0
    with server:
        client = socket.create_connection(("127.0.0.1", port), timeout=30)
        conn, _ = server.accept()
        with client, conn:
            for _ in range(samples):
                t = threading.Thread(target=receive, args=(conn,), daemon=True)
                c0 = time.process_time()
                t.start()
                for _ in range(total // TCP_MESSAGE):
                    client.sendall(messages[sent % len(messages)])
                    sent += 1
                t.join(timeout=30)
                per_byte.append((time.process_time() - c0) / total)
    return sorted(per_byte)[samples // 2]


def _xor_two_into(out: np.ndarray) -> Callable[[np.ndarray, np.ndarray], None]:
    """`out[...] = a ^ b` as a worker writes its staging slot: the native staging copy where the
    workers use it (streaming stores), numpy's XOR where they do not."""
    stage = stager()
    if stage is None:
        return lambda a, b: np.bitwise_xor(a, b, out=out)
    at = out.ctypes.data
    return lambda a, b: stage(at, a.ctypes.data, b.ctypes.data, out.nbytes)


def _xor_two_cost(a: np.ndarray, b: np.ndarray, rows: np.ndarray) -> float:
    """CPU seconds per byte of the cheaper way to write `a ^ b` into each of `rows` in turn: a
    store through the cache (numpy) or the workers' streaming stores, which win where the row is
    cold and lose where it is in cache."""
    native = [_xor_two_into(row) for row in rows]
    turn = itertools.cycle(range(len(rows)))
    return min(
        _cpu_s_per_byte(lambda: native[next(turn)](a, b), a.nbytes),
        _cpu_s_per_byte(lambda: np.bitwise_xor(a, b, out=rows[next(turn)]), a.nbytes),
    )


def handoff_fold_s_per_byte(size: int = CHUNK, slots: int = 16, rounds: int = 400) -> float | None:
    """CPU seconds per byte (median of 5 batches) to fold a `size`-byte slot into a parity row
    when a thread on the other core has just written the slot, as a worker writes a staging slot
    for its keeper: the cost the cold `fold` term stands for. None with fewer than two cores to
    pin the two threads to. The writer runs up to `slots` slots ahead, as a worker does."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    buf = np.zeros((slots, size), dtype=np.uint8)
    rows = np.zeros((64, size // 8), dtype=np.uint64)  # parity rows, each touched every 64 slots
    ready: queue.SimpleQueue[int] = queue.SimpleQueue()
    free: queue.SimpleQueue[int] = queue.SimpleQueue()
    for s in range(slots):
        free.put(s)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 256, size, dtype=np.uint8), rng.integers(0, 256, size, dtype=np.uint8)
    into = [_xor_two_into(buf[s]) for s in range(slots)]

    def write() -> None:
        os.sched_setaffinity(0, {cores[0]})  # this thread only
        for _ in range(rounds):
            s = free.get(timeout=30)
            into[s](a, b)
            ready.put(s)

    per = max(1, rounds // 5)  # slots a batch
    mask = os.sched_getaffinity(0)
    writer = threading.Thread(target=write, daemon=True)
    samples, spent = [], 0.0
    try:
        os.sched_setaffinity(0, {cores[1]})
        writer.start()
        for r in range(rounds):
            s = ready.get(timeout=30)
            row = rows[r % len(rows)]
            c0 = time.thread_time()
            np.bitwise_xor(row, words(buf[s]), out=row)  # as the keeper folds
            spent += time.thread_time() - c0
            free.put(s)
            if (r + 1) % per == 0:
                samples.append(spent / (per * size))
                spent = 0.0
    finally:
        os.sched_setaffinity(0, mask)
        writer.join(timeout=30)
    return sorted(samples)[len(samples) // 2]


def operation_costs(size: int = CHUNK) -> dict[str, float]:
    """CPU nanoseconds per byte of each operation of the hot path on buffers of `size` bytes,
    measured now (loopback TCP with 1 MiB messages, sent from `size` bytes or one message)."""
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 256, size, dtype=np.uint8), rng.integers(0, 256, size, dtype=np.uint8)
    out = np.empty_like(a)
    ns = {
        "copy": _cpu_s_per_byte(lambda: np.copyto(out, a), size),
        "xor_two_into_slot": _xor_two_cost(a, b, out[None]),
        "checksum": _cpu_s_per_byte(lambda: checksum(a), size),
        "fold": _cpu_s_per_byte(lambda: xor_into(out, a), size),
        "tcp_loopback": tcp_cpu_s_per_byte(source_bytes=size),
    }
    return {k: round(v * 1e9, 4) for k, v in ns.items()}


def placed_costs(size: int = CHUNK) -> dict[str, float]:
    """CPU nanoseconds per byte of the two operations whose bytes lie in two places: a chunk in
    cache XORed with another into a cold slot (the worker's, just after the update), and a chunk
    in cache folded into a cold parity row (a tier-2 receiver's batch buffer into rows last
    touched a step ago). The cold side cycles through `COLD` bytes."""
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 256, size, dtype=np.uint8), rng.integers(0, 256, size, dtype=np.uint8)
    rows = np.zeros((COLD // size, size), dtype=np.uint8)
    turn = itertools.cycle(rows)
    ns = {
        "xor_two_into_slot": _xor_two_cost(a, b, rows),
        "fold": _cpu_s_per_byte(lambda: xor_into(next(turn), a), size),
    }
    return {k: round(v * 1e9, 4) for k, v in ns.items()}


def sample() -> dict:
    """Every operation's cost measured once, now: on chunk-sized buffers (`costs`), on cold ones
    (`cold`), from cache into cold memory (`placed`), and the fold of a slot another core has just
    written (None on one core)."""
    handoff = handoff_fold_s_per_byte()
    return {
        "costs": operation_costs(),
        "cold": operation_costs(COLD),
        "placed": placed_costs(),
        "handoff_fold_ns_per_byte": None if handoff is None else round(handoff * 1e9, 4),
    }


# Where the protocol leaves each term's bytes when it moves them (docs/protection.md, "One step,
# in order"): which measurement prices the term in the floor `where the bytes lie`. The worker's
# chunk is in cache after its update, its slot cold (the keeper read it last, on another core);
# the keeper folds a slot another core has just written; the kernel sends from such slots; a
# tier-2 receiver folds its batch buffer, in cache, into parity rows touched a step ago.
PLACED = {
    "worker: next value aside and back": ("costs", "copy"),
    "worker: XOR old and new into the slot": ("placed", "xor_two_into_slot"),
    "worker: checksum of the new value": ("costs", "checksum"),
    "keeper: fold into tier-1 parity": ("handoff", "fold"),
    "tier 2: TCP send and receive": ("cold", "tcp_loopback"),
    "tier 2: fold into tier-2 parity": ("placed", "fold"),
}


def _terms(layout: Layout) -> dict[str, tuple[float, str]]:
    """Each term of the floor: (bytes a step, the operation that moves them)."""
    per_elem = bytes_per_element_per_step(layout)["total"]
    g = layout.geometry
    elements = layout.world_size * g.n_chunks * g.chunk_elems
    staged, tier2 = per_elem["staged"] * elements, per_elem["tier2_sent"] * elements
    return {
        "worker: next value aside and back": (staged, "copy"),
        "worker: XOR old and new into the slot": (staged, "xor_two_into_slot"),
        "worker: checksum of the new value": (per_elem["checksummed"] * elements, "checksum"),
        "keeper: fold into tier-1 parity": (staged, "fold"),
        "tier 2: TCP send and receive": (tier2, "tcp_loopback"),
        "tier 2: fold into tier-2 parity": (tier2, "fold"),
    }


def _median_costs(costs: list[dict[str, float]]) -> dict[str, float]:
    return {op: statistics.median(c[op] for c in costs) for op in costs[0]}


def floor(layout: Layout, step_s_off: float, cores: int, samples: list[dict] | None = None) -> dict:
    """CPU milliseconds per step of each term of the floor, their sum, and the overhead ratio
    they alone would cost if the job's `cores` were busy with training for `step_s_off`; the
    same with the costs on cold buffers (`cold_*`). Each operation's cost is its median over
    `samples` (`sample()`'s; one taken now if None): the cold costs move up to 2x from one
    measurement to the next here, so the bench takes one after each round."""
    samples = samples or [sample()]
    costs = _median_costs([s["costs"] for s in samples])
    cold = _median_costs([s["cold"] for s in samples])
    terms = _terms(layout)
    out = {
        name: {
            "bytes_per_step": int(nb),
            "operation": op,
            "ns_per_byte": costs[op],
            "cpu_ms_per_step": round(nb * costs[op] * 1e-6, 3),
            "cold_ns_per_byte": cold[op],
            "cold_cpu_ms_per_step": round(nb * cold[op] * 1e-6, 3),
        }
        for name, (nb, op) in terms.items()
    }
    total_ms = sum(t["cpu_ms_per_step"] for t in out.values())
    cold_ms = sum(t["cold_cpu_ms_per_step"] for t in out.values())

    def total(c: dict[str, float]) -> float:
        return round(sum(nb * c[op] * 1e-6 for nb, op in terms.values()), 3)

    def ratio(ms: float) -> float:  # the wall ratio `ms` of CPU a step costs with every core busy
        return round(1 + ms * 1e-3 / (cores * step_s_off), 4)

    handoffs = [s["handoff_fold_ns_per_byte"] for s in samples if s["handoff_fold_ns_per_byte"] is not None]
    handoff = round(statistics.median(handoffs), 4) if handoffs else None
    placed_ms = None
    if all("placed" in s for s in samples):
        where = {
            "costs": costs,
            "cold": cold,
            "placed": _median_costs([s["placed"] for s in samples]),
            "handoff": {"fold": handoff if handoff is not None else cold["fold"]},
        }
        for name, t in out.items():
            at, op = PLACED[name]
            t["placed_ns_per_byte"] = where[at][op]
            t["placed_cpu_ms_per_step"] = round(t["bytes_per_step"] * where[at][op] * 1e-6, 3)
        placed_ms = sum(t["placed_cpu_ms_per_step"] for t in out.values())
    return {
        "terms": out,
        # what the cold fold term stands for, measured as it happens (not a term: the cold
        # `fold` is): a slot another core has just written, folded
        "handoff_fold_ns_per_byte": handoff,
        "operation_ns_per_byte": costs,
        "cold_operation_ns_per_byte": cold,
        "total_cpu_ms_per_step": round(total_ms, 3),
        "cold_total_cpu_ms_per_step": round(cold_ms, 3),
        # each measurement's own totals: how far one measurement alone would have moved the floor
        "samples": [{"cpu_ms_per_step": total(s["costs"]), "cold_cpu_ms_per_step": total(s["cold"])} for s in samples],
        "floor_overhead_ratio": ratio(total_ms),
        "cold_floor_overhead_ratio": ratio(cold_ms),
        # each term priced where the protocol leaves its bytes (`PLACED`); None without those
        # measurements
        "placed_total_cpu_ms_per_step": None if placed_ms is None else round(placed_ms, 3),
        "placed_floor_overhead_ratio": None if placed_ms is None else ratio(placed_ms),
        "note": "CPU the data movement alone needs per step, no per-chunk or per-message costs; each "
        "operation's cost is its median over the measurements; the ratio assumes every core is busy "
        "with training, as on this machine",
    }
