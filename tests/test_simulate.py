"""Specification tests for `leto simulate` (docs/simulation.md)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from leto.persistence.interval import daly_interval_s
from leto.simulation.assumptions import Assumptions
from leto.simulation.calibration import CalibrationError, load_calibration
from leto.simulation.cli import main
from leto.simulation.engine import (
    LOSS_KEYS,
    POLICIES,
    Scenario,
    build_costs,
    closed_form_checkpoint_restart,
    policies_for,
    shrink_throughput,
    simulate,
    stage_loss_cost,
    sweep_sizes,
)
from leto.simulation.failures import LLAMA3_MTBF_GPU_HOURS
from leto.simulation.scaling import checkpoint_write_s
from leto.simulation.stage_loss import Mesh, stage_loss

CAL = load_calibration()


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------- closed form (item 5)


@pytest.mark.parametrize("gpus,days", [(1024, 40000), (16384, 3650), (131072, 400)])
def test_checkpoint_restart_matches_closed_form_within_1_percent(gpus: int, days: int) -> None:
    # exponential failures, Daly interval, unlimited spares: renewal theory is exact
    sc = Scenario(gpus=gpus, days=days, spares=10**9, seed=7)
    res = simulate(sc, ["checkpoint-restart"], CAL)
    assert res.failures > 10000  # long enough for the statistical error to be well below 1 %
    simulated = res.results["checkpoint-restart"].productivity
    expected = closed_form_checkpoint_restart(sc, CAL)
    assert simulated == pytest.approx(expected, rel=0.01)


def test_checkpoint_interval_is_daly_optimal() -> None:
    sc = Scenario(gpus=16384)
    pc = build_costs("checkpoint-restart", sc, CAL)
    delta = checkpoint_write_s(sc.assumptions, CAL, sc.gpus)
    assert pc.commit_s == delta
    x = delta / (2 * sc.job_mtbf_s)
    assert pc.work_s == pytest.approx(math.sqrt(2 * delta * sc.job_mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - delta)
    assert daly_interval_s(1.0, math.inf) == math.inf


def test_daly_interval() -> None:
    # Young: sqrt(2 C M); Daly adds higher-order terms and subtracts C
    assert daly_interval_s(1.0, 1800.0) == pytest.approx(60.0 * (1 + (1 / 3600) ** 0.5 / 3 + 1 / 3600 / 9) - 1)
    assert daly_interval_s(10.0, 4.0) == 4.0  # a checkpoint costlier than 2 MTBF: once per MTBF
    assert daly_interval_s(0.0, 100.0) == 0.0
    with pytest.raises(ValueError):
        daly_interval_s(1.0, 0.0)


# ---------------------------------------------------------------- reproducibility, invariants


def test_same_seed_reproduces_and_other_seed_differs() -> None:
    a = simulate(Scenario(gpus=16384, seed=3), POLICIES, CAL).to_json()
    b = simulate(Scenario(gpus=16384, seed=3), POLICIES, CAL).to_json()
    c = simulate(Scenario(gpus=16384, seed=4), POLICIES, CAL).to_json()
    assert a == b
    assert a["productivity"] != c["productivity"]


def test_cli_seed_reproduces(capsys: pytest.CaptureFixture[str]) -> None:
    docs = []
    for _ in range(2):
        rc, out, _ = run_cli(capsys, "--gpus", "8192", "--seed", "11", "--json")
        assert rc == 0
        doc = json.loads(out)
        doc.pop("runtime_s")
        docs.append(doc)
    assert docs[0] == docs[1]


@pytest.mark.parametrize("spares", [None, 0, 3])
def test_time_is_fully_accounted(spares: int | None) -> None:
    res = simulate(Scenario(gpus=32768, days=60, spares=spares, seed=1), POLICIES, CAL)
    assert list(res.results) == list(POLICIES)
    for r in res.results.values():
        assert set(r.lost) == set(LOSS_KEYS)
        assert r.productivity + sum(r.lost.values()) == pytest.approx(1.0, abs=1e-9)
        assert all(v >= 0 for v in r.lost.values())
        assert 0.0 <= r.productivity <= 1.0


def test_zero_failures_gives_100_percent() -> None:
    sc = Scenario(gpus=131072, mtbf_gpu_hours=math.inf)
    res = simulate(sc, POLICIES, CAL)
    assert res.failures == 0
    cr = res.results["checkpoint-restart"]
    assert cr.productivity == 1.0  # no failures: the Daly interval is infinite, no checkpoints
    assert list(res.results) == list(POLICIES)
    for r in res.results.values():
        assert {k: v for k, v in r.lost.items() if k != "protection"} == dict.fromkeys(
            set(LOSS_KEYS) - {"protection"}, 0.0
        )
        assert r.productivity == pytest.approx(1.0 - r.lost["protection"], abs=1e-12)
    # with nothing to protect, every policy is 100 % productive
    stateless = dataclasses.replace(
        sc, assumptions=Assumptions(optimizer_bytes_per_param=0.0, weight_bytes_per_param=0.0)
    )
    results = simulate(stateless, POLICIES, CAL).results
    assert list(results) == list(POLICIES)
    for r in results.values():
        assert r.productivity == pytest.approx(1.0, abs=1e-12)


# ---------------------------------------------------------------- policy behaviour


def test_without_spares_leto_shrinks_and_restarts_wait() -> None:
    res = simulate(Scenario(gpus=16384, days=30, spares=0, seed=2), POLICIES, CAL)
    leto, cr = res.results["leto"], res.results["checkpoint-restart"]
    assert res.node_losing_failures > 0
    assert leto.lost["waiting_for_spares"] == 0.0
    assert leto.lost["shrink"] > 0.0 and leto.events["shrinks"] > 0
    assert cr.lost["waiting_for_spares"] > 0.0
    assert leto.productivity > cr.productivity


@pytest.mark.parametrize(
    "replicas,short,balanced,exact",
    [
        (2, 1, 1 / 2, 1 / 2),
        (3, 1, 2 / 3, 1 / 2),  # 3 replicas on 2 ranks: one hosts two
        (3, 2, 1 / 3, 1 / 3),
        (4, 1, 3 / 4, 1 / 2),
        (4, 2, 2 / 4, 1 / 2),
        (4, 3, 1 / 4, 1 / 4),
        (5, 2, 3 / 5, 1 / 2),
        (7, 4, 3 / 7, 1 / 3),  # 7 replicas on 3 ranks: 3 + 2 + 2
        (8, 0, 1.0, 1.0),
    ],
)
def test_shrink_throughput(replicas: int, short: int, balanced: float, exact: float) -> None:
    for unit in (1, 128):  # the same in replicas or in GPUs of 128-GPU replicas
        assert shrink_throughput("balanced", replicas * unit, short * unit) == pytest.approx(balanced)
        assert shrink_throughput("exact", replicas * unit, short * unit) == exact
    with pytest.raises(ValueError, match="shrink mode"):
        shrink_throughput("fast", replicas, short)


def test_exact_shrink_loses_more_than_balanced() -> None:
    """A loop with a loss function per replica runs at the busiest rank's pace while shrunk."""
    runs = {
        m: simulate(Scenario(gpus=16384, days=30, spares=0, seed=2, shrink=m), POLICIES, CAL)
        for m in ("balanced", "exact")
    }
    balanced, exact = runs["balanced"].results["leto"], runs["exact"].results["leto"]
    assert balanced.events == exact.events and exact.events["shrinks"] > 0
    assert exact.lost["shrink"] > 2 * balanced.lost["shrink"] > 0
    assert exact.productivity < balanced.productivity
    # only the throughput while shrunk differs: the rest of the time is charged alike
    assert {k: v for k, v in exact.lost.items() if k != "shrink"} == {
        k: v for k, v in balanced.lost.items() if k != "shrink"
    }
    assert exact.productivity + exact.lost["shrink"] == pytest.approx(
        balanced.productivity + balanced.lost["shrink"], abs=1e-12
    )
    for p in ("checkpoint-restart", "memory-restart", "torchft"):  # never host a dropped replica
        assert runs["exact"].results[p] == runs["balanced"].results[p]


