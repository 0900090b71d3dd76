"""KL-Shampoo as its reference code runs it: the "stock" arm of workload 5.

This is a foil, written from arXiv 2509.03378 and the behaviour of ``yorkerlin/KL-Methods`` optim/kl_opt.py
(``KLOpt(using_klsoap=False)`` with its code defaults), so that the
benchmark compares the library against what a user of the published optimizer actually gets — not against
the library's own KL-Shampoo component, which RMS-matches its update and therefore cannot run away.

What the reference does, and this class reproduces (2-D parameters; 1-D ones go to AdamW, as the reference
only supports matrices):

* every state tensor (momentum, factors S_a/S_b, bases Q, inverse roots s = D^{-1/2}) is kept in **bf16**;
  the gradient is cast to bf16 first; only eigh and QR run in fp32;
* first call: S_a = (1-β)/d_b·G Gᵀ, S_b = (1-β)/d_a·GᵀG, Q from eigh (descending order), every inverse
  root set to 1/√``init_factor`` (0.1 → 3.16) — and **no parameter update** on that call;
* then per step: m ← lerp(m, G, 1-β₁); U = Q_a [(Q_aᵀ m Q_b) ⊙ (s_a s_bᵀ)/(1 + ε·s_a s_bᵀ)] Q_bᵀ;
  **W ← W − lr·U** (no grafting, no RMS matching: the step is as large as the preconditioner says);
  W ← W − lr·wd·W;
* after computing U, the coupled factor update with the current gradient
  (S_a ← βS_a + (1-β)/d_b·G S_b⁻¹ Gᵀ, S_b symmetric, S⁻¹ from the tracked pair Q·diag(s²)·Qᵀ), the
  eigenvalue tracking D ← lerp(D, diag(Qᵀ G S_other⁻¹ Gᵀ Q)/d_other, 1-β) with D recovered as 1/s², and
  s = 1/√D passed through ``nan_to_num(→0)`` and clamped to ≤ max(10, min(dim, 4000));
* every ``precondition_frequency`` steps: Q ← qr(S·Q) (one warm-started power iteration).

The hazards this keeps on purpose (they are the point of the workload): the update is lr·U with U scaled by
up to cap² = 4096 (for dim ≥ 64) when the tracked eigenvalues get small, and the bf16 factors and roots
lose the small eigenvalues; a non-finite gradient or factor silently turns into 0 or NaN directions.
"""
from __future__ import annotations

import math

import torch
from torch.optim import Optimizer

__all__ = ["StockKLShampoo", "inverse_root_clamped"]


def inverse_root_clamped(D: torch.Tensor, dim: int, max_clamp: int = 4000) -> torch.Tensor:
    """s = 1/√D with NaN/±Inf → 0, clamped to ≤ max(10, min(dim, max_clamp)) (the reference's rule).

    The hazard: D = 0 gives s = +Inf → 0 (a silently dropped direction, not a large one), and a small but
    non-zero D gives the full cap — the amplification the update then multiplies by lr without any bound on
    the step's norm."""
    s = torch.nan_to_num(torch.rsqrt(D), nan=0.0, posinf=0.0, neginf=0.0)
    return torch.clamp(s, max=float(max(10, min(dim, max_clamp))))


class StockKLShampoo(Optimizer):
    """The reference KL-Shampoo update for 2-D parameters (see the module docstring).

    Args follow the reference code defaults: betas (0.9, 0.98) with the factor EMA β = betas[1], ε 1e-8,
    weight_decay 0.01, precondition_frequency 10, init_factor 0.1, state in ``cast_dtype`` = bf16."""

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.98), eps: float = 1e-8,
                 weight_decay: float = 0.01, precondition_frequency: int = 10, init_factor: float = 0.1,
                 cast_dtype: torch.dtype = torch.bfloat16):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      precondition_frequency=precondition_frequency))
        self.init_factor, self.cast_dtype = init_factor, cast_dtype
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"StockKLShampoo handles 2-D parameters only, got shape {tuple(p.shape)}")

    # ------------------------------------------------------------------ state
    def _init_state(self, st: dict, G: torch.Tensor, beta: float) -> None:
        """First call: raw-gradient factors, eigh bases (descending), every root = 1/√init_factor."""
        m, n = G.shape
        st["step"] = 0
        st["exp_avg"] = torch.zeros_like(G)
        st["S"] = [(1 - beta) / n * (G @ G.mT), (1 - beta) / m * (G.mT @ G)]
        st["Q"], st["s"] = [], []
        for S in st["S"]:
            _, Q = torch.linalg.eigh(S.float())
            st["Q"].append(torch.flip(Q, [1]).to(self.cast_dtype))
            st["s"].append(torch.full((S.shape[0],), 1.0 / math.sqrt(self.init_factor), dtype=self.cast_dtype,
                                      device=S.device))

    def _direction(self, st: dict, G: torch.Tensor, beta1: float, eps: float) -> torch.Tensor:
        """U = Q_a [(Q_aᵀ m Q_b) ⊙ s_a s_bᵀ / (1 + ε s_a s_bᵀ)] Q_bᵀ after the momentum update."""
        st["exp_avg"].lerp_(G, 1 - beta1)
        (Q_a, Q_b), (s_a, s_b) = st["Q"], st["s"]
        scale = s_a[:, None] * s_b[None, :]
        scale = scale / (1 + scale * eps)
        return Q_a @ ((Q_a.mT @ st["exp_avg"] @ Q_b) * scale) @ Q_b.mT

    def _absorb(self, st: dict, G: torch.Tensor, beta: float) -> None:
        """Coupled factor update, eigenvalue tracking with nan_to_num + clamp (all in the state dtype)."""
        m, n = G.shape
        (Q_a, Q_b), (s_a, s_b) = st["Q"], st["s"]
        A = Q_a.mT @ G                      # Q_aᵀ G
        W = (G @ Q_b) * s_b[None, :]        # G Q_b diag(s_b): W Wᵀ = G S_b⁻¹ Gᵀ
        V = A * s_a[:, None]                # diag(s_a) Q_aᵀ G: Vᵀ V = Gᵀ S_a⁻¹ G
        st["S"][0].mul_(beta).add_(W @ W.mT, alpha=(1 - beta) / n)
        st["S"][1].mul_(beta).add_(V.mT @ V, alpha=(1 - beta) / m)
        H = A @ Q_b                         # Q_aᵀ G Q_b
        diags = [(H * s_b[None, :]).square().mean(1), (H * s_a[:, None]).square().mean(0)]
        for i, (s, diag) in enumerate(zip(st["s"], diags)):
            D = torch.nan_to_num(1.0 / s.square(), nan=0.0, posinf=0.0, neginf=0.0)
            st["s"][i] = inverse_root_clamped(D.lerp(diag, 1 - beta), s.shape[0])
        if st["step"] % self.defaults["precondition_frequency"] == 0:
            st["Q"] = [torch.linalg.qr(S.float() @ Q.float()).Q.to(self.cast_dtype)
                       for S, Q in zip(st["S"], st["Q"])]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                G = p.grad.to(self.cast_dtype)
                st = self.state[p]
                if "Q" not in st:  # the reference skips the update on the first call
                    self._init_state(st, G, beta)
                    continue
                st["step"] += 1
                U = self._direction(st, G, beta1, group["eps"])
                self._absorb(st, G, beta)
                p.add_(U.to(p.dtype), alpha=-group["lr"])
                if group["weight_decay"] > 0:
                    p.add_(p, alpha=-group["lr"] * group["weight_decay"])
        return loss
