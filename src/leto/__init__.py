"""Leto: fault-tolerant training that recovers in place.

The public surface is small: `init()` joins the job, `Trainer` wraps a model and an elementwise
optimizer (`AdamW`, `Adam`, `SGD` or your own, docs/optimizers.md) into
sharded data parallel (a `Pipeline` of stages with `--pp`), `for step in trainer.steps(n)`
drives the loop.
"""

from leto.runtime.env import Job, init
from leto.training.optim import SGD, Adam, AdamW
from leto.training.pipeline import Pipeline
from leto.training.trainer import Trainer

__all__ = ["SGD", "Adam", "AdamW", "Job", "Pipeline", "Trainer", "init"]
