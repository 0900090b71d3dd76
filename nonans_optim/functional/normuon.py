"""NorMuon (arXiv 2510.05491, Algorithm 1) and the RMS matching that lets one lr serve every path.

Paper form, per matrix O = NS5(M) of shape m×n (rows = output neurons):

    v ← β₂ v + (1-β₂) mean_cols(O ⊙ O)        (fp32, no bias correction)
    Ô = O ⊘ (sqrt(v) + ε)                       (v broadcast along each row)
    update = 0.2 · sqrt(m·n) · Ô / ‖Ô‖_F        (update RMS exactly 0.2)

The global renormalisation is what makes the missing bias correction harmless: FusionOpt's row-*sum*
variant without it (``Taikakim/fusion-optimiser`` fusion_optimiser/optimizer.py ``_spectral_group_step``)
makes step 1 about 1/√(1-β₂) = 4.47x too large. A zero ‖Ô‖_F (zero momentum) gives a zero update rather
than 0/0.

Overflow. NS5's output is bounded (unit-norm input, singular values pushed towards 1), so with NS5 every
square and sum below stays far inside fp32 (``bounded=True``: the arithmetic as written). Without NS5, O is
the momentum itself, and a finite momentum of entries ~1e20 has squares past fp32's maximum: ‖Ô‖_F comes out
+Inf for a finite Ô, the factor 0.2·sqrt(mn)/‖Ô‖_F is 0, and the step is silently zero. ``bounded=False``
takes the norm of Ô scaled by a power of two from its max-abs entry (:func:`nonans_optim.ns5.normalise`:
exact, so the result is scale invariant over fp32's whole range). The row moment can overflow there too;
see :func:`row_moment`.

Resolution: ``row_ok`` (rows whose gradient was entirely finite) gates the row moment, so a row that saw a
non-finite gradient keeps its previous second moment (missing observation).
"""
from __future__ import annotations

import torch

from ..detection import finite_mask
from ..ns5 import normalise

__all__ = ["normuon", "row_moment", "rms_match", "RMS_TARGET"]

# the 0.2 of Moonlight's "match AdamW RMS" (MoonshotAI/Moonlight examples/toy_train.py), applied as NorMuon's
# exact renormalisation (rms_match), not as Moonlight's fixed factor 0.2·sqrt(max(m, n))
RMS_TARGET = 0.2


def rms_match(O: torch.Tensor, target: float = RMS_TARGET, *, bounded: bool = False) -> torch.Tensor:
    """Scale each matrix of O (..., m, n) to update RMS ``target``; zero stays zero.

    This is not Moonlight's rule, 0.2·sqrt(max(m, n))·O, though both come from its 0.2: the two agree when
    NS5's output is full rank (every singular value near 1, so ‖O‖_F ≈ sqrt(min(m, n))), and for low-rank
    momentum (few non-zero singular values, small ‖O‖_F) this one steps harder — RMS exactly 0.2 where
    Moonlight's falls with the rank, by about sqrt(rank / min(m, n)). The Muon preset uses it too, so one lr
    serves every path whatever the momentum's rank.

    RMS matching is scale invariant (U = target·sqrt(mn)·O/‖O‖_F), so the norm is taken of O divided by a
    power of two near its max-abs entry: the fp32 sum of squares of a finite O then never overflows (it
    used to for entries past ~1e19, giving a zero update) nor underflows. ``bounded``: the caller knows O's
    squares stay inside fp32 (NS5 output), and the plain norm is used — the arithmetic, and bits, of every
    NS5 composition."""
    numel = O.shape[-1] * O.shape[-2]
    if not bounded:  # normalise: ‖X‖ ≥ 0.5 for a non-zero X (ε = 1e-30 beside it), zero stays zero
        return normalise(O).mul_(target * numel ** 0.5).to(O.dtype)
    norm = torch.linalg.matrix_norm(O.float(), keepdim=True)
    scale = torch.where(norm > 0, target * numel ** 0.5 / norm, torch.zeros_like(norm))
    return (O.float() * scale).to(O.dtype)


def row_moment(O: torch.Tensor, v: torch.Tensor, row_ok: torch.Tensor | None, *, beta2: float,
               bounded: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(new row moment, rows whose new moment overflowed with a finite gradient row, or None).

    v ← lerp(v, mean_cols(O²), 1-β₂), kept where ``row_ok`` is False (missing observation). Without NS5
    (``bounded`` False) and under the gate, a finite gradient row can still overflow it (O² past fp32's
    maximum): that row keeps its previous v too — missing observation, and marked for the "moment" stage —
    and the division Ô = O/(sqrt(v)+ε) uses the kept v, where the +Inf would have made the row's direction
    0 (the step continues from the optimizer's own estimate). With NS5 that cannot happen; the caller's
    storage guard covers v there. Without the gate (``row_ok`` None, "off"): the stock arithmetic."""
    v_new = v.lerp(O.square().mean(dim=-1), 1 - beta2)
    if row_ok is None:
        return v_new, None
    if bounded:
        return torch.where(row_ok, v_new, v), None
    fresh = finite_mask(v_new)
    return torch.where(row_ok & fresh, v_new, v), row_ok & ~fresh


def normuon(O: torch.Tensor, v: torch.Tensor, row_ok: torch.Tensor | None, *, beta2: float, eps: float,
            bounded: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Return (update with RMS 0.2, new row moment, overflow rows or None: :func:`row_moment`). O: (..., m,
    n) fp32; v: (..., m) fp32. ``bounded``: O is NS5's output (see the module docstring)."""
    O = O.float()
    v_new, overflow = row_moment(O, v, row_ok, beta2=beta2, bounded=bounded)
    O_hat = O / (v_new.sqrt().unsqueeze(-1) + eps)
    return rms_match(O_hat, bounded=bounded), v_new, overflow
