"""How often to checkpoint: the Young/Daly interval (used by persistence and the baselines)."""
from __future__ import annotations

import math


def young_daly_interval(ckpt_cost_s: float, mtbf_s: float) -> float:
    """Seconds of training between checkpoints that minimise the expected waste.

    Daly's higher-order estimate (2006), which refines Young's sqrt(2·C·M); M itself when C >= 2M.
    """
    if ckpt_cost_s < 0 or mtbf_s <= 0:
        raise ValueError(f"need checkpoint cost >= 0 and MTBF > 0, got {ckpt_cost_s}, {mtbf_s}")
    if ckpt_cost_s >= 2 * mtbf_s:
        return mtbf_s
    x = ckpt_cost_s / (2 * mtbf_s)
    return math.sqrt(2 * ckpt_cost_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - ckpt_cost_s


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
