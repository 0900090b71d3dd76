"""Gram Newton-Schulz: the NS iteration run on the small s×s Gram matrix instead of the s×l iterate.

Why it is the same iteration. For a wide normalised X₀ (s×l, s ≤ l) one NS step is
X_{k+1} = P_k X_k with P_k = a I + b R_k + c R_k², R_k = X_k X_kᵀ. Every P_k is a polynomial in R₀ = X₀X₀ᵀ,
so X_k = Q_k X₀ with Q_k an s×s polynomial in R₀ (all of them commute), and the loop runs on s×s matrices:

    Q₀ = I,   Q_{k+1} = P_k Q_k,   R_{k+1} = X_{k+1} X_{k+1}ᵀ = P_k R_k P_k,   X_out = Q_K X₀.

Q₁ = P₀ needs no matmul, and R is not needed after the last step. The s×l matmuls (2s²l FLOP each) are
only R₀ = X₀X₀ᵀ and the final Q X₀ (per segment, below); the rest are s³ matmuls. See :func:`gram_flops`:
five steps with restarts after steps 2 and 4 cost 22 s³ + 12 s²l FLOP against 10 s³ + 20 s²l for the
standard iteration — fewer once l/s > 1.5 (l = 4s: 0.78x, l = 3s: 0.83x; square: 1.13x).

Hazard 1, negative eigenvalues. In exact arithmetic R_k is positive semi-definite, but inside a segment R
is *never recomputed from X*: rounding puts eigenvalues ±ε·‖R‖ (ε ≈ 2⁻⁹ in bf16) on the directions where
the input's singular values are tiny or zero. A positive one is harmless — it is what a tiny singular
value would do. A negative one is not: p(λ) = a + bλ + cλ² then has all three terms positive (b < 0 < c),
so λ ← λ·p(λ)² grows by ≥ a² ≈ 11.9 per step with no cubic damping: -1e-4 becomes -1.2e-3, -0.014,
-0.18, -3.3 in four steps, and the last P, hence Q, is ~10⁴x too large on that direction. Measured in
bf16 on σ log-spread over 1e-4..1: output σ_max 261 instead of NS5's ≤ 1.2024 (tests/test_ns5_gram.py).
The standard iteration is immune because it rebuilds A = X Xᵀ from X every step. The fix (Dao et al.)
is a *restart*: form X = Q X₀ explicitly, recompute R = X Xᵀ (PSD up to one rounding), reset Q = I and
continue with X as the new X₀.

Hazard 2, the last segment is not self-correcting. Standard NS5 forgives rounding: each step re-reads
the current σ from X and p maps the whole band back into itself. Within a Gram segment, Q is a product of
rounded P's that no later step re-reads, and Q's eigenvalues span 1 (converged σ) to a^L (tiny σ) —
a³ ≈ 41 for three steps — so rounding Q to bf16 (≈ 2⁻⁹·‖Q‖₂ per direction) is an error of order
41·2⁻⁹ ≈ 8% on the converged directions, and nothing after the segment repairs it. Dao et
al.'s single restart after step 2 (segments [2, 3]; 28 s³ + 8 s²l) therefore leaves the band with
Keller's constant coefficients: in bf16, σ_max 1.29-1.33 on σ log-spread over 1e-4..1 and up to 1.26 on
Gaussian inputs, where restarting every two steps ([2, 2, 1], the default) kept σ_max ≤ 1.203 and the error
≤ 1.95x standard's over all 12 cases of RESULTS.md, "Newton-Schulz: standard vs Gram iteration on CPU" (3
shapes × 2 inputs × bf16/fp32; results/ns5_method.json). Scratch runs cited in commit 3ba53cb (2026-11-22,
not published) also had [3, 2] at σ_max 1.214 and 4.4x the standard error, and [2, 2, 1] within σ_max 1.204
and 2.15x over 84 cases including fp16. (With schedules whose late a is small, e.g. Polar Express, the
last segment's range a^L shrinks — pass ``restart_after``.)

Sources: T. Dao et al., "Gram Newton-Schulz" (https://tridao.me/blog/2026/gram-newton-schulz/) and
DeepSpeed PR #7953 "Add Gram Newton-Schulz orthogonalization for Muon" (restart after 2 iterations).
This file is an independent implementation of that description; the schedule and the ``baddbmm``
rounding layout (see :func:`iterate_gram`) are this library's, chosen by the measurements above.
"""
from __future__ import annotations

from typing import Sequence

import torch

from nonans_optim._workspace import Workspace

__all__ = ["iterate_gram", "gram_flops", "standard_flops", "segments"]


