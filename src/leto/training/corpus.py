"""The training corpus: the King James Bible (public domain) from Debian's package registry.

`prepare()` runs at install time (`leto data prepare`): it downloads the Debian packages
`bible-kjv-text` (the text) and `bible-kjv` (its reader) with `apt-get download`, extracts
them into the data directory without installing anything system-wide, dumps the whole text and
stores it as byte-level tokens. Training only reads the prepared file; nothing is downloaded
at run time.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

PACKAGES = ("bible-kjv-text", "bible-kjv")
TOKENS_FILE = "kjv.u8"
META_FILE = "kjv.json"
_VERSE_REF = re.compile(r"^[1-3]?[A-Za-z]+\d+:\d+ ", re.MULTILINE)


class CorpusError(RuntimeError):
    """The corpus is missing or could not be prepared."""


def data_dir() -> Path:
    """Where prepared data lives: $LETO_DATA_DIR, else ~/.cache/leto."""
    return Path(os.environ.get("LETO_DATA_DIR") or Path.home() / ".cache" / "leto")


def load_tokens(directory: Path | None = None) -> np.ndarray:
    """The prepared corpus as a read-only uint8 memory map of byte tokens."""
    path = (directory or data_dir()) / TOKENS_FILE
    if not path.exists():
        raise CorpusError(f"corpus not prepared: {path} is missing; run `leto data prepare` first")
    return np.memmap(path, dtype=np.uint8, mode="r")


def _run(cmd: list[str], cwd: Path, what: str) -> str:
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CorpusError(f"{what} failed: {e}") from e
    if proc.returncode != 0:
        raise CorpusError(f"{what} failed (exit {proc.returncode}): {proc.stderr.strip()[-400:]}")
    return proc.stdout


def _download(workdir: Path) -> None:
    try:
        _run(["apt-get", "download", *PACKAGES], workdir, "apt-get download")
    except CorpusError:
        # a fresh machine may have no package lists yet
        _run(["apt-get", "update", "-q"], workdir, "apt-get update")
        _run(["apt-get", "download", *PACKAGES], workdir, "apt-get download")


def prepare(directory: Path | None = None, force: bool = False) -> Path:
    """Fetch and tokenize the corpus into `directory`; idempotent. Returns the token file."""
    out = directory or data_dir()
    target = out / TOKENS_FILE
    if target.exists() and not force:
        return target
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="leto-corpus-") as tmp:
        work = Path(tmp)
        _download(work)
        debs = sorted(work.glob("*.deb"))
        if len(debs) != len(PACKAGES):
            raise CorpusError(f"expected {len(PACKAGES)} .deb files, got {[d.name for d in debs]}")
        root = work / "root"
        for deb in debs:
            _run(["dpkg-deb", "-x", str(deb), str(root)], work, f"dpkg-deb -x {deb.name}")
        reader = root / "usr" / "bin" / "bible"
        text = _run([str(reader), "-f", "-p", str(root / "usr" / "lib"), "Gen1:1-Rev22:21"], work, "bible")
    text = _VERSE_REF.sub("", text)
    if len(text) < 1_000_000:
        raise CorpusError(f"corpus too short ({len(text)} bytes): the reader's output was unexpected")
    data = text.encode("utf-8")
    tmp_target = target.with_suffix(".tmp")
    tmp_target.write_bytes(data)
    os.replace(tmp_target, target)
    meta = {
        "source": "Debian packages " + ", ".join(PACKAGES),
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "tokenizer": "bytes (vocab 256)",
    }
    (out / META_FILE).write_text(json.dumps(meta, indent=1))
    return target


def remove(directory: Path | None = None) -> None:
    """Delete the prepared corpus."""
    shutil.rmtree(directory or data_dir(), ignore_errors=True)
