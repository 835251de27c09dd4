"""Print a job's LETO_TRACE files merged with its metrics.jsonl, in seconds from one event.

    python scripts/trace-timeline.py TRACE... [--run-dir RUN_DIR] [--from EVENT] [--at UNIX_TIME]

Several files (one per host) are merged by time; the hosts' clocks differ by their NTP skew.

Without --at, times count from the first metrics event or trace mark named EVENT (default
`host_lost`, else the first line). Steps of metrics.jsonl are shown as `step N done`.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", type=Path, nargs="+")
    ap.add_argument("--run-dir", type=Path)
    ap.add_argument("--from", dest="origin", default="host_lost")
    ap.add_argument("--at", type=float, help="time zero (unix seconds), e.g. when a fault was made")
    args = ap.parse_args()
    rows = []
    for line in (line for path in args.trace for line in path.read_text().splitlines()):
        r = json.loads(line)
        extra = {k: v for k, v in r.items() if k not in ("t", "pid", "role", "proc", "node", "what")}
        rows.append((r["t"], f"{r['role']:<10} n{r['node'] or '-':<2} {r['proc'] or r['pid']:<12}", r["what"], extra))
    if args.run_dir is not None:
        for line in (args.run_dir / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            if "event" in r:
                rows.append((r["time"], f"{'coordinator':<10} {'':<3} {'':<12}", r["event"],
                             {k: r[k] for k in ("node", "rank", "generation") if k in r}))
            elif "step" in r:
                rows.append((r["time"], f"{'rank 0':<10} {'':<3} {'':<12}", f"step {r['step']} done",
                             {"step_s": r.get("step_s")}))
    rows.sort(key=lambda r: r[0])
    t0 = args.at if args.at is not None else next((t for t, _, what, _ in rows if what == args.origin), rows[0][0])
    for t, who, what, extra in rows:
        print(f"{t - t0:+9.3f}  {who}  {what}  {json.dumps(extra) if extra else ''}")


if __name__ == "__main__":
    main()
