"""A user's model under `leto run` whose arithmetic depends on more than parameters and AdamW:
`--model dropout` draws dropout masks and samples its batches from torch's global RNG (as
nanoGPT's get_batch does); `--model batchnorm` updates BatchNorm buffers and reads its data from
a stateful loader with its own generator, registered with the trainer."""

import argparse
import time

import torch
import torch.nn as nn

import leto


class Loader:
    """Batches from a private generator: its position is per-rank state the trainer must carry."""

    def __init__(self, seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.served = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.served += 1
        x = torch.randn(16, 8, generator=self.g)
        return x, x.sum(dim=1, keepdim=True).tanh()

    def state_dict(self) -> dict:
        return {"rng": self.g.get_state(), "served": self.served}

    def load_state_dict(self, state: dict) -> None:
        self.g.set_state(state["rng"])
        self.served = state["served"]


p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
p.add_argument("--model", choices=["dropout", "batchnorm"], required=True)
p.add_argument(
    "--step-sleep",
    type=float,
    default=0.0,
    help="seconds of sleep per step (an outside kill must land before the last steps: a step here takes ~10 ms)",
)
args = p.parse_args()

torch.set_num_threads(1)
job = leto.init()
torch.manual_seed(0)
if args.model == "dropout":
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 1))
else:
    model = nn.Sequential(nn.Linear(8, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 1))
trainer = leto.Trainer(model, job, leto.AdamW(lr=1e-2), chunk_bytes=12 * 256, seed=3)
loader = None
for step in trainer.steps(args.steps):
    if args.model == "dropout":
        x = torch.randn(16, 8)  # the global RNG, reseeded by the trainer every step
        y = x.sum(dim=1, keepdim=True).tanh()
    else:
        if loader is None:  # built once this process has a rank (a shadow gets one when adopted)
            loader = Loader(seed=100 + trainer.rank)
            trainer.register_state("loader", loader)
        x, y = loader.next()
    time.sleep(args.step_sleep)
    trainer.step(lambda: nn.functional.mse_loss(model(x), y))
if loader is not None and job.rank is not None:
    print(f"rank {job.rank} loader served {loader.served}", flush=True)
