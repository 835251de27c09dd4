"""Tensor parallelism for a model of your own: a tiny transformer, cut by a plan you write.

    leto run --workers 4 --spares 1 --nodes 2 --tp 2 examples/tensor_parallel.py --steps 60

Every rank builds the same full model from a fixed seed and keeps its TP slice of it: the plan
splits each attention's q, k, v and MLP's `up` by output features ("colwise": a rank holds half
the heads and half the hidden features) and `out`, `down` by input features ("rowwise": partial
results summed over the TP group). The rest is replicated. Each model replica (the `--tp` ranks
of one DP coordinate) trains on its slice of the batch, by `trainer.dp_rank`/`dp_size`. At the
end `trainer.state_dict()` is the full model, which rank 0 loads into a plain one.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import leto
from leto.training.tensor_parallel import pending_group
from leto.training.tp_plan import parallelize

# module names (`*`: one part of a name) -> how the nn.Linear there is cut
PLAN = {
    "*.q": "colwise",
    "*.k": "colwise",
    "*.v": "colwise",
    "*.out": "rowwise",
    "*.up": "colwise",
    "*.down": "rowwise",
}


class Block(nn.Module):
    """Pre-norm causal attention and MLP. The heads are counted from `head_dim`, so a TP rank's
    block runs the heads its slices of q, k and v hold."""

    def __init__(self, d: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (f(h).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same full model on every rank: each cuts its slice from it
    return nn.Sequential(nn.Linear(8, 32), Block(32, head_dim=8), Block(32, head_dim=8), nn.Linear(32, 1))


W_TRUE = torch.randn(8, 1, generator=torch.Generator().manual_seed(1))


def batch(step: int, rows: int = 32, t: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: sequences whose target is the running mean so far, projected."""
    x = torch.randn(rows, t, 8, generator=torch.Generator().manual_seed(step))
    return x, (x.cumsum(1) / torch.arange(1, t + 1).view(1, t, 1)) @ W_TRUE


parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
args = parser.parse_args()

torch.set_num_threads(1)
job = leto.init()
model = parallelize(make_model(), PLAN, pending_group(job))  # this rank's TP coordinate
trainer = leto.Trainer(model, job, leto.AdamW(lr=3e-3, weight_decay=0.0))

for step in trainer.steps(args.steps):
    x, y = batch(step)
    x, y = x[trainer.dp_rank :: trainer.dp_size], y[trainer.dp_rank :: trainer.dp_size]  # the replica's rows
    loss = trainer.step(lambda: F.mse_loss(model(x.to(job.device)), y.to(job.device)))
    if loss is not None and trainer.rank == 0 and step % 10 == 0:  # None: a step a recovery redoes
        print(f"step {step} loss {loss:.4f}", flush=True)

if job.rank is None:  # a shadow that was never adopted
    raise SystemExit
x, y = batch(10**6)  # held out
with torch.no_grad():  # the TP model's forward is a collective of its TP group: every rank runs it
    tp_loss = F.mse_loss(model(x.to(job.device)), y.to(job.device)).item()
state = trainer.state_dict()  # the full model; a collective of the TP group
if job.rank == 0:
    plain = make_model()
    with torch.no_grad():
        untrained = F.mse_loss(plain(x), y).item()
        plain.load_state_dict(state)
        plain_loss = F.mse_loss(plain(x), y).item()
    held, full = (sum(p.numel() for p in m.parameters()) for m in (model, plain))
    print(f"rank 0 holds {held} of the model's {full} parameters", flush=True)
    print(
        f"held-out loss: untrained {untrained:.8g}, tensor-parallel {tp_loss:.8g}, plain {plain_loss:.8g}", flush=True
    )
    assert abs(plain_loss - tp_loss) <= 1e-4 * tp_loss, "the plain model does not compute what the TP model does"
