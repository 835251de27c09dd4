"""`leto bench recovery --hosts 3`: a host's loss on a cluster of network-namespace hosts.

Every host runs `leto train --rdzv` (one etcd member each, tests/netns_cluster.py). The same job
(`--workers 2×hosts`, tier 2 across hosts) is failed three ways:
- `host`: SIGKILL of every process of a host that is not the coordinator, with its etcd member;
- `coordinator`: the same for the coordinator's host;
- `partition`: the link of a host that is not the coordinator cut, then restored;
- `coordinator-partition`: the same for the coordinator's host (which holds etcd's leader too);
- `join` (leto only, no shadow): SIGKILL of a worker host's processes (its etcd member lives);
  once the job has shrunk, the same command with `--join` on a replacement machine (a new
  namespace plugged in then, at the next address, with no etcd member): the time from that
  command to its admission, to the job at full width, to tier 2 restored (`restored` event), and
  the training pause of the grow.

Systems, side by side in one run:
- `leto`: in-place recovery with 2 spares;
- `checkpoint-restart`: the same job with protection off and a checkpoint every K steps. A
  failure stops it on every host, and it restarts on the same hosts (the killed host's
  namespace, with its etcd member restarted, stands for a replacement host) from the newest
  checkpoint, with `--resume`.

All numbers come from the runs' metrics.jsonl through `runs.analyze_recovery`, from the moment
of the kill or the cut:
- `first_s`: until a step completes again;
- `regain_s`: until the step in flight at the failure is done again;
- `recovery_s`: as `regain_s`, and the next steps also run at the pre-failure speed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from leto.bench.runs import analyze_recovery, default_out, log, machine, median, ratio
from leto.console import read_jsonl
from leto.runtime.trace import mark

STEPS = 30
KILL_AFTER = 8  # the failure comes once this step is recorded
CKPT_EVERY = 5  # checkpoint-restart's K
TARGETS_S = {"host": 3.0, "coordinator": 4.0}  # partition: the lease time + 1 s
SCENARIOS = ("host", "coordinator", "partition", "coordinator-partition")
JOIN_STEPS = 150  # `join`: training goes on through the loss, the join and the grow
JOIN_FIGURES = {
    "join_admitted_s": "admitted",
    "join_full_width_s": "full width",
    "join_restored_s": "tier 2 restored",
    "grow_pause_s": "the grow's pause",
}
CUTS = ("partition", "coordinator-partition")
REPO = Path(__file__).resolve().parents[3]


def _harness():
    """tests/netns_cluster.py of this checkout (the benchmark needs the source tree and root)."""
    tests = REPO / "tests"
    if not (tests / "netns_cluster.py").exists():
        raise RuntimeError(
            f"leto bench recovery --hosts needs the source tree's tests/netns_cluster.py (not found under {tests})"
        )
    sys.path.insert(0, str(tests))
    import netns_cluster

    why = netns_cluster.available()
    if why is not None:
        raise RuntimeError(f"no namespace cluster on this machine: {why}")
    return netns_cluster


def _records(run_dir: Path) -> list[dict]:
    out = []
    for path in sorted(run_dir.glob("metrics.jsonl.attempt*")) + [run_dir / "metrics.jsonl"]:
        out += read_jsonl(path)
    return out


def _last_step(run_dir: Path) -> int:
    return max(
        (r["step"] for r in _records(run_dir) if "event" not in r and isinstance(r.get("step"), int)), default=-1
    )


def _wait(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.02)


class _Job:
    """One `leto train --rdzv` per host, output to RUN_DIR.host<i>.<attempt>.{out,err}."""

    def __init__(self, cluster, run_dir: Path, job_id: str, flags: list[str]) -> None:
        self.cluster, self.run_dir, self.job_id, self.flags = cluster, run_dir, job_id, flags
        self.procs: list[subprocess.Popen] = []

    def start(self, attempt: int, extra: list[str]) -> None:
        self.procs = [self.popen(i, attempt, extra) for i in range(self.cluster.hosts)]

    def popen(self, i: int, attempt: int, extra: list[str], name: str = "") -> subprocess.Popen:
        """This job's command (`extra` added) on host i, its output to RUN_DIR.host<i><name>.<attempt>.*"""
        env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
        argv = [
            sys.executable,
            "-m",
            "leto.cli",
            "train",
            "--rdzv",
            self.cluster.rdzv,
            "--job-id",
            f"{self.job_id}-a{attempt}",
            *self.flags,
            *extra,
        ]
        with (
            open(f"{self.run_dir}.host{i}{name}.{attempt}.out", "w") as out,
            open(f"{self.run_dir}.host{i}{name}.{attempt}.err", "w") as err,
        ):
            return self.cluster.popen(i, argv, env=env, cwd=REPO, stdout=out, stderr=err)

    def wait(self, timeout_s: float) -> list[int]:
        deadline = time.monotonic() + timeout_s
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
                codes.append(p.wait())
        return codes

    def coordinator_host(self, attempt: int) -> tuple[int, int]:
        """(node of the coordinator, the host index that runs it)."""
        got = self.cluster.etcdctl(
            0, "get", f"/leto/{self.job_id}-a{attempt}/control/coordinator", "--print-value-only"
        )
        node = int(got.stdout.strip())
        return node, self.host_of(node)

    def host_of(self, node: int) -> int:
        procs = json.loads((self.run_dir / f"procs-host{node}.json").read_text())
        pid = next(p["pid"] for p in procs if p["role"] == "controller")
        return next(i for i in range(self.cluster.hosts) if pid in self.cluster.pids(i))


