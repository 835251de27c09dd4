"""A deterministic, resumable sampler: the batch of (seed, step, rank, world size) is a pure function."""

from __future__ import annotations

import numpy as np
import torch

from leto.runtime.ordered import contiguous_part


def split_rows(global_rows: int, world_size: int, rank: int) -> range:
    """The rows of the global batch that `rank` trains on (contiguous, sizes differ by at most one)."""
    return contiguous_part(global_rows, world_size, rank)


class Sampler:
    """Random windows of a token array; the global batch depends only on (seed, step).

    A rank's share is a slice of the global batch, so the job can change its world size
    (shrink after a failure) and still train on exactly the same global batch.
    """

    def __init__(self, tokens: np.ndarray, block_size: int, global_rows: int, seed: int) -> None:
        if len(tokens) <= block_size + 1:
            raise ValueError(f"corpus of {len(tokens)} tokens is shorter than a block of {block_size}")
        if global_rows < 1:
            raise ValueError(f"global batch must have at least one row, got {global_rows}")
        self.tokens = tokens
        self.block_size = block_size
        self.global_rows = global_rows
        self.seed = seed

    def offsets(self, step: int) -> np.ndarray:
        rng = np.random.Generator(np.random.PCG64([self.seed, step]))
        return rng.integers(0, len(self.tokens) - self.block_size - 1, size=self.global_rows)

    def batch(self, step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(inputs, targets, weight): `weight` is this rank's share of the global batch."""
        rows = split_rows(self.global_rows, world_size, rank)
        offs = self.offsets(step)[rows.start : rows.stop]
        window = np.stack([np.asarray(self.tokens[o : o + self.block_size + 1]) for o in offs])
        t = torch.from_numpy(window.astype(np.int64))
        return t[:, :-1], t[:, 1:], self.share(rank, world_size)

    def batch_on(
        self, device: torch.device, step: int, rank: int, world_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of `batch` on `device`."""
        x, y, _ = self.batch(step, rank, world_size)
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def share(self, rank: int, world_size: int) -> float:
        """`rank`'s share of the global batch (the weight `batch` returns)."""
        return len(split_rows(self.global_rows, world_size, rank)) / self.global_rows
