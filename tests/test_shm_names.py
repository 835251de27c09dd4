"""/dev/shm names: each job's files are its own. Stopping job `exp` (host 0: files of `exp-h0`)
never removes job `exp-h0`'s (host 0: `exp-h0-h0`); a segment or owner record that exists
already (another job of that id, or a file or link someone else made) is refused with one clear
error, and nothing is written through a link. Real files in /dev/shm, removed afterwards."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from leto.config import JobConfig
from leto.control.supervisor import Supervisor
from leto.protection import shm
from leto.protection.layout import Geometry, Layout

LAYOUT = Layout(0, 0, Geometry(n_chunks=2, chunk_elems=16), (0, 1), (1, 1), replicated_grads=True)


@pytest.fixture
def base() -> Iterator[str]:
    """A job id no other test or job uses; every /dev/shm file naming it is removed at the end."""
    tag = f"t{uuid.uuid4().hex[:10]}"
    try:
        yield tag
    finally:
        for name in os.listdir(shm.SHM_DIR):
            if name.startswith(f"leto-{tag}"):
                (shm.SHM_DIR / name).unlink(missing_ok=True)


def test_a_supervisor_removes_its_jobs_segments_not_a_job_whose_id_extends_it(base: str, tmp_path: Path) -> None:
    """Job `<base>` on host 0 is `<base>-h0`; job `<base>-h0` on host 0 is `<base>-h0-h0`: the
    first's name is a prefix of the second's, but when the first host's supervisor ends its job
    (here: fenced) it removes only its own files."""
    mine, theirs = f"{base}-h0", f"{base}-h0-h0"
    regions = {job: [shm.Region(LAYOUT, job, n, create=True) for n in (0, 1)] for job in (mine, theirs)}
    for job in (mine, theirs):
        shm.write_owner(job, os.getpid())
    try:
        assert [p.name for p in shm.job_files(mine)] == sorted(
            [f"leto-{mine}-g0-n0", f"leto-{mine}-g0-n1", f"leto-{mine}-owner"]
        )
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
        Supervisor(store, JobConfig(run_dir=str(tmp_path)), f"127.0.0.1:{store.port}", mine, node=0).fence()
        assert shm.job_files(mine) == []
        assert [p.name for p in shm.job_files(theirs)] == sorted(
            [f"leto-{theirs}-g0-n0", f"leto-{theirs}-g0-n1", f"leto-{theirs}-owner"]
        )
        assert all(r.path.exists() for r in regions[theirs])
        # and a worker of the job left opens its keeper's region by the same name
        again = shm.Region(LAYOUT, theirs, 1, create=False)
        assert again.path == regions[theirs][1].path and again.nbytes == regions[theirs][1].nbytes
        again.close()
    finally:
        for rs in regions.values():
            for r in rs:
                r.close()


def test_a_segment_that_exists_already_is_refused_by_name(base: str) -> None:
    """Someone made the file the keeper of node 0 must create: the keeper refuses with one line
    naming the file, and the file's content is left alone."""
    job = f"{base}-h0"
    taken = shm.SHM_DIR / shm.region_name(job, 0, 0)
    taken.write_bytes(b"not yours")
    with pytest.raises(shm.NameTaken, match=f"{taken}.* exists already"):
        shm.Region(LAYOUT, job, 0, create=True)
    assert taken.read_bytes() == b"not yours"
    # a region is created for this user alone
    region = shm.Region(LAYOUT, job, 1, create=True)
    try:
        assert os.stat(region.path).st_mode & 0o777 == 0o600
    finally:
        region.close()


def test_an_owner_record_is_never_written_through_a_link(base: str, tmp_path: Path) -> None:
    """A link placed where the supervisor writes its owner record (to a file of the user's): the
    supervisor refuses, naming the link, and the file it points to is unchanged; a start that
    cleans up dead jobs' files does not follow it either."""
    job = f"{base}-h1"
    precious = tmp_path / "precious"
    precious.write_text("keep me")
    link = shm.owner_path(job)
    link.symlink_to(precious)
    region = shm.SHM_DIR / shm.region_name(job, 0, 1)
    region.write_bytes(b"")
    with pytest.raises(shm.NameTaken, match=f"{link} exists already \\(a symbolic link"):
        shm.write_owner(job, os.getpid())
    assert precious.read_text() == "keep me"
    shm.remove_dead_segments()  # whose the region is cannot be read through a link: it is kept
    assert region.exists() and precious.read_text() == "keep me"


def test_a_dead_jobs_files_go_and_only_exactly_its_own(base: str) -> None:
    """The owner of `<base>-h0` is dead, the owner of `<base>-h0-h0` alive (this process): the
    clean-up at a start removes the first job's files only."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    gone, alive = f"{base}-h0", f"{base}-h0-h0"
    (shm.SHM_DIR / f"leto-{gone}-owner").write_text(f'{{"pid": {dead.pid}, "start": "1"}}')
    shm.write_owner(alive, os.getpid())
    for job in (gone, alive):
        (shm.SHM_DIR / shm.region_name(job, 3, 0)).write_bytes(b"")
    removed = shm.remove_dead_segments()
    assert {f"leto-{gone}-owner", f"leto-{gone}-g3-n0"} <= set(removed)
    assert [p.name for p in shm.job_files(gone)] == []
    assert [p.name for p in shm.job_files(alive)] == sorted([f"leto-{alive}-g3-n0", f"leto-{alive}-owner"])


@pytest.mark.parametrize(
    "job, ok",
    [("exp", True), ("a_b.c-9", True), ("", False), ("a/b", False), ("a b", False), ("x" * 65, False), ("é", False)],
)
def test_a_job_id_is_a_plain_name(job: str, ok: bool) -> None:
    assert (shm.check_job_id(job) is None) == ok
