"""Small models and offline data for the singularity benchmark.

Everything is synthetic or shipped with an installed package, so the benchmark runs offline and is
reproducible from a seed: sklearn's 8×8 digits, a character corpus read from Python's own standard library
sources, and Gaussian regression data.
"""
from __future__ import annotations

import functools
import json
import os

import torch
import torch.nn.functional as F

from experiments.tasks import Block
from torch import nn

__all__ = ["MLP", "TinyLM", "char_corpus", "digits", "batch_rng"]


def batch_rng(seed: int, index: int) -> torch.Generator:
    """A generator for data batch ``index``: replaying a step (rollback) or skipping one never shifts the
    batches of the other steps, so every arm sees the same data stream."""
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


class MLP(nn.Module):
    """Plain ReLU MLP. ``bias=False`` mimics transformer-style bias-free projections."""

    def __init__(self, sizes: list[int], *, bias: bool = True, norm: nn.Module | None = None):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b in zip(sizes[:-1], sizes[1:]))
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 0 and self.norm is not None:
                x = self.norm(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


class TinyLM(nn.Module):
    """A GPT-style character language model: token + position embeddings, pre-LN blocks, a head."""

    def __init__(self, vocab: int, d: int = 32, layers: int = 2, heads: int = 2, ctx: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos_embed = nn.Parameter(torch.randn(ctx, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads, bias=False) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos_embed[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@functools.lru_cache(maxsize=1)
def char_corpus(max_chars: int = 200_000) -> tuple[torch.Tensor, int]:
    """(int64 token tensor, vocab size) from this interpreter's own stdlib sources (``json`` package and
    ``functools``), printable ASCII only — deterministic for a given Python version, and always present."""
    paths = sorted(os.path.join(os.path.dirname(json.__file__), f) for f in os.listdir(os.path.dirname(json.__file__))
                   if f.endswith(".py"))
    paths.append(functools.__file__)
    text = "".join(open(p, encoding="utf-8", errors="ignore").read() for p in paths)
    text = "".join(c if 32 <= ord(c) < 127 or c == "\n" else " " for c in text)[:max_chars]
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    return torch.tensor([lookup[c] for c in text], dtype=torch.int64), len(chars)


@functools.lru_cache(maxsize=1)
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """sklearn's 1797 8×8 digits as (float32 features in [0, 1], int64 labels)."""
    from sklearn.datasets import load_digits
    d = load_digits()
    return torch.tensor(d.data / 16.0, dtype=torch.float32), torch.tensor(d.target, dtype=torch.int64)
