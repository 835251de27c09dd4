"""Pipeline parallelism for a model of your own: a small residual network, cut into stages.

    leto run --workers 4 --spares 1 --nodes 2 --pp 2 examples/pipeline_parallel.py --steps 60

`Model` is a plain PyTorch model: a list of layers (an input projection, residual blocks that
mix each position with those before it, an output head). `Stage(model, s, P)` is its stage s of
P: a contiguous run of those layers under their names in the full model (`layers.2.*` stays
`layers.2.*`), so the stages' state dicts together are the full model's; the last stage also
computes the loss. `leto.Pipeline` is how the trainer takes it: `build(s)` builds stage s from
the same seeded full model in every process (a shadow builds stage 0, and rebuilds as the stage
of the rank it adopts), `act_shape` is the shape of the activations passed between stages. Each
model replica (the `--pp` ranks of one DP coordinate) trains on its slice of the global batch,
which the trainer cuts into micro-batches and runs through the stages (1F1B). At the end
`trainer.state_dict()` is the full model (a collective of the pipeline: every rank calls it),
which rank 0 loads into the plain `Model`.

With `--tp 2` too (`--workers 8 --tp 2 --pp 2`), each block's MLP is cut by `PLAN` (as in
examples/tensor_parallel.py) before the stage is taken from the model. With `--pp 1`
the one stage is the whole model: the same script, data parallel only.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import leto
from leto.training.tensor_parallel import pending_group
from leto.training.tp_plan import parallelize

D, T, FEATURES = 32, 16, 8  # width, sequence length, input features
# with --tp: each block's MLP cut as Megatron's (`*`: one part of a name; examples/tensor_parallel.py)
PLAN = {"layers.*.up": "colwise", "layers.*.down": "rowwise"}


class Block(nn.Module):
    """Pre-norm residual block: a causal mix of the positions so far (their running mean, then a
    linear map), and an MLP."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.mix = nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seen = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype).view(1, -1, 1)
        x = x + self.mix(self.norm1(x).cumsum(1) / seen)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Model(nn.Module):
    """The plain model: [b, t, FEATURES] -> [b, t, 1]."""

    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(FEATURES, D), *(Block(D) for _ in range(blocks)), nn.Linear(D, 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def make_model(tp_group=None) -> Model:
    torch.manual_seed(0)  # the same full model in every process: each takes its stage of it
    model = Model()
    return model if tp_group is None else parallelize(model, PLAN, tp_group)


class Stage(nn.Module):
    """Stage `s` of `stages` of `model`: its share of the layers, contiguous and balanced, named as
    in the full model. The last stage returns the mean squared error given the targets."""

    def __init__(self, model: Model, s: int, stages: int) -> None:
        super().__init__()
        n = len(model.layers)
        lo, hi = s * n // stages, (s + 1) * n // stages
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(lo, hi)})
        self.last = s == stages - 1

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x if targets is None else F.mse_loss(x, targets)


W_TRUE = torch.randn(FEATURES, 1, generator=torch.Generator().manual_seed(1))


def batch(step: int, rows: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: sequences whose target is the running mean so far, projected."""
    x = torch.randn(rows, T, FEATURES, generator=torch.Generator().manual_seed(step))
    return x, (x.cumsum(1) / torch.arange(1, T + 1).view(1, T, 1)) @ W_TRUE


def replica_batch(step: int, replica: int, replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Model replica `replica`'s slice of the global batch (its rows, strided)."""
    x, y = batch(step)
    return x[replica::replicas], y[replica::replicas]


parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--microbatches", type=int, default=4)
args = parser.parse_args()

torch.set_num_threads(1)
job = leto.init()
mesh = job.config.mesh
group = pending_group(job) if mesh.tp > 1 else None  # this rank's TP coordinate, if any
pipe = leto.Pipeline(
    lambda s: Stage(make_model(group), s, mesh.pp),
    stages=mesh.pp,
    microbatches=args.microbatches,
    act_shape=lambda x: (x.shape[0], T, D),  # a micro-batch's activations between two stages
)
trainer = leto.Trainer(pipe, job, leto.AdamW(lr=3e-3, weight_decay=0.0))

for step in trainer.steps(args.steps):
    dev = job.device
    # the replica's whole batch (inputs, targets): the trainer cuts it into micro-batches
    loss = trainer.step(lambda replica: tuple(t.to(dev) for t in replica_batch(step, replica, trainer.replicas)))
    if loss is not None and trainer.rank == 0 and step % 10 == 0:  # None: a step a recovery redoes
        print(f"step {step} loss {loss:.4f}", flush=True)

if job.rank is None:  # a shadow that was never adopted
    raise SystemExit
state = trainer.state_dict()  # the full model; a collective of the pipeline (and TP group)
if job.rank == 0:
    plain = make_model()
    x, y = batch(10**6)  # held out
    with torch.no_grad():
        untrained = F.mse_loss(plain(x), y).item()
        plain.load_state_dict(state)
        trained = F.mse_loss(plain(x), y).item()
    held, full = (sum(p.numel() for p in m.parameters()) for m in (trainer.model, plain))
    print(f"rank 0 (stage {trainer.stage}) holds {held} of the model's {full} parameters", flush=True)
    print(f"held-out loss of the plain model: untrained {untrained:.8g}, trained {trained:.8g}", flush=True)
