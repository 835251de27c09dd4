"""The mesh of a benchmark job: the model's elements against one rank's slice of it.

Each rank's protected state is its ZeRO-1 shard of its slice (its pipeline stage's part, cut for
its TP coordinate). The slices of a TP group hold the sharded parameters once and the replicated
ones (embeddings, LayerNorms, biases of the row-parallel layers) once per TP rank; with pipeline
stages the last stage also holds its own copy of the tied embedding, and every rank's shard is
laid out for the largest stage's slice (one protection geometry for the whole job), so a smaller
stage's shard is padded. The benchmarks charge protection per element of the model too, so what
replication and padding add is counted, not hidden in a per-shard figure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leto.errors import UsageError
from leto.runtime.mesh import layout_problem
from leto.training.model import GPT, PRESETS, tensor_parallel_gpt
from leto.training.pipeline import GPTStage
from leto.training.tensor_parallel import PendingGroup, tp_layout


@dataclass(frozen=True)
class MeshElements:
    """Trainable elements of `model` cut into `len(stages)` pipeline stages of `tp` slices."""

    tp: int
    model: int  # the plain model's
    stages: tuple[tuple[int, int], ...]  # per stage: (one TP rank's slice, of it replicated on every TP rank)
    tied: int = 0  # the last stage's copy of the tied embedding, on each of its TP ranks (0 with one stage)

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def replica_ranks(self) -> int:
        return self.tp * self.pp

    @property
    def slice(self) -> int:
        """The largest stage's slice: every rank's shard is laid out for this many elements."""
        return max(n for n, _ in self.stages)

    @property
    def replicated(self) -> int:
        """Of `slice`, the elements every TP rank holds too (0 with tp 1)."""
        return max(self.stages)[1]

    @property
    def sharded(self) -> int:
        """Of `slice`, this TP rank's part of the parameters split over the TP group."""
        return self.slice - self.replicated

    @property
    def held(self) -> int:
        """The elements one model replica's ranks hold together."""
        return self.tp * sum(n for n, _ in self.stages)

    @property
    def copies(self) -> int:
        """Of `held`, the elements beyond the model's own: replicated parameters on the other TP
        ranks, the last stage's copy of the tied embedding."""
        return self.held - self.model

    @property
    def stage_padding(self) -> int:
        """The elements one replica's shards are laid out for beyond `held`: each smaller
        stage's slice padded to the largest."""
        return self.replica_ranks * self.slice - self.held


def _trained(module: torch.nn.Module) -> tuple[int, int]:
    """(trainable elements, of them not split over TP) of a module cut for one TP rank."""
    split = tp_layout(module)
    trained = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    return sum(p.numel() for _, p in trained), sum(p.numel() for n, p in trained if split.get(n) is None)


def mesh_elements(model: str, tp: int = 1, pp: int = 1) -> MeshElements:
    """The elements of the built-in GPT preset `model` and of its slices (on the meta device:
    shapes only), each stage cut as the trainer cuts it (`GPTStage` of the TP-cut model).
    ValueError if the model does not split over `tp` ranks or into `pp` stages."""
    stages, tied = [], 0
    with torch.device("meta"):
        total = _trained(GPT(PRESETS[model]))[0]
        for s in range(pp):
            sizes = set()
            for tp_rank in range(tp):
                gpt = GPT(PRESETS[model])
                if tp > 1:
                    tensor_parallel_gpt(gpt, PendingGroup(tp_rank, tp))
                stage = GPTStage(gpt, s, pp) if pp > 1 else gpt
                sizes.add(_trained(stage))
                if pp > 1 and s == pp - 1:
                    tied = stage.wte.weight.numel()
            if len(sizes) != 1:
                raise ValueError(f"the TP slices of {model}'s stage {s} differ in size: {sorted(sizes)}")
            ((slice_, replicated),) = sizes
            stages.append((slice_, replicated if tp > 1 else 0))
    return MeshElements(tp, total, tuple(stages), tied)


def mesh_flags(tp: int, pp: int = 1) -> str:
    """The mesh as the command line says it: "--tp 2 --pp 2" (the flags above 1)."""
    return " ".join(f"--{k} {v}" for k, v in (("tp", tp), ("pp", pp)) if v != 1)


def mesh_shape(workers: int, tp: int, pp: int = 1) -> str:
    """ "DP 2 x PP 2 x TP 2" (the axes above 1 besides DP)."""
    return " x ".join([f"DP {workers // (tp * pp)}", *(f"{k} {v}" for k, v in (("PP", pp), ("TP", tp)) if v > 1)])


def shard_accounting(elements: MeshElements, workers: int, chunk_elems: int) -> dict:
    """Per rank and per element of the model, what the job's ZeRO-1 shards hold, for `workers`
    ranks and chunks of `chunk_elems` elements: every shard is laid out for the largest stage's
    slice over its DP group and padded to whole chunks. Protected elements = the model's +
    copies + stage padding + chunk padding."""
    dp = workers // elements.replica_ranks
    n_chunks = -(-elements.slice // (dp * chunk_elems))
    shard = n_chunks * chunk_elems
    protected = workers * shard
    return {
        "tp": elements.tp,
        "pp": elements.pp,
        "dp": dp,
        "model_elements": elements.model,
        "stage_slice_elements": [n for n, _ in elements.stages],
        "stage_replicated_elements": [r for _, r in elements.stages],
        "tied_copy_elements": elements.tied,
        "slice_elements": elements.slice,
        "replicated_elements_per_slice": elements.replicated,
        "copies_elements": elements.copies,
        "stage_padding_elements": elements.stage_padding,
        "chunk_padding_elements": protected - elements.replica_ranks * elements.slice,
        "shard_elements_per_rank": shard,
        "protected_elements": protected,
        "protected_per_model_element": round(protected / elements.model, 4),
    }


def check_mesh(model: str, workers: int, nodes: int, tp: int, pp: int = 1) -> str | None:
    """Why `workers` ranks on `nodes` nodes cannot train `model` in replicas of `pp` stages of
    `tp` ranks, or None."""
    problem = layout_problem(workers, nodes, tp, pp)
    if problem is None:
        try:
            mesh_elements(model, tp, pp)
        except ValueError as e:
            problem = f"{mesh_flags(tp, pp)}: {e}"
    return problem


def mesh_of(args: object) -> tuple[int, int]:
    """(--tp, --pp) of a benchmark's arguments, 1 where not given."""
    return tuple(1 if getattr(args, k, None) is None else getattr(args, k) for k in ("tp", "pp"))  # type: ignore[return-value]


def refuse_tp(args: object, bench: str) -> None:
    """A benchmark that runs only data-parallel jobs refuses a model-parallel mesh (`--tp` or
    `--pp` > 1) rather than ignore it."""
    tp, pp = mesh_of(args)
    if (tp, pp) != (1, 1):
        raise UsageError(
            f"leto bench {bench}: error: {mesh_flags(tp, pp)}: this benchmark runs data-parallel jobs only; "
            "`leto bench overhead` and `leto bench recovery` take --tp and --pp"
        )
