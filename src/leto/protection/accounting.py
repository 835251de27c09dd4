"""What protection moves: bytes per protected element and step, by buffer and by path.

A *protected element* is one parameter element of a rank's ZeRO-1 shard. Per step, each buffer
that protection covers is handed to the keeper (`staged`: the worker writes it into a staging
slot and the keeper reads it), covered by a checksum (`checksummed`), and shipped to other nodes'
keepers (`tier2_sent`: once per parity block of its stripe). Replicated state (parameters, and
the reduced gradient on gloo) is not moved at all. docs/protection.md ("What each step moves")
explains why each buffer is or is not there.
"""

from __future__ import annotations

from leto.protection.layout import Layout

STATE_BUFFERS = ("master", "exp_avg", "exp_avg_sq")
FLOAT_BYTES = 4


def bytes_per_element_per_step(layout: Layout) -> dict[str, dict[str, float]]:
    """{buffer: {"staged", "checksummed", "tier2_sent"}} plus "total", averaged over steps (an
    interval moves its N steps' worth once)."""
    m = layout.tier2[0].m if layout.tier2 is not None else 0
    every = layout.protect_every
    buffers = list(STATE_BUFFERS) + (["grad"] if layout.protects_grads else [])
    out: dict[str, dict[str, float]] = {}
    for name in buffers:
        b = FLOAT_BYTES / every
        out[name] = {"staged": b, "checksummed": b, "tier2_sent": b * m}
    out["total"] = {k: sum(v[k] for v in out.values()) for k in ("staged", "checksummed", "tier2_sent")}
    return out
