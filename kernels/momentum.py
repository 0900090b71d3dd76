"""Fused momentum update of the spectral (Muon / SF-NorMuon) path with detection, repair and counting.

``buf ← β·buf + (1 − β)·g`` — written as ``buf + (1 − β)(g − buf)``, torch's ``lerp_`` form for weights
below 0.5 — in one pass that reads ``buf`` and ``g`` once and writes ``buf`` once. Under ``"repair"`` an
entry whose gradient is not finite keeps its old momentum (missing observation, ``tl.where`` select), so a
NaN never enters the buffer that feeds NS5; ``"skip"`` leaves the whole buffer untouched if any entry is
non-finite; ``"off"`` is the stock update. A new value that overflows with finite inputs (g - buf) keeps the
old one under both. NaN/Inf counts go to an int64 device counter (``_elementwise.py``
has the policy and counting details, shared with ``fused_adamw.py``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nonans_optim.detection import storable_mask

from ._cast import cast_rtne
from ._elementwise import (check_counters, elementwise_block, kept_finite, load_grad_block, policy_code,
                           reference_counts_and_skip, skip_flag_and_count)
from ._runtime import interpreting, on_device

__all__ = ["momentum_update_", "momentum_update_reference_", "_momentum_kernel"]


@triton.jit
def _momentum_kernel(BUF, G, COUNTS, FLAG, N, beta, POLICY: tl.constexpr, COUNT: tl.constexpr,
                     HAS_FLAG: tl.constexpr, BLOCK: tl.constexpr, EMULATE: tl.constexpr):
    """In-place momentum update on one BLOCK; POLICY 0 off, 1 repair, 2 skip."""
    offsets, mask, g, go = load_grad_block(G, COUNTS, FLAG, N, COUNT, HAS_FLAG, BLOCK)
    if go:
        buf = tl.load(BUF + offsets, mask=mask, other=0.0).to(tl.float32)
        new = buf + (1.0 - beta) * (g - buf)
        if POLICY != 0:  # missing entries, and g - buf overflowing with both finite: keep the old value
            finite = (g == g) & (tl.abs(g) != float("inf"))
            new = tl.where(finite & kept_finite(new, BUF.dtype.element_ty, EMULATE), new, buf)
        tl.store(BUF + offsets, cast_rtne(new, BUF.dtype.element_ty, EMULATE), mask=mask)


def momentum_update_(buf: torch.Tensor, grad: torch.Tensor, counters: torch.Tensor | None = None, *,
                     beta: float, policy: str = "repair", skip_flag: torch.Tensor | None = None) -> None:
    """In place: ``buf ← β·buf + (1 − β)·grad`` under ``policy`` (``grad`` is never modified).

    ``counters`` and ``skip_flag`` behave as in :func:`nonans_optim.kernels.fused_adamw.fused_adamw_`."""
    code = policy_code(policy)
    if buf.shape != grad.shape or buf.device != grad.device:
        raise ValueError("buf and grad must have the same shape and device")
    if not (buf.is_contiguous() and grad.is_contiguous()):
        raise ValueError("buf and grad must be contiguous (the kernel walks the flat storage)")
    check_counters(counters, buf.device)
    if skip_flag is not None and code != 2:
        raise ValueError("skip_flag is only meaningful with policy='skip'")
    n = buf.numel()
    if n == 0:
        return
    with on_device(buf):
        flag, count = skip_flag_and_count(code, grad, counters, skip_flag)
        block, warps = elementwise_block()
        _momentum_kernel[(triton.cdiv(n, block),)](
            buf, grad, counters if count else buf, buf if flag is None else flag, n, float(beta), POLICY=code,
            COUNT=count, HAS_FLAG=flag is not None, BLOCK=block, EMULATE=interpreting(), num_warps=warps)


def momentum_update_reference_(buf: torch.Tensor, grad: torch.Tensor, counters: torch.Tensor | None = None,
                               *, beta: float, policy: str = "repair",
                               skip_flag: torch.Tensor | None = None) -> None:
    """Pure-torch oracle of :func:`momentum_update_` (same signature and semantics, fp32 math, no sync)."""
    code = policy_code(policy)
    g = grad.float()
    finite, skip = reference_counts_and_skip(g, counters, code, skip_flag)
    old = buf.float()
    new = old + (1.0 - beta) * (g - old)
    if code != 0:
        new = torch.where(finite & storable_mask(new, buf.dtype), new, old)
    if code == 2:
        new = torch.where(skip, old, new)
    buf.copy_(new)
