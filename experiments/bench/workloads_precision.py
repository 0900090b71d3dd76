"""Workloads whose singularity comes from finite-precision arithmetic in the forward pass.

2. aggressive learning rate on a small transformer LM trained under fp16 autocast;
3. occasional outlier batches that overflow fp16 activations under autocast;
7. a normalisation layer with a vanishing denominator (zero-padded inputs, tiny eps).

CPU autocast to float16 is supported by torch 2.13 (``torch.autocast("cpu", dtype=torch.float16)`` runs
``nn.Linear`` in fp16), so the fp16 overflow is the real one, not an emulation; it is slow on CPUs without
native fp16 (fp16 matmul ≈ 50x slower than fp32 on the CI machines: ``nonans_optim/ns5.py``), which is
why the models are tiny.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .models import MLP, TinyLM, batch_rng, char_corpus, digits
from .spec import OptimSpec, Task, Workload

__all__ = ["LM_LR", "W2_AGGRESSIVE_LR", "W3_OUTLIERS", "W7_NORM"]

# Largest stable AdamW rate of the W2 model under fp16 autocast, found by a sweep over
# {1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3} at the default size (``lm_sweep``): 0.1 is the largest rate with no
# non-finite value and a falling loss; 0.3 overflows fp16 from step 2 on.
LM_LR = {"stable": 0.1, "aggressive": 0.3, "tiny_aggressive": 1.0}
_LM = {"tiny": dict(d=16, layers=1, ctx=16, batch=8, steps=60),
       "default": dict(d=32, layers=1, ctx=32, batch=16, steps=200),
       "scale": dict(d=128, layers=4, ctx=128, batch=32, steps=2000)}


def _lm_batch(seed: int, index: int, ctx: int, batch: int):
    data, _ = char_corpus()
    g = batch_rng(seed, index)
    i = torch.randint(0, len(data) - ctx - 1, (batch,), generator=g)
    x = torch.stack([data[j:j + ctx] for j in i.tolist()])
    y = torch.stack([data[j + 1:j + ctx + 1] for j in i.tolist()])
    return x, y


def build_lm(size: str, seed: int, clean: bool, lr: float | None = None) -> Task:
    cfg = _LM[size]
    _, vocab = char_corpus()
    model = TinyLM(vocab, d=cfg["d"], layers=cfg["layers"], heads=2, ctx=cfg["ctx"])

    def loss_fn(m, index):
        x, y = _lm_batch(seed, index, cfg["ctx"], cfg["batch"])
        with torch.autocast("cpu", dtype=torch.float16):
            logits = m(x)
        return F.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))

    def evaluate(m):
        x, y = _lm_batch(seed + 7919, 0, cfg["ctx"], 64)
        return float(F.cross_entropy(m(x).reshape(-1, vocab), y.reshape(-1)))

    rate = lr if lr is not None else LM_LR["stable" if clean else "aggressive"]
    if size == "tiny" and lr is None and not clean:
        rate = LM_LR["tiny_aggressive"]  # the test's 60-step version needs a faster blow-up
    return Task(model, loss_fn, evaluate, OptimSpec("adamw", lr=rate, weight_decay=0.0, betas=(0.9, 0.95)),
                steps=cfg["steps"], metric="held-out CE (nats/char)", amp=True)


W2_AGGRESSIVE_LR = Workload(
    key="w2_aggressive_lr", title="Aggressive LR, transformer LM (fp16 autocast)",
    cause="AdamW at 3x the largest stable rate grows the weights until an fp16 activation overflows",
    build=build_lm, guards="clip_grad_norm_(1.0) + GradScaler",
    notes=f"stable rate {LM_LR['stable']} (sweep), run at {LM_LR['aggressive']}; clean run at the stable rate. "
          "Once the fp16 forward overflows on every batch, no arm sees a gradient again: GradScaler freezes the "
          "weights; repair takes one continuation step from momentum, then holds each parameter because the "
          "whole-tensor events repeat (before that hold it kept drifting along the direction that grew the "
          "activations) — see the non-finite-loss counts")


# ---------------------------------------------------------------- 3: outlier batches under fp16 autocast
_MLP = {"tiny": dict(hidden=64, batch=32, steps=60, every=15),
        "default": dict(hidden=128, batch=64, steps=200, every=25),
        "scale": dict(hidden=1024, batch=256, steps=2000, every=150)}
OUTLIER_SCALE = 65535.0  # a batch that skipped normalisation: raw 16-bit sensor counts instead of [0, 1]


def _digits_batch(seed: int, index: int, batch: int):
    X, Y = digits()
    g = batch_rng(seed, index)
    i = torch.randint(0, 1497, (batch,), generator=g)
    return X[i], Y[i]


def _digits_eval(m):
    X, Y = digits()
    return float(F.cross_entropy(m(X[1497:]), Y[1497:]))


def build_outliers(size: str, seed: int, clean: bool) -> Task:
    cfg = _MLP[size]
    model = MLP([64, cfg["hidden"], cfg["hidden"], 10])

    def loss_fn(m, index):
        x, y = _digits_batch(seed, index, cfg["batch"])
        if not clean and index % cfg["every"] == cfg["every"] - 1:
            x = x * OUTLIER_SCALE
        with torch.autocast("cpu", dtype=torch.float16):
            logits = m(x)
        return F.cross_entropy(logits.float(), y)

    return Task(model, loss_fn, _digits_eval, OptimSpec("adamw", lr=1e-3), steps=cfg["steps"],
                metric="held-out CE", amp=True)


W3_OUTLIERS = Workload(
    key="w3_outlier_batches", title="Outlier batches overflow fp16 activations",
    cause=f"every k-th batch arrives un-normalised (x{OUTLIER_SCALE:g}); its fp16 activations exceed 65504",
    build=build_outliers, guards="clip_grad_norm_(1.0) + GradScaler")


# ---------------------------------------------------------------- 7: vanishing normalisation denominator
class StdNorm(nn.Module):
    """Per-row standardisation written a common way: (h - mean) / (sqrt(var) + eps) with a tiny eps.

    The hazard: for an all-zero row (a zero-padded sample through a bias-free projection) the forward
    is 0/eps = 0, but the backward of sqrt at var = 0 is 1/(2·sqrt(0)) = Inf, multiplied by
    d var/d h = 2(h - mean)/n = 0: Inf·0 = NaN. (``torch.std``'s own backward special-cases std = 0 and
    returns a huge finite gradient instead; ``sqrt(var + eps)`` — LayerNorm's form — is the fix.)"""

    def __init__(self, eps: float = 1e-12):
        super().__init__()
        self.eps = eps

    def forward(self, h):
        return (h - h.mean(-1, keepdim=True)) / (h.var(-1, keepdim=True, unbiased=False).sqrt() + self.eps)


class SafeNorm(StdNorm):
    """The clean variant: sqrt(var + eps) with eps = 1e-5 (LayerNorm's form) is differentiable at zero."""

    def forward(self, h):
        return (h - h.mean(-1, keepdim=True)) / torch.sqrt(h.var(-1, keepdim=True, unbiased=False) + 1e-5)


def build_norm(size: str, seed: int, clean: bool) -> Task:
    cfg = _MLP[size]
    model = MLP([64, cfg["hidden"], cfg["hidden"], 10], bias=False, norm=SafeNorm() if clean else StdNorm())

    def loss_fn(m, index):
        x, y = _digits_batch(seed, index, cfg["batch"])
        if index % cfg["every"] == cfg["every"] - 1:  # a short batch zero-padded to the full batch size
            x = x.clone()
            x[-cfg["batch"] // 8:] = 0.0
        return F.cross_entropy(m(x), y)

    return Task(model, loss_fn, _digits_eval, OptimSpec("adamw", lr=1e-3), steps=cfg["steps"],
                metric="held-out CE")


W7_NORM = Workload(
    key="w7_vanishing_norm", title="Normalisation with a vanishing denominator",
    cause="zero-padded rows through a bias-free layer reach (h-mean)/(sqrt(var)+1e-12): sqrt's backward is Inf·0",
    build=build_norm, notes="clean run: sqrt(var + 1e-5) normalisation, same padded batches")


def lm_sweep(size: str = "default", seed: int = 0, rates=(1e-3, 3e-3, 1e-2, 3e-2, 1e-1)) -> dict:
    """The calibration behind ``LM_LR``: the stock arm (AdamW + clip + GradScaler) at each rate; a rate is
    stable when no loss or gradient was non-finite and the held-out CE ended below its initial value."""
    from .harness import run_arm
    out = {}
    for rate in rates:
        wl = Workload(key=f"lm_{rate:g}", title="", cause="",
                      build=lambda size, seed, clean, r=rate: build_lm(size, seed, clean, lr=r))
        rec = run_arm(wl, "baseline", size=size, seed=seed)
        first = rec["losses"][0] if rec["losses"] else None
        out[rate] = dict(first_nonfinite_step=rec["first_nonfinite_step"], final=rec["final_metric"],
                         scaler_skips=rec["scaler_skips"], initial=first,
                         stable=rec["first_nonfinite_step"] is None and rec["final_metric"] is not None
                         and first is not None and rec["final_metric"] < first)
    return out
