"""Momentum with Nesterov, and MONA's gradient-difference term, with the missing-observation gate.

Momentum (Muon form, ``KellerJordan/Muon`` ``muon_update``): B ← μB + (1-μ)G̃ (a lerp), and with Nesterov
the direction input is M = (1-μ)G̃ + μB (a second lerp). The (1-μ) factor matters when neither NS5 nor
NorMuon renormalises the result (FusionOpt drops it, B ← μB + G in ``Taikakim/fusion-optimiser``
fusion_optimiser/optimizer.py ``_spectral_group_step``: 1/(1-μ) = 20x larger steps at μ = 0.95).

MONA (arXiv 2605.26842 — its abstract adds an EMA of gradient differences to Muon's gradient; the form
below is re-implementations' reading of it, unconfirmed against the paper's method section): D = G - G_prev,
A ← β_a A + (1-β_a) D, G̃ = G + α A. ``G_prev`` starts as the first gradient, so step 1 adds no spurious
α·G₁ kick (FusionOpt starts it at zero).

Resolution: an entry where G is not finite is a missing observation. MONA keeps both of its buffers
(G_prev and A) at their previous values there; the momentum lerp gets G̃ := B at that entry, which leaves B
exactly unchanged (lerp(B, B, w) = B in IEEE arithmetic) and gives the Nesterov combination a finite input,
so the step continues from the momentum. A finite G can still overflow a buffer: lerp(a, b, w) = a + w(b - a)
overflows in b - a when a and b are huge and of opposite signs (G = +3e38 after B = -3e37). Under the gate
such an entry is a missing observation for that buffer: A, or B, keeps its previous value wherever the new
one (as stored) is not finite — and for B the direction input there is the old B, as for a missing G, so M
stays finite — and the entries where either overflowed are returned as a mask for the "moment" stage.
Clean entries see the stock arithmetic, bit for bit.
"""
from __future__ import annotations

import torch

from ..detection import storable_mask

__all__ = ["mona_", "momentum_"]


def mona_(g: torch.Tensor, prev_grad: torch.Tensor, diff_avg: torch.Tensor, ok: torch.Tensor | None, *,
          alpha: float, beta: float, first: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return (G̃ = G + α·A, overflow mask) and update (prev_grad, diff_avg) in place.

    ``ok`` is the finiteness mask of ``g`` (None when resolution is off: no gates, mask None). Where
    ``ok`` is False both buffers keep their values and G̃ is NaN-free only where G was; the caller's
    momentum gate then substitutes the momentum for it. Where the new A is not finite although G was (an
    overflow in G - G_prev or in the lerp), A keeps its value; the mask marks those entries."""
    if first:
        prev_grad.copy_(g if ok is None else torch.where(ok, g, torch.zeros_like(g)))
    diff = g - prev_grad
    new_avg = diff_avg.lerp(diff, 1 - beta)
    if ok is None:
        diff_avg.copy_(new_avg)
        prev_grad.copy_(g)
        return g.add(diff_avg, alpha=alpha), None
    keep = ok & storable_mask(new_avg, diff_avg.dtype)
    diff_avg.copy_(torch.where(keep, new_avg, diff_avg))
    prev_grad.copy_(torch.where(ok, g, prev_grad))
    return g.add(diff_avg, alpha=alpha), ok & ~keep


def momentum_(g: torch.Tensor, buf: torch.Tensor, ok: torch.Tensor | None, *, mu: float,
              nesterov: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Update ``buf`` (momentum_buffer) in place and return (the direction input M, overflow mask).

    A buffer stored in a narrower dtype than ``g`` (``momentum_dtype="bf16"``) is updated in g's dtype and
    rounded once on the write; M uses the unrounded new value. The missing-observation gate still leaves it
    exactly unchanged: lerp(b, b, w) = b, and b is representable in the buffer's dtype. With the gate
    (``ok`` given), an entry whose new value is not finite as stored is a missing observation too: the
    buffer keeps its value and M there is the old value (the lerp of b with itself), marked in the mask;
    without the gate the mask is None."""
    wide = buf.to(g.dtype) if buf.dtype != g.dtype else buf
    g_in = g if ok is None else torch.where(ok, g, wide)
    new = torch.lerp(wide, g_in, 1 - mu)
    overflow = None
    if ok is not None:
        kept = storable_mask(new, buf.dtype)
        overflow = ~kept
        new = torch.where(kept, new, wide)
        if nesterov:  # lerp(b, b, μ) = b: M continues from the old buffer there (without Nesterov M = new)
            g_in = torch.where(kept, g_in, wide)
    buf.copy_(new)
    return (g_in.lerp(new, mu) if nesterov else new), overflow  # new is never buf itself
