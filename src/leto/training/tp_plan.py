"""A tensor-parallel plan by module names, in the shape of PyTorch's `parallelize_module` plans:
`{"blocks.*.fc": "colwise", "blocks.*.proj": "rowwise"}` cuts the named `nn.Linear`s into
`ColumnParallelLinear` / `RowParallelLinear` (`training/tensor_parallel.py`), Leto's layers,
whose collectives run over a group Leto rebuilds in place (docs/design.md, "Mesh")."""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Literal

import torch.nn as nn

from leto.training.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TPGroup


@dataclass(frozen=True)
class Colwise:
    """Split the output features ("colwise"); `parts` > 1 for a fused projection whose output is
    `parts` equal blocks (3 for [q; k; v]), each split on its own."""

    parts: int = 1


@dataclass(frozen=True)
class Rowwise:
    """Split the input features ("rowwise"); the partial results are summed over the TP group."""


Style = Literal["colwise", "rowwise"] | Colwise | Rowwise
_NAMED = {"colwise": Colwise(), "rowwise": Rowwise()}


def _matches(pattern: str, name: str) -> bool:
    """`*` and `?` match within one dotted part of a module name, as in PyTorch's plans."""
    parts, atoms = pattern.split("."), name.split(".")
    return len(parts) == len(atoms) and all(fnmatchcase(a, p) for p, a in zip(parts, atoms))


def _style(pattern: str, style: Style) -> Colwise | Rowwise:
    if isinstance(style, Colwise | Rowwise):
        return style
    if style not in _NAMED:
        raise ValueError(f"plan entry {pattern!r}: style {style!r} is neither 'colwise' nor 'rowwise'")
    return _NAMED[style]


def parallelize(model: nn.Module, plan: dict[str, Style], group: TPGroup) -> nn.Module:
    """`model` with every `nn.Linear` that a key of `plan` names replaced, in place, by its
    column-parallel ("colwise") or row-parallel ("rowwise") slice for `group`'s rank; returns
    `model`. Each linear is cut from its own weights, so the TP model starts from the plain
    model's values, with the same parameter names. A key that names no module, a module that is
    not a plain `nn.Linear`, a module given two styles or an unknown style is refused."""
    targets: dict[str, Colwise | Rowwise] = {}
    for pattern, given in plan.items():
        style = _style(pattern, given)
        names = [name for name, _ in model.named_modules() if name and _matches(pattern, name)]
        if not names:
            raise ValueError(f"plan entry {pattern!r} names no module of the model")
        for name in names:
            if targets.setdefault(name, style) != style:
                raise ValueError(f"module {name!r} is cut both as {targets[name]} and as {style} in the plan")
    for name, style in targets.items():
        full = model.get_submodule(name)
        if type(full) is not nn.Linear:
            raise TypeError(f"plan entry for {name!r}: a {type(full).__name__}, not a plain nn.Linear")
        parent, _, attr = name.rpartition(".")
        cut = (
            ColumnParallelLinear(full, group, style.parts)
            if isinstance(style, Colwise)
            else RowParallelLinear(full, group)
        )
        setattr(model.get_submodule(parent), attr, cut)
    return model
