"""A nanoGPT-style recipe under `leto run`: parameter groups (no decay on biases and norms),
gradient clipping by global norm, gradient accumulation over micro-batches, bf16 autocast with
fp32 master weights, warm-up + cosine schedule, dropout. Prints rank 0's last gradient norm."""

import argparse
import time

import torch
import torch.nn as nn

import leto
from leto.training.optim import warmup_cosine

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=16)
p.add_argument("--micro", type=int, default=2)
p.add_argument("--clip", type=float, default=0.05)
p.add_argument(
    "--step-sleep",
    type=float,
    default=0.0,
    help="seconds of sleep per step (an outside kill must land before the last step)",
)
args = p.parse_args()

torch.set_num_threads(1)
job = leto.init()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 64), nn.LayerNorm(64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 1))
optimizer = leto.AdamW(lr=warmup_cosine(3e-3, warmup=4, total=args.steps), weight_decay=0.1)
trainer = leto.Trainer(
    model,
    job,
    optimizer,
    chunk_bytes=12 * 256,
    seed=1,
    max_grad_norm=args.clip,
    autocast=torch.bfloat16,
    param_groups=[{"params": [q for q in model.parameters() if q.dim() < 2], "weight_decay": 0.0}],
)


def micro_batch():
    x = torch.randn(8, 8)  # the global RNG, reseeded by the trainer every step
    y = x.sum(dim=1, keepdim=True).tanh()
    return lambda: nn.functional.mse_loss(model(x).float(), y)


for step in trainer.steps(args.steps):
    trainer.step([micro_batch() for _ in range(args.micro)])
    time.sleep(args.step_sleep)
if job.rank == 0:
    print(f"grad_norm {trainer.grad_norm:.6f}", flush=True)
