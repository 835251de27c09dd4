"""How often to checkpoint: the Young/Daly interval and K, the interval in steps; used by
persistence, the baselines and the simulator's checkpoint-restart policy."""

from __future__ import annotations

import math


def daly_interval_s(delta_s: float, mtbf_s: float) -> float:
    """Compute time between checkpoints of cost `delta_s` that minimises the expected waste
    under exponential failures of mean `mtbf_s`: Daly's (2006) higher-order estimate
    sqrt(2 d M)(1 + sqrt(d/2M)/3 + d/18M) - d, M itself when d >= 2M, infinite without failures.

    Leto's one Daly formula: the simulator's checkpoint-restart policy and persistence's K
    (`steps_between`) both use it. The higher-order estimate, not the first-order
    sqrt(2 d M) - d, because it is the true optimum of the renewal model the simulator runs (to
    1e-6 relative at the defaults; the first-order one is 1 % short at 131,072 GPUs), and
    persistence wants the least waste for its measured cost and MTBF just the same.
    """
    if delta_s < 0 or mtbf_s <= 0:
        raise ValueError(f"need checkpoint cost >= 0 and MTBF > 0, got {delta_s}, {mtbf_s}")
    if math.isinf(mtbf_s):
        return math.inf
    if delta_s >= 2 * mtbf_s:
        return mtbf_s
    x = delta_s / (2 * mtbf_s)
    return math.sqrt(2 * delta_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - delta_s


def steps_between(interval_s: float, step_s: float) -> int:
    """K: the Young/Daly interval in whole steps (at least 1)."""
    return max(1, round(interval_s / step_s)) if step_s > 0 else 1


def parse_duration(text: str) -> float:
    """Seconds of a duration such as `90`, `90s`, `5m`, `1.5h`, `2d`; ValueError otherwise."""
    units = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
    t = text.strip().lower()
    scale = units.get(t[-1:], None)
    number = t[:-1] if scale is not None else t
    try:
        value = float(number) * (scale or 1.0)
    except ValueError:
        raise ValueError(f"{text!r} is not a duration (e.g. 300, 300s, 5m, 1h)") from None
    if not value > 0 or math.isinf(value):
        raise ValueError(f"{text!r} must be a positive duration")
    return value
