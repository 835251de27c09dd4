"""A user script whose rank 1 turns rogue at step 3: it sends its peers, in place of its registered
state, bytes that would run a shell command (`touch MARKER`) if they were unpickled."""

import argparse
import io
import os

import torch
import torch.nn as nn

import leto
import leto.runtime.plain

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--marker", required=True)
args = parser.parse_args()


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {args.marker}",))


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def rogue_dumps(obj: object) -> bytes:
    f = io.BytesIO()
    torch.save({"buffers": None, "user": {"counter": Evil()}}, f)
    return f.getvalue()


torch.set_num_threads(1)
job = leto.init()
torch.manual_seed(0)
model = nn.Linear(8, 1)
trainer = leto.Trainer(model, job, leto.AdamW(lr=1e-2))
counter = Counter()
for step in trainer.steps(args.steps):
    if step == 0:
        trainer.register_state("counter", counter)
    if step == 3 and trainer.rank == 1:
        leto.runtime.plain.dumps = rogue_dumps
    counter.n += 1
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + trainer.rank))
    trainer.step(lambda: model(x).pow(2).mean())