def run_one(nc, system: str, scenario: str, out: Path, trial: int, args: argparse.Namespace) -> dict:
    """One run: start the job, fail it once, let it finish; its numbers."""
    hosts = args.hosts
    run_dir = out / f"{system}-{scenario}-t{trial}"
    flags = [
        "--nodes",
        str(hosts),
        "--workers",
        str(2 * hosts),
        "--steps",
        str(args.steps or STEPS),
        "--model",
        args.model,
        "--run-dir",
        str(run_dir),
        "--lease",
        "2",
    ]
    if scenario == "join":  # no shadow: the loss shrinks the job, and only the new host grows it back
        flags += ["--spares", "0", "--persist", "off"]
        flags[flags.index("--steps") + 1] = str(args.steps or JOIN_STEPS)
    elif system == "leto":
        flags += ["--spares", "2", "--persist", "off"]
    else:
        flags += ["--spares", "0", "--protection", "off", "--persist", "on", "--persist-every", str(CKPT_EVERY)]
    rec: dict = {"system": system, "scenario": scenario, "run_dir": str(run_dir)}
    shutil.rmtree(
        run_dir, ignore_errors=True
    )  # a run of an earlier bench in the same --out would be read as this one's
    with nc.Cluster(hosts=hosts) as cluster:
        job = _Job(cluster, run_dir, f"b{os.getpid()}-{system}-{scenario}-{trial}", flags)
        job.start(0, [])
        _wait(lambda: _last_step(run_dir) >= KILL_AFTER, 300, f"step {KILL_AFTER}")
        lead, lead_host = job.coordinator_host(0)
        on_lead = scenario in ("coordinator", "coordinator-partition")
        node = lead if on_lead else (lead + 1) % hosts
        victim = lead_host if on_lead else job.host_of(node)
        t_fail = time.time()
        mark("fault", scenario=scenario, host=victim)
        if scenario == "join":
            rec.update(_replace_host(cluster, job, victim, run_dir))
        elif scenario in CUTS:
            cluster.cut_link(victim)
            job.procs[victim].wait(timeout=60)  # it leaves the job once its lease is gone
            rec["victim_left_s"] = round(time.time() - t_fail, 3)
            cluster.restore_link(victim)
        else:
            cluster.kill_host(victim)
        if system == "checkpoint-restart":
            job.wait(120)  # every host stops: nothing protects the lost state
            if scenario not in CUTS:
                cluster.start_etcd(victim)
            cluster.wait_healthy()
            job.start(1, ["--resume", str(run_dir)])
        codes = job.wait(600)
        rec["exit_codes"] = codes
        rec["failed_node"] = node
    rec.update(analyze_recovery(_records(run_dir), t_fail))
    summary = run_dir / "summary.json"
    s = json.loads(summary.read_text()) if summary.exists() else {}
    rec["ok"] = s.get("exit_code") == 0 and s.get("steps") == (
        args.steps or (JOIN_STEPS if scenario == "join" else STEPS)
    )
    rec["digest"] = s.get("digest")
    recs = s.get("recoveries") or []
    if recs:
        rec["leto_record"] = {
            k: recs[0].get(k) for k in ("detect_s", "restore_s", "join_s", "total_s", "tier", "world_size")
        }
    return rec


def _kill_all_but_etcd(cluster, i: int) -> None:
    """SIGKILL every process of host i but its etcd member (the etcd cluster keeps its quorum
    while a new machine replaces the host), until none is left."""
    deadline = time.monotonic() + 10
    while left := [p for p in cluster.pids(i) if p not in cluster.etcd_pids()]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"host {i}'s processes {left} outlived SIGKILL for 10s")
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def _replace_host(cluster, job: _Job, victim: int, run_dir: Path) -> dict:
    """Lose host `victim`'s processes; once the job has shrunk, plug in a new machine (the
    cluster's next host, no etcd member), start the same command there with `--join` and time,
    from that command, the joiner's admission, the job back at full width and tier 2 restored,
    and the grow's pause."""
    _kill_all_but_etcd(cluster, victim)
    _wait(lambda: any(r.get("event") == "recovery" for r in _records(run_dir)), 120, "the shrink")
    new = cluster.add_host()  # (before the clock starts: the machine is there when its command runs)
    t_join = time.time()
    mark("join", host=new)
    job.procs.append(job.popen(new, 0, ["--join"], name="-join"))  # job.procs[i] stays host i's
    _wait(lambda: any(r.get("event") == "restored" for r in _records(run_dir)), 600, "the job restored")
    events = {r["event"]: r for r in _records(run_dir) if r.get("event") in ("host_joined", "resize", "restored")}
    return {
        "join_admitted_s": round(events["host_joined"]["time"] - t_join, 3),
        "join_full_width_s": round(events["resize"]["time"] - t_join, 3),
        "join_restored_s": round(events["restored"]["time"] - t_join, 3),
        "grow_pause_s": events["resize"].get("total_s"),
    }


