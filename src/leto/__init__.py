"""Leto: fault-tolerant training that recovers in place.

The public surface is small: `init()` joins the job, `Trainer` wraps a model and AdamW into
sharded data parallel, `for step in trainer.steps(n)` drives the loop.
"""
from leto.control.runtime import Job, init
from leto.training.optim import AdamW
from leto.training.trainer import Trainer

__all__ = ["AdamW", "Job", "Trainer", "init"]
