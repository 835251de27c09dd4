"""Each rank's share of the machine in a benchmark: a CPU quota per process that runs a rank.

On a GPU cluster a rank is a GPU. A job that loses a rank and goes on without it (a shrink) has
less hardware until it grows back, and its steps slow down. On this machine every rank shares
the same cores, so a shrunk job steps as fast as the whole one and a comparison would charge a
shrink nothing. `RankCapacity` gives every process that runs a rank, or waits to (a worker, a
shadow, a spare), a CPU quota of its own in a cgroup of its own: `cores / ranks` of the machine,
the same for every system. A system that keeps its ranks keeps its hardware; one that shrinks
loses what the lost ranks had. The processes that serve ranks (a controller, keepers,
supervisors) are not capped: they are host CPU on a cluster too.

The processes are found in the run's `procs.json` (every system writes one) within `POLL_S` of
their listing; until then they run uncapped (their start-up). Every cgroup made is removed when
the run ends, whatever happens to it.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from pathlib import Path

from leto.runtime import linux

RANK_ROLES = frozenset({"worker", "shadow", "spare"})
PERIOD_US = 100_000  # the quota's period: the kernel's default
POLL_S = 0.05
V1 = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller
V2 = Path("/sys/fs/cgroup")  # cgroup v2's unified hierarchy


def hierarchy() -> tuple[Path, str] | str:
    """The cgroup hierarchy with a cpu controller this process can make groups in, as (root,
    "v1" or "v2"), or why there is none."""
    if (V1 / "cpu.cfs_quota_us").is_file() and os.access(V1, os.W_OK):
        return V1, "v1"
    control = V2 / "cgroup.subtree_control"
    try:
        if "cpu" in control.read_text().split() and os.access(V2, os.W_OK):
            return V2, "v2"
    except OSError:
        pass
    return "no cgroup hierarchy with a cpu controller is writable here (root and cgroup v1 cpu, or v2 with +cpu)"


def cores() -> int:
    """The CPUs this process may run on: what the ranks share."""
    return len(os.sched_getaffinity(0))


class RankCapacity:
    """While in use, caps every rank process `run_dir/procs.json` lists at `share` CPUs."""

    def __init__(self, run_dir: Path, share: float) -> None:
        found = hierarchy()
        if isinstance(found, str):
            raise RuntimeError(found)
        if not 0 < share:
            raise ValueError(f"a rank's CPU share must be positive, got {share}")
        self.root, self.version = found
        self.run_dir, self.share = Path(run_dir), share
        self.group = self.root / f"leto-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.placed: dict[int, str] = {}  # pid -> start time
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="leto-bench-capacity")

    def __enter__(self) -> RankCapacity:
        self.group.mkdir()
        if self.version == "v2":
            (self.group / "cgroup.subtree_control").write_text("+cpu")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self.release()

    def summary(self) -> dict:
        return {
            "cpu_per_rank": self.share,
            "cgroup": self.version,
            "processes": len(self.placed),
            "errors": self.errors,
        }

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                procs = json.loads((self.run_dir / "procs.json").read_text())
            except (OSError, ValueError):  # not written yet, or being replaced
                continue
            if not isinstance(procs, list):
                continue
            for p in procs:
                if not isinstance(p, dict) or p.get("role") not in RANK_ROLES:
                    continue
                pid = p.get("pid")
                if isinstance(pid, int) and pid > 0 and pid not in self.placed:
                    self.place(pid, p.get("start"))

    def place(self, pid: int, start: str | None) -> None:
        """Move process `pid` (with start time `start`; None: the one alive now) into a cgroup of
        its own with the quota."""
        start = start if isinstance(start, str) else linux.start_time(pid)
        if start is None or not linux.same_process(pid, start):
            return  # gone, or the pid names another process now
        d = self.group / f"p{pid}"
        try:
            d.mkdir(exist_ok=True)
            quota = round(self.share * PERIOD_US)
            if self.version == "v1":
                (d / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (d / "cpu.cfs_quota_us").write_text(str(quota))
            else:
                (d / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            if linux.same_process(pid, start):
                (d / "cgroup.procs").write_text(str(pid))
                self.placed[pid] = start
        except OSError as e:  # it exited meanwhile (ESRCH), most likely
            if linux.same_process(pid, start):
                self.errors.append(f"process {pid}: {e}")

    def release(self) -> None:
        """Remove every cgroup made; a process still in one goes back to the hierarchy's root."""
        if not self.group.exists():
            return
        for d in sorted(p for p in self.group.iterdir() if p.is_dir()):
            _empty(d, self.root)
            _rmdir(d, self.errors)
        _rmdir(self.group, self.errors)


def _empty(group: Path, root: Path) -> None:
    try:
        pids = (group / "cgroup.procs").read_text().split()
    except OSError:
        return
    for pid in pids:
        try:
            (root / "cgroup.procs").write_text(pid)
        except OSError:  # exited meanwhile
            pass


def _rmdir(group: Path, errors: list[str]) -> None:
    try:
        group.rmdir()
    except FileNotFoundError:
        pass
    except OSError as e:
        errors.append(f"could not remove {group}: {e}")
