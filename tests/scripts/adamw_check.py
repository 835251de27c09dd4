"""Trains a small model under `leto run` and saves the unsharded state (rank 0) to argv[1]."""

import sys

import torch
import torch.nn as nn

import leto

torch.set_num_threads(1)
job = leto.init()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
trainer = leto.Trainer(
    model, job, leto.AdamW(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1), chunk_bytes=12 * 64
)
data = torch.Generator().manual_seed(7)
X, Y = torch.randn(5, 12, 8, generator=data), torch.randn(5, 12, 4, generator=data)  # 5 steps, 12 rows
for step in trainer.steps(5):
    rows = torch.arange(12).tensor_split(trainer.world_size)[trainer.rank]
    x, y = X[step, rows].to(job.device), Y[step, rows].to(job.device)  # the model is on the job's device
    trainer.step(lambda: nn.functional.mse_loss(model(x), y), weight=len(rows) / 12)
state = trainer.full_state()
if trainer.rank == 0:
    torch.save({k: v.cpu().clone() for k, v in state.items()}, sys.argv[1])
