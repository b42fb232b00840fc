"""A small GPT (nanoGPT's shape: token and position embeddings, pre-norm blocks of causal
self-attention and an MLP, tied output head) and a synthetic corpus, shared by the two example
training scripts. Nothing here knows hpclaunch."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.dropout(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, vocab: int, block: int, n_layer: int, n_head: int, d_model: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(block, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight  # weight tying
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02 / (math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 1))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def synthetic_corpus(vocab: int, length: int, seed: int = 1234) -> torch.Tensor:
    """A token stream from a fixed random order-1 Markov chain: learnable, the same everywhere."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((vocab, vocab)) * 3.0
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    cumulative = probs.cumsum(axis=1)
    draws = rng.random(length)
    out = np.empty(length, dtype=np.int64)
    token = 0
    for i in range(length):
        token = min(int(np.searchsorted(cumulative[token], draws[i])), vocab - 1)
        out[i] = token
    return torch.from_numpy(out)


class Windows(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Every ``block``-token window of the corpus, and the same window one token on (the targets)."""

    def __init__(self, tokens: torch.Tensor, block: int) -> None:
        self.tokens, self.block = tokens, block

    def __len__(self) -> int:
        return len(self.tokens) - self.block - 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[i : i + self.block + 1]
        return chunk[:-1], chunk[1:]
