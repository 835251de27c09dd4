"""Component costs measured by Leto's benchmarks on the machine that ran them
(`leto bench ... --json`), parsed into a `Calibration` over the shipped defaults in
`default_calibration.json` (docs/simulation.md, "Calibration")."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from .units import GB


class CalibrationError(ValueError):
    """A calibration file is missing, unreadable, or has a bad key or value."""


_DEFAULT_FILE = "default_calibration.json"


@dataclass(frozen=True)
class Calibration:
    """Component costs measured on the benchmark machine. `None` = not measured.

    `sources` maps each field name to where its value came from.
    """

    process_start_s: float
    restart_new_procs_s: float
    restart_group_ready_s: float
    restart_first_step_s: float
    ckpt_bytes: float
    ckpt_save_s: float
    ckpt_load_s: float
    memcpy_gbps: float
    allreduce_gbps: float
    torchft_commit_s: float
    torchft_heartbeat_s: float
    leto_exit_detect_s: float
    leto_lost_steps: float
    protect_cpu_s_per_byte: float
    protect_moved_per_state_byte: float
    protect_tier2_per_state_byte: float
    d2h_gbps: float | None = None
    bench_step_s: float | None = None
    bench_state_bytes: float | None = None
    encode_gbps: float | None = None
    protect_s_per_step: float | None = None
    memory_overhead: float | None = None
    leto_restore_s: float | None = None
    leto_rebuild_s: float | None = None
    cr_detect_s: float | None = None
    cr_restart_s: float | None = None
    cr_restore_s: float | None = None
    mr_detect_s: float | None = None
    mr_restart_s: float | None = None
    mr_restore_s: float | None = None
    sources: Mapping[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    details: Mapping[str, Any] = field(default_factory=dict)

    # ---- derived quantities (the laws in docs/simulation.md, section "Calibration")

    @property
    def warmup_s(self) -> float:
        """Model build + first step after a restart, beyond group-ready, load and one step."""
        step = self.bench_step_s or 0.0
        return max(0.0, self.restart_first_step_s - self.restart_group_ready_s - self.ckpt_load_s - step)

    @property
    def ckpt_write_bps(self) -> float:
        """Bytes/s one rank writes a checkpoint at (DCP save on the bench machine)."""
        return self.ckpt_bytes / self.ckpt_save_s

    @property
    def ckpt_read_bps(self) -> float:
        """Bytes/s one rank reads a checkpoint at (DCP load, or the CR recovery bench)."""
        if self.cr_restore_s and self.bench_state_bytes:
            return self.bench_state_bytes / self.cr_restore_s
        return self.ckpt_bytes / self.ckpt_load_s

    @property
    def cr_restart_fixed_s(self) -> float:
        """Size-independent part of a job restart (respawn, import, rendezvous, warm-up)."""
        if self.cr_restart_s is not None:
            return self.cr_restart_s
        return self.restart_group_ready_s + self.warmup_s

    @property
    def mr_restart_fixed_s(self) -> float:
        """Same for memory-restart; defaults to the checkpoint-restart launcher path."""
        if self.mr_restart_s is not None:
            return self.mr_restart_s
        return self.cr_restart_fixed_s

    @property
    def host_bps(self) -> float:
        """Host-memory bandwidth for tier-1 encode/decode and in-memory restore."""
        return self.memcpy_gbps * GB

    @property
    def torchft_reconfigure_s(self) -> float:
        """torchft's in-place reconfiguration: kill -> survivors commit, minus its heartbeat."""
        return max(0.0, self.torchft_commit_s - self.torchft_heartbeat_s)

    @property
    def leto_rebuild_fixed_s(self) -> float:
        """Size-independent part of Leto's in-place group rebuild (shadow already running)."""
        if self.leto_rebuild_s is not None:
            return self.leto_rebuild_s
        return self.torchft_reconfigure_s  # the same in-place reconfiguration, until measured

    @property
    def leto_restore_bps(self) -> float | None:
        """Bytes/s of Leto's measured restore, if the recovery benchmark provided it."""
        if self.leto_restore_s and self.bench_state_bytes:
            return self.bench_state_bytes / self.leto_restore_s
        return None


