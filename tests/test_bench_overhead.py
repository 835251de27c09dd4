"""`leto bench overhead`: memory counted whole, the curve's entries, the targets' verdicts, the
mesh's figures.

On synthetic inputs or small layouts computed by hand, and one short real `--tp 2` run whose
figures are checked for their structure and sense; no wall-clock value is checked.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import pytest

from leto import cli
from leto.bench import cpu, overhead, persist_cost, protection_cpu, throughput
from leto.bench.cpu import CpuSampler, memory_bytes
from leto.bench.mesh import mesh_elements
from leto.bench.overhead import (
    PARTS,
    Point,
    check_tokens,
    curve_entry,
    memory_parts,
    memory_summary,
    parse_curve,
    protected_bytes,
    rss_summary,
    targets,
    verdict,
    worker_copy_bytes,
)
from leto.errors import UsageError
from leto.protection.accounting import bytes_per_element_per_step
from leto.protection.layout import RING_SLOTS, Geometry, Layout, ring_slots_for
from leto.protection.shm import Region
from leto.protection.transport import HDR, SEND_BUFFERS, batch_buffer_bytes

# 4 ranks on 2 nodes, 3 chunks of 1000 elements each, --ec 1+1: state chunk 12,000 B, gradient chunk 4,000 B
GEOM = Geometry(3, 1000)
NODES = (0, 0, 1, 1)


def layout(**kw: object) -> Layout:
    return Layout(0, 0, GEOM, NODES, (1, 1), **kw)


def test_memory_parts_of_the_nccl_path_by_hand() -> None:
    """Gradients protected (a real reduce-scatter): every part, computed by hand."""
    lay = layout()
    assert lay.protects_grads and lay.segment_len == 6  # 1+1 on 2 nodes: each keeps the other's 6 positions
    parts = memory_parts(lay)
    assert set(parts) == set(PARTS)
    per_node = {
        "tier1_parity": 3 * 12000,
        "tier2_parity": 6 * 12000,
        "gradient_parity": 2 * 3 * 4000 + 2 * 6 * 4000,  # two steps, tier 1 and tier 2
        "staging_slots": 2 * 8 * 8 * 8 + 2 * 8 * 12000,  # slot headers and data: 8 slots per worker
        # header; v1, crc1, g1_step, g1_count, gcrc1; v2, crc2, g2_step, g2_count, gcrc2 (int64)
        "tables": 128 + 8 * (6 + 6 + 6 + 6 + 12) + 8 * (6 + 6 + 12 + 12 + 12),
        # one link each way; per kind SEND_BUFFERS to send, each of a prefix and 6 record headers
        # (a step's 6 chunks fit in a batch; 1+1 sends every body from its staging slot), and one
        # to receive, of a prefix and 6 records of HDR int64 and the chunk
        "tier2_batch_buffers": SEND_BUFFERS * 2 * (16 + 6 * HDR * 8)
        + (16 + 6 * (HDR * 8 + 4000))
        + (16 + 6 * (HDR * 8 + 12000)),
    }
    for part, b in per_node.items():
        assert parts[part] == 2 * b, part
    assert parts["parity_preimages"] == 0 and parts["worker_snapshot"] == 0 and parts["worker_chunk_scratch"] == 0
    assert parts["worker_second_state"] == 4 * 3 * 12000  # the second version of every shard
    assert parts["worker_second_grads"] == 4 * 3 * 4000  # and of every gradient shard
    assert protected_bytes(lay) == 4 * 3 * 12000
    s = memory_summary(lay)
    assert s["memory_overhead"] == pytest.approx(sum(parts.values()) / 144000, abs=1e-4)
    assert sum(p["bytes"] for p in s["memory_parts"].values()) == sum(parts.values())
    assert sum(p["per_protected_byte"] for p in s["memory_parts"].values()) == pytest.approx(
        s["memory_overhead"], abs=1e-3
    )


def test_memory_parts_of_the_gloo_path_leave_out_gradients() -> None:
    """Replicated gradients: no gradient parity, no gradient batches, no second gradient shard,
    and the shard is updated in place through one scratch chunk instead of a second version."""
    lay = layout(replicated_grads=True)
    parts = memory_parts(lay)
    assert parts["gradient_parity"] == parts["worker_second_grads"] == 0
    assert parts["tier2_batch_buffers"] == 2 * (SEND_BUFFERS * (16 + 6 * HDR * 8) + 16 + 6 * (HDR * 8 + 12000))
    assert parts["worker_second_state"] == 0 and parts["worker_chunk_scratch"] == 4 * 12000
    assert parts["tier1_parity"] + parts["tier2_parity"] == 2 * (3 + 6) * 12000
    # the limit for a large model: 1/W tier 1 + m/k tier 2 (and the tables)
    assert memory_summary(lay)["memory_overhead_large_model_limit"] == pytest.approx(0.5 + 1.0, abs=1e-2)


def test_an_interval_keeps_preimages_and_a_snapshot() -> None:
    lay = layout(protect_every=3)
    parts = memory_parts(lay)
    assert parts["parity_preimages"] == 2 * (3 + 6) * 12000
    assert parts["worker_snapshot"] == 4 * 3 * 12000 and parts["worker_second_grads"] == 0
    assert parts["worker_second_state"] == 4 * 3 * 12000 and parts["worker_chunk_scratch"] == 0  # not in place
    assert parts["gradient_parity"] == 0


def test_batches_are_capped_by_the_largest_message() -> None:
    """A chunk bigger than a batch: one record per message, whatever the number of chunks."""
    lay = Layout(0, 0, Geometry(5, 1 << 20), NODES, (1, 1), replicated_grads=True)
    record = HDR * 8 + 12 * (1 << 20)
    assert batch_buffer_bytes(lay, 0) == SEND_BUFFERS * (16 + HDR * 8) + 16 + record
    assert worker_copy_bytes(lay) == {
        "worker_second_state": 0,
        "worker_second_grads": 0,
        "worker_snapshot": 0,
        "worker_chunk_scratch": 12 * (1 << 20),
    }


def test_a_workers_staging_ring_holds_a_steps_chunks_within_its_bounds() -> None:
    """As many slots as a rank has chunks (a worker then never waits for its keeper to free one
    in a step), never fewer than the lower bound nor more than the upper; the default job's
    layout, and so its memory figure, has such a ring."""
    low, high = RING_SLOTS
    for n_chunks, slots in [(1, low), (low, low), (low + 1, low + 1), (high, high), (10 * high, high)]:
        assert ring_slots_for(Geometry(n_chunks, 16384)) == slots
    lay, _ = overhead.job_layout("tiny", 4, 2, (1, 1))
    assert lay.ring_slots == lay.geometry.n_chunks == 13
    assert memory_parts(lay)["staging_slots"] == 4 * 13 * (8 * 8 + lay.geometry.state_bytes)


@pytest.mark.parametrize("replicated", [False, True])
def test_region_parts_are_the_keepers_real_region(replicated: bool) -> None:
    """The shared-memory parts add up to the file a keeper creates (less cache-line padding)."""
    lay = layout(replicated_grads=replicated)
    parts = memory_parts(lay)
    region = sum(b for p, b in parts.items() if PARTS[p][0] == "keeper shm")
    sizes = []
    for node in lay.nodes:
        r = Region(lay, f"test-overhead-{os.getpid()}", node, create=True)
        try:
            sizes.append((r.nbytes, len(r.arrays)))
        finally:
            r.close()
            r.unlink()
    total, arrays = sum(s for s, _ in sizes), sum(n for _, n in sizes)
    assert region <= total < region + 64 * arrays


def test_memory_cost_keeps_the_old_figures_beside_the_headline() -> None:
    m = overhead.memory_cost("tiny", 4, 2, (1, 1))
    parts = m["memory_parts"]
    assert m["memory_overhead"] == pytest.approx(
        sum(p["bytes"] for p in parts.values()) / m["protected_bytes"], abs=1e-4
    )
    assert m["memory_overhead_without_batches_and_copies"] == pytest.approx(
        m["keeper_bytes"] / m["protected_bytes"], abs=1e-4
    )
    assert m["keeper_bytes"] == sum(m["keeper_breakdown"].values())
    assert m["keeper_batch_buffer_bytes"] == parts["tier2_batch_buffers"]["bytes"] > 0
    assert m["worker_second_copies_bytes"] == sum(parts[p]["bytes"] for p in parts if p.startswith("worker_")) > 0
    assert (
        m["memory_overhead"] > m["memory_overhead_with_worker_copies"] > m["memory_overhead_without_batches_and_copies"]
    )
    assert m["memory_layout"]["replicated_grads"] and not m["memory_layout"]["protects_grads"]
    assert (
        m["memory_overhead_by_path"]["nccl"]["memory_overhead"]
        > m["memory_overhead_by_path"]["gloo"]["memory_overhead"]
    )
    assert m["protected_elements"] * 12 == m["protected_bytes"]


# ----- measured memory of processes
def test_rss_by_role_counts_each_process_once_without_shared_regions() -> None:
    mib = 1 << 20
    peaks = {
        1: {
            "pid": 1,
            "role": "keeper",
            "node": 0,
            "vm_rss": 200 * mib,
            "rss_shmem": 10 * mib,
            "pss": 150 * mib,
            "pss_shmem": 5 * mib,
        },
        2: {
            "pid": 2,
            "role": "keeper",
            "node": 1,
            "vm_rss": 210 * mib,
            "rss_shmem": 10 * mib,
            "pss": 160 * mib,
            "pss_shmem": 5 * mib,
        },
        3: {"pid": 3, "role": "zygote", "node": 0, "vm_rss": 100 * mib, "rss_shmem": 0},  # no smaps_rollup
        4: {"pid": 4, "role": "shadow", "node": 0, "vm_rss": 90 * mib, "pss": 60 * mib, "pss_shmem": 0},
        5: {"pid": 5, "role": "worker", "node": 0, "vm_rss": 300 * mib, "pss": 250 * mib, "pss_shmem": mib},
    }
    s = rss_summary(peaks)
    assert s["fixed_rss_bytes_per_node"] == {"keeper": 155 * mib, "zygote": 100 * mib}  # the larger node's keeper
    assert s["recovery_rss_bytes_per_node"] == {"shadow": 60 * mib}
    assert s["rss_by_role"]["keeper"]["processes"] == 2
    assert s["rss_by_role"]["keeper"]["own_bytes"] == 300 * mib
    assert "worker" not in s["fixed_rss_bytes_per_node"]


def test_memory_of_a_live_process_and_the_peak_sample(tmp_path: Path) -> None:
    mine = memory_bytes(os.getpid())
    assert mine is not None and mine["vm_rss"] > 0 and mine["rss_anon"] > 0
    assert memory_bytes(2**22 + 12345) is None  # no such process


def test_the_jobs_peak_is_one_moment_not_each_processs_own_peak(tmp_path: Path) -> None:
    """Pss moves shared pages between processes as others map or unmap them: a server alone
    holds all of them before it forks, a keeper more of them once the workers are gone. The
    job's peak is the pass whose processes held the most together."""
    sampler = CpuSampler(tmp_path, memory_every_s=0.0)

    def rec(pid: int, role: str, pss: int) -> dict:
        return {"pid": pid, "role": role, "node": 0, "vm_rss": 2 * pss, "pss": pss}

    sampler.memory = [
        (1.0, rec(1, "fork-server", 170)),  # alone: every page its own
        (2.0, rec(1, "fork-server", 40)),
        (2.0, rec(7, "keeper", 80)),
        (2.0, rec(8, "worker", 300)),
        (3.0, rec(1, "fork-server", 52)),
        (3.0, rec(7, "keeper", 99)),  # the worker is gone: the keeper's share grew
    ]
    assert sampler.memory_at_peak() == {1: rec(1, "fork-server", 40), 7: rec(7, "keeper", 80), 8: rec(8, "worker", 300)}
    assert sampler.memory_at_peak(2.5, None) == {1: rec(1, "fork-server", 52), 7: rec(7, "keeper", 99)}
    assert sampler.memory_at_peak(0.0, 1.5) == {1: rec(1, "fork-server", 170)}
    assert sampler.memory_at_peak(5.0, None) == {}  # no pass in the window
    assert overhead.job_memory(sampler.memory_at_peak())["bytes"] == 420  # not 170 + 99 + 300


