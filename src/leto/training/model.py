"""A small decoder-only GPT (nanoGPT-style) with size presets."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from leto.training.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TPGroup


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # byte-level tokens
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    batch_size: int = 32  # global batch, split over the workers


PRESETS: dict[str, GPTConfig] = {
    # a step well under a second with 4 workers on 2 CPU cores
    "tiny": GPTConfig(),
    "small": GPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=384, batch_size=32),
    # GPT-2 124M / 350M shapes, for real machines
    "gpt2": GPTConfig(block_size=1024, n_layer=12, n_head=12, n_embd=768, batch_size=64),
    "gpt2-medium": GPTConfig(block_size=1024, n_layer=24, n_head=16, n_embd=1024, batch_size=64),
}


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.fc_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # under tensor parallelism `attn` yields this rank's heads only (`n_head` of them)
        q, k, v = self.attn(self.ln_1(x)).chunk(3, dim=2)
        q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, -1))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    """Token + position embeddings, a stack of pre-norm blocks, a tied LM head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # GPT-2 scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits, or the mean cross-entropy when targets are given."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        new_tokens: int,
        temperature: float = 0.8,
        top_k: int = 20,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append `new_tokens` sampled tokens to `idx` ([batch, t]), top-k, from `generator`."""
        for _ in range(new_tokens):
            logits = self(idx[:, -self.cfg.block_size :])[:, -1, :] / temperature
            kth = torch.topk(logits, top_k).values[:, -1:]
            probs = F.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
            # drawn on the host: a CPU generator gives the same text on any device
            idx = torch.cat([idx, torch.multinomial(probs.cpu(), 1, generator=generator).to(idx.device)], dim=1)
        return idx


def tensor_parallel_gpt(model: GPT, group: TPGroup) -> GPT:
    """`model` made tensor-parallel over `group`, in place (Megatron's layout): in every block the
    fused QKV projection `attn` and the MLP's `fc` are column-parallel, `proj` and `fc_proj`
    row-parallel, so this rank computes `n_head / tp` heads and `4 n_embd / tp` MLP features.
    Embeddings, LayerNorms and the tied LM head are replicated. Parameter names and order are
    those of the plain model; the sharded ones hold this rank's slice of the plain model's
    values (`tensor_parallel.tp_layout` says which and along which dim)."""
    tp = group.world_size
    if model.cfg.n_head % tp:
        raise ValueError(f"{model.cfg.n_head} attention heads do not split over {tp} tensor-parallel ranks")
    for block in model.blocks:
        assert isinstance(block, Block)
        if isinstance(block.attn, ColumnParallelLinear):
            raise ValueError("the model is tensor-parallel already")
        block.attn = ColumnParallelLinear(block.attn, group, parts=3)  # [q; k; v], each split by heads
        block.proj = RowParallelLinear(block.proj, group)
        block.fc = ColumnParallelLinear(block.fc, group)
        block.fc_proj = RowParallelLinear(block.fc_proj, group)
        block.n_head = model.cfg.n_head // tp
    return model