@pytest.mark.parametrize("gpus,mtbf", [(16384, LLAMA3_MTBF_GPU_HOURS), (131072, math.inf)])
def test_shrink_mode_changes_nothing_without_a_shrink(gpus: int, mtbf: float) -> None:
    docs = {}
    for mode in ("balanced", "exact"):
        res = simulate(Scenario(gpus=gpus, days=30, mtbf_gpu_hours=mtbf, seed=5, shrink=mode), POLICIES, CAL)
        assert res.results["leto"].events["shrinks"] == 0
        docs[mode] = res.to_json()
        assert docs[mode].pop("shrink") == mode
    assert docs["balanced"] == docs["exact"]


def test_cli_shrink_flag(capsys: pytest.CaptureFixture[str]) -> None:
    prod = {}
    for mode in ("balanced", "exact"):
        rc, out, _ = run_cli(capsys, "--gpus", "16384", "--spares", "0", "--seed", "2", "--shrink", mode, "--json")
        assert rc == 0
        doc = json.loads(out)
        assert doc["shrink"] == mode
        prod[mode] = doc["productivity"]["leto"]
    rc, out, _ = run_cli(capsys, "--gpus", "16384", "--spares", "0", "--seed", "2", "--json")
    assert json.loads(out)["shrink"] == "balanced"  # the default
    assert json.loads(out)["productivity"]["leto"] == prod["balanced"] > prod["exact"]
    rc, out, _ = run_cli(capsys, "--gpus", "16384", "--shrink", "exact")
    assert rc == 0 and "shrink exact" in out
    with pytest.raises(ValueError, match="--shrink"):
        Scenario(shrink="fast").validate()


