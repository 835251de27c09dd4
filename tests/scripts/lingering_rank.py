"""A user script whose last rank lingers after training (as if writing its own files): it writes
`--marker` once its loop is done, then sleeps, so that a test can kill it after the others ended;
with `--fail` it raises instead (a user's evaluation failing after the last step)."""

import argparse
import time
from pathlib import Path

import torch
import torch.nn as nn

import leto

parser = argparse.ArgumentParser()
parser.add_argument("--marker", required=True)
parser.add_argument("--fail", action="store_true")
args = parser.parse_args()

torch.set_num_threads(1)
job = leto.init()
torch.manual_seed(0)
model = nn.Linear(8, 4)
trainer = leto.Trainer(model, job, leto.AdamW(lr=1e-2), chunk_bytes=12 * 64)
x, y = torch.randn(12, 8), torch.randn(12, 4)
for step in trainer.steps(6):
    rows = torch.arange(12).tensor_split(trainer.world_size)[trainer.rank]
    trainer.step(lambda: nn.functional.mse_loss(model(x[rows]), y[rows]), weight=len(rows) / 12)
if trainer.rank == trainer.world_size - 1:
    Path(args.marker).write_text("done")
    if args.fail:
        raise RuntimeError("the evaluation after training failed")
    time.sleep(120)
