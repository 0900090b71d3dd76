"""NS5 on Triton: ``ns5_iterate`` chains the three kernels of one quintic Newton-Schulz iteration.

    A = X·Xᵀ                (ns5_gram.gram:  one triangle of tiles, mirrored)
    B = b·A + c·A²          (ns5_gram.poly:  one triangle, b·A fused in the epilogue)
    X ← a·X + B·X           (ns5_axpb.axpb:  a·X fused in the epilogue)

Same contract as the torch reference ``nonans_optim.ns5.iterate_reference`` (the oracle): X is a
normalised, wide (m ≤ n), contiguous (B, m, n) batch in the hot dtype; the result has X's shape and dtype.
Per iteration this does 3m²n + m³ useful FLOPs instead of the dense 4m²n + 2m³ (``ns5_gram``: one triangle).

``ns5_iterate_fp16_safe`` is the rescale-restore variant (nonans_optim/ns5.py ``_FP16_SAFE_SCALE``): the
iteration runs on X' = s·X with b' = b/s², c' = c/s⁴ — identical in exact arithmetic, since
A' = s²A, b'A' + c'A'² = bA + cA² = B and a·X' + B·X' = s·(aX + BX) — while keeping the entries of X,
which scale like 1/√(mn), away from fp16's subnormal floor (6e-8). With ‖X‖₂ ≤ 1 every intermediate stays
≤ ~3.2·s⁴ in magnitude, far below 65504 for s = 8. Both rescales are fused: the first iteration scales X as
it is loaded (before the cast to fp16, so an fp32 input loses nothing to underflow) and the last iteration's
epilogue divides by s before its single store. s must be a power of two so both are exact.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ._runtime import check_hot_dtype, is_power_of_two
from .ns5_axpb import axpb
from .ns5_gram import gram, poly

__all__ = ["ns5_iterate", "ns5_iterate_fp16_safe", "ns5_iterate_reference", "ns5_iterate_fp16_safe_reference",
           "FP16_SAFE_SCALE"]

FP16_SAFE_SCALE = 8.0  # mirrors nonans_optim.ns5._FP16_SAFE_SCALE (see its comment for the bound)


def _check_input(X: torch.Tensor) -> None:
    if X.ndim != 3:
        raise ValueError(f"X must be a (B, m, n) batch, got shape {tuple(X.shape)}")
    if X.shape[1] > X.shape[2]:
        raise ValueError(f"X must be wide (m <= n); transpose tall matrices first, got {tuple(X.shape)}")
    check_hot_dtype(X, "X")


def ns5_iterate(X: torch.Tensor, coefficients: Sequence[tuple[float, float, float]]) -> torch.Tensor:
    """Run one NS iteration per (a, b, c) in ``coefficients`` on the (B, m, n) batch ``X`` (m ≤ n).

    Never writes into X. Buffers are allocated once per call and reused across iterations."""
    _check_input(X)
    coefficients = list(coefficients)
    if not coefficients:
        return X
    X = X.contiguous()
    Bsz, m, _ = X.shape
    A = torch.empty((Bsz, m, m), dtype=X.dtype, device=X.device)
    Bm = torch.empty_like(A)
    buffers = [torch.empty_like(X), torch.empty_like(X) if len(coefficients) > 1 else None]
    current = X
    for i, (a, b, c) in enumerate(coefficients):
        gram(current, out=A)
        poly(A, b, c, out=Bm)
        current = axpb(Bm, current, a, out=buffers[i % 2])
    return current


def ns5_iterate_fp16_safe(X: torch.Tensor, coefficients: Sequence[tuple[float, float, float]],
                          scale: float = FP16_SAFE_SCALE) -> torch.Tensor:
    """fp16 NS iteration on ``scale·X`` with the rescale fused into the first loads and the last store.

    X: normalised, wide (B, m, n) batch in fp32 (preferred: nothing is rounded before the rescale), fp16 or
    bf16. Intermediates are fp16; the result is unscaled and has X's dtype. ``coefficients`` are the plain
    (unscaled) ones: this function derives b/s², c/s⁴ itself."""
    _check_input(X)
    if not is_power_of_two(scale):
        raise ValueError(f"scale must be a power of two so the rescale is exact, got {scale}")
    coefficients = list(coefficients)
    if not coefficients:
        return X
    X = X.contiguous()
    Bsz, m, n = X.shape
    s = float(scale)
    A = torch.empty((Bsz, m, m), dtype=torch.float16, device=X.device)
    Bm = torch.empty_like(A)
    buffers = [torch.empty((Bsz, m, n), dtype=torch.float16, device=X.device) for _ in range(2)]
    last = len(coefficients) - 1
    current = X
    for i, (a, b, c) in enumerate(coefficients):
        first = i == 0
        gram(current, out=A, in_scale=s if first else None, dtype=torch.float16)
        poly(A, b / s**2, c / s**4, out=Bm)
        out = None if i == last else buffers[i % 2]
        current = axpb(Bm, current, a, out=out, in_scale=s if first else None,
                       out_scale=1.0 / s if i == last else None,
                       out_dtype=X.dtype if i == last else torch.float16)
    return current


def ns5_iterate_reference(X: torch.Tensor, coefficients: Sequence[tuple[float, float, float]]) -> torch.Tensor:
    """Torch oracle of :func:`ns5_iterate`: ``nonans_optim.ns5.iterate_reference``."""
    from nonans_optim.ns5 import iterate_reference

    return iterate_reference(X, list(coefficients))


def ns5_iterate_fp16_safe_reference(X: torch.Tensor, coefficients: Sequence[tuple[float, float, float]],
                                    scale: float = FP16_SAFE_SCALE) -> torch.Tensor:
    """Torch oracle of :func:`ns5_iterate_fp16_safe`: the unfused sequence ``nonans_optim.ns5.ns5`` runs."""
    from nonans_optim.ns5 import iterate_reference

    coefficients = list(coefficients)
    if not coefficients:
        return X
    s = float(scale)
    scaled = [(a, b / s**2, c / s**4) for a, b, c in coefficients]
    Y = iterate_reference((X.float() * s).to(torch.float16), scaled)
    return (Y.float() / s).to(X.dtype)
