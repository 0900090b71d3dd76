"""FusionOpt's Polyak-style step multiplier, on the device and NaN-safe.

Rule (``Taikakim/fusion-optimiser`` fusion_optimiser/optimizer.py ``_update_polyak``): L̄ and Ḡ are EMAs
(β = 0.98) of the loss and of the mean |g| over all parameters, each seeded with its first value; the step is
γ = lr · clamp(L̄ / Ḡ, 0.1, 10). This is *not* ScheduleFree+'s rule (no ⟨g, z-x⟩ term, no √(π/2), no
max(0, ·)); whether its clamp saturates is FusionOpt's open question 5.

Hazards handled here: a NaN/Inf loss leaves L̄ unchanged (FusionOpt: NaN γ → every parameter NaN); a
non-finite mean |g| leaves Ḡ unchanged; a non-finite or 0/0 ratio falls back to the multiplier 1; no loss
given yet → multiplier 1. All on the device: no ``.item()``.
"""
from __future__ import annotations

import torch

__all__ = ["init_polyak", "update_polyak", "CLAMP"]

CLAMP = (0.1, 10.0)


def init_polyak(device: torch.device) -> dict[str, torch.Tensor]:
    z = lambda: torch.zeros((), dtype=torch.float32, device=device)  # noqa: E731
    return {"loss_ema": z(), "gnorm_ema": z(), "loss_seen": z().bool(), "gnorm_seen": z().bool(),
            "gamma_mult": torch.ones((), dtype=torch.float32, device=device)}


def _ema_(ema: torch.Tensor, seen: torch.Tensor, x: torch.Tensor, beta: float) -> torch.Tensor:
    ok = torch.isfinite(x)
    new = torch.where(seen, ema * beta + (1 - beta) * x, x)
    ema.copy_(torch.where(ok, new, ema))
    seen.logical_or_(ok)
    return ok


def update_polyak(state: dict[str, torch.Tensor], loss: torch.Tensor | None, l1_sum: torch.Tensor,
                  count: torch.Tensor, *, beta: float = 0.98, clamp: tuple[float, float] = CLAMP
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold this step's loss and Σ|g| / count into the EMAs; return (multiplier, loss_was_bad)."""
    gmean = l1_sum / count
    _ema_(state["gnorm_ema"], state["gnorm_seen"], gmean, beta)
    loss_bad = torch.zeros((), dtype=torch.bool, device=l1_sum.device)
    if loss is not None:
        loss = loss.detach().to(device=l1_sum.device, dtype=torch.float32).reshape(())
        loss_bad = ~_ema_(state["loss_ema"], state["loss_seen"], loss, beta)
    ratio = state["loss_ema"] / state["gnorm_ema"]
    usable = state["loss_seen"] & state["gnorm_seen"] & torch.isfinite(ratio)
    mult = torch.where(usable, ratio.clamp(*clamp), torch.ones_like(ratio))
    state["gamma_mult"].copy_(mult)
    return mult, loss_bad
