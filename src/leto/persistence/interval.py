"""How often to checkpoint: K from the Young/Daly interval (`simulation.model.daly_interval_s`,
the one Daly formula), used by persistence and the baselines."""
from __future__ import annotations

import math


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
