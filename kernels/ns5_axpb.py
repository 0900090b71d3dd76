"""``axpb(B, X, a) = a·X + B·X``: the last product of an NS5 iteration, with ``a·X`` fused in the epilogue.

A plain tiled GEMM over the (m, n) output — B is (B, m, m), X is (B, m, n) — whose epilogue loads the X
tile under the output tile and adds ``a·X`` to the fp32 accumulator before the one rounding, so the
iteration never materialises ``B·X`` (torch's ``baddbmm`` does the same on cuBLAS). Two optional exact
power-of-two scales serve the fp16-safe variant (``ns5.py``): ``in_scale`` rescales X as it is loaded
(operand and epilogue term alike) and ``out_scale`` rescales the result before it is stored, so entering
and leaving the scaled iteration costs no extra pass over memory.

Batched with int64 batch offsets; grouped tile order for L2 reuse (``_tiles.py``); autotuned over a small
Hopper-oriented set (128x128x64 and 128x256x64 with 8 warps, 3-4 stages), pruned by shared memory.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._runtime import H100_SMEM_BYTES, check_hot_dtype, interpreting, on_device, tl_dtype
from ._cast import cast_rtne
from ._tiles import dot_k_loop, grouped_tile

__all__ = ["axpb", "axpb_reference", "AXPB_CONFIGS", "_axpb_kernel"]


def _config(bm, bn, bk, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP": 8},
                         num_warps=warps, num_stages=stages)


AXPB_CONFIGS = [
    _config(128, 128, 64, 8, 3),
    _config(128, 128, 64, 8, 4),
    _config(128, 256, 64, 8, 3),
    _config(64, 128, 64, 4, 4),
    _config(128, 64, 64, 4, 4),
]
_INTERPRETER_CONFIG = _config(16, 32, 16, 1, 1)


def _prune_by_smem(configs, named_args, **kwargs):
    """Drop configs whose pipelined B and X tiles exceed the sm_90 shared-memory limit."""
    size = max(named_args["Bm"].element_size(), named_args["X"].element_size())
    kept = []
    for c in configs:
        kw = c.kwargs
        if c.num_stages * (kw["BLOCK_M"] + kw["BLOCK_N"]) * kw["BLOCK_K"] * size <= H100_SMEM_BYTES:
            kept.append(c)
    return kept or configs[:1]


@triton.jit
def _axpb_kernel(Bm, X, Y, M, N, BATCH, stride_bb, stride_bm, stride_xb, stride_xm, stride_yb, stride_ym,
                 a, in_scale, out_scale,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                 SCALE_IN: tl.constexpr, SCALE_OUT: tl.constexpr, EVEN_K: tl.constexpr,
                 UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """Y[b] = out_scale·(a·X'[b] + Bm[b]·X'[b]), X' = in_scale·X (the dot operand rounded to Bm's dtype).

    BATCH is read only by the autotuner's key (the best tile depends on how many tiles the stack has)."""
    DOT: tl.constexpr = Bm.dtype.element_ty
    pid = tl.program_id(0)
    n_rows = tl.cdiv(M, BLOCK_M)
    n_cols = tl.cdiv(N, BLOCK_N)
    per_batch = n_rows * n_cols
    batch = pid // per_batch
    tile_r, tile_c = grouped_tile(pid % per_batch, n_rows, n_cols, GROUP)
    Bm += batch.to(tl.int64) * stride_bb
    X += batch.to(tl.int64) * stride_xb
    Y += batch.to(tl.int64) * stride_yb
    rows = tile_r * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_c * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    lhs = Bm + (rows % M)[:, None] * stride_bm + ks[None, :]
    rhs = X + ks[:, None] * stride_xm + (cols % N)[None, :]
    acc = dot_k_loop(lhs, rhs, M, BLOCK_K * stride_xm, in_scale, BLOCK_M, BLOCK_N, BLOCK_K, False, SCALE_IN,
                     EVEN_K, DOT, UPCAST, IEEE)
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    x_tile = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    if SCALE_IN:
        x_tile = x_tile * in_scale
    acc += a * x_tile
    if SCALE_OUT:
        acc = acc * out_scale
    out = cast_rtne(acc, Y.dtype.element_ty, UPCAST)
    tl.store(Y + rows[:, None] * stride_ym + cols[None, :], out, mask=inside)


