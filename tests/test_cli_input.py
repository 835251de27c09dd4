"""Every input of the `leto` command that is wrong gets one line naming it and exit code 2,
never a traceback, and nothing is started, read or deleted because of it.

The commands run in a network namespace of their own where the kernel allows it, so a host name
that does not resolve is looked up without a packet leaving the machine.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import REPO

LETO = str(REPO / ".venv" / "bin" / "leto")


def _isolated() -> list[str] | None:
    """A prefix that runs a command without a network (only a loopback that is down), or None."""
    for prefix in (["unshare", "--net"], ["unshare", "--map-root-user", "--net"]):
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.TimeoutExpired):
            pass
    return None


ISOLATED = _isolated()


def leto(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([*(ISOLATED or []), LETO, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def _resume_dir(tmp: Path, record: str | None, name: str = "run") -> Path:
    run_dir = tmp / name
    run_dir.mkdir()
    if record is not None:
        (run_dir / "persist.json").write_text(record)
    return run_dir


# (arguments, what the one line must name); {tmp} is the test's folder, {file} a plain file in it.
# Unknown models, missing scripts and malformed endpoints: test_cli_errors.py, test_etcd_store.py.
CASES = [
    (["train", "--rdzv", "etcd://nohost.invalid:2379", "--job-id", "j"], "'nohost.invalid'"),
    (["train", "--rdzv", "etcd://127.0.0.1:2379,other.invalid:2379", "--job-id", "j"], "'other.invalid'"),
    (["train", "--rdzv", "etcd://127.0.0.1:2379", "--job-id", "../up"], "'../up'"),
    (["train", "--timeout", "nan"], "--timeout: 'nan'"),
    (["train", "--lr", "inf"], "--lr: 'inf'"),
    (["train", "--heartbeat-timeout=-inf"], "--heartbeat-timeout: '-inf'"),
    (["train", "--mtbf", "5 weeks"], "'5 weeks'"),
    (["train", "--ec", "3+x"], "'3+x'"),
    (["train", "--inject", "explode:rank=0:step=1"], "'explode'"),
    (["train", "--inject", "kill:rank=0:step=99", "--steps", "5"], "step 99"),
    (["train", "--seed", "-1"], "--seed"),
    (["run"], "script"),
    (["train", "--run-dir", "{file}"], "{file}"),
    (["train", "--persist", "on", "--persist-dir", "{file}", "--run-dir", "{tmp}/run"], "{file}"),
    (["bench", "recovery", "--out", "{file}"], "{file}"),
    (["train", "--resume", "{tmp}/nothing"], "{tmp}/nothing"),
    (["train", "--resume", "{tmp}/corrupt"], "{tmp}/corrupt/persist.json is corrupt"),
    (["train", "--resume", "{tmp}/unreadable"], "cannot read {tmp}/unreadable/persist.json"),
    (["train", "--resume", "{tmp}/bad-flag"], "workers='many'"),
    (["run", "--resume", "{tmp}/trained"], "`leto train"),
]


@pytest.mark.parametrize("args, named", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_bad_input_is_one_line_naming_it_and_exit_2(tmp_path: Path, args: list[str], named: str) -> None:
    if ISOLATED is None and any(a.startswith("etcd://") for a in args):
        pytest.skip("no network namespace to look names up in: the lookup would leave the machine")
    (tmp_path / "file").write_text("a plain file\n")
    _resume_dir(tmp_path, "{not json", "corrupt")
    (_resume_dir(tmp_path, None, "unreadable") / "persist.json").mkdir()
    _resume_dir(
        tmp_path,
        json.dumps({"dir": "checkpoints", "command": [], "flags": {"cmd": "train", "workers": "many"}}),
        "bad-flag",
    )
    _resume_dir(tmp_path, json.dumps({"dir": "checkpoints", "command": [], "flags": {"cmd": "train"}}), "trained")
    fill = {"{tmp}": str(tmp_path), "{file}": str(tmp_path / "file")}

    def filled(text: str) -> str:
        for key, value in fill.items():
            text = text.replace(key, value)
        return text

    res = leto(*map(filled, args), cwd=tmp_path if args[:1] == ["run"] else REPO)
    assert res.returncode == 2, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr + res.stdout, res.stderr[-3000:]
    assert lines[0].startswith(f"leto {args[0]}") and filled(named) in lines[0], lines[0]
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


@pytest.mark.parametrize("escape", ["dot-dot", "absolute", "symlink"])
def test_a_persist_json_pointing_outside_the_run_is_refused_and_nothing_there_deleted(
    tmp_path: Path, escape: str
) -> None:
    """A record that leads out of the run folder (`..`, an absolute path, a symbolic link) is
    refused; the folder it names, with a step folder `--resume` would otherwise delete as torn,
    is untouched. Given on the command line (--persist-dir), the same folder is read."""
    victim = tmp_path / "elsewhere"
    (victim / "step-00000099").mkdir(parents=True)
    (victim / "step-00000099" / "precious").write_text("not a checkpoint of this run\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    recorded = {"dot-dot": "../elsewhere", "absolute": str(victim), "symlink": "checkpoints"}[escape]
    if escape == "symlink":
        (run_dir / "checkpoints").symlink_to(victim)
    (run_dir / "persist.json").write_text(json.dumps({"dir": recorded, "command": []}))
    res = leto("train", "--resume", str(run_dir))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr[-3000:]
    assert "leads out of the run folder" in res.stderr and f"--persist-dir {victim}" in res.stderr
    assert (victim / "step-00000099" / "precious").exists()

    res = leto("train", "--resume", str(run_dir), "--persist-dir", str(victim))  # the operator's word for it
    assert res.returncode == 2 and "leads out" not in res.stderr, res.stderr[-3000:]  # (its command is not this job's)
    assert (victim / "step-00000099" / "precious").exists()


def test_a_used_run_dir_is_refused_and_its_records_kept(tmp_path: Path) -> None:
    """A new job in the run folder of an earlier one would overwrite its metrics and summary:
    it is refused with one line, and the earlier run's files are as they were."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    earlier = {"metrics.jsonl": '{"step": 1, "loss": 5.0}\n', "summary.json": '{"digest": "earlier"}'}
    for name, text in earlier.items():
        (run_dir / name).write_text(text)
    res = leto("train", "--run-dir", str(run_dir), "--steps", "2")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr[-3000:]
    assert "holds an earlier run's" in res.stderr and f"--resume {run_dir}" in res.stderr
    assert {name: (run_dir / name).read_text() for name in earlier} == earlier
    assert not (run_dir / "procs.json").exists() and not (run_dir / "config.json").exists()
