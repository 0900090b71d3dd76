"""Workloads of the spectral (Muon-family) optimizers.

1. NS5 in an fp16 hot dtype on a model whose gradients have large norms: a regression on un-normalised
   targets (prices in currency units). The common NS5 casts the momentum to fp16 *before* normalising, so
   an entry above 65504 becomes Inf and the normalisation makes it NaN (OPEN_QUESTIONS.md Q2 traces where it breaks).
   The library's ``ns5`` normalises in fp32 first, so the same fp16 hot dtype is safe: this workload is
   *avoided* by construction, not repaired — expect zero resolution events on it.
5. KL-Shampoo alone (FusionOpt's docs report its standalone KL-Shampoo diverging) against KL-Shampoo
   composed with NS5 (FullFusion's order). The stock arm is the reference update as published
   (:class:`~.kl_shampoo_stock.StockKLShampoo`: bf16 state, init_factor 0.1, nan_to_num(→0) and the
   max(10, min(dim, 4000)) clamp on the inverse roots, W -= lr·U with no grafting or RMS matching), at the
   best rate of :func:`shampoo_sweep`. Measured: it stays finite at every rate of the sweep and far above
   it (``shampoo_sweep(rates=(0.1, 0.3, 1, 3))``: held-out CE is ruined from lr 0.3 on, but no NaN/Inf appears) —
   the whitened update U is O(1) per entry whatever the gradient scale, and the clamp bounds the rest. The
   claim is refuted at this size; the workload pins that down.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .models import MLP, batch_rng, digits
from .spec import OptimSpec, Task, Workload

__all__ = ["W1_FP16_NS5", "W5_SHAMPOO"]

TARGET_SCALE = 1e5  # regression targets in currency units, not standardised
_REG = {"tiny": dict(d=16, hidden=32, batch=64, steps=30),
        "default": dict(d=32, hidden=64, batch=128, steps=150),
        "scale": dict(d=256, hidden=1024, batch=1024, steps=2000)}


def build_fp16_ns5(size: str, seed: int, clean: bool) -> Task:
    cfg = _REG[size]
    d = cfg["d"]
    model = MLP([d, cfg["hidden"], cfg["hidden"], 1])
    w_true = torch.randn(d, generator=batch_rng(seed, -1))

    def sample(index, batch):
        x = torch.randn(batch, d, generator=batch_rng(seed, index))
        return x, (x @ w_true + torch.sin(3 * x[:, 0])) * TARGET_SCALE

    def loss_fn(m, index):
        x, y = sample(index, cfg["batch"])
        return F.mse_loss(m(x).squeeze(-1), y)

    def evaluate(m):
        x, y = sample(10**6, 1024)
        return float(F.mse_loss(m(x).squeeze(-1), y) / y.var())

    # the stock arm uses hot="fp16"; its clean run swaps in an fp32 NS5 (arms.make_optimizer)
    return Task(model, loss_fn, evaluate, OptimSpec("muon", lr=0.05, hot="fp16"), steps=cfg["steps"],
                metric="held-out MSE / Var(y)", clip=None)


W1_FP16_NS5 = Workload(
    key="w1_fp16_ns5", title="Muon NS5 in fp16, large gradient norms",
    cause=f"targets in raw units (x{TARGET_SCALE:g}): momentum entries > 65504 become Inf at the fp16 cast",
    build=build_fp16_ns5, guards="none (Muon recipes do not clip)",
    notes="stock arm: Muon-style NS5 that casts to fp16 before normalising (ns5_naive); nonans: the "
          "library's ns5 in fp16 (fp32 normalisation first) — the hazard is avoided, so 0 events is expected; "
          "clean run: the stock arm with an fp32 NS5")


# The stock KL-Shampoo rate: the best held-out CE of ``shampoo_sweep`` over {1e-4, 3e-4, 1e-3, 3e-3, 1e-2,
# 3e-2} at the default size (the reference code's default is 1e-4, its docstring says 3e-3).
SHAMPOO_STOCK_LR = 1e-2
_CLS = {"tiny": dict(hidden=32, batch=32, steps=40),
        "default": dict(hidden=64, batch=64, steps=150),
        "scale": dict(hidden=512, batch=256, steps=2000)}


def build_shampoo(size: str, seed: int, clean: bool, stock_lr: float | None = None) -> Task:
    cfg = _CLS[size]
    model = MLP([64, cfg["hidden"], cfg["hidden"], 10])
    X, Y = digits()

    def loss_fn(m, index):
        i = torch.randint(0, 1497, (cfg["batch"],), generator=batch_rng(seed, index))
        return F.cross_entropy(m(X[i]), Y[i])

    def evaluate(m):
        return float(F.cross_entropy(m(X[1497:]), Y[1497:]))

    return Task(model, loss_fn, evaluate, OptimSpec("shampoo", lr=0.02, weight_decay=0.0,
                                                    stock_lr=SHAMPOO_STOCK_LR if stock_lr is None else stock_lr),
                steps=cfg["steps"], metric="held-out CE")


W5_SHAMPOO = Workload(
    key="w5_kl_shampoo", title="KL-Shampoo alone vs KL-Shampoo + NS5",
    cause="claimed: KL-Shampoo without grafting (raw lr·U, bf16 factors) amplifies directions whose tracked "
          "eigenvalue is tiny until it diverges",
    build=build_shampoo,
    notes=f"stock arm: the reference KL-Shampoo update (bf16 state, no grafting) at lr {SHAMPOO_STOCK_LR:g} "
          "(sweep-best), AdamW for vectors; clean run: the same with fp32 state; nonans: "
          "Fusion(('shampoo','ns5')) at lr 0.02 (RMS-matched)")


def shampoo_sweep(size: str = "default", seed: int = 0, rates=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2)) -> dict:
    """The calibration behind ``SHAMPOO_STOCK_LR``: the stock arm (reference KL-Shampoo + clip) at each
    rate → {rate: {first_nonfinite_step, final}}."""
    from .harness import run_arm
    out = {}
    for rate in rates:
        wl = Workload(key=f"shampoo_{rate:g}", title="", cause="",
                      build=lambda size, seed, clean, r=rate: build_shampoo(size, seed, clean, stock_lr=r))
        rec = run_arm(wl, "baseline", size=size, seed=seed)
        out[rate] = dict(first_nonfinite_step=rec["first_nonfinite_step"], final=rec["final_metric"])
    return out