def test_leto_target_at_131072_gpus() -> None:
    """Issue target: Leto >= 97 % at 131,072 GPUs under the documented defaults."""
    res = simulate(Scenario(), POLICIES, CAL)
    assert res.results["leto"].productivity >= 0.97
    assert res.to_json()["gap_vs_checkpoint_restart"]["leto"] > 0


# ---------------------------------------------------------------- the mesh: what losing a stage costs


def on_mesh(pp: int, *, tp: int = 8, gpus: int = 16384, **kw: object) -> Scenario:
    return Scenario(gpus=gpus, assumptions=Assumptions(tp=tp, pp=pp), **kw)  # type: ignore[arg-type]


def price(policy: str, sc: Scenario) -> dict[str, float]:
    """What losing one rank of one stage costs `policy` on `sc` (first order)."""
    m = Mesh(sc.assumptions.tp, sc.assumptions.pp, sc.gpus // (sc.assumptions.tp * sc.assumptions.pp))
    return stage_loss_cost(build_costs(policy, sc, CAL), stage_loss(policy, m), sc.gpus)


@pytest.mark.parametrize("tp,pp,dp", [(8, 1, 16), (8, 4, 4), (4, 16, 2), (1, 2, 3)])
def test_which_ranks_each_policy_restarts_when_a_stage_loses_a_rank(tp: int, pp: int, dp: int) -> None:
    m = Mesh(tp, pp, dp)
    everything = stage_loss("checkpoint-restart", m)
    assert everything == stage_loss("memory-restart", m)
    assert (everything.restarted_gpus, everything.restarted_stages) == (tp * pp * dp, pp)
    assert everything.stall_groups == (tp * pp * dp,) and everything.out_gpus == 0
    replica = stage_loss("torchft", m)  # the lost rank's whole pipeline, every stage of it
    assert (replica.restarted_gpus, replica.restarted_stages, replica.out_gpus) == (tp * pp, pp, tp * pp)
    assert replica.stall_groups == (dp,)  # the others only re-form their replica group
    assert replica.out_groups == (tp, pp, dp)
    in_place = stage_loss("leto", m)  # one rank, adopted in place; its TP, PP and DP groups
    assert (in_place.restarted_gpus, in_place.restarted_stages, in_place.out_gpus) == (1, 1, 0)
    assert in_place.stall_groups == (tp, pp, dp)
    with pytest.raises(ValueError, match="unknown policy"):
        stage_loss("pray", m)


def test_a_replica_restart_costs_more_with_more_stages_leto_in_place_does_not() -> None:
    """At a fixed job size: torchft takes a whole pipeline out, so its GPU-seconds out per
    failure grow with pp; Leto restarts one rank whatever the stage count, and its stall does not
    grow (a deeper pipeline means a smaller data-parallel group to rebuild); a full restart is
    the same on any mesh."""
    prices = {pp: {p: price(p, on_mesh(pp)) for p in POLICIES} for pp in (2, 4, 8, 16, 32)}
    out = [prices[pp]["torchft"]["out_gpus"] * prices[pp]["torchft"]["out_s"] for pp in sorted(prices)]
    assert all(a < b for a, b in zip(out, out[1:], strict=False))
    for pp, by_policy in prices.items():
        assert by_policy["torchft"]["out_gpus"] == 8 * pp
        assert by_policy["leto"]["restarted_gpus"] == 1 and by_policy["leto"]["out_gpus"] == 0
        assert by_policy["leto"]["gpu_hours"] < by_policy["torchft"]["gpu_hours"]
        assert by_policy["checkpoint-restart"] == prices[2]["checkpoint-restart"] | {"restarted_stages": pp}
    leto_stall = [prices[pp]["leto"]["stall_s"] for pp in sorted(prices)]
    assert all(a >= b for a, b in zip(leto_stall, leto_stall[1:], strict=False))
    # Leto's stall is its detection, rebuild (fixed + init of tp + pp + dp ranks), decode,
    # weights from a peer, redone steps and half a step in flight: the rebuild's groups are the mesh's
    sc = on_mesh(16)
    pc = build_costs("leto", sc, CAL)
    a = sc.assumptions
    assert pc.components["rebuild_s"] == pytest.approx(
        CAL.leto_rebuild_fixed_s + a.comm_init_s_per_rank * (8 + 16 + sc.gpus // 128)
    )


def test_without_spares_a_lost_node_costs_a_whole_replica() -> None:
    """Same failures (common random numbers), deeper pipelines: the restart-based policies
    restart everything whatever the mesh; Leto shrinks by, and torchft waits with, a whole
    replica of tp x pp GPUs, so their shrink loss grows with pp."""
    runs = {pp: simulate(on_mesh(pp, days=30, spares=0, seed=2), POLICIES, CAL) for pp in (4, 8, 16, 32)}
    assert len({r.failures for r in runs.values()}) == 1
    for p in ("checkpoint-restart", "memory-restart"):
        assert len({r.results[p].productivity for r in runs.values()}) == 1
    for p in ("torchft", "leto"):
        shrink = [runs[pp].results[p].lost["shrink"] for pp in sorted(runs)]
        assert 0 < shrink[0] and all(a < b for a, b in zip(shrink, shrink[1:], strict=False)), (p, shrink)
        assert all(r.results[p].events["max_dropped_replicas"] >= 1 for r in runs.values())
    # with spares Leto never runs short whatever the mesh; torchft still runs without the
    # restarting replica, the longer the deeper the pipeline
    spared = {pp: simulate(on_mesh(pp, days=30, seed=2), POLICIES, CAL) for pp in (4, 32)}
    assert all(r.results["leto"].lost["shrink"] == 0 for r in spared.values())
    assert 0 < spared[4].results["torchft"].lost["shrink"] < spared[32].results["torchft"].lost["shrink"]


@pytest.mark.parametrize(
    "tp,pp,unit_gpus",
    [(8, 16, 128), (4, 1, 8), (4, 3, 24), (2, 1, 8), (16, 1, 16)],  # 8-GPU nodes
)
def test_a_shrink_drops_whole_replicas_on_whole_nodes(tp: int, pp: int, unit_gpus: int) -> None:
    sc = on_mesh(pp, tp=tp, gpus=4800 if unit_gpus == 24 else 4096)
    for policy in ("leto", "torchft"):
        pc = build_costs(policy, sc, CAL)
        lost_node = pc.shrink_gpus if policy == "leto" else pc.out_node_gpus
        assert lost_node == unit_gpus
        assert lost_node % (tp * pp) == 0 and lost_node % 8 == 0
    assert build_costs("leto", sc, CAL).shrink_nodes == unit_gpus // 8
    res = simulate(dataclasses.replace(sc, days=60, spares=0, seed=3), ["leto", "torchft"], CAL)
    assert res.results["leto"].events["max_dropped_replicas"] >= unit_gpus // (tp * pp)


def test_torchft_needs_a_peer_replica(capsys: pytest.CaptureFixture[str]) -> None:
    one_replica = Scenario(gpus=128)
    assert "torchft" not in policies_for(one_replica)
    assert set(simulate(one_replica, calibration=CAL).results) == set(POLICIES) - {"torchft"}
    with pytest.raises(ValueError, match="at least 2 model replicas"):
        simulate(one_replica, ["torchft"], CAL)
    rc, _, err = run_cli(capsys, "--gpus", "128", "--policy", "torchft")
    assert rc == 2 and "at least 2 model replicas" in err
    assert sweep_sizes(Scenario(assumptions=Assumptions(tp=8, pp=256)))[0] == 4096  # two replicas
    # two replicas, no spares: both can be out at once, and the time still adds up
    res = simulate(Scenario(gpus=256, days=3000, spares=0, seed=1), ["torchft"], CAL).results["torchft"]
    assert res.events["all_replicas_out"] > 0 and res.lost["waiting_for_spares"] > 0
    assert res.productivity + sum(res.lost.values()) == pytest.approx(1.0, abs=1e-9)


def test_cli_mesh_flags_equal_set_and_show_the_mesh(capsys: pytest.CaptureFixture[str]) -> None:
    docs = []
    for argv in (["--tp", "4", "--pp", "8"], ["--set", "tp=4", "--set", "pp=8"], ["--pp", "8", "--set", "tp=4"]):
        rc, out, _ = run_cli(capsys, "--gpus", "8192", "--seed", "4", "--json", *argv)
        assert rc == 0
        doc = json.loads(out)
        doc.pop("runtime_s")
        docs.append(doc)
    assert docs[0] == docs[1] == docs[2]
    assert docs[0]["mesh"] == {"tp": 4, "pp": 8, "dp": 256, "replica_gpus": 32}
    rc, out, _ = run_cli(capsys, "--gpus", "8192", "--seed", "4", "--json")
    assert json.loads(out)["productivity"] != docs[0]["productivity"]  # the flags do something
    rc, out, _ = run_cli(capsys, "--gpus", "8192", "--tp", "4", "--pp", "8")
    assert rc == 0
    assert "mesh: tp 4 x pp 8 = 32 GPUs a replica (a pipeline of 8 stages of 4 GPUs), dp 256 replicas" in out
    assert "losing one rank of one pipeline stage" in out
    torchft_row = next(line for line in out.splitlines() if line.startswith("torchft ") and "of 8" in line)
    assert " 32 " in torchft_row  # restarts, and keeps out, the 32 GPUs of its pipeline


# ---------------------------------------------------------------- CLI output


def test_json_output_schema(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, "--gpus", "16384", "--days", "10", "--json")
    assert rc == 0 and err == ""
    doc = json.loads(out)
    assert doc["gpus"] == 16384
    assert set(doc["productivity"]) == set(POLICIES)
    assert all(0.0 <= v <= 1.0 for v in doc["productivity"].values())
    assert set(doc["lost"]) == set(POLICIES)
    for lost in doc["lost"].values():
        assert set(lost) == set(LOSS_KEYS)
    assert set(doc["gap_vs_checkpoint_restart"]) == {"memory-restart", "torchft", "leto"}
    assert doc["mesh"] == {"tp": 8, "pp": 16, "dp": 128, "replica_gpus": 128}
    assert set(doc["stage_loss"]) == set(POLICIES)
    assert doc["failures"] >= doc["node_losing_failures"] >= 0


def test_policy_selection_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(capsys, "--gpus", "4096", "--policy", "leto,checkpoint-restart")
    assert rc == 0
    assert "leto" in out and "checkpoint-restart" in out and "memory-restart  " not in out
    rc, out, _ = run_cli(capsys, "--gpus", "4096", "--policy", "leto", "--json")
    assert list(json.loads(out)["productivity"]) == ["leto"]


def test_plot_and_sweep(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "productivity.png"
    rc, out, _ = run_cli(capsys, "--days", "5", "--plot", str(png), "--json")
    assert rc == 0
    assert png.stat().st_size > 1000
    sizes = [pt["gpus"] for pt in json.loads(out)["sweep"]]
    assert sizes == [1024 * 2**k for k in range(8)]


def test_unmeasured_inputs_are_traceable(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(capsys, "--list-assumptions")
    assert rc == 0
    assert "ASSUMPTION" in out and "Dubey et al. 2024" in out
    assert CAL.sources and all(s for s in CAL.sources.values())


# ---------------------------------------------------------------- calibration files


def write(tmp_path: Path, name: str, doc: object) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_calibration_accepts_each_bench_output(tmp_path: Path) -> None:
    sc = Scenario(gpus=1024)
    base = build_costs("leto", sc, CAL)
    overhead = write(
        tmp_path,
        "o.json",
        {
            "step_s_off": 1.0,
            "step_s_on": 1.5,
            "overhead_ratio": 0.5,
            "encode_gbps": 3.0,
            "memcpy_gbps": 10.0,
            "memory_overhead": 0.25,
            "state_bytes_per_rank": 1e9,
        },
    )
    cal = load_calibration(overhead)
    assert cal.protect_s_per_step == 0.5 and cal.encode_gbps == 3.0  # recorded
    # no CPU figures in that file: the shipped protection cost stays, and a note says so
    assert any("no cpu_s_per_step_on" in n for n in cal.notes)
    assert build_costs("leto", sc, cal).commit_s == pytest.approx(base.commit_s)

    recovery = {
        "systems": {
            "leto": {"detect_s": 0.5, "restore_s": 0.1, "recovery_s": 1.0, "lost_steps": 1},
            "checkpoint-restart": {"detect_s": 0.2, "restore_s": 2.0, "recovery_s": 20.0, "lost_steps": 7},
            "memory-restart": {"detect_s": 0.2, "restore_s": 0.2, "recovery_s": 15.0, "lost_steps": 1},
        },
        "speedup": {"checkpoint-restart": 20.0},
        "state_bytes_per_rank": 1.2e9,
    }
    cal = load_calibration(write(tmp_path, "r.json", recovery))
    assert cal.leto_exit_detect_s == 0.5
    assert cal.leto_rebuild_fixed_s == pytest.approx(0.4)
    assert cal.cr_restart_fixed_s == pytest.approx(17.8)
    assert build_costs("leto", sc, cal).detect_s[0] == 0.5

    throughput = write(
        tmp_path, "t.json", {"step_s": 0.8, "tokens_per_s": 5000.0, "workers": 2, "state_bytes_per_rank": 1.2e9}
    )
    assert load_calibration(throughput).bench_step_s == 0.8

    merged = write(tmp_path, "m.json", {"throughput": {"step_s": 0.8}, "recovery": recovery})
    cal = load_calibration(merged)
    assert cal.bench_step_s == 0.8 and cal.leto_exit_detect_s == 0.5
    assert "m.json" in cal.sources["leto_exit_detect_s"]


@pytest.mark.parametrize(
    "content,needle",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"hello": 1}', "found keys: hello"),
        ('{"systems": {"leto": {"detect_s": "fast"}}}', "systems.leto.detect_s"),
        ('{"step_s": -1}', "step_s"),
        ('{"measurements": {"warp_factor": {"value": 1, "source": "x"}}}', "warp_factor"),
    ],
)
def test_bad_calibration_names_file_and_key(tmp_path: Path, content: str, needle: str) -> None:
    path = tmp_path / "bench.json"
    path.write_text(content)
    with pytest.raises(CalibrationError, match="bench.json") as info:
        load_calibration(path)
    assert needle in str(info.value)


# ---------------------------------------------------------------- bad arguments (item 5)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--gpus", "-8"], "--gpus"),
        (["--gpus", "0"], "--gpus"),
        (["--gpus", "many"], "--gpus"),
        (["--gpus", "1028"], "--gpus-per-node"),
        (["--gpus", "1000"], "tp*pp"),
        (["--gpus", "1024", "--pp", "3"], "--pp 3"),
        (["--gpus", "1024", "--tp", "3"], "--tp 3"),
        (["--pp", "0"], "--pp"),
        (["--tp", "-2"], "--tp"),
        (["--pp", "two"], "--pp"),
        (["--pp", "4", "--set", "pp=8"], "--pp 4 and --set pp=8 disagree"),
        (["--gpus-per-node", "3"], "--gpus-per-node"),
        (["--days", "0"], "--days"),
        (["--days", "1e9"], "too many"),
        (["--mtbf-gpu-hours", "-5"], "--mtbf-gpu-hours"),
        (["--spares", "-1"], "--spares"),
        (["--policy", "magic"], "unknown policy 'magic'"),
        (["--shrink", "fast"], "--shrink: invalid choice: 'fast'"),
        (["--shrink"], "--shrink"),
        (["--calibration", "/nonexistent/bench.json"], "/nonexistent/bench.json"),
        (["--set", "warp=9"], "unknown assumption 'warp'"),
        (["--set", "params=lots"], "params"),
        (["--set", "protect_overlap=2"], "protect_overlap"),
        (["--set", "d2h_overlap=1.5"], "d2h_overlap"),
        (["--set", "host_cores_per_node=8"], "host_cores_per_node"),
        (["--plot", "/nonexistent/dir/out.png"], "does not exist"),
        (["--frobnicate"], "--frobnicate"),
    ],
)
def test_bad_arguments_give_one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2
    assert out == ""
    assert err.startswith("leto simulate: error: ")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert needle in err


def test_garbled_calibration_file_is_a_usage_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "garbled.json"
    for garbage in (b"\x00\x01 not json", b"\xff\xfe\x00binary"):
        path.write_bytes(garbage)
        rc, _, err = run_cli(capsys, "--calibration", str(path))
        assert rc == 2 and "garbled.json" in err and err.count("\n") == 1


def test_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(capsys, "--help")
    assert rc == 0 and "leto simulate" in out
