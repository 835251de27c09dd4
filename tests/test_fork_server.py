"""The host's fork server: every process of a job is forked from one interpreter that imported
torch once, and a forked process cannot tell it from a new interpreter of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO, alive, read_procs, wait_for
from leto.control.prefork import forkable

PROBE = REPO / "tests" / "scripts" / "interpreter_probe.py"


def _probe(launcher, tmp_path: Path, fork_server: str) -> tuple[dict[int, dict], list[dict]]:
    out, run_dir = tmp_path / fork_server, tmp_path / f"run-{fork_server}"
    out.mkdir()
    popen = launcher.start(
        "run",
        "--workers",
        "2",
        "--nodes",
        "2",
        "--fork-server",
        fork_server,
        "--protection",
        "off",
        "--run-dir",
        str(run_dir),
        str(PROBE),
        "--flag",
        "x",
        run_dir=run_dir,
        env=dict(os.environ, PROBE_DIR=str(out)),
    )
    procs = wait_for(lambda: len(read_procs(run_dir)) >= 3 and read_procs(run_dir), 120, "the job's processes")
    _, err = popen.communicate(timeout=240)
    assert popen.returncode == 0, err[-3000:]
    facts = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}
    for r in (0, 1):
        facts[r]["atexit_ran"] = (out / f"rank{r}.atexit").exists()
    return facts, procs


def test_a_forked_worker_sees_what_a_new_interpreter_would(launcher, tmp_path: Path) -> None:
    forked, procs = _probe(launcher, tmp_path, "on")
    execd, execd_procs = _probe(launcher, tmp_path, "off")
    server = [p for p in procs if p["role"] == "fork-server"]
    assert len(server) == 1 and not alive(server[0]["pid"])  # listed while it runs, stopped with the job
    assert not any(p["role"] == "fork-server" for p in execd_procs)
    same = ("argv", "path0", "name", "file", "main_file", "cwd", "own_session", "atexit_ran")
    for r in (0, 1):
        assert {k: forked[r][k] for k in same} == {k: execd[r][k] for k in same}
    assert forked[0]["argv"] == [str(PROBE), "--flag", "x"] and forked[0]["name"] == "__main__"
    assert forked[0]["path0"] == str(PROBE.parent) and forked[0]["own_session"]
    assert forked[1]["probe_env"] == str(tmp_path / "on")  # its environment is the job's, not the server's
    # the server's generators are not shared: each process draws its own numbers
    assert forked[0]["numpy_draw"] != forked[1]["numpy_draw"]
    assert forked[0]["random_draw"] != forked[1]["random_draw"]
    # it ends like one too: its atexit handlers run; what the server imported stays out of its
    # collections (the exec'd interpreter froze nothing)
    assert forked[0]["atexit_ran"] and forked[1]["atexit_ran"]
    assert forked[0]["frozen"] > 0 and execd[0]["frozen"] == 0


def test_a_forked_process_ends_after_its_threads_with_its_exit_code_output_and_atexit_handlers() -> None:
    script = (
        "import atexit, sys, threading, time\n"
        "from leto.control.prefork import exit_code, exit_now\n"
        "atexit.register(lambda: print('atexit ran'))\n"
        "print('buffered, not flushed')\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread done'))).start()\n"
        "try:\n"
        "    sys.exit(sys.argv[1] if sys.argv[1] == 'a message' else int(sys.argv[1]))\n"
        "except SystemExit as e:\n"
        "    exit_now(exit_code(e))\n"
    )
    for arg, code in (("0", 0), ("3", 3), ("a message", 1)):
        done = subprocess.run([sys.executable, "-c", script, arg], capture_output=True, text=True, timeout=120)
        assert done.returncode == code
        assert done.stdout == "buffered, not flushed\nthread done\natexit ran\n"  # a pipe: block-buffered
        assert done.stderr == ("a message\n" if arg == "a message" else "")


def test_only_a_plain_python_command_is_forked() -> None:
    assert forkable(["-m", "leto.training.train_gpt", "--steps", "3"]) and forkable(["train.py", "--lr", "1"])
    assert not forkable(["-X", "importtime", "train.py"]) and not forkable(["-c", "print(1)"])
    assert not forkable([]) and not forkable(["-m"])