def segments(steps: int, restart_after: int | Sequence[int] | None = 2) -> list[int]:
    """Lengths of the runs of iterations between restarts.

    ``restart_after`` is an int k (restart every k steps: (5, 2) → [2, 2, 1]), a tuple of step counts
    after which to restart (``(2,)`` is Dao et al.'s single restart: [2, 3]), or ``None`` (no restart)."""
    if steps <= 0:
        return []
    if restart_after is None:
        cuts: list[int] = []
    elif isinstance(restart_after, int):
        if restart_after < 1:
            raise ValueError(f"restart_after must be >= 1, a tuple of steps, or None, got {restart_after!r}")
        cuts = list(range(restart_after, steps, restart_after))
    else:
        cuts = sorted({int(k) for k in restart_after if 0 < int(k) < steps})
    bounds = [0, *cuts, steps]
    return [hi - lo for lo, hi in zip(bounds, bounds[1:])]


def iterate_gram(X: torch.Tensor, coefficients: Sequence[tuple[float, float, float]], *,
                 restart_after: int | Sequence[int] | None = 2, tall: bool = False,
                 workspace: Workspace | None = None) -> torch.Tensor:
    """The NS iteration on a normalised, wide (s ≤ l) batch ``X`` of shape (B, s, l), in X's dtype —
    same contract and result (up to rounding) as :func:`nonans_optim.ns5.iterate_reference`.

    ``restart_after``: see :func:`segments`; ``None`` is the naive unrestarted Gram iteration, kept for
    tests and experiments. Rounding: like the standard iteration's ``aX + BX``, P = aI + B is never
    stored when it can be avoided — with B = bR + cR² the products are ``baddbmm`` calls PQ = aQ + BQ,
    PR = aR + BR and (PR)P = a(PR) + (PR)B, so the large a·I term is added before the one rounding. Only
    Q₁ = P₀ itself is formed (in place on B₀), and a one-step segment is exactly the standard step.

    ``tall=True``: X is (B, l, s), the transpose of the wide layout, and the iteration runs on it as is —
    R = XᵀX and X ← XQ (Q and P are polynomials in the symmetric R, so XQ = (QXᵀ)ᵀ) — giving the transpose
    of the wide result up to rounding without a transposed copy of the input or the output.

    ``workspace``: every intermediate is written with ``out=`` into it (:class:`~nonans_optim._workspace.
    Workspace`), so repeated calls allocate nothing; the result then lives in the workspace until its next
    use. Without one, a fresh workspace serves this call. The arithmetic is the same either way."""
    ws = workspace if workspace is not None else Workspace()
    coefficients = list(coefficients)
    s = X.shape[-1] if tall else X.shape[-2]
    small = (*X.shape[:-2], s, s)
    start = 0
    for length in segments(len(coefficients), restart_after):
        R = ws.get("R", small, X)
        torch.bmm(X.mT, X, out=R) if tall else torch.bmm(X, X.mT, out=R)
        Q = None
        for j, (a, b, c) in enumerate(coefficients[start:start + length]):
            B = ws.get(f"B{j}", small, X)
            torch.baddbmm(R, R, R, beta=b, alpha=c, out=B)  # b·R + c·R²
            if j + 1 < length:  # R is only needed by the next step of this segment
                T = ws.get("T", small, X)
                torch.baddbmm(R, B, R, beta=a, out=T)  # P R
                torch.baddbmm(T, T, B, beta=a, out=R)  # P R P (R itself is no longer an input)
            if j == 0:
                B0, a0 = B, a  # Q₁ = P₀ = a₀I + B₀, formed only if a second step needs it
            else:
                if Q is None:
                    Q = B0
                    Q.diagonal(dim1=-2, dim2=-1).add_(a0)
                Q_next = ws.other("Q", small, X, avoid=Q)
                torch.baddbmm(Q, B, Q, beta=a, out=Q_next)  # P Q
                Q = Q_next
        Y = ws.other("X", tuple(X.shape), X, avoid=X)
        if tall:
            torch.baddbmm(X, X, B0, beta=a0, out=Y) if Q is None else torch.bmm(X, Q, out=Y)
        else:
            torch.baddbmm(X, B0, X, beta=a0, out=Y) if Q is None else torch.bmm(Q, X, out=Y)
        X = Y
        start += length
    return X


def gram_flops(s: int, l: int, steps: int = 5, restart_after: int | Sequence[int] | None = 2) -> int:
    """FLOPs of :func:`iterate_gram` on one s×l matrix (2·m·n·k per m×k by k×n matmul).

    Per segment of length L: R = XXᵀ and X = QX (2s²l each); L matmuls R² (2s³), L-1 products PQ and
    L-1 updates PRP (2 matmuls) — 4L-3 s³-matmuls. Default [2, 2, 1]: 11 matmuls = 22 s³, plus 12 s²l;
    Dao's [2, 3]: 28 s³ + 8 s²l."""
    total = 0
    for length in segments(steps, restart_after):
        total += 2 * (2 * s * s * l) + (4 * length - 3) * 2 * s ** 3
    return total


def standard_flops(s: int, l: int, steps: int = 5) -> int:
    """FLOPs of the standard iteration: A = XXᵀ and (bA + cA²)X (2s²l each), A² (2s³) per step."""
    return steps * (4 * s * s * l + 2 * s ** 3)
