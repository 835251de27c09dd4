"""Parameter groups on the flat buffer: ranges of elements updated with their own
hyper-parameters, as `torch.optim` param groups (e.g. no weight decay on biases and norms).

    Trainer(model, job, AdamW(lr=6e-4, weight_decay=0.1),
            param_groups=[{"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}])

Each group is the trainer's optimizer with some fields replaced (`dataclasses.replace`); the
parameters in no group use the optimizer as given.
"""

from __future__ import annotations

import bisect
import dataclasses

import torch

from leto.training.optim import Optimizer


class ParamGroups:
    def __init__(self, params: list[torch.Tensor], default: Optimizer, groups: list[dict]) -> None:
        self.optimizers: list[Optimizer] = [default]
        group_of = {id(p): 0 for p in params}
        claimed: set[int] = set()
        for i, g in enumerate(groups, start=1):
            if "params" not in g:
                raise ValueError(f"param group {i - 1} has no 'params'")
            overrides = {k: v for k, v in g.items() if k != "params"}
            fields = {f.name for f in dataclasses.fields(default)} if dataclasses.is_dataclass(default) else set()
            unknown = sorted(set(overrides) - fields)
            if unknown:
                raise ValueError(f"param group {i - 1}: {type(default).__name__} has no field {', '.join(unknown)}")
            self.optimizers.append(dataclasses.replace(default, **overrides))
            for p in g["params"]:
                if id(p) not in group_of:
                    raise ValueError(
                        f"param group {i - 1} holds a tensor that is not a trainable parameter of the model"
                    )
                if id(p) in claimed:
                    raise ValueError(f"a parameter is in more than one param group (group {i - 1})")
                claimed.add(id(p))
                group_of[id(p)] = i
        # (start, group) of each run of consecutive flat elements in one group
        self.starts: list[int] = []
        self.group: list[int] = []
        offset = 0
        for p in params:
            gi = group_of[id(p)]
            if not self.group or self.group[-1] != gi:
                self.starts.append(offset)
                self.group.append(gi)
            offset += p.numel()
        self.numel = offset
        self._cache: dict[tuple[int, int], list[tuple[int, int, Optimizer]]] = {}

    def segments(self, offset: int, length: int) -> list[tuple[int, int, Optimizer]]:
        """(lo, hi, optimizer) covering chunk elements [0, length) whose first flat element is
        `offset`; padding past the parameters goes with the default optimizer (it stays zero)."""
        key = (offset, length)
        if key in self._cache:
            return self._cache[key]
        out: list[tuple[int, int, Optimizer]] = []
        if len(self.optimizers) == 1 or offset >= self.numel:
            out = [(0, length, self.optimizers[0])]
        else:
            i = bisect.bisect_right(self.starts, offset) - 1
            pos = offset
            end = offset + length
            while pos < min(end, self.numel):
                nxt = self.starts[i + 1] if i + 1 < len(self.starts) else self.numel
                hi = min(nxt, end)
                out.append((pos - offset, hi - offset, self.optimizers[self.group[i]]))
                pos, i = hi, i + 1
            if pos < end:
                out.append((pos - offset, length, self.optimizers[0]))
            # merge neighbours with the same optimizer (padding after a default-group run)
            merged = [out[0]]
            for lo, hi, opt in out[1:]:
                if opt is merged[-1][2]:
                    merged[-1] = (merged[-1][0], hi, opt)
                else:
                    merged.append((lo, hi, opt))
            out = merged
        self._cache[key] = out
        return out
