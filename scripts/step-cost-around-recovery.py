"""Does a recovery change what a step costs? Per-thread CPU per step and the median step time of
a window before and a window after, in a failure-free run and in a run whose rank 1 is SIGKILLed
from outside (by pidfd) between the two windows, the same windows in both.

    python scripts/step-cost-around-recovery.py [free|kill ...] [--steps 600] [--kill-at 180] [-- TRAIN ARGS]

Default: free kill free kill (each of the default 4-worker, 2-node tiny job with protection,
persistence off). One JSON line a run: per window its steps, median step time and CPU
milliseconds per step by role/thread (from /proc/PID/task/TID/schedstat; a thread that lives
in one window only is left out). Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def threads_cpu_ms(root: int, run_dir: Path) -> dict[tuple[int, int], tuple[str, float]]:
    """CPU milliseconds so far of every thread of the job (the controller `root` and its
    children), named role/thread (role from procs.json, `main` for a process's first thread)."""
    try:
        roles = {p["pid"]: p["role"] for p in json.loads((run_dir / "procs.json").read_text())}
    except (OSError, ValueError):
        roles = {}
    out = {}
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if pid != root and parent != root:
                continue
            role = roles.get(pid, Path(f"/proc/{pid}/comm").read_text().strip())
            for tid in (int(t) for t in os.listdir(f"/proc/{pid}/task")):
                name = "main" if tid == pid else Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                ns = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
                out[(pid, tid)] = (f"{role}/{name}", ns / 1e6)
        except (OSError, ValueError, IndexError):
            pass
    return out


def one_run(kill: bool, steps: int, kill_at: int, extra: list[str], tag: str) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"leto-step-cost-{tag}-"))
    windows = {"before": (steps // 10, kill_at - 5), "after": (steps // 2, steps)}
    argv = [sys.executable, "-m", "leto.cli", "train", "--steps", str(steps), "--persist", "off"]
    p = subprocess.Popen(
        [*argv, "--run-dir", str(run_dir), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    marks: dict[str, tuple[int, dict]] = {}
    for line in p.stdout or ():
        m = re.match(r"step (\d+)/", line)
        if m is None:
            continue
        step = int(m.group(1))
        for name, (lo, hi) in windows.items():
            for edge, at in (("0", lo), ("1", hi - 2)):
                if name + edge not in marks and step >= at:
                    marks[name + edge] = (step, threads_cpu_ms(p.pid, run_dir))
                    if kill and name + edge == "before1":
                        procs = json.loads((run_dir / "procs.json").read_text())
                        victim = next(x for x in procs if x["role"] == "worker" and x["rank"] == 1)
                        fd = os.pidfd_open(victim["pid"])
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
                        os.close(fd)
    p.wait(timeout=600)
    step_s = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "step_s" in r:
            step_s[r["step"]] = r["step_s"]  # a redone step: its last record
    out: dict = {"run": tag, "run_dir": str(run_dir), "exit_code": p.returncode}
    for name in windows:
        (s0, a), (s1, b) = marks[name + "0"], marks[name + "1"]
        by: dict[str, float] = collections.defaultdict(float)
        for key in a.keys() & b.keys():
            by[b[key][0]] += (b[key][1] - a[key][1]) / (s1 - s0)
        out[name] = {
            "steps": [s0, s1],
            "median_step_s": round(statistics.median(step_s[s] for s in range(s0, s1) if s in step_s), 4),
            "cpu_ms_per_step": {k: round(v, 2) for k, v in sorted(by.items()) if v >= 0.05},
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*", choices=["free", "kill"], default=["free", "kill", "free", "kill"])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--kill-at", type=int, default=180)
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]
    for i, kind in enumerate(args.runs):
        print(json.dumps(one_run(kind == "kill", args.steps, args.kill_at, extra, f"{i}-{kind}")), flush=True)


if __name__ == "__main__":
    main()
