"""Momentum with Nesterov, and MONA's gradient-difference term, with the missing-observation gate.

Momentum (Muon form, ``KellerJordan/Muon`` ``muon_update``): B ← μB + (1-μ)G̃ (a lerp), and with Nesterov
the direction input is M = (1-μ)G̃ + μB (a second lerp). The (1-μ) factor matters when neither NS5 nor
NorMuon renormalises the result (FusionOpt drops it: 20x larger steps; ALGORITHMS.md §8b.2).

MONA (arXiv 2605.26842; ALGORITHMS.md §3 — only the abstract is primary, the form below is the secondary
consensus): D = G - G_prev, A ← β_a A + (1-β_a) D, G̃ = G + α A. ``G_prev`` starts as the first gradient,
so step 1 adds no spurious α·G₁ kick (FusionOpt starts it at zero).

Resolution: an entry where G is not finite is a missing observation. MONA keeps both of its buffers
(G_prev and A) at their previous values there; the momentum lerp gets G̃ := B at that entry, which leaves B
exactly unchanged (lerp(B, B, w) = B in IEEE arithmetic) and gives the Nesterov combination a finite input,
so the step continues from the momentum. Clean entries see the stock arithmetic, bit for bit.
"""
from __future__ import annotations

import torch

__all__ = ["mona_", "momentum_"]


def mona_(g: torch.Tensor, prev_grad: torch.Tensor, diff_avg: torch.Tensor, ok: torch.Tensor | None, *,
          alpha: float, beta: float, first: bool) -> torch.Tensor:
    """Return G̃ = G + α·A and update (prev_grad, diff_avg) in place.

    ``ok`` is the finiteness mask of ``g`` (None when resolution is off). Where ``ok`` is False both
    buffers keep their values and G̃ is NaN-free only where G was; the caller's momentum gate then
    substitutes the momentum for it."""
    if first:
        prev_grad.copy_(g if ok is None else torch.where(ok, g, torch.zeros_like(g)))
    diff = g - prev_grad
    new_avg = diff_avg.lerp(diff, 1 - beta)
    if ok is None:
        diff_avg.copy_(new_avg)
        prev_grad.copy_(g)
    else:
        diff_avg.copy_(torch.where(ok, new_avg, diff_avg))
        prev_grad.copy_(torch.where(ok, g, prev_grad))
    return g.add(diff_avg, alpha=alpha)


def momentum_(g: torch.Tensor, buf: torch.Tensor, ok: torch.Tensor | None, *, mu: float,
              nesterov: bool) -> torch.Tensor:
    """Update ``buf`` (momentum_buffer) in place and return the direction input M.

    A buffer stored in a narrower dtype than ``g`` (``momentum_dtype="bf16"``) is updated in g's dtype and
    rounded once on the write; M uses the unrounded new value. The missing-observation gate still leaves it
    exactly unchanged: lerp(b, b, w) = b, and b is representable in the buffer's dtype."""
    if buf.dtype != g.dtype:
        g_in = g if ok is None else torch.where(ok, g, buf.to(g.dtype))
        new = buf.to(g.dtype).lerp(g_in, 1 - mu)
        buf.copy_(new)
        return g_in.lerp(new, mu) if nesterov else new
    g_in = g if ok is None else torch.where(ok, g, buf)
    buf.lerp_(g_in, 1 - mu)
    return g_in.lerp(buf, mu) if nesterov else buf.clone()