# ----- the curve
ENTRY_KEYS = {
    "label",
    "model",
    "rows",
    "step_s_off",
    "step_s_on",
    "overhead_ratio",
    "cpu_s_per_step_off",
    "cpu_s_per_step_on",
    "bytes_per_element_per_step",
    "tokens_per_param_per_step",
}


def test_a_curve_entry_has_the_documented_keys() -> None:
    lay = layout(replicated_grads=True)
    off, on = [1.0, 1.2, 1.1], [1.05, 1.3, 1.1]
    cpu_off = [{"worker": 0.10}, {"worker": 0.12}, {"worker": 0.11}]
    cpu_on = [{"worker": 0.11, "keeper": 0.02, "keeper/main": 0.01}] * 3
    e = curve_entry(
        Point("tiny", 512),
        800_000,
        lay,
        off,
        on,
        cpu_off,
        cpu_on,
        steps=12,
        prot_rounds=[
            [{"stage_s": 0.001, "wait_s": 0.002, "wait_slot_s": 0.0015, "stage_cpu_s": 0.0008, "wait_cpu_s": 0.0001}]
        ],
    )
    assert ENTRY_KEYS <= set(e)
    assert e["label"] == "tiny x512 rows" and e["model"] == "tiny" and e["rows"] == 512
    assert e["step_s_off"] == 1.1 and e["step_s_on"] == 1.1 and e["overhead_ratio_of_medians"] == 1.0  # medians
    # the headline pairs each round's runs: median of 1.05, 1.3/1.2 and 1.0, not 1.1/1.1
    assert e["overhead_ratio"] == pytest.approx(1.05)
    assert e["cpu_s_per_step_off"] == {"worker": 0.11}
    assert e["cpu_s_per_step_on"] == {"keeper": 0.02, "keeper/main": 0.01, "worker": 0.11}
    assert e["tokens_per_param_per_step"] == pytest.approx(512 * 64 / 800_000, rel=1e-3)
    assert e["bytes_per_element_per_step"]["total"]["staged"] == 12  # master, exp_avg, exp_avg_sq; no gradient
    assert e["rounds"] == 3 and e["steps_per_run"] == 12
    assert e["protected_elements"] == 4 * 3 * 1000
    assert e["protection_stage_cpu_s_per_step"] == 0.0008 and e["protection_wait_cpu_s_per_step"] == 0.0001
    assert e["protection_wait_s_per_step"] == 0.002 and e["protection_wait_slot_s_per_step"] == 0.0015
    default = curve_entry(Point("small"), 10_000_000, lay, [4.0], [4.4], [{}], [{}], steps=12)
    assert default["rows"] == 32 and default["overhead_ratio"] == 1.1 and default["rounds"] == 1


def test_curve_points_from_the_flag() -> None:
    assert parse_curve("none", "tiny", 4) == []
    assert parse_curve("default", "tiny", 4) == [Point("tiny", 512)]
    assert parse_curve("full", "tiny", 4) == [Point("tiny", 128), Point("tiny", 512), Point("small")]
    # the default job is always measured, never twice; duplicates go
    assert parse_curve("32,tiny,64,64,small", "tiny", 4) == [Point("tiny", 64), Point("small")]
    with pytest.raises(ValueError):
        parse_curve("huge", "tiny", 4)
    with pytest.raises(ValueError):
        parse_curve("2", "tiny", 4)  # fewer rows than workers