_META = ("sources", "notes", "details")
_REQUIRED = tuple(
    f.name
    for f in dataclasses.fields(Calibration)
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in _META
)
_OPTIONAL = tuple(f.name for f in dataclasses.fields(Calibration) if f.default is None)


def _number(value: Any, where: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CalibrationError(f"{where}: expected a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        need = "> 0" if positive else ">= 0"
        raise CalibrationError(f"{where}: must be a finite number {need}, got {value!r}")
    return v


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CalibrationError(f"calibration file {str(path)!r} not found") from None
    except OSError as e:
        raise CalibrationError(f"calibration file {str(path)!r}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise CalibrationError(f"calibration file {str(path)!r} is not UTF-8 text") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise CalibrationError(f"calibration file {str(path)!r} is not valid JSON (line {e.lineno}: {e.msg})") from None


_POSITIVE = {
    "restart_first_step_s",
    "ckpt_bytes",
    "ckpt_save_s",
    "ckpt_load_s",
    "memcpy_gbps",
    "allreduce_gbps",
    "bench_step_s",
    "bench_state_bytes",
    "encode_gbps",
    "d2h_gbps",
}

CALIBRATION_UNITS = {
    "process_start_s": "s",
    "restart_new_procs_s": "s",
    "restart_group_ready_s": "s",
    "restart_first_step_s": "s",
    "ckpt_bytes": "bytes",
    "ckpt_save_s": "s",
    "ckpt_load_s": "s",
    "memcpy_gbps": "GB/s",
    "allreduce_gbps": "GB/s",
    "torchft_commit_s": "s",
    "torchft_heartbeat_s": "s",
    "leto_exit_detect_s": "s",
    "leto_lost_steps": "steps",
    "protect_cpu_s_per_byte": "CPU s/byte moved",
    "protect_moved_per_state_byte": "bytes moved/byte of optimizer state/step",
    "protect_tier2_per_state_byte": "tier-2 bytes/parity node/byte of optimizer state/step",
    "d2h_gbps": "GB/s",
    "bench_step_s": "s",
    "bench_state_bytes": "bytes",
    "encode_gbps": "GB/s",
    "protect_s_per_step": "s",
    "memory_overhead": "bytes/byte",
    "leto_restore_s": "s",
    "leto_rebuild_s": "s",
    "cr_detect_s": "s",
    "cr_restart_s": "s",
    "cr_restore_s": "s",
    "mr_detect_s": "s",
    "mr_restart_s": "s",
    "mr_restore_s": "s",
}
"""Unit of every calibration field (for the JSON listing of inputs)."""

BENCH_STATE_BYTES_PER_ELEMENT = 12
"""Optimizer state the bench protects per parameter element: fp32 master, exp_avg, exp_avg_sq
(training/optim.py). Converts the bench's per-element bytes into bytes per byte of state."""

GRAD_BYTES_PER_ELEMENT = 4.0
"""The fp32 gradient of one protected element (staged on the NCCL path, docs/protection.md)."""

DEFAULT_MOVED_PER_ELEMENT = 16.0
"""Bytes staged per protected element per step when the overhead file does not say: 12 B of
optimizer-state deltas + 4 B of fp32 gradient (docs/protection.md, protocol of 2026-11-30)."""


def _measurements(doc: Mapping[str, Any], name: str) -> dict[str, tuple[float, str]]:
    """Parse the `{"measurements": {KEY: {"value", "unit", "source"}}}` format."""
    known = set(_REQUIRED) | set(_OPTIONAL)
    out: dict[str, tuple[float, str]] = {}
    entries = doc["measurements"]
    if not isinstance(entries, Mapping):
        raise CalibrationError(f"{name}: 'measurements' must be an object")
    for key, entry in entries.items():
        if key not in known:
            raise CalibrationError(f"{name}: unknown measurement {key!r}")
        if not isinstance(entry, Mapping) or "value" not in entry or "source" not in entry:
            raise CalibrationError(f"{name}: measurement {key!r} needs 'value' and 'source'")
        value = _number(entry["value"], f"{name}: measurements.{key}.value", positive=key in _POSITIVE)
        out[key] = (value, f"{name}: measurements.{key}: {entry['source']}")
    return out


def _mapping(obj: Any, where: str, what: str) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise CalibrationError(f"{where}: expected an object of {what}, got {obj!r}")
    return obj


def _parity_count(ec: Any, name: str, notes: list[str]) -> int | None:
    """Tier-2 parity nodes of the bench run (`ec` = "k+m" or "none"), None if unknown."""
    if ec is None:
        notes.append(f"{name}: no 'ec': the bench's tier-2 parity count is taken as 1")
        return 1
    text = str(ec).strip().lower()
    if text == "none":
        return None
    k, sep, m = text.partition("+")
    if sep and k.isdigit() and m.isdigit() and int(m) > 0:
        return int(m)
    notes.append(f"{name}: ec {ec!r} is not of the form k+m: the bench's tier-2 parity count is taken as 1")
    return 1


def _bytes_per_element(obj: Any, where: str, notes: list[str]) -> tuple[float, float | None, bool | None]:
    """(staged, tier2_sent, gradients staged?) per protected element per step from the bench's
    accounting; the last is None when the accounting has no per-buffer rows to tell."""
    bpe = _mapping(obj, f"{where}bytes_per_element_per_step", "{buffer: {staged, checksummed, tier2_sent}}")
    buffers = [str(k) for k in bpe if k != "total"]
    grads = any(b.lower().startswith("grad") for b in buffers) if buffers else None
    total = bpe.get("total")
    if total is not None:
        t = _mapping(
            total, f"{where}bytes_per_element_per_step.total", "bytes per element {staged, checksummed, tier2_sent}"
        )
        if t.get("staged") is None:
            raise CalibrationError(f"{where}bytes_per_element_per_step.total: no 'staged' figure")
        staged = _number(t["staged"], f"{where}bytes_per_element_per_step.total.staged")
        tier2 = t.get("tier2_sent")
        return (
            staged,
            (None if tier2 is None else _number(tier2, f"{where}bytes_per_element_per_step.total.tier2_sent")),
            grads,
        )
    staged_sum, tier2_sum, seen_staged, seen_tier2 = 0.0, 0.0, False, False
    for buf, entry in bpe.items():
        e = _mapping(
            entry, f"{where}bytes_per_element_per_step.{buf}", "bytes per element {staged, checksummed, tier2_sent}"
        )
        if e.get("staged") is not None:
            staged_sum += _number(e["staged"], f"{where}bytes_per_element_per_step.{buf}.staged")
            seen_staged = True
        if e.get("tier2_sent") is not None:
            tier2_sum += _number(e["tier2_sent"], f"{where}bytes_per_element_per_step.{buf}.tier2_sent")
            seen_tier2 = True
    if not seen_staged:
        raise CalibrationError(f"{where}bytes_per_element_per_step: no 'total' and no buffer with a 'staged' figure")
    notes.append(f"{where}bytes_per_element_per_step has no 'total': summed over its buffers")
    return staged_sum, (tier2_sum if seen_tier2 else None), grads


def _cpu_figure(
    entry: Mapping[str, Any],
    where: str,
    label: str,
    notes: list[str],
    top: dict[str, Any] | None,
    key: str = "default job",
) -> dict[str, Any] | None:
    """Protection CPU per byte moved of one bench run (the default job or a curve entry).

    `top` is the default job's figure, used for what a curve entry leaves out. Returns None
    (with a note) when the entry lacks what the figure needs.
    """
    on = entry.get("cpu_s_per_step_on")
    if on is None:
        notes.append(f"{where}no cpu_s_per_step_on: {label} gives no protection CPU figure")
        return None
    on = _mapping(on, f"{where}cpu_s_per_step_on", "CPU seconds per step by role")
    if on.get("keeper") is None:
        notes.append(f"{where}cpu_s_per_step_on has no 'keeper': {label} gives no protection CPU figure")
        return None
    keeper = _number(on["keeper"], f"{where}cpu_s_per_step_on.keeper")
    off = entry.get("cpu_s_per_step_off")
    if off is not None:
        off = _mapping(off, f"{where}cpu_s_per_step_off", "CPU seconds per step by role")
    w_on = on.get("worker")
    w_off = off.get("worker") if off is not None else None
    # protected elements (all ranks)
    if entry.get("protected_elements") is not None:
        elements = _number(entry["protected_elements"], f"{where}protected_elements", positive=True)
        elements_from = "protected_elements"
    elif entry.get("protected_bytes") is not None:
        elements = (
            _number(entry["protected_bytes"], f"{where}protected_bytes", positive=True) / BENCH_STATE_BYTES_PER_ELEMENT
        )
        elements_from = f"protected_bytes / {BENCH_STATE_BYTES_PER_ELEMENT}"
        notes.append(
            f"{where}no protected_elements: protected_bytes / "
            f"{BENCH_STATE_BYTES_PER_ELEMENT} (fp32 master, exp_avg, exp_avg_sq)"
        )
    elif top is not None and entry.get("model") == top["model"]:
        elements, elements_from = top["elements"], "the default job's (same model)"
        notes.append(f"{where}no protected_elements: the default job's ({top['model']})")
    else:
        notes.append(
            f"{where}no protected_elements or protected_bytes for model {entry.get('model')!r}: {label} not used"
        )
        return None
    # bytes moved per element
    if entry.get("bytes_per_element_per_step") is not None:
        staged, tier2, grads = _bytes_per_element(entry["bytes_per_element_per_step"], where, notes)
        moved_from, moved_assumed = "bytes_per_element_per_step.total.staged", False
    elif top is not None:
        staged, tier2, grads = (top["moved_per_element"], top["tier2_per_element"], top["grads_staged"])
        moved_from, moved_assumed = "the default job's bytes per element", top["moved_assumed"]
        notes.append(f"{where}no bytes_per_element_per_step: the default job's ({staged:g} B per element)")
    else:
        staged, tier2, grads = DEFAULT_MOVED_PER_ELEMENT, None, True
        moved_from = f"{DEFAULT_MOVED_PER_ELEMENT:g} B per element (assumed)"
        moved_assumed = True
        notes.append(
            f"{where}no bytes_per_element_per_step: {DEFAULT_MOVED_PER_ELEMENT:g} B "
            f"moved per protected element a step assumed (12 B of optimizer-state "
            f"deltas + 4 B of gradient, docs/protection.md as of 2026-11-30)"
        )
    moved = elements * staged
    if moved <= 0:
        raise CalibrationError(
            f"{where}no bytes moved per step ({elements_from} x {moved_from} = 0): no protection CPU per byte"
        )
    # extra worker CPU with protection on
    if w_on is not None and w_off is not None:
        extra = _number(w_on, f"{where}cpu_s_per_step_on.worker") - _number(w_off, f"{where}cpu_s_per_step_off.worker")
        if extra < 0:
            notes.append(
                f"{where}workers used less CPU with protection on ({extra:+.5f} s a "
                f"step, noise): their extra counted as 0"
            )
            extra = 0.0
        extra_from = "cpu_s_per_step_on.worker - cpu_s_per_step_off.worker"
    elif top is not None:
        extra = top["worker_extra_s_per_byte"] * moved
        extra_from = "the default job's extra worker CPU per byte"
        notes.append(
            f"{where}no worker CPU with protection off: {label} takes the default job's extra worker CPU per byte moved"
        )
    else:
        extra, extra_from = 0.0, "not measured (0)"
        notes.append(
            f"{where}no worker CPU with protection {'off' if w_on is not None else 'on'}:"
            f" only the keepers' CPU counted (an underestimate)"
        )
    cpu = keeper + extra
    return {
        "label": key,
        "model": entry.get("model"),
        "rows": entry.get("rows"),
        "elements": elements,
        "moved_per_element": staged,
        "moved_assumed": moved_assumed,
        "tier2_per_element": tier2,
        "grads_staged": grads,
        "bytes_per_step": moved,
        "keeper_cpu_s_per_step": keeper,
        "worker_extra_cpu_s_per_step": extra,
        "worker_extra_s_per_byte": extra / moved,
        "cpu_s_per_step": cpu,
        "cpu_s_per_byte": cpu / moved,
        "formula": f"(cpu_s_per_step_on.keeper [{keeper:.5g}] + {extra_from} "
        f"[{extra:.5g}]) / ({elements_from} [{elements:.6g}] x {moved_from} "
        f"[{staged:g}])",
    }


def _protection_from_overhead(
    doc: Mapping[str, Any], name: str, notes: list[str], details: dict[str, Any]
) -> dict[str, tuple[float, str]]:
    """Leto's protection cost figures from `leto bench overhead --json` (docs/simulation.md)."""
    out: dict[str, tuple[float, str]] = {}
    if doc.get("d2h_gbps") is not None:
        out["d2h_gbps"] = (_number(doc["d2h_gbps"], f"{name}: d2h_gbps", positive=True), f"{name}: d2h_gbps")
    top = _cpu_figure(doc, f"{name}: ", "the default job", notes, None)
    if top is not None:
        top["where"] = ""
    candidates = [top] if top is not None else []
    curve = doc.get("curve")
    if curve is not None:
        if not isinstance(curve, list):
            raise CalibrationError(f"{name}: curve: expected a list of runs, got {curve!r}")
        for i, entry in enumerate(curve):
            where = f"{name}: curve[{i}]."
            entry = _mapping(entry, f"{name}: curve[{i}]", "one bench run")
            label = str(entry.get("label") or f"curve[{i}]")
            fig = _cpu_figure(entry, where, f"curve entry {label!r}", notes, top, label)
            if fig is not None:
                fig["where"] = f"curve[{i}]."
                candidates.append(fig)
    if not candidates:
        notes.append(
            f"{name}: no protection CPU figure in this file (it needs "
            f"cpu_s_per_step_on.keeper and protected_elements or protected_bytes): the "
            f"shipped protection figures are kept"
        )
        return out
    m_bench = _parity_count(doc.get("ec"), name, notes)
    # the run moving the most bytes a step amortises per-step fixed costs best (a cluster shard
    # is far larger than any bench model); ties: the most rows (most compute per byte)
    best = max(candidates, key=lambda f: (f["bytes_per_step"], f["rows"] or 0))
    where = f"{name}: {best['where'].rstrip('.')}:" if best["where"] else f"{name}:"
    details["protection_figures"] = [{k: v for k, v in f.items() if k != "where"} for f in candidates]
    details["protection_chosen"] = best["label"]
    out["protect_cpu_s_per_byte"] = (best["cpu_s_per_byte"], f"{where} {best['formula']}")
    # the bench's path vs the cluster's: on gloo every rank holds the reduced gradient, so the
    # bench does not stage it; NCCL's reduce-scatter leaves each rank only its gradient shard,
    # which protection then covers (docs/protection.md): its 4 B an element are added at scale
    staged = best["moved_per_element"]
    if best["grads_staged"] is False:
        grad, grad_text = (
            GRAD_BYTES_PER_ELEMENT,
            (
                f" + {GRAD_BYTES_PER_ELEMENT:g} B of gradient shard (staged on the NCCL path, not on "
                f"the bench's gloo path)"
            ),
        )
        notes.append(
            f"{where} no gradient buffer in bytes_per_element_per_step (the bench's "
            f"gloo path, where every rank holds the reduced gradient): the cluster's "
            f"NCCL path stages each rank's gradient shard too, "
            f"+{GRAD_BYTES_PER_ELEMENT:g} B an element at scale"
        )
    else:
        grad, grad_text = 0.0, ""
        if best["grads_staged"] is None:
            notes.append(
                f"{where} bytes_per_element_per_step has only a 'total': taken as what "
                f"the cluster's NCCL path stages (gradients included)"
            )
    assumed = "ASSUMED (the file has no bytes_per_element_per_step): " if best["moved_assumed"] else ""
    out["protect_moved_per_state_byte"] = (
        (staged + grad) / BENCH_STATE_BYTES_PER_ELEMENT,
        f"{where} {assumed}(bytes moved per element [{staged:g}]{grad_text}) / "
        f"{BENCH_STATE_BYTES_PER_ELEMENT} B of optimizer state per element",
    )
    tier2 = best["tier2_per_element"]
    if tier2 is not None and m_bench is not None and tier2 > 0:
        out["protect_tier2_per_state_byte"] = (
            (tier2 / m_bench + grad) / BENCH_STATE_BYTES_PER_ELEMENT,
            f"{where} (bytes_per_element_per_step.total.tier2_sent [{tier2:g}] / parity nodes "
            f"[{m_bench}]{grad_text}) / {BENCH_STATE_BYTES_PER_ELEMENT}",
        )
    else:
        why = "no tier-2 bytes in the accounting" if tier2 is None else "the bench ran without tier 2"
        notes.append(
            f"{where} {why}: every byte moved is taken to go once to each tier-2 "
            f"parity node (as the 1+1 mirror of 2026-11-30: 6.8 MB each way for "
            f"13.6 MB moved)"
        )
        out["protect_tier2_per_state_byte"] = (
            (staged + grad) / BENCH_STATE_BYTES_PER_ELEMENT,
            f"{where} ASSUMED ({why}): each byte moved sent once per parity node: (bytes "
            f"moved per element [{staged:g}]{grad_text}) / {BENCH_STATE_BYTES_PER_ELEMENT}",
        )
    return out


def _section(
    doc: Mapping[str, Any], section: str, name: str, notes: list[str], details: dict[str, Any]
) -> dict[str, tuple[float, str]]:
    """Map one `leto bench` JSON section onto calibration fields."""
    out: dict[str, tuple[float, str]] = {}

    def take(key: str, target: str, obj: Mapping[str, Any] = doc, prefix: str = "", positive: bool = False) -> None:
        if key in obj and obj[key] is not None:
            where = f"{name}: {prefix}{key}"
            out[target] = (_number(obj[key], where, positive=positive), where)

    if section == "throughput":
        take("step_s", "bench_step_s", positive=True)
        take("state_bytes_per_rank", "bench_state_bytes", positive=True)
    elif section == "overhead":
        take("encode_gbps", "encode_gbps", positive=True)
        take("memcpy_gbps", "memcpy_gbps", positive=True)
        take("memory_overhead", "memory_overhead")
        take("state_bytes_per_rank", "bench_state_bytes", positive=True)
        on, off, ratio = doc.get("step_s_on"), doc.get("step_s_off"), doc.get("overhead_ratio")
        if on is not None and off is not None:
            d = _number(on, f"{name}: step_s_on") - _number(off, f"{name}: step_s_off")
            out["protect_s_per_step"] = (max(0.0, d), f"{name}: step_s_on - step_s_off")
        elif ratio is not None and off is not None:
            d = (_number(ratio, f"{name}: overhead_ratio") - 1.0) * _number(off, f"{name}: step_s_off")
            out["protect_s_per_step"] = (max(0.0, d), f"{name}: (overhead_ratio - 1) x step_s_off")
        out.update(_protection_from_overhead(doc, name, notes, details))
    elif section == "recovery":
        take("state_bytes_per_rank", "bench_state_bytes", positive=True)
        systems = doc.get("systems")
        if not isinstance(systems, Mapping):
            raise CalibrationError(f"{name}: 'systems' must be an object of per-system results")
        for sysname, prefix in (("leto", "leto"), ("checkpoint-restart", "cr"), ("memory-restart", "mr")):
            s = systems.get(sysname)
            if s is None:
                continue
            if not isinstance(s, Mapping):
                raise CalibrationError(f"{name}: systems.{sysname} must be an object")
            p = f"systems.{sysname}."
            det = s.get("detect_s")
            rest = s.get("restore_s")
            rec = s.get("recovery_s")
            if det is not None:
                v = _number(det, f"{name}: {p}detect_s")
                out["leto_exit_detect_s" if prefix == "leto" else f"{prefix}_detect_s"] = (v, f"{name}: {p}detect_s")
            if rest is not None:
                out[f"{prefix}_restore_s"] = (_number(rest, f"{name}: {p}restore_s"), f"{name}: {p}restore_s")
            target = "leto_rebuild_s" if prefix == "leto" else f"{prefix}_restart_s"
            rebuild = (
                (s.get("breakdown") or {}).get("restart / rebuild") if isinstance(s.get("breakdown"), Mapping) else None
            )
            if rebuild is not None:  # without recomputed steps (charged as lost work) and slow steps after
                out[target] = (
                    max(0.0, _number(rebuild, f"{name}: {p}breakdown")),
                    f"{name}: {p}breakdown[restart / rebuild]",
                )
            elif rec is not None:
                fixed = _number(rec, f"{name}: {p}recovery_s")
                fixed -= float(det or 0.0) + float(rest or 0.0)
                out[target] = (max(0.0, fixed), f"{name}: {p}recovery_s - detect_s - restore_s")
            if prefix == "leto":
                take("lost_steps", "leto_lost_steps", s, p)
    return out


def _detect_section(doc: Mapping[str, Any]) -> str | None:
    if "systems" in doc:
        return "recovery"
    if {"step_s_on", "step_s_off", "overhead_ratio"} & doc.keys():
        return "overhead"
    if {"step_s", "tokens_per_s"} & doc.keys():
        return "throughput"
    return None


def _parse(
    doc: Any, name: str, notes: list[str] | None = None, details: dict[str, Any] | None = None
) -> dict[str, tuple[float, str]]:
    notes = [] if notes is None else notes
    details = {} if details is None else details
    if not isinstance(doc, Mapping):
        raise CalibrationError(f"{name}: expected a JSON object, got {type(doc).__name__}")
    if "measurements" in doc:
        return _measurements(doc, name)
    merged = {k for k in ("throughput", "overhead", "recovery") if isinstance(doc.get(k), Mapping)}
    values: dict[str, tuple[float, str]] = {}
    if merged:
        for section in ("throughput", "overhead", "recovery"):
            if section in merged:
                values.update(_section(doc[section], section, f"{name} [{section}]", notes, details))
        return values
    detected = _detect_section(doc)
    if detected is None:
        keys = ", ".join(sorted(map(str, doc))) or "none"
        raise CalibrationError(
            f"{name}: not a calibration: expected output of 'leto bench throughput|overhead|"
            f"recovery --json', a dict with keys throughput/overhead/recovery, or "
            f"'measurements'; found keys: {keys}"
        )
    return _section(doc, detected, name, notes, details)


def load_calibration(path: str | Path | None = None) -> Calibration:
    """Shipped defaults, overlaid with the measurements in `path` (if given).

    Raises:
        CalibrationError: naming the file and the bad key.
    """
    ref = resources.files("leto.simulation").joinpath(_DEFAULT_FILE)
    values = _parse(json.loads(ref.read_text()), _DEFAULT_FILE)
    notes: list[str] = []
    details: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        values.update(_parse(_read_json(p), str(p), notes, details))
    missing = [k for k in _REQUIRED if k not in values]
    if missing:
        raise CalibrationError(f"calibration lacks {', '.join(missing)}")
    kwargs: dict[str, Any] = {k: v for k, (v, _) in values.items()}
    sources = {k: s for k, (_, s) in values.items()}
    return Calibration(**kwargs, sources=sources, notes=tuple(notes), details=details)
