"""The keeper's data plane in native code (`dataplane.c`, built with the package): the pass over the
staging slots and the tier-2 links' threads, outside the interpreter. It serves layouts whose
tier-2 contributions are the chunks themselves (codes with one parity block, every coefficient 1)
and that protect deltas only (no gradients, no protection interval); the keeper runs the Python
data plane (`Keeper.consume_slots`, `transport.Link`) for every other layout, or where the library
was not built, or with LETO_DATA_PLANE=python (docs/protection.md, "The native data plane").
The library also holds the workers' staging copy into a slot (`stager`)."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import socket
import struct
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from leto.protection import doorbell
from leto.protection.layout import Layout
from leto.protection.shm import (
    KIND_DELTA,
    S_CHUNK,
    S_CRC,
    S_KIND,
    S_READY,
    S_STEP,
    SLOT_FREE,
    SLOT_HELD,
    SLOT_STAGED,
)
from leto.protection.transport import HDR, KINDS, PREFIX, SEND_BUFFERS

if TYPE_CHECKING:
    from leto.protection.keeper import Keeper

ENV_DATA_PLANE = "LETO_DATA_PLANE"  # native (the default where it serves the layout) | python
PLANES = ("native", "python")
# what dataplane.c compiles in, as the Python plane defines it (a library that differs is not used)
CONSTANTS = (
    HDR,
    PREFIX,
    SEND_BUFFERS,
    S_READY,
    S_KIND,
    S_STEP,
    S_CHUNK,
    S_CRC,
    SLOT_FREE,
    SLOT_STAGED,
    SLOT_HELD,
    KIND_DELTA,
)
NO_WANT = 2**63 - 1
SERVE_CONTROL = 2  # `DataPlane.serve` returned for the control doorbell
_P, _I, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_SIGNATURES: dict[str, tuple[object, list[object]]] = {
    "dp_constants": (None, [_P]),
    "dp_new": (_P, [_I] * 4 + [_I64] * 2 + [_P] * 5 + [_I, _I64, _I64, ctypes.c_double, _I, ctypes.c_ulong, _I, _I]),
    "dp_route": (None, [_P, _I, _I, _I64, _I64, _I64]),
    "dp_stripe": (None, [_P, _I64, _P, _P, _P, _P, _I, _I]),
    "dp_link": (_I, [_P, _I, _I]),
    "dp_start": (_I, [_P]),
    "dp_pass": (_I, [_P]),
    "dp_staged": (_I, [_P]),
    "dp_flush": (None, [_P]),
    "dp_applied": (_I64, [_P]),
    "dp_set_want": (_I, [_P, _I64]),
    "dp_freeze": (None, [_P]),
    "dp_errors": (_I64, [_P]),
    "dp_serve": (_I, [_P, ctypes.c_double, ctypes.c_double, ctypes.c_double, _I]),
    "dp_link_state": (None, [_P, _I, _P]),
    "dp_stop": (None, [_P]),
    "dp_free": (None, [_P]),
    "dp_stage": (None, [_P, _P, _P, _I64]),
}
_lib: ctypes.CDLL | None = None
_unusable: str | None = None  # why the library found cannot be used (said once)


def library() -> ctypes.CDLL | None:
    """The built library, or None where the package was installed without it (or with one that
    does not load, or lacks a function: a build older than this source, said once on stderr)."""
    global _lib, _unusable
    if _lib is None and _unusable is None:
        spec = importlib.util.find_spec("leto.protection._dataplane")
        if spec is None or spec.origin is None:
            _unusable = "not built"
            return None
        try:
            lib = ctypes.CDLL(spec.origin)
            for name, (res, args) in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = res, args
            got = (ctypes.c_int64 * len(CONSTANTS))()
            lib.dp_constants(got)
            if tuple(got) != CONSTANTS:
                raise AttributeError(f"its constants are {tuple(got)}, this source's {CONSTANTS}")
        except (OSError, AttributeError) as e:
            _unusable = str(e)
            print(
                f"leto: the native data plane {spec.origin} cannot be used ({e}); keepers run their Python one "
                f"(reinstall the package to rebuild it)",
                file=sys.stderr,
                flush=True,
            )
            return None
        _lib = lib
    return _lib


def stager() -> Callable[[int, int, int, int], None] | None:
    """The worker's native staging copy, `dp_stage(slot, old, new, nbytes)` (addresses; old 0: a
    full chunk), or None where the Python plane runs (the library is not built, or LETO_DATA_PLANE
    is python): then the worker XORs with numpy."""
    if os.environ.get(ENV_DATA_PLANE, "native") == "python":
        return None
    lib = library()
    return None if lib is None else lib.dp_stage


def serves(layout: Layout) -> bool:
    """Whether the native data plane serves `layout` (and is built, and not turned off)."""
    if os.environ.get(ENV_DATA_PLANE, "native") == "python" or library() is None:
        return False
    if layout.protect_every != 1 or layout.protects_grads or layout.tier2_preimages:
        return False
    nodes = layout.nodes
    for node in nodes:
        for pos in range(len(layout.local_ranks(node)) * layout.geometry.n_chunks):
            routes = layout.routes(node, pos)
            if len(routes) > 1 or any(r.coef != 1 for r in routes):
                return False
    return True


class NativeLink:
    """What a drain asks of a tier-2 link (`drain.drain`), for a link of the native data plane."""

    def __init__(self, plane: DataPlane, index: int, node: int, sends: bool) -> None:
        self.plane, self.index, self.node = plane, index, node
        self.bufs = sends  # truthy where this link sends (as `transport.Link.bufs`)
        self.told = False

    def _state(self) -> list[int]:
        out = (ctypes.c_int64 * 9)()
        if self.plane.stopped:
            return list(out)
        self.plane.lib.dp_link_state(self.plane.dp, self.index, out)
        return list(out)

    @property
    def sent(self) -> dict[int, int]:
        """Messages sent, by kind (every kind, as a Python plane's peer counts them)."""
        return {**dict.fromkeys(KINDS, 0), KIND_DELTA: self._state()[0]}

    @property
    def received(self) -> dict[int, int]:
        return {**dict.fromkeys(KINDS, 0), KIND_DELTA: self._state()[1]}

    def idle(self) -> bool:
        return bool(self._state()[2])

    @property
    def error(self) -> str | None:
        _, _, _, code, err, a, b, c, _ = self._state()
        return self.describe(code, err, a, b, c)

    def waited_s(self) -> float:
        return self._state()[8] / 1e9

    def describe(self, code: int, err: int, a: int, b: int, c: int) -> str | None:
        why = os.strerror(err) if err else "the connection was closed"
        if code == 1:
            return f"sending {'a batch' if a else 'a keepalive'} to node {self.node} failed: {why}"
        if code == 2:
            return f"receiving from node {self.node} failed: {why}"
        if code == 3:
            return f"node {self.node} sent a batch of {a} records of kind {b}"
        if code == 4:
            return f"node {self.node} sent a record for stripe {a}, position {b}, offset {c}"
        return None

    def flush(self, kind: int) -> None:
        self.plane.flush()


class DataPlane:
    """One keeper generation's native data plane, over its region and its tier-2 connections
    (`out[n]`, `inbound[n]`: to and from keeper `n`), which it takes over."""

    def __init__(self, keeper: Keeper, out: dict[int, socket.socket], inbound: dict[int, socket.socket]) -> None:
        lib = library()
        if lib is None:
            raise RuntimeError("the native data plane is not built")
        self.lib, self.keeper = lib, keeper
        r, layout = keeper.region, keeper.layout
        hdr, data = r["slot_hdr"], r["slot_data"]
        p1, crc1, v1 = r["p1"], r["crc1"], r["v1"]
        arrays = [hdr, data, p1, crc1, v1]
        self._keep: list[object] = []  # what the library points into, alive as long as it runs
        nb = keeper.nbytes[KIND_DELTA]
        peers = sorted(set(out) | set(inbound))
        stripes = keeper.parity.stripes
        self.dp = lib.dp_new(
            keeper.W, layout.ring_slots, layout.geometry.n_chunks, hdr.shape[-1], nb, data.shape[-1],
            *(a.ctypes.data for a in arrays),
            keeper.per_msg[KIND_DELTA], keeper.idx, keeper.gen, keeper.timeout_s, int(doorbell.DATA),
            threading.main_thread().ident, len(peers), len(stripes),
        )  # fmt: skip
        if not self.dp:
            raise MemoryError("the native data plane could not allocate its tables")
        timeout = struct.pack("ll", int(keeper.timeout_s), int(keeper.timeout_s % 1 * 1e6))
        self.sockets: list[socket.socket] = []
        self.links: dict[int, NativeLink] = {}
        for n in peers:
            fds = []
            for conns in (out, inbound):
                s = conns.get(n)
                if s is not None:  # blocking, each call bounded by the job's timeout as before
                    s.setblocking(True)
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeout)
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeout)
                    self.sockets.append(s)
                fds.append(-1 if s is None else s.fileno())
            self.links[n] = NativeLink(self, lib.dp_link(self.dp, *fds), n, n in out)
        for pos, routes in enumerate(keeper.routes):
            for rt in routes:
                lib.dp_route(self.dp, pos, self.links[rt.parity_node].index, rt.stripe, rt.p, rt.i)
        for si in stripes:
            v2 = r[f"v2_{si}"]
            real = np.stack([keeper.parity.real[(si, p)] for p in range(v2.shape[0])]).astype(np.uint8)
            self._keep.append(real)
            p2, crc2 = r[f"p2_{si}"], r[f"crc2_{si}"]
            arrays += [p2, crc2, v2]
            lib.dp_stripe(self.dp, si, p2.ctypes.data, crc2.ctypes.data, v2.ctypes.data, real.ctypes.data, *v2.shape)
        if not all(a.flags.c_contiguous for a in arrays):
            raise RuntimeError("the native data plane needs the region's tables contiguous")
        self._errors = 0
        self.stopped = False
        if lib.dp_start(self.dp):
            raise RuntimeError("the native data plane could not start its threads")

    def take(self) -> int:
        """Take what the workers staged (`dataplane.c`, `dp_pass`): the slots taken, -1 where a
        link's buffers were full and nothing was taken."""
        n = self.lib.dp_pass(self.dp)
        if n == -2:
            raise RuntimeError("a worker staged a chunk the native data plane does not take")
        return n

    def serve(self, until: float, idle_s: tuple[float, float]) -> int:
        """The keeper's main loop until it needs Python (`dataplane.c`, `dp_serve`): the pass
        and the sleeps between doorbells, at the `idle_s` waits of `Keeper.run`, until the next
        barrier can be entered, the control doorbell rings, a link breaks, a doorbell rings while
        a barrier is in flight, or `until` (`time.monotonic()`) comes. Returns why (SERVE_*)."""
        why = self.lib.dp_serve(self.dp, until, idle_s[0], idle_s[1], int(doorbell.CONTROL))
        if why == -2:
            raise RuntimeError("a worker staged a chunk the native data plane does not take")
        return why

    def staged(self) -> bool:
        return bool(self.lib.dp_staged(self.dp))

    def flush(self) -> None:
        """Send every link's open batch (one only deltas fill)."""
        self.lib.dp_flush(self.dp)

    def applied(self) -> int:
        """The last step at which every source chunk's delta is folded here."""
        return int(self.lib.dp_applied(self.dp))

    def want(self, step: int | None) -> bool:
        """The next barrier waits for `step` (None: one is in flight), and the receivers ring for
        it; whether it can be entered already."""
        return bool(self.lib.dp_set_want(self.dp, NO_WANT if step is None else step))

    def freeze(self) -> None:
        """Nothing folds from now on (a reported region never changes)."""
        self.lib.dp_freeze(self.dp)

    def failed_links(self) -> list[NativeLink]:
        """Links that broke since the last call."""
        errors = int(self.lib.dp_errors(self.dp))
        if errors == self._errors:
            return []
        self._errors = errors
        out = []
        for link in self.links.values():
            if not link.told and link.error is not None:
                link.told = True
                out.append(link)
        return out

    def stop(self) -> None:
        """End the threads, close the connections, free the tables (the region may go after)."""
        if self.stopped:
            return
        self.stopped = True
        self.lib.dp_stop(self.dp)
        for s in self.sockets:
            s.close()
        self.lib.dp_free(self.dp)