def test_a_rows_knob_that_did_not_take_is_an_error(tmp_path: Path) -> None:
    recs = [{"step": 1, "step_s": 0.5, "tokens_per_s": 4096.0}, {"step": 2, "step_s": 0.25, "tokens_per_s": 8192.0}]
    check_tokens(recs, 2048, tmp_path)
    with pytest.raises(RuntimeError):
        check_tokens(recs, 32768, tmp_path)


# ----- targets
def test_verdicts_are_measured_never_assumed() -> None:
    assert verdict(1.03, 1.03) == "met"
    assert verdict(1.0301, 1.03) == "MISS"
    assert verdict(None, 1.03) == "NOT MEASURED"
    out = {
        "model": "tiny",
        "overhead_ratio": 1.02,
        "memory_overhead": 3.5,
        "curve": [
            {"model": "tiny", "rows": 32, "overhead_ratio": 1.02},
            {"model": "tiny", "rows": 512, "overhead_ratio": 1.011},
        ],
    }
    t = targets(out)
    assert t["overhead_ratio_default_job"]["result"] == "met"
    assert t["overhead_ratio_512_rows"] == {"value": 1.011, "target": "<= 1.01", "result": "MISS"}
    assert t["memory_overhead_default_job"]["result"] == "MISS"
    out["curve"] = out["curve"][:1]
    assert targets(out)["overhead_ratio_512_rows"]["result"] == "NOT MEASURED"
    assert t["overhead_ratio_default_job_with_persistence"]["result"] == "NOT MEASURED"
    out["persistence"] = {"overhead_ratio_with_persistence": 1.025}
    assert targets(out)["overhead_ratio_default_job_with_persistence"]["result"] == "met"


def test_bad_curve_flags_are_usage_errors_before_any_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_run(*a: object, **kw: object) -> dict:
        raise AssertionError("no job may run")

    monkeypatch.setattr(overhead, "run_job", no_run)
    assert cli.main(["bench", "overhead", "--curve", "huge"]) == 2
    assert "--curve" in capsys.readouterr().err
    assert cli.main(["bench", "overhead", "--rounds", "0"]) == 2
    args = cli.build_parser().parse_args(
        [
            "bench",
            "overhead",
            "--curve",
            "full",
            "--curve-rounds",
            "1",
            "--curve-steps",
            "6",
            "--rss",
            "off",
            "--rounds",
            "5",
        ]
    )
    assert (args.curve, args.curve_rounds, args.curve_steps, args.rss, args.rounds) == ("full", 1, 6, "off", 5)
    assert isinstance(args, argparse.Namespace)


