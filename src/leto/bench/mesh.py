"""The mesh of a benchmark job: the model's elements against one tensor-parallel rank's slice.

Each rank's protected state is its ZeRO-1 shard of its TP slice; the slices of a TP group hold
the sharded parameters once and the replicated ones (embeddings, LayerNorms, biases of the
row-parallel layers) once per TP rank. The benchmarks charge protection per element of the model
too, so what replication adds is counted, not hidden in a per-shard figure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leto.errors import UsageError
from leto.runtime.mesh import layout_problem
from leto.training.model import GPT, PRESETS, tensor_parallel_gpt
from leto.training.tensor_parallel import PendingGroup, tp_layout


@dataclass(frozen=True)
class MeshElements:
    """Trainable elements of `model` cut into `tp` slices."""

    tp: int
    model: int  # the plain model's
    slice: int  # one TP rank's (the same on every TP rank)
    replicated: int  # of `slice`, held by every TP rank too (0 with tp 1: nothing is held twice)

    @property
    def sharded(self) -> int:
        """Of `slice`, this TP rank's part of the parameters split over the TP group."""
        return self.slice - self.replicated


def mesh_elements(model: str, tp: int = 1) -> MeshElements:
    """The elements of the built-in GPT preset `model` and of its TP slices (on the meta device:
    shapes only). ValueError if the model does not split over `tp` ranks."""
    sizes = set()
    with torch.device("meta"):
        total = sum(p.numel() for p in GPT(PRESETS[model]).parameters() if p.requires_grad)
        for tp_rank in range(tp):
            gpt = GPT(PRESETS[model])
            if tp > 1:
                tensor_parallel_gpt(gpt, PendingGroup(tp_rank, tp))
            split = tp_layout(gpt)
            trained = [(n, p) for n, p in gpt.named_parameters() if p.requires_grad]
            sizes.add((sum(p.numel() for _, p in trained), sum(p.numel() for n, p in trained if split.get(n) is None)))
    if len(sizes) != 1:
        raise ValueError(f"the TP slices of {model} differ in size: {sorted(sizes)}")
    ((slice_, replicated),) = sizes
    return MeshElements(tp, total, slice_, replicated if tp > 1 else 0)


def check_mesh(model: str, workers: int, nodes: int, tp: int) -> str | None:
    """Why `workers` ranks on `nodes` nodes cannot train `model` with TP groups of `tp`, or None."""
    problem = layout_problem(workers, nodes, tp)
    if problem is None:
        try:
            mesh_elements(model, tp)
        except ValueError as e:
            problem = f"--tp {tp}: {e}"
    return problem


def refuse_tp(args: object, bench: str) -> None:
    """A benchmark that runs only data-parallel jobs refuses `--tp` > 1 rather than ignore it."""
    tp = getattr(args, "tp", None) or 1
    if tp > 1:
        raise UsageError(
            f"leto bench {bench}: error: --tp {tp}: this benchmark runs data-parallel jobs only; "
            "`leto bench overhead` and `leto bench recovery` take --tp"
        )
