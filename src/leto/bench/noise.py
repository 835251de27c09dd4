"""Judging figures measured on a noisy machine: repeats, their spread, and targets per repeat.

Two benches use the same rules (`leto bench productivity` over trials, `leto bench overhead` over
rounds), so a figure called "within noise" or a target called "met" means the same in both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

MET, MISS, INCOMPLETE, NOT_MEASURED = "met", "MISS", "INCOMPLETE", "NOT MEASURED"

NOISE_RULE = (
    "two figures measured over repeats (trials, rounds) differ within noise when their [min, max] ranges "
    "over the repeats overlap: the one behind by median has a repeat at least as good as the worst repeat "
    "of the one ahead; with fewer than 2 repeats of either there is no spread, and the flag is null "
    "(noise not measured)"
)


def measured(values: Sequence[float | None]) -> list[float]:
    """The values that were measured (not None)."""
    return [v for v in values if v is not None]


def within_noise(a: Sequence[float | None], b: Sequence[float | None]) -> bool | None:
    """Whether figures `a` and `b` (one value per repeat) differ within noise (NOISE_RULE): their
    [min, max] ranges overlap. None when either has fewer than 2 measured repeats."""
    xa, xb = measured(a), measured(b)
    if len(xa) < 2 or len(xb) < 2:
        return None
    return max(min(xa), min(xb)) <= min(max(xa), max(xb))


def every_repeat(values: Sequence[float | None], ok: Callable[[float], bool]) -> str:
    """A target that must hold in every repeat: MISS if any measured repeat misses it, met if every
    repeat measured it and met it, INCOMPLETE if some repeats did not measure it (the others met
    it), NOT MEASURED if none did."""
    got = measured(values)
    if not got:
        return NOT_MEASURED
    if not all(ok(v) for v in got):
        return MISS
    return MET if len(got) == len(values) else INCOMPLETE


def on_median(value: float | None, ok: bool, repeats_measured: int, repeats: int) -> str:
    """A target judged on a median: met only if every repeat measured the figure and the median
    meets it; a figure missing from some repeats is INCOMPLETE, from all NOT MEASURED."""
    if value is None or repeats_measured == 0:
        return NOT_MEASURED
    if repeats_measured < repeats:
        return INCOMPLETE
    return MET if ok else MISS


def noise_word(flag: bool | None) -> str:
    """How a comparison reads: 'within noise', 'beyond noise' or 'noise not measured'."""
    return "noise not measured" if flag is None else "within noise" if flag else "beyond noise"
