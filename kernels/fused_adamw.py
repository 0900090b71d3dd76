"""One fused Triton kernel for the scalar (elementwise) AdamW path with detection, repair and counting.

Each element of param, grad, exp_avg and exp_avg_sq is read once and each of param/exp_avg/exp_avg_sq is
written once: the memory-bound minimum for an AdamW step (7 tensor accesses), where torch's foreach path
makes several passes and a separate ``isfinite`` check makes another. Inside the one pass:

1. detection — ``g`` is finite iff ``g == g`` (not NaN) and ``|g| != inf``; counts of NaN and Inf go to an
   int64 device counter with one atomic per dirty block (``_elementwise.py``);
2. repair (policy ``"repair"``) — the moments keep their old value where ``g`` is not finite, selected with
   ``tl.where`` (a 0/1 multiply would turn 0·NaN into NaN); the param update uses those moments, i.e. the
   step continues along the last good estimate instead of stopping or absorbing the NaN;
3. AdamW (Loshchilov & Hutter 2019, Alg. 2, in torch.optim.AdamW's order): ``p ← p·(1 − lr·wd)``,
   ``m ← m + (1 − β1)(g − m)``, ``v ← β2·v + (1 − β2)·g²``,
   ``p ← p − (lr / bc1)·m / (√v / √bc2 + eps)``. Math in fp32 whatever the storage dtype, with IEEE
   ``sqrt_rn``/``div_rn`` (Triton's default sqrt/div are approximate) so fp32 results track torch.

``lr``, ``bias_correction1`` (= 1 − β1^t) and ``bias_correction2`` (= 1 − β2^t) may be Python numbers or
one-element device tensors read in-kernel (no host sync). ``"skip"``: see ``_elementwise.py``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nonans_optim.detection import storable_mask

from ._cast import cast_rtne
from ._elementwise import (check_counters, elementwise_block, kept_finite, load_grad_block, policy_code,
                           reference_counts_and_skip, skip_flag_and_count)
from ._runtime import interpreting, on_device, scalar_arg

__all__ = ["fused_adamw_", "fused_adamw_reference_", "_adamw_kernel"]


@triton.jit
def _load_scalar(arg, IS_PTR: tl.constexpr):
    if IS_PTR:
        value = tl.load(arg).to(tl.float32)
    else:
        value = arg
    return value


@triton.jit
def _adamw_kernel(P, G, M, V, COUNTS, FLAG, N, lr, beta1, beta2, eps, weight_decay, bc1, bc2,
                  LR_PTR: tl.constexpr, BC1_PTR: tl.constexpr, BC2_PTR: tl.constexpr, POLICY: tl.constexpr,
                  COUNT: tl.constexpr, HAS_FLAG: tl.constexpr, BLOCK: tl.constexpr, EMULATE: tl.constexpr):
    """In-place AdamW on one BLOCK of the flattened tensors; POLICY 0 off, 1 repair, 2 skip."""
    offsets, mask, g, go = load_grad_block(G, COUNTS, FLAG, N, COUNT, HAS_FLAG, BLOCK)
    if go:
        lr_value = _load_scalar(lr, LR_PTR)
        bc1_value = _load_scalar(bc1, BC1_PTR)
        bc2_value = _load_scalar(bc2, BC2_PTR)
        p = tl.load(P + offsets, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(M + offsets, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(V + offsets, mask=mask, other=0.0).to(tl.float32)
        m_new = m + (1.0 - beta1) * (g - m)
        v_new = v * beta2 + (1.0 - beta2) * (g * g)
        if POLICY != 0:  # missing entries, and overflows with finite inputs (as stored): keep the old value
            finite = (g == g) & (tl.abs(g) != float("inf"))
            # either moment not kept finite: a missing observation, both keep their values (one overflowed
            # alone, the other written, moved the parameter by ~1e35: functional/adam.py::_observed)
            seen = finite & kept_finite(m_new, M.dtype.element_ty, EMULATE) & kept_finite(v_new, V.dtype.element_ty,
                                                                                            EMULATE)
            m_new = tl.where(seen, m_new, m)
            v_new = tl.where(seen, v_new, v)
        p_new = p * (1.0 - lr_value * weight_decay)
        denom = tl.div_rn(tl.sqrt_rn(v_new), tl.sqrt_rn(bc2_value)) + eps
        p_new = p_new - tl.div_rn(lr_value, bc1_value) * tl.div_rn(m_new, denom)
        if POLICY != 0:
            p_new = tl.where(kept_finite(p_new, P.dtype.element_ty, EMULATE), p_new, p)
        tl.store(P + offsets, cast_rtne(p_new, P.dtype.element_ty, EMULATE), mask=mask)
        tl.store(M + offsets, cast_rtne(m_new, M.dtype.element_ty, EMULATE), mask=mask)
        tl.store(V + offsets, cast_rtne(v_new, V.dtype.element_ty, EMULATE), mask=mask)


def _check_tensors(param, grad, exp_avg, exp_avg_sq):
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.shape != param.shape or t.device != param.device:
            raise ValueError(f"{name} must match param's shape and device")
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernel walks the flat storage)")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {t.dtype}")


def fused_adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 counters: torch.Tensor | None = None, *, lr, beta1: float, beta2: float, eps: float,
                 weight_decay: float, bias_correction1, bias_correction2, policy: str = "repair",
                 skip_flag: torch.Tensor | None = None) -> None:
    """One in-place AdamW step of ``param`` (and its moments) from ``grad`` (never modified).

    Args:
        counters: optional int64 device tensor; ``counters[0] += #NaN(grad)``, ``counters[1] += #Inf(grad)``
            under ``"repair"`` and ``"skip"`` (``"off"`` does no detection).
        lr, bias_correction1, bias_correction2: float or one-element device tensor.
        policy: ``"repair"`` | ``"skip"`` | ``"off"`` (module docstring of ``_elementwise.py``).
        skip_flag: ``"skip"`` only — a precomputed one-element integer device tensor, nonzero = skip; without
            it a first pass over ``grad`` computes the tensor's own verdict.
    """
    code = policy_code(policy)
    _check_tensors(param, grad, exp_avg, exp_avg_sq)
    check_counters(counters, param.device)
    if skip_flag is not None and code != 2:
        raise ValueError("skip_flag is only meaningful with policy='skip'")
    n = param.numel()
    if n == 0:
        return
    lr_arg, lr_ptr = scalar_arg(lr, "lr", param.device)
    bc1_arg, bc1_ptr = scalar_arg(bias_correction1, "bias_correction1", param.device)
    bc2_arg, bc2_ptr = scalar_arg(bias_correction2, "bias_correction2", param.device)
    with on_device(param):
        flag, count = skip_flag_and_count(code, grad, counters, skip_flag)
        block, warps = elementwise_block()
        dummy = param  # never dereferenced when its constexpr switch is off
        _adamw_kernel[(triton.cdiv(n, block),)](
            param, grad, exp_avg, exp_avg_sq, counters if count else dummy, dummy if flag is None else flag, n,
            lr_arg, float(beta1), float(beta2), float(eps), float(weight_decay), bc1_arg, bc2_arg,
            LR_PTR=lr_ptr, BC1_PTR=bc1_ptr, BC2_PTR=bc2_ptr, POLICY=code, COUNT=count, HAS_FLAG=flag is not None,
            BLOCK=block, EMULATE=interpreting(), num_warps=warps)


def fused_adamw_reference_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                           exp_avg_sq: torch.Tensor, counters: torch.Tensor | None = None, *, lr, beta1: float,
                           beta2: float, eps: float, weight_decay: float, bias_correction1, bias_correction2,
                           policy: str = "repair", skip_flag: torch.Tensor | None = None) -> None:
    """Pure-torch oracle of :func:`fused_adamw_` (same signature and semantics, fp32 math, no host sync)."""
    code = policy_code(policy)
    g = grad.float()
    finite, skip = reference_counts_and_skip(g, counters, code, skip_flag)
    p, m, v = param.float(), exp_avg.float(), exp_avg_sq.float()
    m_new = m + (1.0 - beta1) * (g - m)
    v_new = v * beta2 + (1.0 - beta2) * (g * g)
    if code != 0:
        seen = finite & storable_mask(m_new, exp_avg.dtype) & storable_mask(v_new, exp_avg_sq.dtype)
        m_new = torch.where(seen, m_new, m)
        v_new = torch.where(seen, v_new, v)
    bc2 = torch.as_tensor(bias_correction2, dtype=torch.float32, device=p.device)
    p_new = p * (1.0 - lr * weight_decay)
    p_new = p_new - (lr / bias_correction1) * (m_new / (v_new.sqrt() / bc2.sqrt() + eps))
    if code != 0:
        p_new = torch.where(storable_mask(p_new, param.dtype), p_new, p)
    if code == 2:
        p_new, m_new, v_new = (torch.where(skip, old, new) for old, new in ((p, p_new), (m, m_new), (v, v_new)))
    param.copy_(p_new)
    exp_avg.copy_(m_new)
    exp_avg_sq.copy_(v_new)