def test_the_bench_interleaves_runs_and_reports_every_key(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """main() on stand-in runs (no job starts): the order of runs, the JSON keys, the printout."""
    import json

    calls: list[tuple] = []
    persisted: list[bool] = []

    def fake_run(
        workers: int,
        steps: int,
        model: str,
        run_dir: Path,
        extra: list[str] | None = None,
        spares: int = 0,
        nodes: int = 1,
        protection: bool = False,
        ec: object = None,
        module: str | None = None,
        memory_every_s: float | None = None,
        persist: bool = False,
        tp: int = 1,
    ) -> dict:
        assert tp == 1
        rows = int(extra[1]) if extra else overhead.PRESETS[model].batch_size
        calls.append((model, rows, protection, spares, module))
        persisted.append(persist)
        step_s = 0.1 * rows / 32 * (1.1 if protection else 1.0)
        wall_s = step_s * (1.2 / 1.1 if persist else 1.0)  # a checkpoint's copy: not in the median step time
        recs = [
            {
                "step": i + 1,
                "step_s": step_s,
                "tokens_per_s": rows * 64 / step_s,
                "stage_s": 0.001,
                "wait_s": 0.002,
                "stage_cpu_s": 0.001,  # x 4 workers: 4 ms a step
                "wait_cpu_s": 0.0005,  # 2 ms
                "time": 1000.0 + i * wall_s,
            }
            for i in range(steps)
        ]
        # K 6 chosen after the calibration checkpoint of step 5; each write commits half a step after its copy
        commits = [5, *range(11, steps, 6)]
        events = (
            [{"event": "persist_interval", "every": 6, "first": 11, "time": recs[6]["time"]}]
            + [{"event": "persist_commit", "step": c, "time": recs[c - 1]["time"] + wall_s / 2} for c in commits]
            if persist
            else []
        )
        mem = {
            1: {"pid": 1, "role": "keeper", "node": 0, "vm_rss": 9 << 20, "pss": 8 << 20, "pss_shmem": 1 << 20},
            2: {"pid": 2, "role": "zygote", "node": 0, "vm_rss": 7 << 20, "pss": 6 << 20, "pss_shmem": 0},
            3: {"pid": 3, "role": "shadow", "node": 0, "vm_rss": 7 << 20, "pss": 5 << 20, "pss_shmem": 0},
            4: {"pid": 4, "role": "worker", "node": 0, "vm_rss": 30 << 20, "pss": 20 << 20, "pss_shmem": 0},
        }
        if not protection:
            mem = {4: mem[4]}
        return {
            "steps": recs,
            "events": events,
            "cpu_s_per_step": {
                "worker": 0.1,
                **({"keeper": 0.02, "keeper/main": 0.012, "keeper/gloo": 0.008} if protection else {}),
            },
            "memory": mem if memory_every_s else {},
        }

    monkeypatch.setattr(overhead, "run_job", fake_run)
    monkeypatch.setattr(
        "leto.bench.floor.operation_costs",
        lambda size=0: dict.fromkeys(("copy", "xor_two_into_slot", "checksum", "fold", "tcp_loopback"), 0.1),
    )
    monkeypatch.setattr(
        overhead,
        "measure_codec",
        lambda **kw: dict.fromkeys(("encode_gbps", "xor_gbps", "checksum_gbps", "memcpy_gbps"), 10.0),
    )
    assert cli.main(["bench", "overhead", "--json", "--steps", "4", "--curve", "128", "--curve-rounds", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    # K's calibration run, then the rounds: off, on, persisting; on, off, persisting; ... (counterbalanced)
    default = [("tiny", 32, True, 0, None)] + [
        ("tiny", 32, p, 0, None)
        for i in range(overhead.ROUNDS)
        for p in ((False, True) if i % 2 == 0 else (True, False)) + (True,)
    ]
    curve = [("tiny", 128, p, 0, None) for i in range(2) for p in ((False, True) if i % 2 == 0 else (True, False))]
    n = len(default)
    assert calls[:n] == default and calls[n : n + 4] == curve
    assert persisted == [True] + [False, False, True] * overhead.ROUNDS + [False] * (len(calls) - n)
    assert overhead.round_order(("off", "on"), 3) == ("on", "off")
    assert out["overhead_ratio_by_order"] == {"off_first": [1.1] * 3, "on_first": [1.1] * 2}
    assert overhead.ratio_by_order([1.0, 1.0, 1.0], [1.2, 1.0, 1.1]) == {"off_first": [1.2, 1.1], "on_first": [1.0]}
    pe = out["persistence"]
    assert pe["overhead_ratio_with_persistence"] == pytest.approx(1.2) and pe["overhead_ratio_wall"] == pytest.approx(
        1.1
    )
    # the persisting runs are long enough for 2 checkpoints at K 6 after the calibration: 5 + 2 x 12 + 6 steps
    assert [r["run_steps"] for r in pe["rounds"]] == [35] * overhead.ROUNDS and pe["k_calibration"] == 6
    assert pe["every"] == [6] * overhead.ROUNDS and pe["checkpoints_in_window"] >= 2 and pe["window_ok"]
    assert pe["wall_share"] == pytest.approx(0.0, abs=1e-6)  # no step of these runs is slower than another
    assert out["targets"]["overhead_ratio_default_job_with_persistence"]["result"] == "MISS"
    assert out["targets"]["persistence_wall_share_per_step"]["result"] == "met"
    assert out["targets"]["persistence_cpu_share_per_step"]["result"] == "NOT MEASURED"  # no CPU timeline here
    assert calls[n + 4][2:4] == (True, 1)  # the memory runs: protected, with a shadow (and zygotes) ...
    assert calls[n + 5][2:4] == (False, 0)  # ... and unprotected, without them
    assert len(calls) == n + 6
    old_keys = {
        "model",
        "workers",
        "nodes",
        "ec",
        "steps_per_run",
        "rounds",
        "step_s_off",
        "step_s_on",
        "overhead_ratio",
        "step_s_off_runs",
        "step_s_on_runs",
        "protection_stage_s_per_step",
        "protection_wait_s_per_step",
        "protection_wait_slot_s_per_step",
        "encode_gbps",
        "xor_gbps",
        "checksum_gbps",
        "memcpy_gbps",
        "cpu_s_per_step_off",
        "cpu_s_per_step_on",
        "protected_bytes",
        "keeper_bytes",
        "keeper_breakdown",
        "worker_second_copies_bytes",
        "memory_overhead",
        "memory_overhead_with_worker_copies",
    }
    new_keys = {
        "curve",
        "curve_mode",
        "curve_rounds",
        "curve_steps_per_run",
        "bytes_per_element_per_step",
        "protected_elements",
        "memory_parts",
        "memory_overhead_without_batches_and_copies",
        "memory_overhead_large_model_limit",
        "fixed_rss_bytes_per_node",
        "recovery_rss_bytes_per_node",
        "rss_by_role",
        "targets",
    }
    assert old_keys | new_keys <= set(out)
    assert out["overhead_ratio"] == pytest.approx(1.1) and out["rounds"] == overhead.ROUNDS and out["curve_rounds"] == 2
    assert [(e["rows"], e["rounds"]) for e in out["curve"]] == [(32, overhead.ROUNDS), (128, 2)]
    assert all(ENTRY_KEYS <= set(e) for e in out["curve"])
    assert out["fixed_rss_bytes_per_node"] == {"keeper": 7 << 20, "zygote": 6 << 20}
    assert out["recovery_rss_bytes_per_node"] == {"shadow": 5 << 20}
    a = out["memory_all_in"]
    assert a["protected"]["bytes"] == (8 + 6 + 5 + 20) << 20 and a["unprotected"]["bytes"] == 20 << 20
    assert a["ratio"] == pytest.approx(39 / 20, abs=1e-4) and a["extra_bytes"] == 19 << 20
    assert out["tp"] == 1 and out["dp"] == 4 and out["mesh"]["replicated_elements_per_slice"] == 0
    assert out["targets"]["overhead_ratio_512_rows"]["result"] == "NOT MEASURED"
    # protection CPU: keepers 20 ms + the workers' training threads 4 + 2 ms = 26 ms, against training's 94 ms
    pc = out["protection_cpu"]
    assert out["protection_cpu_to_training_cpu"] == pytest.approx(26 / 94, abs=1e-4)
    assert pc["cpu_s_per_step"]["total"]["median"] == pytest.approx(0.026)
    assert pc["cpu_s_per_step"]["training"]["median"] == pytest.approx(0.094)
    assert pc["cpu_s_per_step"]["training_unprotected"]["median"] == pytest.approx(0.1)
    assert len(pc["rounds"]) == overhead.ROUNDS
    # every floor operation 0.1 ns/B, in cache and cold: the floor is 0.1 ns x the bytes of its terms
    fl = out["physical_floor"]
    assert pc["vs_floor"]["total"]["cold_floor_ms"] == pytest.approx(fl["cold_total_cpu_ms_per_step"], abs=1e-3)
    cold_ratio = 26 / fl["cold_total_cpu_ms_per_step"]
    assert out["targets"]["protection_cpu_vs_cold_floor"]["value"] == pytest.approx(cold_ratio, rel=1e-2)
    assert out["targets"]["protection_cpu_vs_cold_floor"]["result"] == ("met" if cold_ratio <= 1.5 else "MISS")
    assert out["protection_cpu_s_per_step"]["total"] == pytest.approx(0.026)
    assert out["protection_cpu_s_per_step"]["worker_difference"] == 0.0  # the old figure, beside it
    assert len(fl["samples"]) == overhead.ROUNDS  # the floor measured after each round
    calls.clear()
    assert cli.main(["bench", "overhead", "--steps", "4", "--rounds", "3", "--curve", "none", "--rss", "off"]) == 0
    text = capsys.readouterr().out
    assert len(calls) == 10
    head = text.index("protection CPU / training CPU 27.66 % [27.66, 27.66]")
    assert head < text.index("wall-clock overhead ratio 1.100") < text.index("keeper/main")
    assert "against the physical floor" in text and "protection_cpu_vs_cold_floor <= 1.5" in text
    assert "overhead ratio 1.100" in text and "memory, all in" in text and "overhead ratio 1.200 by wall time" in text
    assert "per element of the model" in text and "the whole job, measured" not in text  # --rss off
    assert "target overhead_ratio_default_job <= 1.03: 1.1000 MISS" in text
    assert "steps that write nothing" in text and "WARNING" not in text


def test_the_physical_floor_is_bytes_times_measured_cost_per_operation() -> None:
    from leto.bench.floor import floor

    lay = layout(replicated_grads=True)  # 4 ranks x 3 chunks x 1000 elements, --ec 1+1
    costs = {"copy": 0.1, "xor_two_into_slot": 0.2, "checksum": 0.05, "fold": 0.1, "tcp_loopback": 0.5}
    cold = {k: 2 * v for k, v in costs.items()}
    f = floor(lay, step_s_off=0.1, cores=2, samples=[{"costs": costs, "cold": cold, "handoff_fold_ns_per_byte": None}])
    staged = 12 * 4 * 3 * 1000  # master, exp_avg, exp_avg_sq; no gradient on gloo
    t = f["terms"]["tier 2: TCP send and receive"]
    assert (t["bytes_per_step"], t["operation"], t["ns_per_byte"]) == (staged, "tcp_loopback", 0.5)
    assert t["cpu_ms_per_step"] == round(staged * 0.5e-6, 3) and t["cold_cpu_ms_per_step"] == round(staged * 1e-6, 3)
    # every term moves every staged byte once (m=1): the worker's copy aside, XOR and checksum,
    # the keeper's fold, TCP, the tier-2 fold (the kernel takes tier-2 bodies from their slots)
    expected_ns = staged * (0.1 + 0.2 + 0.05 + 0.1 + 0.5 + 0.1)
    assert f["total_cpu_ms_per_step"] == pytest.approx(expected_ns * 1e-6, abs=2e-3)
    assert f["floor_overhead_ratio"] == pytest.approx(1 + expected_ns * 1e-9 / (2 * 0.1), abs=1e-4)
    assert f["cold_total_cpu_ms_per_step"] == pytest.approx(2 * expected_ns * 1e-6, abs=4e-3)


def test_the_floor_takes_each_operations_median_over_its_measurements() -> None:
    from leto.bench.floor import floor

    lay = layout(replicated_grads=True)
    ops = ("copy", "xor_two_into_slot", "checksum", "fold", "tcp_loopback")
    # three measurements; the middle one of each operation is 0.1 ns/B in cache and 0.2 cold
    samples = [
        {"costs": dict.fromkeys(ops, c), "cold": dict.fromkeys(ops, 2 * c), "handoff_fold_ns_per_byte": h}
        for c, h in ((0.05, 0.3), (0.1, None), (0.4, 0.1))
    ]
    f = floor(lay, step_s_off=0.1, cores=2, samples=samples)
    staged = 12 * 4 * 3 * 1000  # every term moves every staged byte once (m=1)
    assert f["operation_ns_per_byte"] == dict.fromkeys(ops, 0.1) and f["cold_operation_ns_per_byte"] == dict.fromkeys(
        ops, 0.2
    )
    # (each term is rounded to the microsecond)
    assert f["total_cpu_ms_per_step"] == pytest.approx(6 * staged * 0.1e-6, abs=3e-3)
    assert f["cold_total_cpu_ms_per_step"] == pytest.approx(6 * staged * 0.2e-6, abs=3e-3)
    assert [x["cpu_ms_per_step"] for x in f["samples"]] == [round(6 * staged * c * 1e-6, 3) for c in (0.05, 0.1, 0.4)]
    assert f["handoff_fold_ns_per_byte"] == pytest.approx(0.2)  # the median of those measured


def test_the_floor_where_the_bytes_lie_prices_each_term_where_the_protocol_leaves_them() -> None:
    from leto.bench.floor import floor

    lay = layout(replicated_grads=True)
    ops = ("copy", "xor_two_into_slot", "checksum", "fold", "tcp_loopback")
    sample = {
        "costs": dict.fromkeys(ops, 0.1),
        "cold": dict.fromkeys(ops, 0.4),
        "placed": {"xor_two_into_slot": 0.2, "fold": 0.3},
        "handoff_fold_ns_per_byte": 0.5,
    }
    f = floor(lay, step_s_off=0.1, cores=2, samples=[sample])
    staged = 12 * 4 * 3 * 1000
    got = {name: t["placed_ns_per_byte"] for name, t in f["terms"].items()}
    assert got == {
        "worker: next value aside and back": 0.1,  # the chunk in cache
        "worker: checksum of the new value": 0.1,
        "worker: XOR old and new into the slot": 0.2,  # in cache into a cold slot
        "keeper: fold into tier-1 parity": 0.5,  # a slot another core has just written
        "tier 2: TCP send and receive": 0.4,  # from such slots
        "tier 2: fold into tier-2 parity": 0.3,  # a buffer in cache into cold rows
    }
    assert f["placed_total_cpu_ms_per_step"] == pytest.approx(staged * 1.6e-6, abs=3e-3)
    assert f["placed_floor_overhead_ratio"] == pytest.approx(1 + staged * 1.6e-9 / 0.2, abs=1e-4)
    # one core: no hand-off measured, the cold fold stands for it; older samples: no such floor
    f = floor(lay, step_s_off=0.1, cores=2, samples=[{**sample, "handoff_fold_ns_per_byte": None}])
    assert f["terms"]["keeper: fold into tier-1 parity"]["placed_ns_per_byte"] == 0.4
    f = floor(lay, step_s_off=0.1, cores=2, samples=[{k: v for k, v in sample.items() if k != "placed"}])
    assert f["placed_total_cpu_ms_per_step"] is None and f["placed_floor_overhead_ratio"] is None


def test_the_floor_measures_every_operation_it_uses() -> None:
    from leto.bench.floor import operation_costs, placed_costs

    costs = operation_costs()
    assert set(costs) == {"copy", "xor_two_into_slot", "checksum", "fold", "tcp_loopback"}
    assert all(v > 0 for v in costs.values())
    placed = placed_costs()
    assert set(placed) == {"xor_two_into_slot", "fold"} and all(v > 0 for v in placed.values())


def test_the_cold_floor_sends_tier_2_bytes_from_memory_larger_than_the_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    from leto.bench import floor as floor_mod

    sources: list[int] = []

    def tcp(total: int = 0, samples: int = 0, source_bytes: int = floor_mod.TCP_MESSAGE) -> float:
        sources.append(source_bytes)
        return 1e-9

    monkeypatch.setattr(floor_mod, "tcp_cpu_s_per_byte", tcp)
    monkeypatch.setattr(floor_mod, "_cpu_s_per_byte", lambda op, nbytes, min_s=0.2: 1e-9)
    floor_mod.operation_costs()
    floor_mod.operation_costs(floor_mod.COLD)
    # in cache a chunk's worth (less than a message): one message is sent over and over
    assert sources == [floor_mod.CHUNK, floor_mod.COLD]


def test_the_fold_of_a_slot_another_core_just_wrote_is_measured_where_two_cores_exist(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from leto.bench import floor as floor_mod

    if len(os.sched_getaffinity(0)) >= 2:
        ns = floor_mod.handoff_fold_s_per_byte(rounds=50) * 1e9
        assert 0 < ns < 100  # a fold moves bytes at well over 10 MB/s on any machine that runs this
    monkeypatch.setattr(floor_mod.os, "sched_getaffinity", lambda pid: {0})
    assert floor_mod.handoff_fold_s_per_byte() is None  # one core: no other core to write the slot


# ----- the mesh (--tp)
def test_a_tp_slice_by_hand() -> None:
    """tiny cut in two (Megatron's layout): embeddings, LayerNorms and the row-parallel layers'
    biases are on both TP ranks, the rest is halved."""
    c, tp = overhead.PRESETS["tiny"], 2
    e = c.n_embd
    replicated = c.vocab_size * e + c.block_size * e + 2 * e + c.n_layer * (2 * 2 * e + 2 * e)
    m = mesh_elements("tiny", tp)
    assert m.model == 834_304 and m.replicated == replicated
    assert m.slice == replicated + (m.model - replicated) // tp and m.sharded * tp == m.model - replicated
    assert mesh_elements("tiny").replicated == 0 and mesh_elements("tiny").slice == m.model
    with pytest.raises(ValueError):
        mesh_elements("small", 4)  # 6 heads do not split over 4 ranks


def test_mesh_figures_charge_the_replicated_copies() -> None:
    lay, numel = overhead.job_layout("tiny", 4, 2, (1, 1), tp=2)
    m = mesh_elements("tiny", 2)
    elems = overhead.DEFAULT_CHUNK_BYTES // 12
    assert numel == m.model and lay.world_size == 4
    assert lay.geometry.n_chunks == -(-m.slice // (2 * elems))  # the slice's shard over a DP group of 2
    f = overhead.mesh_figures(lay, m)
    protected = 4 * lay.geometry.n_chunks * elems
    assert (f["tp"], f["dp"], f["protected_elements"]) == (2, 2, protected)
    assert f["protected_per_model_element"] == pytest.approx(protected / m.model, abs=1e-4)
    assert f["protected_per_model_element"] > 1
    per_protected = bytes_per_element_per_step(lay)["total"]
    assert per_protected["staged"] == 12  # master, exp_avg, exp_avg_sq; gradients replicated on gloo
    for k, v in f["bytes_per_model_element_per_step"].items():
        assert v == pytest.approx(per_protected[k] * protected / m.model, abs=1e-3) and v > per_protected[k]
    assert f["memory_overhead_per_model_byte"] == pytest.approx(
        sum(memory_parts(lay).values()) / (12 * m.model), abs=1e-4
    )
    dp_lay, _ = overhead.job_layout("tiny", 4, 2, (1, 1))
    assert (
        overhead.mesh_figures(dp_lay, mesh_elements("tiny"))["protected_per_model_element"]
        < (f["protected_per_model_element"])
    )


def test_the_whole_jobs_memory_counts_shared_pages_once() -> None:
    mib = 1 << 20
    on = {
        1: {"role": "worker", "vm_rss": 300 * mib, "pss": 200 * mib},
        2: {"role": "worker", "vm_rss": 300 * mib, "pss": 210 * mib},
        3: {"role": "keeper", "vm_rss": 120 * mib, "pss": 60 * mib},
    }
    off = {1: {"role": "worker", "vm_rss": 290 * mib, "pss": 190 * mib}}
    a = overhead.memory_all_in(on, off, model_elements=mib)
    assert a["protected"] == {
        "measure": "pss",
        "processes": 3,
        "bytes_by_role": {"keeper": 60 * mib, "worker": 410 * mib},
        "bytes": 470 * mib,
    }
    assert a["ratio"] == pytest.approx(470 / 190, abs=1e-4) and a["extra_bytes"] == 280 * mib
    assert a["extra_per_model_state_byte"] == pytest.approx(280 / 12, abs=0.01)
    del on[3]["pss"]  # no smaps_rollup somewhere: VmRSS for every process, never a mix
    assert overhead.job_memory(on)["measure"] == "vm_rss" and overhead.job_memory(on)["bytes"] == 720 * mib


def bench_args(**kw: object) -> argparse.Namespace:
    """`leto bench overhead`'s arguments, as the CLI parses them with no flags, then `kw`."""
    defaults = dict.fromkeys(("steps", "rounds", "curve", "curve_rounds", "curve_steps", "rss"))
    return argparse.Namespace(**{**defaults, "json": False, "model": "tiny", "workers": 4, "tp": 1, **kw})


def test_a_mesh_that_does_not_fit_is_refused_before_any_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_run(*a: object, **kw: object) -> dict:
        raise AssertionError("no job may run")

    monkeypatch.setattr(overhead, "run_job", no_run)
    with pytest.raises(UsageError, match="multiple of --tp"):
        overhead.main(bench_args(tp=3))  # 4 workers
    with pytest.raises(UsageError, match="inside one node"):
        overhead.main(bench_args(tp=2, workers=2))  # a TP group across the 2 nodes
    with pytest.raises(UsageError, match="small"):  # tiny's 4 heads split over 4 ranks, small's 6 do not
        overhead.main(bench_args(tp=4, workers=8, curve="small"))
    with pytest.raises(UsageError, match="--tp"):
        throughput.main(bench_args(tp=2))


def test_bench_overhead_tp2_runs_the_mesh_protected_and_not(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real, tiny `leto bench overhead --tp 2`: every job is the DP 2 x TP 2 mesh, protected
    and unprotected side by side, and the output carries the mesh's figures."""
    import json

    real_run, seen = overhead.run_job, []

    def spy(*a: object, **kw: object) -> dict:
        res = real_run(*a, **kw)
        seen.append((kw.get("protection"), res["summary"]["config"]["mesh"]["tp"]))
        return res

    monkeypatch.setattr(overhead, "run_job", spy)
    monkeypatch.setattr(overhead, "RSS_STEPS", 10)
    # K unknown: the persisting run is as short as the others (CI's time; the window's sizing is specified above)
    monkeypatch.setattr(overhead, "calibrate_k", lambda *a: None)
    assert overhead.main(bench_args(tp=2, json=True, steps=3, rounds=1, curve="none")) == 0
    out = json.loads(capsys.readouterr().out)
    assert seen == [(False, 2), (True, 2), (True, 2), (True, 2), (False, 2)]  # off, on, persisting; memory on, off
    assert (out["tp"], out["dp"], out["workers"]) == (2, 2, 4)
    m = out["mesh"]
    assert m["model_elements"] == out["curve"][0]["params"] == 834_304
    assert m["protected_elements"] == out["protected_elements"] and m["protected_per_model_element"] > 1
    assert all(v > 12 for v in m["bytes_per_model_element_per_step"].values())  # charges the replicated copies
    assert out["bytes_per_element_per_step"]["total"]["staged"] == 12
    assert 0 < out["memory_overhead"] < m["memory_overhead_per_model_byte"]
    on, off = out["cpu_s_per_step_on"], out["cpu_s_per_step_off"]
    assert on["worker"] > 0 and on["keeper"] > 0 and off["worker"] > 0 and "keeper" not in off
    a = out["memory_all_in"]
    assert a["protected"]["bytes"] > a["unprotected"]["bytes"] > 0 and a["extra_per_model_state_byte"] > 0
    assert {"worker", "keeper", "shadow"} <= set(a["protected"]["bytes_by_role"])
    assert "keeper" not in a["unprotected"]["bytes_by_role"] and "worker" in a["unprotected"]["bytes_by_role"]
    assert a["protected"]["bytes_by_role"]["worker"] > 0
    assert out["persistence"]["status"] in ("measured", "not measured: the job wrote no persistent checkpoint")
    assert set(out["targets"]) >= {"memory_overhead_default_job", "memory_overhead_per_model_byte"}


# ----- persistence, measured where it writes
def _persisting_run(
    k: int = 6,
    steps: int = 30,
    slow: dict[int, float] | None = None,
    extra_cpu: dict[int, dict[str, float]] | None = None,
) -> tuple[list[dict], list[dict], dict]:
    """A persisting run's records, events and CPU timeline: steps of 0.1 s, each using 0.2 s of
    workers' training-thread CPU and 0.02 s of keepers'; the calibration checkpoint of step 5 commits
    during step 6, K `k` is chosen at step 7 (first = 5 + k), every later checkpoint of step s
    commits during step s + 2. `slow`: extra wall seconds of some steps; `extra_cpu`: extra CPU of
    some steps by thread group (its role's total includes it). The sampler read at every step's end."""
    slow, extra_cpu = slow or {}, extra_cpu or {}
    t, recs, times, samples = 1000.0, [], [1000.0], [{"worker": 0.0, "worker/main": 0.0, "keeper": 0.0}]
    for step in range(1, steps + 1):
        dt = 0.1 + slow.get(step, 0.0)
        t += dt
        recs.append({"step": step, "step_s": dt, "time": t})
        cum = dict(samples[-1])
        for group, v in {"worker/main": 0.2, "keeper": 0.02}.items():
            cum[group] = cum.get(group, 0.0) + v
        cum["worker"] += 0.2
        for group, v in extra_cpu.get(step, {}).items():
            cum[group] = cum.get(group, 0.0) + v
            cum[group.split("/")[0]] += v
        times.append(t)
        samples.append(cum)
    first = 5 + k
    events = [{"event": "persist_commit", "step": 5, "time": recs[5]["time"] - 0.05, "stage_s": 0.004, "write_s": 0.1}]
    events.append({"event": "persist_interval", "every": k, "first": first, "time": recs[6]["time"] - 0.01})
    for s in range(first, steps - 1, k):
        events.append({"event": "persist_commit", "step": s, "time": recs[s + 1]["time"] - 0.05, "stage_s": 0.004})
    return recs, events, {"times": times, "samples": samples}


def test_a_checkpoint_is_charged_what_its_steps_took_beyond_steps_that_write_nothing() -> None:
    """K 6: checkpoints of steps 11, 17, 23. Each one's copy makes the next step 30 ms slower and
    costs the training thread 5 ms of CPU; its write thread uses 10 ms in each of the two steps
    it runs in. Charged per checkpoint: 30 ms of wall time, 25 ms of CPU (20 of it the write
    thread's), whatever guard steps it is given; per step at K: 5 ms wall = 5 % of a 0.1 s step,
    25/6 ms CPU = 2.1 % of 0.2 s of training CPU."""
    copies = {s + 1: 0.03 for s in (11, 17, 23)}
    cpu = {s + 1: {"worker/main": 0.005, "worker/persist": 0.01} for s in (11, 17, 23)}
    cpu.update({s + 2: {"worker/persist": 0.01} for s in (11, 17, 23)})
    a = persist_cost.analyze_run(*_persisting_run(slow=copies, extra_cpu=cpu))
    assert a is not None and a["k"] == 6 and a["checkpoints_in_window"] == 3
    assert [c["step"] for c in a["checkpoints"]] == [11, 17, 23]
    g = persist_cost.GUARD_STEPS
    assert a["checkpoints"][0]["steps"] == list(range(12 - g, 13 + 1 + g))  # copy .. commit, and the guards
    for c in a["checkpoints"]:
        assert c["wall_excess_s"] == pytest.approx(0.03, abs=1e-6)
        assert c["cpu_excess_s"] == pytest.approx(0.025, abs=1e-6)
        assert c["persist_threads_cpu_s"] == pytest.approx(0.02, abs=1e-6)
        assert c["cpu_excess_by_group_s"]["worker/main"] == pytest.approx(0.005, abs=1e-6)
        assert c["cpu_excess_by_group_s"]["keeper"] == pytest.approx(0.0, abs=1e-6)
    assert a["nothing_wall_s_per_step"] == pytest.approx(0.1) and a["nothing_cpu_s_per_step"] == pytest.approx(0.22)
    assert a["nothing_persist_threads_cpu_s"] == 0.0
    assert a["wall_share"] == pytest.approx(0.05, abs=1e-4)
    r = persist_cost.round_entry(a, training_cpu_s=0.2, on_step_s=0.1, on_cpu={"worker": 0.2, "keeper": 0.02})
    assert r["cpu_share"] == pytest.approx(0.025 / 6 / 0.2, abs=1e-4)
    assert r["on_cpu_s_per_step"] == pytest.approx(0.22)


def test_the_window_starts_after_the_calibration_and_ends_before_a_write_still_in_flight() -> None:
    recs, events, timeline = _persisting_run(k=6, steps=30)
    events = [e for e in events if e.get("step") != 23]  # the checkpoint of step 23 never committed
    a = persist_cost.analyze_run(recs, events, timeline)
    assert a["window_steps"][0] == 8  # step 7 holds K's choice, after the calibration write committed
    assert [c["step"] for c in a["checkpoints"]] == [11, 17]
    assert a["window_steps"][1] == 23 - persist_cost.GUARD_STEPS  # nothing after step 23's copy counts
    assert persist_cost.analyze_run(recs, [e for e in events if e["event"] != "persist_interval"], timeline) is None


def test_the_persisting_run_is_long_enough_for_two_checkpoints_even_if_k_grows() -> None:
    """For any K seen before (and a K up to K_MARGIN larger in the run itself), a run of
    plan_steps steps holds WINDOW_CHECKPOINTS checkpoints whose writes commit two steps after
    their copy, inside the window."""
    assert persist_cost.plan_steps(None, 40) == 45  # K unknown: the plain run
    for k_seen in (2, 3, 5, 8, 13, 21, 34, 55, 89):
        n = persist_cost.plan_steps(k_seen, 10)
        for k in (k_seen, (k_seen + int(k_seen * persist_cost.K_MARGIN)) // 2, int(k_seen * persist_cost.K_MARGIN)):
            a = persist_cost.analyze_run(*_persisting_run(k=max(k, 3), steps=n))
            assert a["checkpoints_in_window"] >= persist_cost.WINDOW_CHECKPOINTS, (k_seen, k, n)


def _rounds(shares: list[tuple[float, float]], held: int = 2, threads: float = 0.0) -> list[dict]:
    """Rounds with (cpu_share, wall_share), `held` checkpoints each, steps that write nothing as
    fast as protection alone (0.1 s, 0.22 s of CPU, +-1 %)."""
    return [
        {
            "cpu_share": c,
            "wall_share": w,
            "checkpoints_in_window": held,
            "nothing_persist_threads_cpu_s": threads,
            "nothing_median_step_s": 0.1 + 0.001 * i,
            "on_median_step_s": 0.1 + 0.001 * (1 - i),
            "nothing_cpu_s_per_step": 0.22,
            "on_cpu_s_per_step": 0.22 + 0.002 * i,
        }
        for i, (c, w) in enumerate(shares)
    ]


def test_persistence_targets_are_met_only_on_windows_that_held_two_checkpoints() -> None:
    def judged(rounds: list[dict]) -> dict[str, str]:
        return {n: t["result"] for n, t in persist_cost.targets(persist_cost.summarize(rounds)).items()}

    good = judged(_rounds([(0.004, 0.008), (0.006, 0.012)]))  # medians 0.5 % and 1.0 %
    assert good == {
        "persistence_cpu_share_per_step": "met",
        "persistence_wall_share_per_step": "met",
        "persistence_nothing_on_steps_that_write_nothing": "met",
    }
    assert judged(_rounds([(0.004, 0.012), (0.006, 0.0121)]))["persistence_wall_share_per_step"] == "MISS"
    short = persist_cost.summarize(_rounds([(0.004, 0.008), (0.006, 0.008)], held=1))
    assert not short["window_ok"] and short["checkpoints_in_window"] == 1
    assert {t["result"] for t in list(persist_cost.targets(short).values())[:2]} == {"INCOMPLETE"}
    # a persistence thread ran on a step that writes nothing: something was measured there
    assert judged(_rounds([(0.0, 0.0)] * 2, threads=0.02))["persistence_nothing_on_steps_that_write_nothing"] == "MISS"
    slower = _rounds([(0.0, 0.0)] * 2)
    for r in slower:
        r["nothing_median_step_s"] += 0.01  # beyond the spread of protection alone
    assert judged(slower)["persistence_nothing_on_steps_that_write_nothing"] == "MISS"
    faster = _rounds([(0.0, 0.0)] * 2)
    for r in faster:
        r["nothing_median_step_s"] -= 0.01  # beyond noise, but faster: the load, not a cost
    assert judged(faster)["persistence_nothing_on_steps_that_write_nothing"] == "met"
    one = judged(_rounds([(0.0, 0.0)]))  # one round: no spread, "nothing measurable" cannot be judged
    assert one["persistence_nothing_on_steps_that_write_nothing"] == "NOT MEASURED"


WRITER = """
import ctypes, sys, threading, time
sys.stdin.readline()  # the sampler runs: go
libc = ctypes.CDLL(None)
def spin(name, seconds):
    libc.prctl(15, ctypes.c_char_p(name.encode()))  # PR_SET_NAME, as leto.runtime.linux.name_thread
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
t = threading.Thread(target=spin, args=("leto-persist", 0.25))
t.start(); t.join()
spin("python3", 0.1)  # the main thread: a worker's training thread, whatever its name
print("done", flush=True)
time.sleep(30)
"""


def test_a_workers_ended_write_thread_is_charged_to_persistence(tmp_path: Path) -> None:
    """A worker's write thread ends between two samples: its last CPU still goes to its group."""
    import json
    import subprocess
    import sys

    assert cpu.thread_group("python3", main=True) == "main" and cpu.thread_group("leto-persist") == "persist"
    assert cpu.thread_group("leto-dcp-import") == "persist-import" and cpu.thread_group("python3") == "other"
    p = subprocess.Popen([sys.executable, "-c", WRITER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        (tmp_path / "procs.json").write_text(json.dumps([{"role": "worker", "pid": p.pid}]))
        with cpu.CpuSampler(tmp_path, every_s=0.15) as sampler:
            time.sleep(0.4)
            t0 = time.time()
            assert p.stdin is not None and p.stdout is not None
            p.stdin.write("go\n")
            p.stdin.flush()
            assert p.stdout.readline().strip() == "done"
            time.sleep(0.3)
            used = sampler.between(t0, time.time())
        # none of it left as short-lived, to within the process total's rounding to ticks and the
        # few milliseconds between reading the process and its threads
        assert used["worker/persist"] == pytest.approx(0.25, abs=0.05)
        assert abs(used.get("worker/short-lived", 0.0)) < 0.05
        assert used["worker/main"] >= 0.08
    finally:
        p.kill()
        p.wait()


def test_cumulative_cpu_is_interpolated_between_samples() -> None:
    times, samples = [10.0, 11.0], [{"worker": 1.0}, {"worker": 2.0, "worker/persist": 0.5}]
    assert cpu.cumulative_at(times, samples, 10.5) == {"worker": 1.5, "worker/persist": 0.25}
    assert cpu.cumulative_at(times, samples, 9.0) == {"worker": 1.0}
    assert cpu.cumulative_at(times, samples, 12.0) == samples[1] and cpu.cumulative_at([], [], 1.0) == {}


# ----- protection's CPU, part by part
def _floor_stub() -> dict:
    """A floor of 1 ms a term in cache, 2 ms cold (6 terms: 3 worker, 1 keeper, 2 tier 2)."""
    names = (
        "worker: next value aside and back",
        "worker: XOR old and new into the slot",
        "worker: checksum of the new value",
        "keeper: fold into tier-1 parity",
        "tier 2: TCP send and receive",
        "tier 2: fold into tier-2 parity",
    )
    return {
        "terms": {n: {"cpu_ms_per_step": 1.0, "cold_cpu_ms_per_step": 2.0} for n in names},
        "total_cpu_ms_per_step": 6.0,
        "cold_total_cpu_ms_per_step": 12.0,
    }


def test_protection_cpu_is_keepers_plus_the_workers_measured_part_not_a_difference() -> None:
    """A round: keepers by thread from /proc; the workers' part is rank 0's CPU inside protection
    times the workers plus any protection thread; training is the protected workers' CPU without
    it (the unprotected run's, however noisy, only stands beside it)."""
    on = {
        "worker": 0.200,
        "worker/main": 0.180,
        "worker/gloo": 0.020,
        "worker/protection": 0.004,
        "keeper": 0.030,
        "keeper/main": 0.012,
        "keeper/gloo": 0.010,
        "keeper/tier2-threads": 0.008,
    }
    records = [{"stage_cpu_s": 0.002, "wait_cpu_s": 0.0005}, {"stage_cpu_s": 0.004, "wait_cpu_s": 0.0015}]
    r = protection_cpu.round_cpu(on, {"worker": 0.5}, records, workers=4)
    assert r is not None
    assert r["worker/staging"] == pytest.approx(0.012) and r["worker/waiting"] == pytest.approx(0.004)
    assert r["worker/protection"] == 0.004 and r["worker"] == pytest.approx(0.020)
    assert r["total"] == pytest.approx(0.050) and r["keeper/tier2-threads"] == 0.008
    assert r["training"] == pytest.approx(0.180) and r["training_unprotected"] == 0.5
    assert r["ratio"] == pytest.approx(0.050 / 0.180)
    # records without the training thread's CPU (an older job): nothing to measure by
    assert protection_cpu.round_cpu(on, {}, [{"stage_s": 0.001}], workers=4) is None


def test_protection_cpu_rounds_give_median_and_spread_and_meet_the_floor_part_by_part() -> None:
    def rnd(keeper_main: float, gloo: float, stage: float) -> dict:
        on = {"worker": 0.2, "keeper": keeper_main + gloo, "keeper/main": keeper_main, "keeper/gloo": gloo}
        return protection_cpu.round_cpu(on, {"worker": 0.19}, [{"stage_cpu_s": stage, "wait_cpu_s": 0.0}], 2)

    rounds = [rnd(0.004, 0.004, 0.002), rnd(0.006, 0.002, 0.001), rnd(0.002, 0.003, 0.003), None]
    pc = protection_cpu.summarize(rounds, _floor_stub())
    assert pc["status"] == "measured" and len(pc["rounds"]) == 3  # a round without figures is left out
    assert pc["cpu_s_per_step"]["keeper/main"] == {"median": 0.004, "min": 0.002, "max": 0.006}
    assert pc["cpu_s_per_step"]["worker/staging"] == {"median": 0.004, "min": 0.002, "max": 0.006}
    # totals 12, 10 and 11 ms against training's 196, 198, 194 ms
    assert pc["cpu_s_per_step"]["total"] == {"median": 0.011, "min": 0.01, "max": 0.012}
    assert pc["ratio_to_training_cpu"]["max"] == pytest.approx(0.012 / 0.196, abs=1e-4)
    assert protection_cpu.headline(pc) == pytest.approx(0.011 / 0.194, abs=1e-4)
    f = pc["vs_floor"]
    assert f["worker staging"]["floor_ms"] == 3.0 and f["worker staging"]["cold_floor_ms"] == 6.0
    assert f["worker staging"]["measured_ms"] == {"median": 4.0, "min": 2.0, "max": 6.0}
    assert f["keeper fold"]["cold_ratio"] == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert f["tier 2"]["measured"] == ["keeper/gloo", "keeper/tier2-threads"]
    assert f["tier 2"]["measured_ms"]["median"] == 3.0 and f["tier 2"]["ratio"]["median"] == 1.5
    assert pc["total_vs_cold_floor"] == {
        "median": round(11 / 12, 3),
        "min": round(10 / 12, 3),
        "max": round(12 / 12, 3),
    }
    assert pc["total_vs_cold_floor_by_round"] == [round(12 / 12, 3), round(10 / 12, 3), round(11 / 12, 3)]
    out = {"protection_cpu": pc}
    target = overhead.targets(out)["protection_cpu_vs_cold_floor"]
    assert target["result"] == "met" and target["rounds_met"] == 3  # the median, and each round's own figure
    pc["total_vs_cold_floor_by_round"] = [1.4, 1.6, 1.45]
    assert overhead.targets(out)["protection_cpu_vs_cold_floor"]["rounds_met"] == 2
    out["protection_cpu"] = protection_cpu.summarize([None], _floor_stub())
    assert out["protection_cpu"]["status"].startswith("not measured")
    assert overhead.targets(out)["protection_cpu_vs_cold_floor"]["result"] == "NOT MEASURED"
    assert protection_cpu.fmt_spread({"median": 0.25, "min": 0.2, "max": 0.3}, 100, " %") == "25.00 % [20.00, 30.00]"


def test_a_curve_points_worker_cpu_is_the_measured_part_where_the_records_carry_it() -> None:
    e = {"cpu_s_per_step_on": {"worker": 0.2}, "cpu_s_per_step_off": {"worker": 0.21}}
    assert overhead._curve_worker_cpu(e, 4) == "-10 ms (difference of the runs)"
    e |= {"protection_stage_cpu_s_per_step": 0.001, "protection_wait_cpu_s_per_step": 0.0005}
    assert overhead._curve_worker_cpu(e, 4) == "6.0 ms inside protection"


def test_the_wall_ratio_targets_carry_what_the_physical_floor_alone_would_cost() -> None:
    """A wall-clock target below the floor's own ratio cannot be met on the machine that ran it;
    the verdict stays a measured one, the floor is shown beside it."""
    out = {
        "model": "tiny",
        "overhead_ratio": 1.12,
        "physical_floor": {
            "floor_overhead_ratio": 1.029,
            "cold_floor_overhead_ratio": 1.044,
            "placed_floor_overhead_ratio": 1.037,
        },
    }
    t = targets(out)
    assert t["overhead_ratio_default_job"]["result"] == "MISS"
    assert t["overhead_ratio_default_job"]["floor"] == {"in_cache": 1.029, "cold": 1.044, "placed": 1.037}
    assert "floor" not in t["memory_overhead_default_job"]
    del out["physical_floor"]
    assert "floor" not in targets(out)["overhead_ratio_default_job"]
