"""A user script whose rank `--rank` raises in step `--step`: every time it gets there, or with
`--once MARKER` only the first time (the marker file says it has)."""

import argparse
from pathlib import Path

import torch
import torch.nn as nn

import leto

parser = argparse.ArgumentParser()
parser.add_argument("--rank", type=int, default=1)
parser.add_argument("--step", type=int, default=3)
parser.add_argument("--once", type=Path)
args = parser.parse_args()

torch.set_num_threads(1)
job = leto.init()
torch.manual_seed(0)
model = nn.Linear(8, 4)
trainer = leto.Trainer(model, job, leto.AdamW(lr=1e-2), chunk_bytes=12 * 64)
x, y = torch.randn(12, 8), torch.randn(12, 4)
for step in trainer.steps(8):
    if trainer.rank == args.rank and step == args.step and not (args.once and args.once.exists()):
        if args.once:
            args.once.write_text("raised")
        raise ValueError(f"the user's data loader broke in step {step}")
    rows = torch.arange(12).tensor_split(trainer.world_size)[trainer.rank]
    trainer.step(lambda: nn.functional.mse_loss(model(x[rows]), y[rows]), weight=len(rows) / 12)
