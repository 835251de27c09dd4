"""The public API is deliberate: `leto`'s names and what a `leto.Trainer` shows are listed in one
place each (`leto.__all__`, `leto.training.trainer.PUBLIC_API`); adding one means adding it there."""

from __future__ import annotations

import inspect

import torch.nn as nn

import leto
from leto.training.trainer import PUBLIC_API


def test_the_package_exports_what_it_lists() -> None:
    names = {n for n, v in vars(leto).items() if not n.startswith("_") and not inspect.ismodule(v)}
    assert names == set(leto.__all__) == {"SGD", "Adam", "AdamW", "Job", "Pipeline", "Trainer", "init"}


def test_a_trainer_shows_only_its_public_api() -> None:
    trainer = leto.Trainer(nn.Linear(4, 2), leto.init("cpu"), leto.AdamW(lr=1e-2), chunk_bytes=12 * 8)
    assert {n for n in dir(trainer) if not n.startswith("_")} == set(PUBLIC_API)
    assert len(PUBLIC_API) == len(set(PUBLIC_API))