def main(args: argparse.Namespace) -> int:
    nc = _harness()
    out = args.out or default_out("recovery-hosts")
    out.mkdir(parents=True, exist_ok=True)
    runs = [
        (system, scenario)
        for scenario in SCENARIOS
        for system in ("leto", "checkpoint-restart")
        if system == "leto" or scenario == "host"
    ] + [("leto", "join")]
    results: list[dict] = []
    for trial in range(args.trials):
        for system, scenario in runs:
            what = "a host lost, a new one joins" if scenario == "join" else f"{scenario} lost"
            log(f"bench recovery --hosts {args.hosts}: trial {trial + 1}/{args.trials}: {system}, {what}")
            results.append(run_one(nc, system, scenario, out, trial, args))
    table: dict = {}
    for system, scenario in runs:
        mine = [r for r in results if r["system"] == system and r["scenario"] == scenario and r["ok"]]
        table[f"{system}/{scenario}"] = {
            k: median([r.get(k) for r in mine]) for k in ("detect_s", "first_s", "regain_s", "recovery_s", "lost_steps")
        }
        table[f"{system}/{scenario}"]["trials_ok"] = len(mine)
    join = [r for r in results if r["scenario"] == "join" and r["ok"]]
    joined = {k: median([r.get(k) for r in join]) for k in JOIN_FIGURES} | {"trials_ok": len(join)}
    leto_host, ckpt_host = table["leto/host"], table["checkpoint-restart/host"]
    lease_s = 2.0
    targets = {
        "host_loss_training_again_s": {"measured": leto_host["regain_s"], "target": TARGETS_S["host"]},
        "coordinator_host_loss_training_again_s": {
            "measured": table["leto/coordinator"]["regain_s"],
            "target": TARGETS_S["coordinator"],
        },
        "partition_training_again_s": {"measured": table["leto/partition"]["regain_s"], "target": lease_s + 1.0},
        # a cut coordinator's host is both a coordinator's host lost and a partition: checked against both
        "coordinator_host_partition_vs_coordinator_target_s": {
            "measured": table["leto/coordinator-partition"]["regain_s"],
            "target": TARGETS_S["coordinator"],
        },
        "coordinator_host_partition_vs_partition_target_s": {
            "measured": table["leto/coordinator-partition"]["regain_s"],
            "target": lease_s + 1.0,
        },
    }
    for t in targets.values():
        t["met"] = t["measured"] is not None and t["measured"] <= t["target"]
    report = {
        "hosts": args.hosts,
        "trials": args.trials,
        "steps": args.steps or STEPS,
        "kill_after_step": KILL_AFTER,
        "checkpoint_every": CKPT_EVERY,
        "lease_s": lease_s,
        "systems": table,
        "join": joined,
        "targets": targets,
        "speedup_regain_host_loss": ratio(ckpt_host["regain_s"], leto_host["regain_s"]),
        "machine": machine(),
        "runs": results,
    }
    (out / "recovery-hosts.json").write_text(json.dumps(report, indent=1))
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(
        f"leto bench recovery --hosts {args.hosts}: {args.trials} trial(s), {2 * args.hosts} workers, "
        f"model {args.model}, lease {lease_s:g}s; medians in seconds from the failure"
    )
    print(
        f"{'system / failure':34} {'detect':>7} {'first step':>10} {'training again':>14} {'full speed':>10}"
        f" {'lost steps':>10}"
    )
    for name, row in table.items():
        cells = [row["detect_s"], row["first_s"], row["regain_s"], row["recovery_s"], row["lost_steps"]]
        print(
            f"{name:34} "
            + " ".join(f"{'-' if v is None else f'{v:.2f}':>{w}}" for v, w in zip(cells, (7, 10, 14, 10, 10)))
        )
    print(
        "a replacement host (--join) after a host's loss, from the join command: "
        + ", ".join(f"{JOIN_FIGURES[k]} {'-' if joined[k] is None else f'{joined[k]:.2f}s'}" for k in JOIN_FIGURES)
    )
    sp = report["speedup_regain_host_loss"]
    print(f"host loss, training again: checkpoint-restart / leto = {'-' if sp is None else f'{sp:.1f}x'}")
    for name, t in targets.items():
        m = t["measured"]
        print(
            f"target {name}: {'-' if m is None else f'{m:.2f}'}s <= {t['target']:.1f}s: "
            f"{'met' if t['met'] else 'NOT met'}"
        )
    print(f"raw results: {out / 'recovery-hosts.json'}")
    return 0
