"""CPU time of a job's processes by role, sampled from /proc while the job runs.

The overhead benchmark uses it to say what protection costs in CPU (keepers, workers' staging)
and not only in step time: on a machine whose cores the training already fills, every CPU
second the keepers spend shows up in the step time. Keepers and workers are also split by thread
(by their OS names: `thread_group`), so the benchmark can say what dominates inside them and
charge a persistent checkpoint's write thread to persistence.

With `memory_every_s` the sampler also reads each process's resident memory (`/proc/<pid>/status`
and `smaps_rollup`), so the benchmark can report what the processes that exist only for
protection (keepers, zygotes) cost per node, measured while the job runs.
"""

from __future__ import annotations

import bisect
import json
import os
import threading
import time
from pathlib import Path

from leto.runtime.linux import proc_stat

_TICK = os.sysconf("SC_CLK_TCK")
TICK_S = 1.0 / _TICK  # the kernel's resolution of a thread's CPU time
BY_THREAD = {"keeper", "worker"}  # roles whose CPU is also reported by thread group
SHORT_LIVED = "short-lived"  # CPU of threads that ended between two samples, of no one known group
PROTECTION_THREAD_PREFIX = "leto-protect"  # OS names of threads protection adds to a worker
WORKER_PROTECTION_GROUPS = ("protection",)  # a worker's thread groups charged to protection, not training


