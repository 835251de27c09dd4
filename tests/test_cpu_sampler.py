"""The CPU sampler attributes a keeper's CPU to its threads by their OS names."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from leto.bench.cpu import CpuSampler, thread_group

BURNER = """
import threading, time
from leto.runtime import linux
def spin(name, seconds):
    linux.name_thread(name)
    end = time.process_time() + seconds  # CPU seconds of the whole process: good enough to keep busy
    while time.process_time() < end:
        pass
linux.name_thread("leto-keeper")
t = threading.Thread(target=spin, args=("keeper-send", 0.6))
t.start(); t.join()
spin("leto-keeper", 0.3)
print("done", flush=True)
time.sleep(30)
"""


def test_thread_names_map_to_what_the_threads_do() -> None:
    assert thread_group("gloo_tcp_loop") == thread_group("pt_gloo_runloop") == "gloo"
    assert thread_group("keeper-send") == thread_group("keeper-recv") == "tier2-threads"
    assert thread_group("leto-keeper") == "main"
    assert thread_group("leto-protect-x") == "protection"  # a thread protection adds to a worker
    assert thread_group("python3") == "other"


def test_a_keepers_cpu_is_split_by_thread_and_adds_up(tmp_path: Path) -> None:
    p = subprocess.Popen([sys.executable, "-c", BURNER], stdout=subprocess.PIPE, text=True)
    try:
        (tmp_path / "procs.json").write_text(json.dumps([{"role": "keeper", "pid": p.pid}]))
        with CpuSampler(tmp_path, every_s=0.02) as sampler:
            t0 = time.time()
            assert p.stdout is not None and p.stdout.readline().strip() == "done"
            time.sleep(0.1)  # one more sample after the work
            used = sampler.between(t0 - 1.0, time.time())
        assert used["keeper"] > 0.5
        assert used["keeper/tier2-threads"] > 0.3  # the thread named keeper-send
        assert used["keeper/main"] > 0.1
        parts = sum(v for k, v in used.items() if k.startswith("keeper/"))
        assert abs(parts - used["keeper"]) < 0.05  # the groups account for the process's CPU
    finally:
        p.kill()
        p.wait()


def test_a_thread_that_ends_before_its_cpu_is_first_read_is_no_error(tmp_path: Path, monkeypatch) -> None:
    """A thread listed in one sample whose CPU could not be read (it ended in between) and that
    is gone at the next sample leaves the sampler running: its CPU lands in the process's rest."""
    from leto.bench import cpu

    listings = iter([{10: "leto-keeper", 11: "keeper-send"}, {10: "leto-keeper"}])
    monkeypatch.setattr(cpu, "_threads", lambda pid: next(listings))
    monkeypatch.setattr(cpu, "thread_cpu_seconds", lambda pid, tid: 1.0 if tid == 10 else None)
    sampler = CpuSampler(tmp_path)
    sampler._sample_threads(10, "keeper", 1.5)
    sampler._sample_threads(10, "keeper", 2.0)  # thread 11 gone, never read
    assert sampler._ended[10]["keeper/short-lived"] == 1.0  # 2.0 of the process, 1.0 of its one thread
