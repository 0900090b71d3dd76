"""NorMuon (arXiv 2510.05491, Algorithm 1) and the RMS matching that lets one lr serve every path.

Paper form, per matrix O = NS5(M) of shape m×n (rows = output neurons):

    v ← β₂ v + (1-β₂) mean_cols(O ⊙ O)        (fp32, no bias correction)
    Ô = O ⊘ (sqrt(v) + ε)                       (v broadcast along each row)
    update = 0.2 · sqrt(m·n) · Ô / ‖Ô‖_F        (update RMS exactly 0.2)

The global renormalisation is what makes the missing bias correction harmless: FusionOpt's row-*sum*
variant without it makes step 1 about 4.47x too large (ALGORITHMS.md §8b.6). A zero ‖Ô‖_F (zero momentum)
gives a zero update rather than 0/0.

Resolution: ``row_ok`` (rows whose gradient was entirely finite) gates the row moment, so a row that saw a
non-finite gradient keeps its previous second moment (missing observation).
"""
from __future__ import annotations

import torch

__all__ = ["normuon", "rms_match", "RMS_TARGET"]

RMS_TARGET = 0.2  # Moonlight's "match AdamW RMS" (MoonshotAI/Moonlight examples/toy_train.py)


def rms_match(O: torch.Tensor, target: float = RMS_TARGET) -> torch.Tensor:
    """Scale each matrix of O (..., m, n) to update RMS ``target``; zero stays zero."""
    norm = torch.linalg.matrix_norm(O.float(), keepdim=True)
    numel = O.shape[-1] * O.shape[-2]
    scale = torch.where(norm > 0, target * numel ** 0.5 / norm, torch.zeros_like(norm))
    return (O.float() * scale).to(O.dtype)


def normuon(O: torch.Tensor, v: torch.Tensor, row_ok: torch.Tensor | None, *, beta2: float,
            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (update with RMS 0.2, new row moment). O: (..., m, n) fp32; v: (..., m) fp32."""
    O = O.float()
    v_new = v.lerp(O.square().mean(dim=-1), 1 - beta2)
    if row_ok is not None:
        v_new = torch.where(row_ok, v_new, v)
    O_hat = O / (v_new.sqrt().unsqueeze(-1) + eps)
    return rms_match(O_hat), v_new
