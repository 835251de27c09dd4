"""What a steady multi-host job asks of etcd: requests and Raft commits per second, and its step time.

Runs a 3-host `leto train --rdzv` job (6 workers, 1 spare) on the namespace cluster of
tests/netns_cluster.py, reads every etcd member's own metrics (`grpc_server_handled_total`,
`etcd_server_proposals_committed_total`) twice, 10 s apart, once past step 5, and prints a JSON
summary. Needs root (namespaces) and etcd. Usage: python scripts/etcd-rates.py [STEPS]
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from netns_cluster import Cluster  # noqa: E402

WINDOW_S = 10.0


def metrics(c: Cluster, i: int) -> dict[str, float]:
    code = f"import urllib.request;print(urllib.request.urlopen('http://{c.addr(i)}:2379/metrics',timeout=5).read().decode())"
    out: dict[str, float] = {}
    for line in c.run_in(i, [sys.executable, "-c", code]).stdout.splitlines():
        if m := re.match(r'grpc_server_handled_total\{.*grpc_method="(\w+)".*\} (\S+)', line):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
        elif m := re.match(r"etcd_server_proposals_committed_total (\S+)", line):
            out["committed"] = float(m.group(1))
    return out


def last_step(run: Path) -> int:
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return max([json.loads(line).get("step", 0) for line in lines] or [0])


def main(steps: int) -> None:
    with TemporaryDirectory() as tmp, Cluster(hosts=3) as c:
        run = Path(tmp) / "run"
        argv = [sys.executable, "-m", "leto.cli", "train", "--rdzv", c.rdzv, "--job-id", f"rates{os.getpid()}",
                "--run-dir", str(run), "--workers", "6", "--nodes", "3", "--spares", "1", "--steps", str(steps),
                "--seed", "0", "--persist", "off"]
        env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
        logs = [open(Path(tmp) / f"host{i}.log", "w") for i in range(3)]  # noqa: SIM115
        hosts = [c.popen(i, argv, env=env, cwd=REPO, stdout=logs[i], stderr=logs[i]) for i in range(3)]
        deadline = time.monotonic() + 300
        while last_step(run) < 5 and time.monotonic() < deadline and all(h.poll() is None for h in hosts):
            time.sleep(0.2)
        before, t0, s0 = [metrics(c, i) for i in range(3)], time.monotonic(), last_step(run)
        time.sleep(WINDOW_S)
        after, t1, s1 = [metrics(c, i) for i in range(3)], time.monotonic(), last_step(run)
        codes = [h.wait(timeout=600) for h in hosts]
        for f in logs:
            f.close()
        rates: dict[str, float] = {}
        for x, y in zip(before, after):
            for k, v in y.items():
                rates[k] = rates.get(k, 0.0) + (v - x.get(k, 0.0)) / (t1 - t0)
        times = sorted(json.loads(line)["step_s"] for line in (run / "metrics.jsonl").read_text().splitlines()
                       if '"step_s"' in line)[5:]
        print(json.dumps({"exit_codes": codes, "steps_per_s": round((s1 - s0) / (t1 - t0), 2),
                          "median_step_s": times[len(times) // 2] if times else None,
                          "raft_commits_per_s": round(rates.pop("committed", 0.0) / 3, 1),  # each member counts each
                          "requests_per_s_all_members": {k: round(v, 1) for k, v in sorted(rates.items()) if v > 0.05}},
                         indent=1))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
