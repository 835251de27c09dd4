"""`leto simulate --calibration OVERHEAD.json`: Leto's per-step protection cost from the measured
CPU seconds per protected byte (docs/simulation.md, "Protection cost")."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from leto.simulation.assumptions import Assumptions
from leto.simulation.calibration import CalibrationError, load_calibration
from leto.simulation.cli import main
from leto.simulation.engine import Scenario, build_costs, leto_protection, simulate
from leto.simulation.scaling import optimizer_bytes_per_gpu, step_time_s
from leto.simulation.units import GB

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT / "docs" / "results" / "overhead-2026-11-30.json"
CAL = load_calibration()

# a small synthetic `leto bench overhead --json` with every key the bench writes or will write
SYNTH = {
    "model": "tiny",
    "workers": 4,
    "nodes": 2,
    "ec": "1+1",
    "step_s_off": 0.1,
    "step_s_on": 0.12,
    "overhead_ratio": 1.2,
    "cpu_s_per_step_off": {"worker": 0.20},
    "cpu_s_per_step_on": {"worker": 0.21, "keeper": 0.03, "keeper/main": 0.02},
    "protected_bytes": 12_000_000,
    "protected_elements": 1_000_000,
    # the gloo path: gradients are replicated there, so not staged (protection/accounting.py)
    "bytes_per_element_per_step": {
        "master": {"staged": 4, "checksummed": 4, "tier2_sent": 4},
        "exp_avg": {"staged": 4, "checksummed": 4, "tier2_sent": 4},
        "exp_avg_sq": {"staged": 4, "checksummed": 4, "tier2_sent": 4},
        "total": {"staged": 12, "checksummed": 12, "tier2_sent": 12},
    },
    "d2h_gbps": 25.0,
}
SYNTH_C = (0.03 + (0.21 - 0.20)) / (1_000_000 * 12)  # CPU s per byte moved on the bench
SYNTH_AT_SCALE = 12 + 4  # per element on the cluster's NCCL path: + the gradient shard


def write(tmp_path: Path, doc: object, name: str = "bench.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def by_hand(sc: Scenario, c: float, moved_per_elem: float, tier2_per_elem: float, d2h_gbps: float) -> float:
    """The documented law, written out again: per-step protection seconds of Leto.

    ``moved_per_elem``/``tier2_per_elem``: bytes per element a step on the cluster (staged;
    sent to each tier-2 parity node)."""
    a = sc.assumptions
    b = 12 * a.params / sc.gpus
    moved = moved_per_elem / 12 * b
    host = c * sc.gpus_per_node * moved / (a.host_cores_per_node - sc.gpus_per_node * a.train_cores_per_gpu)
    d2h = moved / (d2h_gbps * GB)
    tier2 = tier2_per_elem / 12 * b * a.tier2_m / (a.net_gbps_per_gpu * GB)
    od = a.d2h_overlap
    return (1 - od) * d2h + max(0.0, host + tier2 + od * d2h - a.protect_overlap * step_time_s(a))


def failure_free(gpus: int, **assume: float) -> Scenario:
    return Scenario(
        gpus=gpus, days=30, mtbf_gpu_hours=math.inf, assumptions=dataclasses.replace(Assumptions(), **assume)
    )


def protection_fraction(sc: Scenario, cal: object) -> float:
    return simulate(sc, ["leto"], cal).results["leto"].lost["protection"]  # type: ignore[arg-type]


def test_synthetic_overhead_file_sets_the_cost_by_the_computed_amount(tmp_path: Path) -> None:
    cal = load_calibration(write(tmp_path, SYNTH))
    assert cal.protect_cpu_s_per_byte == pytest.approx(SYNTH_C)
    assert cal.protect_moved_per_state_byte == pytest.approx(SYNTH_AT_SCALE / 12)
    assert cal.protect_tier2_per_state_byte == pytest.approx((12 / 1 + 4) / 12)  # ec 1+1
    assert "gradient shard" in cal.sources["protect_moved_per_state_byte"]
    assert cal.d2h_gbps == 25.0
    assert "cpu_s_per_step_on.keeper" in cal.sources["protect_cpu_s_per_byte"]
    assert len(cal.notes) == 1 and "NCCL path stages" in cal.notes[0]  # nothing missing
    # all on the critical path: the whole law shows
    sc = failure_free(1024, protect_overlap=0.0)
    base, new = build_costs("leto", sc, CAL).commit_s, build_costs("leto", sc, cal).commit_s
    assert new == pytest.approx(by_hand(sc, SYNTH_C, 16, 16, 25.0), rel=1e-9)
    assert base == pytest.approx(by_hand(sc, CAL.protect_cpu_s_per_byte, 16, 16, 63.0), rel=1e-9)
    # this file costs more CPU per byte and copies slower: the overhead goes up, and
    # the simulated failure-free loss is the per-step cost over the step plus the cost
    assert new > base
    step = step_time_s(sc.assumptions)
    for c, protect in ((CAL, base), (cal, new)):
        assert protection_fraction(sc, c) == pytest.approx(protect / (step + protect), abs=2e-5)
    assert protection_fraction(sc, cal) > protection_fraction(sc, CAL)


def test_host_work_is_hidden_when_it_fits_in_the_step_and_adds_beyond(tmp_path: Path) -> None:
    sc = failure_free(1024)  # default: protect_overlap = 1, d2h on the critical path
    a, step = sc.assumptions, step_time_s(sc.assumptions)
    cal = load_calibration(write(tmp_path, SYNTH))
    p = leto_protection(sc, cal)
    assert p["protect_host_s"] + p["protect_tier2_s"] < step
    assert build_costs("leto", sc, cal).commit_s == pytest.approx(p["protect_d2h_s"])
    assert p["protect_d2h_s"] == pytest.approx(16 / 12 * optimizer_bytes_per_gpu(a, sc.gpus) / 25e9)
    # 1000x the CPU per byte no longer fits: the excess over one step adds
    slow = dict(SYNTH, cpu_s_per_step_on={"worker": 0.21, "keeper": 30.0})
    cal = load_calibration(write(tmp_path, slow, "slow.json"))
    c = (30.0 + 0.01) / 12e6
    q = leto_protection(sc, cal)
    assert q["protect_host_s"] > step
    assert build_costs("leto", sc, cal).commit_s == pytest.approx(by_hand(sc, c, 16, 16, 25.0))
    assert q["protect_per_step_s"] == pytest.approx(
        q["protect_d2h_s"] + q["protect_host_s"] + q["protect_tier2_s"] - step
    )
    # overlapping the copy too hides it
    sc2 = failure_free(1024, d2h_overlap=1.0)
    assert build_costs("leto", sc2, load_calibration(write(tmp_path, SYNTH))).commit_s == 0.0


def test_real_overhead_result_gives_the_shipped_figure(tmp_path: Path) -> None:
    cal = load_calibration(REAL)
    doc = json.loads(REAL.read_text())
    moved = doc["protected_bytes"] / 12 * 16  # no bytes_per_element_per_step in that file
    cpu = doc["cpu_s_per_step_on"]["keeper"] + doc["cpu_s_per_step_on"]["worker"] - doc["cpu_s_per_step_off"]["worker"]
    assert cal.protect_cpu_s_per_byte == pytest.approx(cpu / moved)
    assert cal.protect_cpu_s_per_byte == pytest.approx(CAL.protect_cpu_s_per_byte, rel=1e-4)
    assert cal.protect_moved_per_state_byte == pytest.approx(16 / 12)
    assert cal.d2h_gbps is None  # no GPU run yet: PCIe stands in
    assert any("no bytes_per_element_per_step" in n for n in cal.notes)
    assert any("no protected_elements" in n for n in cal.notes)
    # at scale: the law on the real figure, all on the critical path
    sc = failure_free(1024, protect_overlap=0.0)
    protect = build_costs("leto", sc, cal).commit_s
    assert protect == pytest.approx(by_hand(sc, cpu / moved, 16, 16, 63.0), rel=1e-9)
    step = step_time_s(sc.assumptions)
    assert protection_fraction(sc, cal) == pytest.approx(protect / (step + protect), abs=2e-5)
    # twice the keepers' CPU in the same file: more overhead, by the computed amount
    doubled = dict(doc, cpu_s_per_step_on=dict(doc["cpu_s_per_step_on"], keeper=2 * doc["cpu_s_per_step_on"]["keeper"]))
    cal2 = load_calibration(write(tmp_path, doubled))
    c2 = (cpu + doc["cpu_s_per_step_on"]["keeper"]) / moved
    protect2 = build_costs("leto", sc, cal2).commit_s
    assert protect2 == pytest.approx(by_hand(sc, c2, 16, 16, 63.0), rel=1e-9)
    assert protect2 > protect
    assert protection_fraction(sc, cal2) > protection_fraction(sc, cal)


def test_curve_entry_moving_the_most_bytes_is_used(tmp_path: Path) -> None:
    doc = dict(
        SYNTH,
        curve=[
            {
                "label": "512 rows",
                "rows": 512,
                "model": "tiny",
                "step_s_off": 0.5,
                "step_s_on": 0.52,
                "overhead_ratio": 1.04,
                "cpu_s_per_step_on": {"worker": 0.9, "keeper": 0.03},
            },
            {
                "label": "small",
                "rows": 32,
                "model": "small",
                "step_s_off": 3.9,
                "step_s_on": 4.0,
                "overhead_ratio": 1.03,
                "protected_elements": 10_000_000,
                "cpu_s_per_step_on": {"worker": 2.0, "keeper": 0.2},
                "bytes_per_element_per_step": {"total": {"staged": 8, "tier2_sent": 8}},
            },
            {"label": "gpt2", "model": "gpt2", "cpu_s_per_step_on": {"keeper": 9.0}},
        ],
    )
    cal = load_calibration(write(tmp_path, doc))
    # 'small': keepers 0.2 s + the default job's extra worker CPU per byte (no 'off' in entries)
    worker_extra_per_byte = 0.01 / 12e6
    expect = (0.2 + worker_extra_per_byte * 8e7) / 8e7
    assert cal.protect_cpu_s_per_byte == pytest.approx(expect)
    assert cal.details["protection_chosen"] == "small"
    assert "curve[1]" in cal.sources["protect_cpu_s_per_byte"]
    labels = [f["label"] for f in cal.details["protection_figures"]]
    assert labels == ["default job", "512 rows", "small"]
    assert any("curve[2]" in n and "not used" in n for n in cal.notes)  # gpt2: no size known
    assert any("curve[0]" in n and "default job's" in n for n in cal.notes)
    assert any("curve[1]" in n and "only a 'total'" in n for n in cal.notes)
    assert cal.protect_moved_per_state_byte == pytest.approx(8 / 12)  # 'small' as it is


def test_gradients_staged_on_the_bench_are_not_added_again(tmp_path: Path) -> None:
    # --protect-grads on (the NCCL protocol on CPU): the accounting has a gradient row
    bpe = dict(SYNTH["bytes_per_element_per_step"])  # type: ignore[arg-type]
    bpe["grad"] = {"staged": 4, "checksummed": 4, "tier2_sent": 4}
    bpe["total"] = {"staged": 16, "checksummed": 16, "tier2_sent": 16}
    cal = load_calibration(write(tmp_path, dict(SYNTH, bytes_per_element_per_step=bpe)))
    assert cal.protect_moved_per_state_byte == pytest.approx(16 / 12)
    assert cal.protect_tier2_per_state_byte == pytest.approx(16 / 12)
    assert cal.protect_cpu_s_per_byte == pytest.approx(0.04 / 16e6)
    assert cal.notes == ()


def test_missing_keys_fall_back_with_a_note(tmp_path: Path) -> None:
    # only step times: the shipped protection figures stay
    cal = load_calibration(write(tmp_path, {"step_s_off": 0.1, "step_s_on": 0.11}))
    assert cal.protect_cpu_s_per_byte == CAL.protect_cpu_s_per_byte
    assert cal.sources["protect_cpu_s_per_byte"] == CAL.sources["protect_cpu_s_per_byte"]
    assert any("cpu_s_per_step_on" in n and "shipped" in n for n in cal.notes)
    # keepers' CPU but no 'off' run and no accounting: keeper CPU over 16 B an element
    doc = {
        "step_s_off": 0.1,
        "step_s_on": 0.11,
        "protected_bytes": 12e6,
        "cpu_s_per_step_on": {"keeper": 0.02, "worker": 0.3},
    }
    cal = load_calibration(write(tmp_path, doc))
    assert cal.protect_cpu_s_per_byte == pytest.approx(0.02 / (1e6 * 16))
    notes = " | ".join(cal.notes)
    assert "only the keepers' CPU counted" in notes
    assert "no bytes_per_element_per_step: 16 B" in notes
    assert "no 'ec'" in notes
    assert "no tier-2 bytes" in notes
    # no 'total' in the accounting: summed over the buffers
    doc = dict(
        SYNTH, bytes_per_element_per_step={"m": {"staged": 4, "tier2_sent": 4}, "v": {"staged": 6, "tier2_sent": 6}}
    )
    cal = load_calibration(write(tmp_path, doc))
    assert cal.protect_moved_per_state_byte == pytest.approx((10 + 4) / 12)  # + gradient shard
    assert any("no 'total'" in n for n in cal.notes)
    # workers less busy with protection on (noise): their extra counts as 0
    doc = dict(SYNTH, cpu_s_per_step_off={"worker": 0.5})
    cal = load_calibration(write(tmp_path, doc))
    assert cal.protect_cpu_s_per_byte == pytest.approx(0.03 / 12e6)
    assert any("counted as 0" in n for n in cal.notes)


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"cpu_s_per_step_on": "fast"}, "cpu_s_per_step_on"),
        ({"cpu_s_per_step_on": {"keeper": "x"}}, "cpu_s_per_step_on.keeper"),
        ({"cpu_s_per_step_off": [0.2]}, "cpu_s_per_step_off"),
        ({"bytes_per_element_per_step": [1]}, "bytes_per_element_per_step"),
        ({"bytes_per_element_per_step": {"total": {"checksummed": 4}}}, "no 'staged'"),
        ({"bytes_per_element_per_step": {"total": {"staged": -1}}}, "total.staged"),
        ({"bytes_per_element_per_step": {"total": {"staged": 0}}}, "no bytes moved"),
        ({"protected_elements": 0}, "protected_elements"),
        ({"protected_elements": None, "protected_bytes": "many"}, "protected_bytes"),
        ({"d2h_gbps": 0}, "d2h_gbps"),
        ({"curve": {"small": 1}}, "curve"),
        ({"curve": [3]}, "curve[0]"),
        ({"curve": [{"cpu_s_per_step_on": {"keeper": -2}}]}, "curve[0].cpu_s_per_step_on.keeper"),
    ],
)
def test_malformed_overhead_file_names_the_problem(tmp_path: Path, change: dict[str, object], needle: str) -> None:
    path = write(tmp_path, {**SYNTH, **change})
    with pytest.raises(CalibrationError, match="bench.json") as info:
        load_calibration(path)
    assert needle in str(info.value)


def test_malformed_overhead_file_is_a_one_line_cli_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = write(tmp_path, {**SYNTH, "cpu_s_per_step_on": {"keeper": "x"}})
    rc = main(["--calibration", str(path)])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.startswith("leto simulate: error: ") and err.count("\n") == 1
    assert "bench.json" in err and "cpu_s_per_step_on.keeper" in err


def test_json_lists_every_input_as_measured_or_assumed(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc = main(["--gpus", "8192", "--days", "5", "--calibration", str(REAL), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0
    inputs = doc["inputs"]
    for name, entry in inputs.items():
        assert entry["kind"] in {"measured", "assumed"}, name
        assert entry["source"], name
        assert "value" in entry and "unit" in entry
    for name in dataclasses.asdict(Assumptions()):
        assert inputs[name]["kind"] == "assumed"
    cpu = inputs["calibration.protect_cpu_s_per_byte"]
    assert cpu["kind"] == "measured" and cpu["used"] is True
    assert "overhead-2026-11-30.json" in cpu["source"] and "cpu_s_per_step_on" in cpu["source"]
    assert inputs["calibration.protect_moved_per_state_byte"]["kind"] == "assumed"
    assert inputs["calibration.d2h_gbps"]["kind"] == "assumed"
    assert inputs["calibration.leto_lost_steps"]["kind"] == "assumed"  # a PLACEHOLDER
    assert inputs["calibration.encode_gbps"]["used"] is False
    assert any("bytes_per_element_per_step" in n for n in doc["calibration_notes"])
    assert doc["protection_calibration"]["protection_chosen"] == "default job"
    costs = doc["costs_s"]["leto"]
    assert costs["protect_per_step_s"] == pytest.approx(costs["protect_d2h_s"])  # hidden host
    # a measured d2h turns that input into a measured one
    rc = main(["--gpus", "8192", "--days", "5", "--json", "--calibration", str(write(tmp_path, SYNTH))])
    doc = json.loads(capsys.readouterr().out)
    d2h = doc["inputs"]["calibration.d2h_gbps"]
    assert d2h["kind"] == "measured" and d2h["value"] == 25.0 and "bench.json" in d2h["source"]
    assert len(doc["calibration_notes"]) == 1  # the gradient shard added at scale
