"""Schedule-Free averaging, memory-efficient form (Defazio et al. 2024, arXiv 2405.15682;
``facebookresearch/schedule_free`` adamw_schedulefree.py).

Sequences: y = (1-β) z + β x (gradients are taken at y), z ← z - γ d, x ← (1-c) x + c z. The parameter
tensor holds y and the state holds only z; substituting x = (y - (1-β) z)/β gives the per-step update

    y ← lerp(y, z, c) + γ (β(1-c) - 1) d ;   z ← z - γ d

(derivation in the docstring of :func:`sf_update_`). Weight decay is applied at z (SF-NorMuon, arXiv
2605.23061: essential for long horizons) by adding λ z to d *before* either update.

Averaging weight (SF-NorMuon Alg. 1): c_t = η_t² / Σ_{k≤t} η_k², with η_t the scheduled, warmed-up lr — a
host-side float, so no sync. The first step has c = 1, so x₁ = z₁.
"""
from __future__ import annotations

import torch

__all__ = ["sf_update_", "sf_weight", "to_x_", "to_y_", "SF_BETA_MIN"]

# The smallest interpolation weight β accepted: x is rebuilt from y and z by dividing by β in fp32 (to_x_),
# and 1/β must stay finite there with room (1/β ≤ 2^100 ≪ fp32's 2^128); a smaller β passed validation and
# steps, then eval() raised "value cannot be converted to type float without overflow".
SF_BETA_MIN = 2.0 ** -100


def sf_weight(lr_t: float, weight_sum: float) -> tuple[float, float]:
    """(c_t, new weight sum) for scheduled lr ``lr_t``; c = 0 while every lr so far is 0."""
    weight_sum = weight_sum + lr_t ** 2
    return (lr_t ** 2 / weight_sum if weight_sum > 0 else 0.0), weight_sum


def sf_update_(y: torch.Tensor, z: torch.Tensor, d: torch.Tensor, gamma: torch.Tensor | float, *, c: float,
               beta: float, weight_decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (y_new, z_new) without writing (the caller gates them with the resolution policy).

    y_{t+1} = (1-β) z_{t+1} + β x_{t+1} with x_{t+1} = (1-c) x_t + c z_{t+1} and x_t = (y_t - (1-β) z_t)/β
    expands to (1-c) y_t + c z_t - (1 - β + βc) γ d, i.e. lerp(y, z, c) + γ(β(1-c) - 1) d."""
    if weight_decay != 0:
        d = d.add(z, alpha=weight_decay)
    if not isinstance(gamma, torch.Tensor):
        gamma = torch.tensor(gamma, dtype=torch.float32)
    # addcmul with the 0-d step size: one pass each instead of a multiply and an add.
    y_new = torch.addcmul(y.lerp(z, c), d, (gamma * (beta * (1 - c) - 1)).to(y.dtype))
    z_new = torch.addcmul(z, d, (-gamma).to(z.dtype))
    return y_new, z_new


def to_x_(p: torch.Tensor, z: torch.Tensor, beta: float) -> None:
    """eval(): y → x, x = lerp(y, z, 1 - 1/β)."""
    p.lerp_(z, 1 - 1 / beta)


def to_y_(p: torch.Tensor, z: torch.Tensor, beta: float) -> None:
    """train(): x → y, y = lerp(x, z, 1 - β)."""
    p.lerp_(z, 1 - beta)
