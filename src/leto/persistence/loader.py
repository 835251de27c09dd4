"""Loading a persistent checkpoint into a new job (`--resume`), in any world size.

Part r of a checkpoint written by W ranks holds elements [r·S, (r+1)·S) of each of the three
unsharded state vectors (master, exp_avg, exp_avg_sq; S = that job's shard size). A rank of
the new job reads only the parts that overlap its own shard, so with the same world size it
reads exactly its own part (bit for bit, padding included) and after a shrink or grow it cuts
its shard out of the overlapping ones.

With tensor parallelism (`tp` ranks per TP group, TP innermost) the same holds per model slice:
part r holds DP shard r // tp of slice r % tp's state, and a rank reads only the parts of its
own slice; its slice's parameters are in the part of that slice's DP rank 0 (part `tp_rank`).
A checkpoint loads only into a job with the same `tp`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from leto.persistence import ckpt_format
from leto.persistence.files import read_json
from leto.persistence.writer import EXTRA
from leto.runtime import plain

if TYPE_CHECKING:
    from leto.runtime.env import Job

_ROWS = 3  # master, exp_avg, exp_avg_sq


@dataclass
class Loaded:
    """What a rank of the new job installs."""

    step: int
    shard: torch.Tensor  # [n_chunks, 3, chunk_elems] in the new job's sharding
    params: torch.Tensor  # [numel]: this rank's slice's parameters
    extra: dict  # the extra state of the same rank of the old job (its slice's DP rank 0's if it had fewer)


def resume_target(job: Job) -> tuple[Path, int] | None:
    """The checkpoint `job` starts from (set by `--resume`), and its step; None for a new job."""
    cfg = job.config.persistence
    return (Path(cfg.resume_from), cfg.start_step) if cfg.resume_from is not None else None


def _load(path: Path, sd: dict) -> dict:
    from leto.persistence import safe_dcp

    try:
        return safe_dcp.load(sd, path)
    except Exception as e:  # noqa: BLE001 - DCP raises several kinds (RuntimeError, OSError, refusals)
        raise ckpt_format.CheckpointError(f"cannot load checkpoint part {path}: {e}") from e


def _shape(path: Path, name: str, dtype: torch.dtype | None = None) -> torch.Size:
    """The size of tensor `name` in the checkpoint part `path` (CheckpointError unless it is a
    tensor, of `dtype` if given)."""
    from leto.persistence import safe_dcp

    try:
        md = safe_dcp.metadata(path).state_dict_metadata.get(name)
    except Exception as e:  # noqa: BLE001 - a missing, corrupt or refused .metadata
        raise ckpt_format.CheckpointError(f"cannot read the metadata of checkpoint part {path}: {e}") from e
    if getattr(md, "properties", None) is None or dtype not in (None, md.properties.dtype):
        raise ckpt_format.CheckpointError(f"checkpoint part {path} holds no {dtype} tensor {name!r} (another format?)")
    return md.size


def load(
    path: Path,
    step: int,
    rank: int,
    world_size: int,
    numel: int,
    n_chunks: int,
    chunk_elems: int,
    tp: int = 1,
) -> Loaded:
    """This rank's state in a job of `world_size` ranks, `tp` of them per TP group, from the
    checkpoint at `path` (`numel`, `n_chunks`: of this rank's slice, sharded over its DP group)."""
    commit = read_json(path / ckpt_format.COMMIT)
    if commit is None or commit.get("step") != step:
        raise ckpt_format.CheckpointError(f"{path} is not the complete checkpoint of step {step}")
    old_world, old_tp = int(commit["world_size"]), commit.get("tp", 1)
    if old_tp != tp:
        ck = ckpt_format.Checkpoint(path, step, old_world, str(commit.get("fingerprint")), old_tp)
        raise ckpt_format.CheckpointError(ckpt_format.tp_mismatch(ck, tp))
    dp_rank, tp_rank = divmod(rank, tp)
    dp_size, old_dp = world_size // tp, old_world // tp

    def part_of(d: int) -> Path:  # the old part holding DP shard `d` of this rank's slice
        return ckpt_format.part_dir(path, d * tp + tp_rank)

    shard_elems = n_chunks * chunk_elems
    lo, hi = dp_rank * shard_elems, min(numel, (dp_rank + 1) * shard_elems)
    rows = torch.zeros(_ROWS, shard_elems)
    old_shard = _shape(part_of(0), "state")
    old_elems = old_shard[0] * old_shard[2]
    for r in range(old_dp):
        a, b = max(lo, r * old_elems), min(hi, (r + 1) * old_elems)
        if a >= b and not (r == dp_rank and old_dp == dp_size):
            continue
        part = part_of(r)
        sd = _load(part, {"state": torch.empty(old_shard), "step": torch.tensor(-1, dtype=torch.int64)})
        if int(sd["step"]) != step:
            raise ckpt_format.CheckpointError(f"{part} holds step {int(sd['step'])}, expected {step}")
        src = sd["state"].transpose(0, 1).reshape(_ROWS, -1)
        if old_dp == dp_size and old_elems == shard_elems:  # the same sharding: the part, bit for bit
            rows.copy_(src)
            break
        rows[:, a - lo : b - lo] = src[:, a - r * old_elems : b - r * old_elems]
    shard = rows.view(_ROWS, n_chunks, chunk_elems).transpose(0, 1).contiguous()
    params = _load(part_of(0), {"params": torch.empty(numel)})["params"]
    own = rank if rank < old_world else tp_rank
    own_part = ckpt_format.part_dir(path, own)
    blob = _load(own_part, {EXTRA: torch.empty(_shape(own_part, EXTRA, torch.uint8), dtype=torch.uint8)})[EXTRA]
    try:
        extra = plain.loads(blob.numpy().tobytes(), f"the extra state in {own_part}")
    except plain.NotPlainData as e:
        raise ckpt_format.CheckpointError(str(e)) from None
    if not isinstance(extra, dict):
        raise ckpt_format.CheckpointError(f"the extra state in {own_part} is not a dict")
    return Loaded(step, shard, params, extra)
