"""The built-in job of `leto train`: a GPT on the King James Bible, sharded data parallel (and
tensor parallel with `--tp`, in pipeline stages with `--pp`)."""

from __future__ import annotations

import argparse
import dataclasses
import io
from pathlib import Path

import torch

import leto
from leto import console
from leto.runtime import durable, runlog
from leto.training.corpus import load_tokens
from leto.training.data import Sampler
from leto.training.model import GPT, PRESETS, tensor_parallel_gpt
from leto.training.optim import AdamW, warmup_cosine
from leto.training.pipeline import gpt_pipeline
from leto.training.tensor_parallel import pending_group
from leto.training.trainer import DEFAULT_CHUNK_BYTES, Trainer

# with no shadow left: "exact" keeps the launch's replicas (the failure-free bits, up to twice as
# long a step while shrunk), "balanced" re-splits the global batch over the ranks left
SHRINK_MODES = ("exact", "balanced")
# what the job leaves at its end: the final weights in run_dir/model.pt and a text sample of them,
# the weights alone, or nothing (the benches: the peers' jobs write neither, so each does the same work)
FINAL_MODES = ("sample", "model", "none")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="leto.training.train_gpt")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES)
    p.add_argument("--rows", type=int, default=None, help="rows of the global batch [the preset's]")
    p.add_argument("--max-grad-norm", type=float, default=None, help="clip to this global norm [no clipping]")
    p.add_argument("--shrink", choices=SHRINK_MODES, default="exact", help="how a shrunk job splits its work [exact]")
    p.add_argument("--microbatches", type=int, default=1, help="with --pp: micro-batches per replica's batch [1]")
    p.add_argument(
        "--final",
        choices=FINAL_MODES,
        default="sample",
        help="at the end: model.pt and a text sample, model.pt alone, or nothing [sample]",
    )
    return p.parse_args(argv)


def build(args: argparse.Namespace, job: leto.Job) -> tuple[Trainer, GPT, Sampler, int]:
    """Model, trainer, data pipeline and tokens per step of the built-in job (shadows too)."""
    cfg = PRESETS[args.model]
    if args.rows is not None:
        cfg = dataclasses.replace(cfg, batch_size=args.rows)

    def make() -> GPT:  # every rank cuts its slice (and stage) from the same seeded model
        torch.manual_seed(args.seed)
        model = GPT(cfg)
        if job.config.mesh.tp > 1:
            tensor_parallel_gpt(model, pending_group(job))
        return model

    pp = job.config.mesh.pp
    model = make() if pp == 1 else gpt_pipeline(make, pp, args.microbatches)
    optimizer = AdamW(lr=warmup_cosine(args.lr, warmup=min(20, args.steps // 10), total=args.steps))
    trainer = Trainer(
        model, job, optimizer, chunk_bytes=args.chunk_bytes, seed=args.seed, max_grad_norm=args.max_grad_norm
    )
    sampler = Sampler(load_tokens(), cfg.block_size, cfg.batch_size, args.seed)
    return trainer, trainer.model, sampler, cfg.batch_size * cfg.block_size


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    torch.set_num_threads(1)  # workers share the machine's cores
    trainer, model, sampler, tokens = build(args, leto.init())
    device, replicas = trainer.job.device, trainer.replicas
    share = lambda replica: sampler.share(replica, replicas)  # noqa: E731
    # with pipeline stages the trainer runs the stages on the batch; without, the model computes the loss
    run = (lambda batch: batch) if trainer.pipeline is not None else (lambda batch: model(*batch))
    for step in trainer.steps(args.steps):
        if args.shrink == "exact":  # per replica of the launch: the failure-free bits survive a shrink
            trainer.step(lambda replica: run(sampler.batch_on(device, step, replica, replicas)), share, tokens)
        else:  # this rank's share of the global batch, re-split when the job shrinks
            dp_rank, dp_size = trainer.dp_rank, trainer.dp_size
            batch = sampler.batch_on(device, step, dp_rank, dp_size)
            trainer.step(lambda: run(batch), sampler.share(dp_rank, dp_size), tokens)
    if args.final == "none" or trainer.job.rank is None or trainer.job.run_dir is None:
        return  # nothing to leave, or a shadow never adopted (it has no rank)
    state = trainer.state_dict()  # with --tp a collective: every rank calls it
    if trainer.job.rank == 0:
        save_model(state, trainer.job.run_dir / "model.pt")
        if args.final != "sample":
            return
        if trainer.member.replica_ranks > 1:  # a slice's forward is a collective: sample the full model
            model = GPT(model.cfg).to(trainer.job.device)
            model.load_state_dict(state)
        console.say(f"sample: {sample(model)!r}")


def save_model(state: dict[str, torch.Tensor], path: Path) -> None:
    """The final weights `state`, written atomically; a full or failing disk costs the file, not the run."""
    buf = io.BytesIO()
    torch.save(state, buf)
    try:
        durable.write_atomic(path, buf.getvalue())
    except OSError as e:
        if not runlog.is_disk_error(e):
            raise
        console.say(f"leto: {path} not written: {e.strerror}", err=True)


PROMPT = "And God said"


def sample(model: GPT, new_tokens: int = 80, seed: int = 0) -> str:
    """Text the model writes after PROMPT (bytes are tokens), the same for the same weights."""
    idx = torch.tensor([list(PROMPT.encode())], dtype=torch.long, device=next(model.parameters()).device)
    out = model.eval().generate(idx, new_tokens, generator=torch.Generator().manual_seed(seed))
    model.train()
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")


if __name__ == "__main__":
    main()
