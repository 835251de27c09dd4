"""Nothing that arrives from another process or from a file runs code when it is read: a rank's
registered state and a checkpoint's files are tensors and plain data, decoded by restricted
readers. Each hostile payload below would run `touch MARKER` if it were unpickled; the marker
must never appear, and the error must name what was refused."""

from __future__ import annotations

import io
import os
import pickle
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from conftest import REPO, Launcher, train
from leto.persistence import ckpt_format, safe_dcp
from leto.runtime import plain
from leto.training.rank_state import RankState

SMALL = (
    "--workers",
    "2",
    "--nodes",
    "1",
    "--spares",
    "0",
    "--steps",
    "6",
    "--seed",
    "0",
    "--persist-every",
    "2",
    "--protection",
    "off",
    "--persist",
    "on",
)


class Evil:
    """Unpickled, it runs a shell command that creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def torch_saved(obj: object) -> bytes:
    f = io.BytesIO()
    torch.save(obj, f)
    return f.getvalue()


def test_bytes_from_a_peer_that_would_run_code_are_refused(tmp_path: Path) -> None:
    """The decoder of what ranks send each other (rank_state's all-gather and recovery broadcast)."""
    marker = tmp_path / "ran"
    for payload in (torch_saved({"buffers": None, "user": {"loader": Evil(marker)}}), pickle.dumps(Evil(marker))):
        with pytest.raises(plain.NotPlainData, match="the state rank 1 sent"):
            plain.loads(payload, "the state rank 1 sent")
    with pytest.raises(plain.NotPlainData, match="posix.system"):
        plain.loads(torch_saved([Evil(marker)]), "x")
    assert not marker.exists()
    state = {"n": 3, "order": [2, 0, 1], "name": "kjv", "w": torch.arange(4.0), "seen": (1, None, b"\x00", 0.5)}
    assert repr(plain.loads(plain.dumps(state), "x")) == repr(state)


class Holder:
    def __init__(self, state: object) -> None:
        self.state = state

    def state_dict(self) -> object:
        return {"pos": 0, "extra": self.state}

    def load_state_dict(self, state: object) -> None:
        pass


@pytest.mark.parametrize(
    "value, named",
    [(lambda: 0, "function"), ({1, 2}, "set"), (Evil(Path("/nonexistent")), "Evil"), (torch.Generator(), "Generator")],
)
def test_registering_state_that_is_not_plain_data_fails_at_registration(value: object, named: str) -> None:
    rs = RankState(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=rf"state 'loader': state_dict\(\)\['extra'\] is of type \S*{named}"):
        rs.register("loader", Holder(value))
    assert not rs.active
    rs.register("loader", Holder({"epoch": 1, "perm": torch.randperm(5), "files": ["a", "b"]}))
    assert rs.active


def test_a_rogue_peer_sending_code_stops_the_job_with_a_clear_error(launcher: Launcher, tmp_path: Path) -> None:
    """Rank 1 of a real job sends a pickle that would run `touch` in place of its state: the
    other ranks refuse it, naming the sender and the refused global, and nothing runs."""
    marker = tmp_path / "ran"
    run_dir = tmp_path / "run"
    res = launcher.run(
        "run",
        "--run-dir",
        str(run_dir),
        "--workers",
        "2",
        "--spares",
        "0",
        "--persist",
        "off",
        str(REPO / "tests" / "scripts" / "rogue_peer.py"),
        "--marker",
        str(marker),
        run_dir=run_dir,
    )
    assert res.returncode != 0
    assert "the state rank 1 sent at step 4 is not tensors and plain data" in res.stderr, res.stderr[-3000:]
    assert "posix.system" in res.stderr
    assert not marker.exists()


@pytest.fixture(scope="module")
def persisted_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A failure-free SMALL run with its checkpoints (each test alters a copy)."""
    tmp = tmp_path_factory.mktemp("persisted")
    lx = Launcher(tmp)
    try:
        res, _ = train(lx, tmp / "run", *SMALL)
        assert res.returncode == 0, res.stderr[-3000:]
        yield tmp / "run"
    finally:
        lx.cleanup()


def _rewrite_parts(run_dir: Path, change) -> ckpt_format.Checkpoint:
    """Rewrite every part of the newest checkpoint with `change(part folder, state dict)` and record
    the new files' checksums (an attacker who can write the folder can write its markers too)."""
    ck = ckpt_format.complete(run_dir / "checkpoints")[0]
    for r in range(ck.world_size):
        part = ckpt_format.part_dir(ck.path, r)
        md = safe_dcp.metadata(part).state_dict_metadata
        sd = safe_dcp.load({k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.items()}, part)
        change(part, sd)
        ckpt_format.mark_part(ck.path, r, ck.step, ck.world_size, ck.fingerprint)
    ckpt_format.verify(ck)
    return ck


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("where", ["extra", "metadata"])
def test_a_checkpoint_that_would_run_code_is_refused_on_resume(
    launcher: Launcher, tmp_path: Path, persisted_run: Path, where: str
) -> None:
    """The newest checkpoint's extra state (the blob beside the tensors), or DCP's own `.metadata`
    (which DCP reads with pickle), is replaced by a pickle that runs `touch`: `--resume` stops
    with one line naming the refused global, no traceback, and nothing runs."""
    import torch.distributed.checkpoint as dcp

    run_dir, marker = tmp_path / "run", tmp_path / "ran"
    shutil.copytree(persisted_run, run_dir)

    def change(part: Path, sd: dict) -> None:
        if where == "extra":
            sd["extra"] = torch.frombuffer(
                bytearray(torch_saved({"buffers": {}, "user": Evil(marker)})), dtype=torch.uint8
            )
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(part), overwrite=True), no_dist=True)
        if where == "metadata":
            (part / ".metadata").write_bytes(pickle.dumps(Evil(marker)))

    ck = _rewrite_parts(run_dir, change)
    res, _ = train(launcher, run_dir, "--resume", str(run_dir), *SMALL)
    assert res.returncode != 0
    refused = {
        "extra": f"the extra state in {ck.path}/rank",
        "metadata": "its DCP .metadata names posix.system, which is not checkpoint metadata; refused",
    }[where]
    out = res.stdout + res.stderr
    assert refused in out and "posix.system" in out, out[-3000:]
    assert "leto: cannot recover: rank " in out and "cannot resume" in out, out[-3000:]
    assert "Traceback" not in out and "--resume" not in out, out[-3000:]  # nor a hint to resume from it again
    assert not marker.exists()
