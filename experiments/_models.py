"""A GPT-like model and parameter set for the performance experiments (step-time, overhead).

Why a real ``nn.Module`` rather than a list of shapes: the optimizers route parameters by name and module
type (embeddings and heads take the scalar path, hidden matrices the spectral one; see
``nonans_optim.routing``), and the overhead experiment also needs a forward/backward pass. One builder keeps
both experiments on the same parameter set.

The default shape (d=256, 4 layers, vocab 1024 tied with the head, 64 positions) has ≈3.44M parameters, of
which 16 hidden matrices (qkv 768×256, proj 256×256, fc 1024×256, fc-proj 256×1024 per layer) carry
3.15M; dense NS5 on those matrices costs ≈18.8 GFLOP (see :func:`ns5_flops`).
"""
from __future__ import annotations

import dataclasses
import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPTConfig", "TinyGPT", "build_gpt", "synthetic_grads", "ns5_flops", "hidden_matrices",
           "QUICK", "DEFAULT", "GPT2_SMALL", "MODELS", "count_params", "random_batch"]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    d: int = 256
    layers: int = 4
    heads: int = 4
    vocab: int = 1024
    ctx: int = 64


DEFAULT = GPTConfig()
QUICK = GPTConfig(d=32, layers=1, heads=2, vocab=64, ctx=16)
# GPT-2 small's shape (Radford et al. 2019; vocab padded to 50304 as in nanoGPT): ≈124M parameters, for
# judging a GPU target on a model whose training step is not dominated by launch overhead, as DEFAULT's is
GPT2_SMALL = GPTConfig(d=768, layers=12, heads=12, vocab=50304, ctx=1024)
MODELS = {"default": DEFAULT, "gpt2-small": GPT2_SMALL}


class _Block(nn.Module):
    """Pre-norm transformer block (GPT-2 layout: fused qkv, 4x MLP with GELU)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.d)
        self.qkv = nn.Linear(cfg.d, 3 * cfg.d)
        self.proj = nn.Linear(cfg.d, cfg.d)
        self.ln2 = nn.LayerNorm(cfg.d)
        self.fc = nn.Linear(cfg.d, 4 * cfg.d)
        self.fc_proj = nn.Linear(4 * cfg.d, cfg.d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
        shape = (B, T, self.heads, C // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """Token + position embeddings, ``layers`` blocks, final norm, LM head tied to the token embedding."""

    def __init__(self, cfg: GPTConfig = DEFAULT):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d)
        self.wpe = nn.Embedding(cfg.ctx, cfg.d)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x) @ self.wte.weight.T

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_gpt(cfg: GPTConfig = DEFAULT, *, seed: int = 0, device: str | torch.device = "cpu") -> TinyGPT:
    """A freshly initialised :class:`TinyGPT` (fixed seed, so every arm starts from the same weights)."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = TinyGPT(cfg).to(device)
    finally:
        torch.random.set_rng_state(gen_state)
    return model


def hidden_matrices(model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(hidden 2-D matrices, everything else) — the Muon / AdamW split every Muon-family peer gets,
    identical to what ``nonans_optim.param_groups`` routes to the spectral and scalar paths."""
    emb = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    hidden, rest = [], []
    for p in model.parameters():
        (hidden if p.ndim == 2 and id(p) not in emb else rest).append(p)
    return hidden, rest


def synthetic_grads(model: nn.Module, *, seed: int = 0, scale: float = 1e-3) -> list[torch.Tensor]:
    """Fixed-seed Gaussian gradients, one per parameter (no forward/backward: the step alone is timed)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return [(torch.randn(p.shape, generator=gen) * scale).to(p.device, p.dtype) for p in model.parameters()]


def ns5_flops(shapes: list[tuple[int, int]], steps: int = 5) -> float:
    """Dense FLOPs of ``steps`` NS5 iterations per matrix, on the short side s and long side l:
    A = XXᵀ (2s²l), A² (2s³), (bA + cA²)X (2s²l) per iteration — the floor for any Muon-family step."""
    total = 0.0
    for m, n in shapes:
        s, l = min(m, n), max(m, n)
        total += steps * (4 * s * s * l + 2 * s ** 3)
    return total


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def random_batch(cfg: GPTConfig, batch: int, *, seed: int = 0, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed-seed token batch (inputs, next-token targets) for the training-step timing."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tok = torch.randint(0, cfg.vocab, (batch, cfg.ctx + 1), generator=gen).to(device)
    return tok[:, :-1], tok[:, 1:]

