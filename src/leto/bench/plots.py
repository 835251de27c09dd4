"""PNG plots of the benchmarks (matplotlib, Agg backend): throughput over wall time per system
with failures marked, and the recovery-time breakdown."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {
    "detect": "#d62728",
    "restart / rebuild": "#7f7f7f",
    "restore": "#1f77b4",
    "recompute": "#ff7f0e",
    "back to speed": "#bcbd22",
}
RUN_COLOR, REDO_COLOR, KILL_COLOR, OK_COLOR = "#1f77b4", "#ff7f0e", "#d62728", "#2ca02c"


@dataclass
class Panel:
    """One system's run: its step records and what to mark on them."""

    title: str
    steps: list[dict]  # {"step", "step_s", "time"} records, any order
    origin: float  # the x = 0 instant (a kill, or the start of the run)
    kills: list[float] = field(default_factory=list)  # absolute times
    marks: list[tuple[float, str]] = field(default_factory=list)  # (absolute time, label), drawn green


def segments(steps: list[dict], tokens_per_step: int) -> list[tuple[float, float, float, bool]]:
    """(start, end, tokens/s, redone) of each step; `redone`: its step number was completed before."""
    out: list[tuple[float, float, float, bool]] = []
    best = 0
    prev_end = float("-inf")
    for r in sorted(steps, key=lambda r: r["time"]):
        dt = max(float(r["step_s"]), 1e-9)
        start = max(r["time"] - dt, prev_end)
        out.append((start, r["time"], tokens_per_step / dt, r["step"] <= best))
        best, prev_end = max(best, r["step"]), r["time"]
    return out


GAP_S = 0.05  # a pause between two steps longer than this is drawn as zero throughput


def _curve(segs: list[tuple[float, float, float, bool]], origin: float) -> tuple[list[float], list[float]]:
    """Piecewise-constant throughput with explicit zeros where no step ran."""
    xs: list[float] = []
    ys: list[float] = []
    for start, end, y, _ in segs:
        if xs and start - (xs[-1] + origin) > GAP_S:
            xs += [xs[-1], start - origin]
            ys += [0.0, 0.0]
        xs += [start - origin, end - origin]
        ys += [y, y]
    return xs, ys


def timeline(
    panels: list[list[Panel]],
    column_titles: list[str],
    tokens_per_step: int,
    path: Path,
    title: str,
    xlabel: str,
    xlim: tuple[float, float | None] | None = None,
) -> Path:
    """Tokens/s against wall time: one row per system, one column per scenario (shared axes)."""
    rows = max(len(col) for col in panels)
    cols = len(panels)
    fig, axes = plt.subplots(
        rows, cols, figsize=(7.5 * cols, 1.9 * rows + 1.2), sharex=True, sharey=True, squeeze=False
    )
    for c, col in enumerate(panels):
        for r in range(rows):
            ax = axes[r][c]
            if r >= len(col):
                ax.axis("off")
                continue
            p = col[r]
            segs = segments(p.steps, tokens_per_step)
            xs, ys = _curve(segs, p.origin)
            ax.fill_between(xs, [y / 1e3 for y in ys], color=RUN_COLOR, alpha=0.25, linewidth=0)
            ax.plot(xs, [y / 1e3 for y in ys], color=RUN_COLOR, linewidth=1.0)
            for start, end, y, redone in segs:
                if redone:
                    ax.fill_between(
                        [start - p.origin, end - p.origin], [y / 1e3] * 2, color=REDO_COLOR, alpha=0.7, linewidth=0
                    )
            for k in p.kills:
                ax.axvline(k - p.origin, color=KILL_COLOR, linewidth=1.6)
            for t, label in p.marks:
                ax.axvline(t - p.origin, color=OK_COLOR, linewidth=1.4, linestyle="--")
                ax.annotate(
                    label,
                    (t - p.origin, 1.0),
                    xycoords=("data", "axes fraction"),
                    xytext=(3, -3),
                    textcoords="offset points",
                    va="top",
                    fontsize=8,
                    color=OK_COLOR,
                )
            ax.set_title(p.title, fontsize=10, loc="left")
            ax.grid(alpha=0.3)
            if c == 0:
                ax.set_ylabel("k tokens/s")
        if col:
            axes[0][c].annotate(
                column_titles[c], (0.5, 1.32), xycoords="axes fraction", ha="center", fontsize=11, fontweight="bold"
            )
    for c, col in enumerate(panels):  # the x axis under the last panel of each column
        last = axes[max(len(col), 1) - 1][c]
        last.set_xlabel(xlabel)
        last.tick_params(labelbottom=True)
    if xlim is not None:
        axes[0][0].set_xlim(*xlim)
    handles = [
        plt.Line2D([], [], color=KILL_COLOR, linewidth=1.6, label="failure (SIGKILL)"),
        plt.Line2D([], [], color=OK_COLOR, linewidth=1.4, linestyle="--", label="back at speed / done"),
        plt.Rectangle((0, 0), 1, 1, color=RUN_COLOR, alpha=0.4, label="training"),
        plt.Rectangle((0, 0), 1, 1, color=REDO_COLOR, alpha=0.7, label="recomputing lost steps"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=4, frameon=False, fontsize=9)
    fig.suptitle(title, fontsize=12)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def breakdown_bars(
    groups: dict[str, dict[str, dict[str, float] | None]], path: Path, title: str, segments_order: tuple[str, ...]
) -> Path:
    """Horizontal stacked bars: per scenario (a subplot), per system, the recovery time split into
    segments, the total written at the end of each bar."""
    n = len(groups)
    height = max(len(g) for g in groups.values()) if groups else 1
    fig, axes = plt.subplots(n, 1, figsize=(10, 0.55 * height * n + 1.8 * n), squeeze=False)
    xmax = max((sum(b.values()) for g in groups.values() for b in g.values() if b), default=1.0)
    for ax, (name, bars) in zip(axes[:, 0], groups.items()):
        labels = list(bars)[::-1]
        for y, label in enumerate(labels):
            parts = bars[label]
            if not parts:
                ax.text(0.01 * xmax, y, "no recovery measured", va="center", fontsize=9, color="#555")
                continue
            left = 0.0
            for seg in segments_order:
                w = parts.get(seg, 0.0)
                if w > 0:
                    ax.barh(y, w, left=left, color=COLORS.get(seg), edgecolor="white", linewidth=0.5, height=0.6)
                left += w
            ax.text(left + 0.01 * xmax, y, f"{left:.2f} s", va="center", fontsize=9)
        ax.set_yticks(range(len(labels)), labels)
        ax.set_xlim(0, xmax * 1.15)
        ax.set_title(name, fontsize=11, loc="left")
        ax.grid(axis="x", alpha=0.3)
        ax.set_xlabel("seconds from the kill")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS.get(s), label=s) for s in segments_order]
    fig.legend(handles=handles, loc="lower center", ncol=len(segments_order), frameon=False, fontsize=9)
    fig.suptitle(title, fontsize=12)
    fig.tight_layout(rect=(0, 0.06, 1, 0.96))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
