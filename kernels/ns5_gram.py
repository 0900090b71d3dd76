"""Symmetric products for NS5: ``gram(X) = X·Xᵀ`` and ``poly(A, b, c) = b·A + c·A²``.

Both are one kernel, :func:`_syrk_kernel`: ``C = alpha·(X·Xᵀ) + beta·ADD`` for X of shape (B, M, K).

* **One triangle.** ``X·Xᵀ`` is symmetric, so only tiles with tile_col ≥ tile_row do any work; each writes
  its block and the transposed block across the diagonal. That removes almost half of the ``X·Xᵀ`` FLOPs
  and, because ``A`` is symmetric too (``A² = A·Aᵀ``), half of the ``A²`` FLOPs: per NS5 iteration
  3m²n + m³ instead of 4m²n + 2m³ (the technique of microsoft/dion
  ``dion/newton_schulz_triton.py`` and modded-nanogpt ``triton_kernels.py``). Lower tiles exit at once;
  launching the full square grid keeps the grouped L2-friendly order (``_tiles.grouped_tile``).
* **Exactly symmetric output.** On a diagonal tile the direct store writes only col ≥ row and the mirrored
  store only row > col, so every entry is written once and ``C == C.mT`` bit for bit. The next kernel
  relies on it: ``A²`` is computed as ``A·Aᵀ`` and ``B·X`` assumes ``B = Bᵀ``.
* **Epilogue.** ``beta·ADD`` (the ``b·A`` term) is added to the fp32 accumulator before the single rounding
  to the output dtype — one rounding instead of torch's ``baddbmm`` path.
* **Batched** over the leading dim with int64 batch offsets (a (B, M, K) stack can exceed 2³¹ elements even
  when one matrix does not). Inputs are contiguous; out-of-range rows are wrapped (``% M``) instead of
  masked so the main loop only masks the K tail, and not even that when ``K % BLOCK_K == 0``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._runtime import H100_SMEM_BYTES, check_hot_dtype, interpreting, on_device, tl_dtype
from ._cast import cast_rtne
from ._tiles import dot_k_loop, grouped_tile

__all__ = ["gram", "poly", "gram_reference", "poly_reference", "SYRK_CONFIGS", "_syrk_kernel"]


def _config(block, block_k, warps, stages):
    return triton.Config({"BLOCK": block, "BLOCK_K": block_k, "GROUP": 8}, num_warps=warps, num_stages=stages)


# Square tiles only (the mirror store needs tile (r, c) and (c, r) to cover the same rows/cols).
# 128x128x64 with 8 warps is the Hopper workhorse (two warpgroups of wgmma); 64-wide tiles win when M is
# small and 128-wide tiles leave SMs idle (M = 1024 has only 36 upper tiles of 128).
SYRK_CONFIGS = [
    _config(128, 64, 8, 3),
    _config(128, 64, 8, 4),
    _config(128, 128, 8, 3),
    _config(64, 64, 4, 4),
    _config(64, 128, 4, 3),
]
_INTERPRETER_CONFIG = _config(16, 16, 1, 1)  # small tiles: ragged 40x72 test shapes span several tiles


def _prune_by_smem(configs, named_args, **kwargs):
    """Drop configs whose pipelined operand buffers exceed the sm_90 shared-memory limit (fp32 inputs)."""
    size = named_args["X"].element_size()
    kept = [c for c in configs
            if c.num_stages * 2 * c.kwargs["BLOCK"] * c.kwargs["BLOCK_K"] * size <= H100_SMEM_BYTES]
    return kept or configs[:1]


@triton.jit
def _syrk_kernel(X, ADD, C, M, K, BATCH, stride_xb, stride_xm, stride_cb, stride_cm, alpha, beta, in_scale,
                 BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                 HAS_ADD: tl.constexpr, SCALE_IN: tl.constexpr, EVEN_K: tl.constexpr,
                 UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """C[b] = alpha·(X'[b]·X'[b]ᵀ) + beta·ADD[b], X' = X·in_scale (if SCALE_IN) rounded to C's dtype.

    BATCH is read only by the autotuner's key: a stack of 32 small matrices fills the GPU with 128-wide
    tiles where a single one would want 64-wide tiles."""
    DOT: tl.constexpr = C.dtype.element_ty
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(M, BLOCK)
    per_batch = n_tiles * n_tiles
    batch = pid // per_batch
    tile_r, tile_c = grouped_tile(pid % per_batch, n_tiles, n_tiles, GROUP)
    if tile_c < tile_r:
        return  # lower triangle: tile (tile_c, tile_r) writes this block as its mirror
    X += batch.to(tl.int64) * stride_xb
    C += batch.to(tl.int64) * stride_cb
    rows = tile_r * BLOCK + tl.arange(0, BLOCK)
    cols = tile_c * BLOCK + tl.arange(0, BLOCK)
    ks = tl.arange(0, BLOCK_K)
    lhs = X + (rows % M)[:, None] * stride_xm + ks[None, :]
    rhs = X + (cols % M)[None, :] * stride_xm + ks[:, None]
    acc = dot_k_loop(lhs, rhs, K, BLOCK_K, in_scale, BLOCK, BLOCK, BLOCK_K, SCALE_IN, SCALE_IN, EVEN_K, DOT,
                     UPCAST, IEEE)
    acc = acc * alpha
    inside = (rows[:, None] < M) & (cols[None, :] < M)
    offsets = rows[:, None] * stride_cm + cols[None, :]
    if HAS_ADD:
        ADD += batch.to(tl.int64) * stride_cb
        acc += beta * tl.load(ADD + offsets, mask=inside, other=0.0).to(tl.float32)
    out = cast_rtne(acc, DOT, UPCAST)
    tl.store(C + offsets, out, mask=inside & (cols[None, :] >= rows[:, None]))
    mirror = cols[:, None] * stride_cm + rows[None, :]
    tl.store(C + mirror, tl.trans(out), mask=tl.trans(inside) & (cols[:, None] > rows[None, :]))


_HEURISTICS = {"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0}
if interpreting():
    _syrk = triton.autotune([_INTERPRETER_CONFIG], key=[])(triton.heuristics(_HEURISTICS)(_syrk_kernel))
else:
    _syrk = triton.autotune(SYRK_CONFIGS, key=["M", "K", "BATCH", "HAS_ADD", "SCALE_IN"],
                            prune_configs_by={"early_config_prune": _prune_by_smem})(
        triton.heuristics(_HEURISTICS)(_syrk_kernel))


def _launch_syrk(X, add, out, alpha, beta, in_scale):
    B, M, K = X.shape
    if M * max(K, M) >= 2**31:
        raise ValueError(f"one matrix of shape {(M, K)} has >= 2**31 elements; offsets inside a matrix are int32")
    grid = lambda meta: (B * triton.cdiv(M, meta["BLOCK"]) ** 2,)  # noqa: E731
    upcast = interpreting()
    with on_device(X):
        _syrk[grid](X, out if add is None else add, out, M, K, B, X.stride(0), X.stride(1), out.stride(0),
                    out.stride(1), float(alpha), float(beta), 1.0 if in_scale is None else float(in_scale),
                    HAS_ADD=add is not None, SCALE_IN=in_scale is not None, UPCAST=upcast,
                    IEEE=(out.dtype == torch.float32) and not upcast)
    return out


def _as_batch(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.ndim != 3:
        raise ValueError(f"{name} must be a (B, m, n) batch, got shape {tuple(t.shape)}")
    check_hot_dtype(t, name)
    return t.contiguous()


def _output(out, shape, dtype, like):
    if out is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {tuple(shape)}")
    if out.data_ptr() == like.data_ptr():
        raise ValueError("out must not alias the input: other tiles still read what a tile would overwrite")
    return out


def gram(X: torch.Tensor, *, out: torch.Tensor | None = None, in_scale: float | None = None,
         dtype: torch.dtype | None = None) -> torch.Tensor:
    """``A = X'·X'ᵀ`` for a (B, m, k) batch; X' = in_scale·X rounded to ``dtype`` (default X.dtype).

    fp32 accumulation, one rounding of the result to ``dtype``; the output is exactly symmetric."""
    X = _as_batch(X, "X")
    dtype = X.dtype if dtype is None else dtype
    tl_dtype(dtype)
    out = _output(out, (X.shape[0], X.shape[1], X.shape[1]), dtype, X)
    return _launch_syrk(X, None, out, 1.0, 0.0, in_scale)


def poly(A: torch.Tensor, b: float, c: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``b·A + c·A²`` for a batch of *symmetric* (B, m, m) matrices (A² is computed as A·Aᵀ)."""
    A = _as_batch(A, "A")
    if A.shape[1] != A.shape[2]:
        raise ValueError(f"poly needs square matrices, got shape {tuple(A.shape)}")
    out = _output(out, A.shape, A.dtype, A)
    return _launch_syrk(A, A, out, c, b, None)


def _rounded(X: torch.Tensor, in_scale: float | None, dtype: torch.dtype) -> torch.Tensor:
    return (X.float() * in_scale).to(dtype) if in_scale is not None else X.to(dtype)


def gram_reference(X: torch.Tensor, *, out: torch.Tensor | None = None, in_scale: float | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """Torch oracle of :func:`gram` (same signature): ``torch.bmm`` in ``dtype``."""
    dtype = X.dtype if dtype is None else dtype
    Xr = _rounded(X, in_scale, dtype)
    result = torch.bmm(Xr, Xr.mT)
    if out is not None:
        return out.copy_(result)
    return result


def poly_reference(A: torch.Tensor, b: float, c: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Torch oracle of :func:`poly` (same signature): ``torch.baddbmm(A, A, A, beta=b, alpha=c)``."""
    result = torch.baddbmm(A, A, A, beta=b, alpha=c)
    if out is not None:
        return out.copy_(result)
    return result
