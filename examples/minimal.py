"""The smallest Leto job: an MLP regression, sharded data parallel, under `leto run`.

    leto run --workers 2 --spares 1 examples/minimal.py --steps 50

Compared with a plain PyTorch loop, three lines change: `leto.init()`, `leto.Trainer(...)`,
and `for step in trainer.steps(n)` (shadow trainers wait there to be adopted).
"""

import argparse

import torch
import torch.nn as nn

import leto

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=50)
args = parser.parse_args()

torch.set_num_threads(1)
job = leto.init()  # 1. join the job
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
trainer = leto.Trainer(model, job, leto.AdamW(lr=1e-2, weight_decay=0.0))  # 2. wrap
true_w = torch.randn(16, 1, generator=torch.Generator().manual_seed(1))

for step in trainer.steps(args.steps):  # 3. loop
    g = torch.Generator().manual_seed(step * 1000 + trainer.rank)  # a pure function of (step, rank)
    x = torch.randn(32, 16, generator=g)
    y = x @ true_w
    loss = trainer.step(lambda: nn.functional.mse_loss(model(x), y))
    if loss is not None and trainer.rank == 0 and step % 10 == 0:  # None: a failure interrupted the step
        print(f"step {step} loss {loss:.4f}", flush=True)
