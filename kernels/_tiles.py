"""Device helpers shared by the matmul kernels (``ns5_gram.py``, ``ns5_axpb.py``).

* :func:`grouped_tile` — the tile visiting order. Consecutive programs take ``GROUP`` tile-rows column by
  column, so the row panels they read stay in L2 while the column panels stream (the "grouped ordering" of
  the Triton matmul tutorial). With naive row-major order at 8192² bf16 the ~132 resident tiles would touch
  ~66 distinct 2 MB panels, more than the H100's 50 MB L2.
* :func:`prep_operand` — what happens to a loaded tile before ``tl.dot``: an optional exact power-of-two
  rescale (the fp16-safe variant scales its input on load, so a tiny fp32 entry is lifted *before* it is
  rounded to fp16), the cast to the dot dtype, and the interpreter's bf16 upcast (see ``_runtime.py``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._cast import cast_rtne


@triton.jit
def grouped_tile(pid, n_rows, n_cols, GROUP: tl.constexpr):
    """Map a linear program id to (tile_row, tile_col) in grouped order."""
    per_group = GROUP * n_cols
    group = pid // per_group
    first_row = group * GROUP
    rows_here = tl.minimum(n_rows - first_row, GROUP)
    local = pid % per_group
    return first_row + local % rows_here, local // rows_here


@triton.jit
def prep_operand(x, scale, SCALE: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr):
    """Loaded tile -> dot operand: optional fp32 rescale, round to the dot dtype, interpreter upcast."""
    if SCALE:
        x = cast_rtne(x.to(tl.float32) * scale, DOT, UPCAST)
    else:
        x = cast_rtne(x, DOT, UPCAST)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def dot_k_loop(lhs, rhs, K, rhs_step, scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, SCALE_LHS: tl.constexpr, SCALE_RHS: tl.constexpr, EVEN_K: tl.constexpr,
               DOT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """fp32 (BLOCK_M, BLOCK_N) tile of Σ_k lhs_k · rhs_k over the contraction length K: ``lhs`` points at a
    (BLOCK_M, BLOCK_K) tile and advances BLOCK_K elements per step, ``rhs`` at a (BLOCK_K, BLOCK_N) tile and
    advances ``rhs_step``; a ragged last step is masked to zero. Shared by the Gram (X·Xᵀ) and aX + BX
    kernels, which differ only in their pointers and in which operand takes the input rescale."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(lhs)
            b = tl.load(rhs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(lhs, mask=ks[None, :] < k_left, other=0.0)
            b = tl.load(rhs, mask=ks[:, None] < k_left, other=0.0)
        a = prep_operand(a, scale, SCALE_LHS, DOT, UPCAST)
        b = prep_operand(b, scale, SCALE_RHS, DOT, UPCAST)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        lhs += BLOCK_K
        rhs += rhs_step
    return acc
