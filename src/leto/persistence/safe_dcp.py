"""Loading a DCP checkpoint folder without letting its files run code.

DCP itself is not safe to point at an untrusted folder: `FileSystemReader.read_metadata` reads
`.metadata` with `pickle.load`, and the default planner decodes every non-tensor item with
`torch.load(weights_only=False)`. Here the metadata is unpickled by an unpickler that builds
only DCP's own metadata classes (and torch's dtypes, sizes and layouts), and any non-tensor item
is refused: Leto's checkpoints hold tensors only (what is not a tensor travels as the bytes of a
uint8 tensor, decoded by `leto.runtime.plain`). Tensors are read by DCP with
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.utils import CheckpointException

_META = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_META, n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpoint(Exception):
    """A checkpoint file that names something other than plain metadata and tensors."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"its DCP .metadata names {module}.{name}, which is not checkpoint metadata; refused")


class SafeReader(FileSystemReader):
    """A FileSystemReader whose `.metadata` cannot run code when read."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = Path(self._get_metadata_path(rank))
        with open(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except UnsafeCheckpoint:
                raise
            except Exception as e:  # noqa: BLE001 - a torn or foreign file: one clear error
                raise UnsafeCheckpoint(f"its DCP .metadata cannot be read ({type(e).__name__}: {e})") from None
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpoint(f"its DCP .metadata holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorsOnlyPlanner(DefaultLoadPlanner):
    """A load planner that refuses non-tensor items (DCP would `torch.load` them unrestricted)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise UnsafeCheckpoint(f"its item {read_item.dest_index.fqn!r} is not a tensor; refused")


def unwrap(e: BaseException) -> BaseException:
    """The error behind DCP's CheckpointException (a BaseException, which would pass through an
    `except Exception`), or `e` itself."""
    if isinstance(e, CheckpointException):
        for exc, _trace in e.failures.values():
            return exc if isinstance(exc, Exception) else RuntimeError(str(exc))
        return RuntimeError("DCP failed without naming an error")
    return e


def metadata(path: Path) -> Metadata:
    """The DCP metadata of the checkpoint folder `path`, read safely."""
    return SafeReader(str(path)).read_metadata()


def load(sd: dict, path: Path) -> dict:
    """Fill the tensors of `sd` from the one-process DCP checkpoint in `path` (tensors only);
    DCP's errors are raised as the error behind them."""
    try:
        dcp_load(sd, storage_reader=SafeReader(str(path)), planner=TensorsOnlyPlanner(), no_dist=True)
    except CheckpointException as e:
        raise unwrap(e) from None
    return sd
