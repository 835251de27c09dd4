"""A tensor-parallel rank's flat buffers against the whole model: which of its elements a global
norm counts, and the plain model's flat state reassembled from every TP rank's."""

from __future__ import annotations

import torch
import torch.nn as nn

from leto.training.tensor_parallel import Sharded, TPGroup, set_tp_group, tp_layout, unshard


class SliceLayout:
    """The trainable parameters of a TP rank's model slice, in flat-buffer order: name, shape
    and how each is split over the TP ranks (None: replicated)."""

    def __init__(self, model: nn.Module, params: list[torch.Tensor], tp_rank: int, tp: int) -> None:
        layout = tp_layout(model)
        trained = {id(p) for p in params}
        self.entries: list[tuple[str, torch.Size, Sharded | None]] = [
            (name, p.shape, layout[name]) for name, p in model.named_parameters() if id(p) in trained
        ]
        self.model, self.tp_rank, self.tp = model, tp_rank, tp

    def join(self, group: TPGroup, adopt: bool) -> None:
        """Train with `group`, a (re)built TP group: the model's parallel layers point at it and
        this slice is its rank's (`adopt`: a shadow taking over another coordinate)."""
        set_tp_group(self.model, group, adopt)
        self.tp_rank = group.rank

    def norm_mask(self, size: int, device: torch.device) -> torch.Tensor | None:
        """1.0 where an element of this rank's flat buffer (`size` elements, padded) counts in a
        global norm, else 0.0: sharded parameters on every TP rank, replicated ones on TP rank 0
        only; None on TP rank 0, where everything counts."""
        if self.tp_rank == 0:
            return None
        mask = torch.zeros(size, dtype=torch.float64, device=device)
        offset = 0
        for _, shape, spec in self.entries:
            n = shape.numel()
            if spec is not None:
                mask[offset : offset + n] = 1.0
            offset += n
        return mask

    def unshard_flat(self, flats: list[torch.Tensor]) -> torch.Tensor:
        """The plain model's flat tensor (its parameters in order) from every TP rank's flat one,
        in TP rank order: sharded parameters reassembled, replicated ones from TP rank 0."""
        sizes = [shape.numel() for _, shape, _ in self.entries]
        per_rank = [f[: sum(sizes)].split(sizes) for f in flats]
        out = []
        for i, (_, shape, spec) in enumerate(self.entries):
            if spec is None:
                out.append(per_rank[0][i])
            else:
                out.append(unshard([r[i].view(shape) for r in per_rank], spec).reshape(-1))
        return torch.cat(out)

    def gather(self, state: dict[str, torch.Tensor], group: TPGroup) -> dict[str, torch.Tensor]:
        """The plain model's flat state from this rank's `state` (flat tensors of one size, each
        over this slice's parameters) and its TP peers' (a collective of the TP group)."""
        local = torch.stack([t.reshape(-1) for t in state.values()])
        out = torch.empty(group.world_size, *local.shape, dtype=local.dtype, device=local.device)
        group.all_gather(out.view(-1), local.view(-1))
        return {name: self.unshard_flat([out[r, i] for r in range(group.world_size)]) for i, name in enumerate(state)}
