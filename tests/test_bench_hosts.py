"""`leto bench recovery --hosts 3`'s `join` scenario, without the cluster: the replacement host is
a new machine plugged into the cluster (not the lost host's namespace), its command the job's
with `--join`, and the figures are timed from that command."""

from __future__ import annotations

import json
from pathlib import Path

from leto.bench import hosts


class _Cluster:
    """Three hosts; `add_host` plugs in a fourth."""

    def __init__(self) -> None:
        self.hosts, self.added = 3, 0

    def pids(self, i: int) -> list[int]:
        return []  # the victim's processes are gone

    def etcd_pids(self) -> list[int]:
        return []

    def add_host(self) -> int:
        self.added += 1
        self.hosts += 1
        return self.hosts - 1


class _Job:
    def __init__(self) -> None:
        self.procs: list[object] = ["h0", "h1", "h2"]
        self.started: list[tuple[int, list[str], str]] = []

    def popen(self, i: int, attempt: int, extra: list[str], name: str = "") -> str:
        self.started.append((i, extra, name))
        return f"h{i}{name}"


def test_the_join_scenario_starts_the_joiner_on_a_new_machine_and_times_from_its_command(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    events = [("recovery", 0.0, None), ("host_joined", 1e12 + 1, None), ("resize", 1e12 + 3, 0.5)]
    events.append(("restored", 1e12 + 3.5, None))
    lines = [json.dumps({"event": e, "time": t, **({"total_s": s} if s else {})}) for e, t, s in events]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    cluster, job = _Cluster(), _Job()
    got = hosts._replace_host(cluster, job, 1, run_dir)
    assert cluster.added == 1 and job.started == [(3, ["--join"], "-join")]
    assert job.procs == ["h0", "h1", "h2", "h3-join"]  # the lost host's slot keeps its process
    assert got["grow_pause_s"] == 0.5
    assert got["join_admitted_s"] < got["join_full_width_s"] < got["join_restored_s"]