_HEURISTICS = {"EVEN_K": lambda args: args["M"] % args["BLOCK_K"] == 0}
if interpreting():
    _axpb = triton.autotune([_INTERPRETER_CONFIG], key=[])(triton.heuristics(_HEURISTICS)(_axpb_kernel))
else:
    _axpb = triton.autotune(AXPB_CONFIGS, key=["M", "N", "BATCH", "SCALE_IN", "SCALE_OUT"],
                            prune_configs_by={"early_config_prune": _prune_by_smem})(
        triton.heuristics(_HEURISTICS)(_axpb_kernel))


def axpb(B: torch.Tensor, X: torch.Tensor, a: float, *, out: torch.Tensor | None = None,
         in_scale: float | None = None, out_scale: float | None = None,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``out_scale·(a·X' + B·X')`` with X' = in_scale·X; B (B, m, m) symmetric-or-not, X (B, m, n).

    The product runs in B's dtype (X is rounded to it on load), accumulates in fp32 and is rounded once to
    ``out_dtype`` (default X.dtype)."""
    for t, name in ((B, "B"), (X, "X")):
        if t.ndim != 3:
            raise ValueError(f"{name} must be a (B, m, n) batch, got shape {tuple(t.shape)}")
        check_hot_dtype(t, name)
    Bsz, M, N = X.shape
    if tuple(B.shape) != (Bsz, M, M):
        raise ValueError(f"B must have shape {(Bsz, M, M)}, got {tuple(B.shape)}")
    if M * max(M, N) >= 2**31:
        raise ValueError(f"one matrix of shape {(M, N)} has >= 2**31 elements; offsets inside a matrix are int32")
    B, X = B.contiguous(), X.contiguous()
    out_dtype = X.dtype if out_dtype is None else out_dtype
    tl_dtype(out_dtype)
    if out is None:
        out = torch.empty((Bsz, M, N), dtype=out_dtype, device=X.device)
    elif tuple(out.shape) != (Bsz, M, N) or out.dtype != out_dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {out_dtype} tensor of shape {(Bsz, M, N)}")
    elif out.data_ptr() in (B.data_ptr(), X.data_ptr()):
        raise ValueError("out must not alias B or X: other tiles still read what a tile would overwrite")
    grid = lambda meta: (Bsz * triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    upcast = interpreting()
    with on_device(X):
        _axpb[grid](B, X, out, M, N, Bsz, B.stride(0), B.stride(1), X.stride(0), X.stride(1), out.stride(0),
                    out.stride(1), float(a), 1.0 if in_scale is None else float(in_scale),
                    1.0 if out_scale is None else float(out_scale),
                    SCALE_IN=in_scale is not None, SCALE_OUT=out_scale is not None, UPCAST=upcast,
                    IEEE=(B.dtype == torch.float32) and not upcast)
    return out


def axpb_reference(B: torch.Tensor, X: torch.Tensor, a: float, *, out: torch.Tensor | None = None,
                   in_scale: float | None = None, out_scale: float | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Torch oracle of :func:`axpb` (same signature): ``torch.baddbmm(X', B, X', beta=a)`` in B's dtype."""
    out_dtype = X.dtype if out_dtype is None else out_dtype
    Xr = (X.float() * in_scale).to(B.dtype) if in_scale is not None else X.to(B.dtype)
    result = torch.baddbmm(Xr, B, Xr, beta=a, alpha=1.0)
    if out_scale is not None:
        result = result.float() * out_scale
    result = result.to(out_dtype)
    if out is not None:
        return out.copy_(result)
    return result