def cpu_seconds(pid: int, tid: int | None = None) -> float | None:
    """user + system CPU seconds of a live process (or one of its threads), None once gone."""
    fields = proc_stat(pid, tid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (14, 15)


def thread_cpu_seconds(pid: int, tid: int) -> float | None:
    """CPU seconds of a live thread: its scheduler run time in nanoseconds (schedstat), else
    its user + system clock ticks; None once gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return cpu_seconds(pid, tid)


def thread_group(name: str, main: bool = False) -> str:
    """What a thread of a keeper or a worker does, from its OS name (`main`: the process's first
    thread, a worker's training thread)."""
    if name.startswith(("gloo", "pt_gloo")):
        return "gloo"  # gloo's transport threads (TCP, its run loop); a keeper's carry its commit barrier
    if name in ("keeper-send", "keeper-recv"):
        return "tier2-threads"  # a keeper's tier-2 TCP links: sending batches, receiving and folding them
    if name.startswith(PROTECTION_THREAD_PREFIX):
        return "protection"  # a thread protection adds to a worker (none today: a worker stages on its training thread)
    if name == "leto-persist":
        return "persist"  # a persistent checkpoint's write (DCP save, marker, commit)
    if name == "leto-dcp-import":
        return "persist-import"  # importing DCP, once, after a worker's first step
    if name == "leto-keeper" or main:
        return "main"  # keepers: staging slots, tier-1 folds, batching, barriers; workers: training
    return "other"


_STATUS_FIELDS = {"VmRSS": "vm_rss", "RssAnon": "rss_anon", "RssFile": "rss_file", "RssShmem": "rss_shmem"}
_ROLLUP_FIELDS = {"Pss": "pss", "Pss_Anon": "pss_anon", "Pss_File": "pss_file", "Pss_Shmem": "pss_shmem"}


def _kb_fields(path: str, wanted: dict[str, str]) -> dict[str, int]:
    out = {}
    with open(path) as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in wanted:
                out[wanted[key]] = int(rest.split()[0]) * 1024  # "1234 kB"
    return out


def memory_bytes(pid: int) -> dict[str, int] | None:
    """Resident memory of a live process in bytes: vm_rss, rss_anon, rss_file, rss_shmem (from
    status) and pss, pss_anon, pss_file, pss_shmem (from smaps_rollup: shared pages divided among
    the processes that map them); None once gone. Missing smaps_rollup leaves out the pss fields."""
    try:
        out = _kb_fields(f"/proc/{pid}/status", _STATUS_FIELDS)
    except OSError:
        return None
    if "vm_rss" not in out:  # a zombie has no memory left
        return None
    try:
        out.update(_kb_fields(f"/proc/{pid}/smaps_rollup", _ROLLUP_FIELDS))
    except OSError:
        pass
    return out


def _threads(pid: int) -> dict[int, str]:
    out = {}
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                out[int(tid)] = f.read().strip()
    except OSError:
        pass
    return out


class CpuSampler:
    """Samples every process in a run's procs.json every `every_s` seconds, in a thread."""

    def __init__(self, run_dir: Path, every_s: float = 0.1, memory_every_s: float | None = None) -> None:
        self.run_dir, self.every_s, self.memory_every_s = run_dir, every_s, memory_every_s
        # (time, {"pid", "role", "node", **memory_bytes}) for every process, every memory_every_s
        self.memory: list[tuple[float, dict]] = []
        self._next_memory = 0.0
        self.times: list[float] = []
        self.samples: list[dict[str, float]] = []  # role -> CPU seconds of its live processes so far
        self._last: dict[int, tuple[str, float]] = {}
        self._last_thread: dict[tuple[int, int], tuple[str, float]] = {}  # a thread keeps its last value once gone
        self._ended: dict[int, dict[str, float]] = {}  # per process, by group: CPU of threads after their last sample
        self._live: dict[int, set[int]] = {}  # per process, its threads at the last sample
        self._rest: dict[int, float] = {}  # per process, its CPU beyond its threads' last samples
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="leto-cpu-sampler")

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                procs = json.loads((self.run_dir / "procs.json").read_text())
            except (OSError, json.JSONDecodeError):
                continue
            for p in procs:
                if p["role"] == "controller":
                    continue
                cpu = cpu_seconds(p["pid"])
                if cpu is not None:  # a process keeps its role of first sight (shadows may adopt)
                    role = self._last.get(p["pid"], (p["role"], 0.0))[0]
                    self._last[p["pid"]] = (role, cpu)
                    if role in BY_THREAD:
                        self._sample_threads(p["pid"], role, cpu)
            totals: dict[str, float] = {}
            for role, cpu in self._last.values():
                totals[role] = totals.get(role, 0.0) + cpu
            for group, cpu in self._last_thread.values():
                totals[group] = totals.get(group, 0.0) + cpu
            for ended in self._ended.values():
                for group, cpu in ended.items():
                    totals[group] = totals.get(group, 0.0) + cpu
            self.times.append(time.time())
            self.samples.append(totals)
            if self.memory_every_s is not None and time.monotonic() >= self._next_memory:
                self._next_memory = time.monotonic() + self.memory_every_s
                self._sample_memory(procs)

    def _sample_threads(self, pid: int, role: str, process_cpu: float) -> None:
        """Each live thread's CPU by its group (`thread_cpu_seconds`: nanoseconds, where the
        kernel keeps them). The rest of the process's CPU (it keeps an ended thread's) is what
        threads used after their last sample: where it grew while the threads that ended since
        the last sample are all of one group, the growth is that group's; the rest of it is
        SHORT_LIVED (threads that lived between two samples; it also carries the process
        total's rounding to a clock tick, so it is not clamped: differences stay unbiased)."""
        live = _threads(pid)
        before, self._live[pid] = self._live.get(pid, set()), set(live)
        for tid, name in live.items():
            t = thread_cpu_seconds(pid, tid)
            if t is not None:
                self._last_thread[(pid, tid)] = (f"{role}/{thread_group(name, main=tid == pid)}", t)
        ended = self._ended.setdefault(pid, {})
        seen = sum(cpu for (p, _), (_, cpu) in self._last_thread.items() if p == pid)
        rest, last_rest = process_cpu - seen, self._rest.get(pid)
        self._rest[pid] = rest
        # a thread listed last time may have ended before its CPU was first read: it has no entry
        gone = {self._last_thread[(pid, tid)][0] for tid in before - set(live) if (pid, tid) in self._last_thread}
        if last_rest is not None and rest > last_rest and len(gone) == 1:
            group = gone.pop()
            ended[group] = ended.get(group, 0.0) + rest - last_rest
        short = f"{role}/{SHORT_LIVED}"
        ended[short] = rest - sum(v for g, v in ended.items() if g != short)

    def _sample_memory(self, procs: list[dict]) -> None:
        now = time.time()
        for p in procs:
            if p["role"] == "controller":
                continue
            mem = memory_bytes(p["pid"])
            if mem is not None:
                role = self._last.get(p["pid"], (p["role"], 0.0))[0]
                self.memory.append((now, {"pid": p["pid"], "role": role, "node": p.get("node"), **mem}))

    def memory_at_peak(self, t0: float | None = None, t1: float | None = None) -> dict[int, dict]:
        """Every process's memory sample (by pid) from the pass, between two wall-clock times
        (default: the whole run), whose processes held the most together: the sum of their pss
        (vm_rss without smaps_rollup). One moment, not each process's own peak: pss divides a
        shared page among the processes mapping it at that moment, so a fork server read before
        it forks, or a keeper read once the workers are gone, holds a larger share of the same
        pages, and a sum of peaks from different moments counts those pages again."""
        passes: dict[float, dict[int, dict]] = {}
        for t, rec in self.memory:
            if (t0 is None or t >= t0) and (t1 is None or t <= t1):
                passes.setdefault(t, {})[rec["pid"]] = rec

        def held(recs: dict[int, dict]) -> int:
            return sum(r.get("pss", r["vm_rss"]) for r in recs.values())

        return max(passes.values(), key=held, default={})

    def at(self, t: float) -> dict[str, float]:
        """CPU seconds each role and thread group had used by wall-clock time `t`, interpolated
        linearly between the two samples around it (the first or last sample outside them)."""
        return cumulative_at(self.times, self.samples, t)

    def between(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds each role used between two wall-clock times (interpolated samples)."""
        if not self.times:
            return {}
        a, b = self.at(t0), self.at(t1)
        return {role: round(b.get(role, 0.0) - a.get(role, 0.0), 4) for role in b}


def cumulative_at(times: list[float], samples: list[dict[str, float]], t: float) -> dict[str, float]:
    """The cumulative sample at time `t`, linear between the samples around it (a group missing
    from a sample had used nothing by then); clamped to the first and last sample."""
    if not times:
        return {}
    i = bisect.bisect_left(times, t)
    if i == 0:
        return dict(samples[0])
    if i >= len(times):
        return dict(samples[-1])
    t0, t1, a, b = times[i - 1], times[i], samples[i - 1], samples[i]
    w = (t - t0) / (t1 - t0) if t1 > t0 else 1.0
    return {k: a.get(k, 0.0) + w * (v - a.get(k, 0.0)) for k, v in b.items()}
