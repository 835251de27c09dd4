"""A benchmark's ranks each get a CPU quota of their own: the processes `procs.json` lists as
ranks (worker, shadow, spare) are moved into a cgroup each with the quota, the processes that
serve them are left alone, and every cgroup made is gone when the run ends."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from leto.bench import capacity, productivity
from leto.bench.capacity import PERIOD_US, RankCapacity
from leto.errors import UsageError

needs_cgroups = pytest.mark.skipif(isinstance(capacity.hierarchy(), str), reason=f"{capacity.hierarchy()}")


def _cgroup_of(pid: int, version: str) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (version == "v1" and "cpu" in controllers.split(",")) or (version == "v2" and controllers == ""):
            return path
    return ""


def _within(done, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


@needs_cgroups
def test_rank_processes_get_a_quota_each_and_every_cgroup_goes_with_the_run(tmp_path: Path) -> None:
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(3)]
    try:
        worker, shadow, keeper = sleepers
        procs = [
            {"role": "worker", "rank": 0, "pid": worker.pid},
            {"role": "shadow", "rank": None, "pid": shadow.pid},
            {"role": "keeper", "rank": None, "pid": keeper.pid},
        ]
        (tmp_path / "procs.json").write_text(json.dumps(procs))
        with RankCapacity(tmp_path, 0.25) as cap:
            _within(lambda: len(cap.placed) == 2, "the two rank processes to be placed")
            root, version = capacity.hierarchy()  # type: ignore[misc]
            for p in (worker, shadow):
                path = _cgroup_of(p.pid, version)
                assert path.endswith(f"/{cap.group.name}/p{p.pid}"), path
                group = cap.group / f"p{p.pid}"
                if version == "v1":
                    assert (group / "cpu.cfs_quota_us").read_text().strip() == str(PERIOD_US // 4)
                else:
                    assert (group / "cpu.max").read_text().split() == [str(PERIOD_US // 4), str(PERIOD_US)]
            assert cap.group.name not in _cgroup_of(keeper.pid, version)
            group = cap.group
        assert not group.exists()
        assert cap.summary() == {"cpu_per_rank": 0.25, "cgroup": version, "processes": 2, "errors": []}
        assert cap.group.name not in _cgroup_of(worker.pid, version)  # a process still alive is let go
    finally:
        for p in sleepers:
            p.kill()
            p.wait()


@needs_cgroups
def test_a_listed_pid_whose_start_time_does_not_match_is_not_moved(tmp_path: Path) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "procs.json").write_text(json.dumps([{"role": "worker", "pid": sleeper.pid, "start": "1"}]))
        with RankCapacity(tmp_path, 0.5) as cap:
            time.sleep(5 * capacity.POLL_S)
            assert cap.placed == {}
    finally:
        sleeper.kill()
        sleeper.wait()


def test_auto_shares_the_cores_among_the_ranks_where_cgroups_allow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(capacity, "cores", lambda: 2)
    monkeypatch.setattr(capacity, "hierarchy", lambda: (Path("/sys/fs/cgroup/cpu"), "v1"))
    assert productivity.rank_cpu_setting(None, 4) == {"cpu_per_rank": 0.5, "cgroup": "v1", "why": "2 cores / 4 ranks"}
    assert productivity.rank_cpu_setting("0.75", 4)["cpu_per_rank"] == 0.75
    assert productivity.rank_cpu_setting("off", 4)["cpu_per_rank"] is None
    monkeypatch.setattr(capacity, "hierarchy", lambda: "no cgroups here")
    assert productivity.rank_cpu_setting("auto", 4) == {"cpu_per_rank": None, "cgroup": None, "why": "no cgroups here"}
    with pytest.raises(UsageError, match="no cgroups here"):
        productivity.rank_cpu_setting("0.5", 4)


@pytest.mark.parametrize("flag", ["0", "-1", "3", "half"])
def test_a_rank_cpu_that_is_not_a_share_of_the_machine_is_refused(flag: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(capacity, "cores", lambda: 2)
    with pytest.raises(
        UsageError, match=f"--rank-cpu must be auto, off or a number of CPUs in \\(0, 2\\], got '{flag}'"
    ):
        productivity.rank_cpu_setting(flag, 4)


@needs_cgroups
def test_entries_of_procs_json_that_are_not_processes_are_passed_over(tmp_path: Path) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        procs = ["garbage", 3, None, {"role": "worker", "pid": "12"}, {"role": "worker", "pid": sleeper.pid}]
        (tmp_path / "procs.json").write_text(json.dumps(procs))
        with RankCapacity(tmp_path, 0.5) as cap:
            _within(lambda: sleeper.pid in cap.placed, "the listed worker to be placed")
            assert cap._thread.is_alive()
        assert list(cap.placed) == [sleeper.pid]
    finally:
        sleeper.kill()
        sleeper.wait()
