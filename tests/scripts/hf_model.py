"""A Hugging Face `transformers` causal LM under `leto run`: GPT-2 built from a config (random
init, tied embeddings, dropout on; nothing downloaded), trained on byte tokens of the corpus."""

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the model comes from a config

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import leto  # noqa: E402
from leto.training.corpus import load_tokens  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=12)
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
config = GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2, tie_word_embeddings=True)
model = GPT2LMHeadModel(config)
model.train()
trainer = leto.Trainer(
    model,
    job,
    leto.AdamW(lr=3e-3, weight_decay=0.1),
    chunk_bytes=12 * 4096,
    seed=7,
    param_groups=[{"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}],
    max_grad_norm=1.0,
)
tokens = torch.from_numpy(load_tokens()[:200_000].astype("int64"))
for step in trainer.steps(args.steps):
    starts = torch.randint(0, len(tokens) - 33, (4,))  # torch's global RNG: reseeded every step
    x = torch.stack([tokens[s : s + 32] for s in starts])
    trainer.step(lambda: model(input_ids=x, labels=x).loss)
    time.sleep(args.step_sleep)
if job.rank == 0:
    sd = trainer.state_dict()
    fresh = GPT2LMHeadModel(config)
    missing, unexpected = fresh.load_state_dict(sd, strict=False)
    print(f"state_dict loads: missing {sorted(missing)} unexpected {sorted(unexpected)}", flush=True)
