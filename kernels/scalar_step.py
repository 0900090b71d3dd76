"""The whole (SF-)AdamW + resolution step of a parameter group as multi-tensor Triton launches (the update;
under a resolution policy first the decisions, one or two launches: ``decisions.py``).

``fused_adamw.py`` is one tensor's AdamW with detection and repair; this module is what ``impl="fused"``
runs on CUDA: every tensor of a group in one launch per pass (a launch per tensor would cost more host time
than a small model's whole step), with the library's full resolution semantics — the spike guard, the
hold rule, "skip", the last-line update guard, the escalation scale and the dense (P, S, 2) event counts.
The arithmetic is that of ``nonans_optim/optimizers/_compiled.py::_one_tensor`` line for line (the CPU twin
is ``nonans_optim/native/scalar_step.c``), and :func:`scalar_step_reference_` — the compiled path's own
group function, run eagerly — is the test oracle with the same signature.

Launches (no host synchronisation: every decision is read from device memory by the next launch):

1. under "repair" and "skip" first the decisions (:mod:`.decisions`: the gradient statistics where a
   decision needs them, then per tensor the spike guard's scale and new EMA, the hold / keep-all flags —
   one launch, or two) into scratch only: the update kernel commits the EMA and the spike count, so every
   persistent write happens in the last launch (a launch that fails to compile, say on another Triton
   version, leaves the optimizer as it was: ``_fused_triton`` then falls back);
2. ``_update_kernel``: per block, read p, g, m (or z), v once, write them once; detection, the gates and
   the counts in registers, one atomic per count only for a block that has something to count (a clean
   step issues none). Under a policy a block first computes what "off" computes and tests it
   (:func:`.scalar_update._speculative_block`, with the per-entry arithmetic); only a block where a gate
   would select something reads its inputs again for the gated recomputation.

Tensors are reached through a table of their addresses (int64, one row per tensor: p, g, m|z, v), turned
back into typed pointers in the kernel; all tensors of one launch share one dtype (:func:`supported`; a
group that mixes dtypes runs ``impl="compiled"``). Math is fp32 whatever the storage dtype, with IEEE
``div_rn``/``sqrt_rn`` as torch uses, and the update is compiled without FMA contraction
(``enable_fp_fusion=False``, as the C loop uses ``-ffp-contract=off``): "repair" and "off" are different
compiled variants of it, and a clean "repair" step must equal "off" bit for bit, which a contraction chosen
differently in each variant would break.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nonans_optim.resolution import RecentRule

from ._elementwise import elementwise_block, policy_code
from ._multi import _ROW, _SPIKE, _block, _column, _layout, address_table, supported
from ._runtime import interpreting, on_device, tl_dtype
from .decisions import decisions
from .scalar_update import _speculative_update, _update_block

__all__ = ["scalar_step_", "scalar_step_reference_", "supported", "group_launch", "_update_kernel"]


@triton.jit
def _columns(ADDR, t, start, TY: tl.constexpr, ALIGNED: tl.constexpr):
    """Typed pointers to the block's first entry of p, g, m|z and v (the address table's four columns)."""
    return (_column(ADDR, t, 0, TY, start, ALIGNED), _column(ADDR, t, 1, TY, start, ALIGNED),
            _column(ADDR, t, 2, TY, start, ALIGNED), _column(ADDR, t, 3, TY, start, ALIGNED))


@triton.jit
def _update_kernel(ADDR, NUMEL, FIRST, BLOCK_TENSOR, BC, HP, GAMMA, SCALE, SEL, DEC, DEC_FLAGS, EMA, DENSE,
                   TY: tl.constexpr, SF: tl.constexpr, GATE: tl.constexpr, GUARD: tl.constexpr,
                   DECAY_Z: tl.constexpr, ALIGNED: tl.constexpr, EMULATE: tl.constexpr, BLOCK: tl.constexpr):
    """One block of one tensor. GATE: a Resolution exists (policy "repair" or "skip"); then
    SCALE/SEL/DEC*/DENSE (and EMA with GUARD) are real, otherwise never dereferenced. A tensor's first
    block also commits the decide kernel's spike-guard EMA and spike count."""
    pid, t, start, rem = _block(BLOCK_TENSOR, FIRST, NUMEL, BLOCK)
    p_ptr, g_ptr, s_ptr, v_ptr = _columns(ADDR, t, start, TY, ALIGNED)
    bc1, bc2 = tl.load(BC + 2 * t), tl.load(BC + 2 * t + 1)
    lr = tl.load(GAMMA)
    s = 1.0
    sel = t
    flags = t * 0
    if GATE:
        sel = tl.load(SEL + t)
        lr = lr * tl.load(SCALE + sel)
        s = tl.load(DEC + 2 * t)
        flags = tl.load(DEC_FLAGS + t)
        if GUARD:
            if start == 0:
                tl.store(EMA + sel, tl.load(DEC + 2 * t + 1))
                spike_row = DENSE + sel * _ROW
                tl.store(spike_row + _SPIKE, tl.load(spike_row + _SPIKE) + ((flags >> 2) & 1).to(tl.int64))
    hold = (flags & 1) != 0
    keep_all = (flags & 2) != 0
    idx = tl.arange(0, BLOCK)
    if GATE:
        _speculative_update(p_ptr, g_ptr, s_ptr, v_ptr, rem, HP, bc1, bc2, lr, s, hold, keep_all, DENSE + sel * _ROW,
                           TY, SF, DECAY_Z, EMULATE, BLOCK)
    elif rem >= BLOCK:
        _update_block(p_ptr, g_ptr, s_ptr, v_ptr, idx, idx < rem, HP, bc1, bc2, lr, s, hold, keep_all, TY, SF,
                      False, DECAY_Z, EMULATE, False)
    else:
        _update_block(p_ptr, g_ptr, s_ptr, v_ptr, idx, idx < rem, HP, bc1, bc2, lr, s, hold, keep_all, TY, SF,
                      False, DECAY_Z, EMULATE, True)


def scalar_step_(params, grads, ms, vs, zs, gamma, res, sel, bcs, hp, *, sf: bool, policy: str, decay_z: bool,
                 factor: float | None, tickets: torch.Tensor | None = None) -> None:
    """The group step of ``_compiled._group_kernel`` (same arguments): ``ms`` (AdamW) or ``zs``
    (schedule-free) hold the second state tensor, the other list Nones; ``res`` is None under "off", else
    (scale, recent, norm EMA, dense counts) — the Resolution tensors, updated in place, where ``recent`` is
    the (P,) flags or a ``resolution.RecentRule`` (the decide kernel then reads the counters itself, which
    saves the host the five launches of evaluating it: what ``impl="fused"`` passes); ``sel`` the global
    parameter indices; ``bcs`` (n, 2) fp32 bias corrections, ``hp`` the seven fp32 hyperparameters,
    ``gamma`` the 0-d step size, all on the tensors' device. ``tickets``: zeroed int32 scratch of one entry
    per tensor (left zeroed), which lets the statistics and decide launches run as one where both run
    (:mod:`.decisions`). Nothing is read back to the host."""
    code = policy_code(policy)
    if (res is None) != (code == 0):
        raise ValueError("res must be given exactly when the policy is not 'off'")
    launch = group_launch(params, grads, zs if sf else ms, vs)
    if launch is None:
        return
    (numel, first, owner, nblocks), addr, aligned = launch
    block, warps = elementwise_block()
    ty = tl_dtype(params[0].dtype)
    with on_device(params[0]):
        dec = dec_flags = dense = scale = ema = None
        if res is not None:
            scale, _, ema, dense = res
            lazy = code == 1 and factor is None
            fold = tickets is not None and not lazy and all([p.numel() for p in params])
            dec, dec_flags = decisions(addr, (numel, first, owner, nblocks), sel, res, code, factor, ty, aligned,
                                       lazy=lazy, tickets=tickets if fold else None)
        dummy = bcs  # never dereferenced when GATE is off
        _update_kernel[(nblocks,)](
            addr, numel, first, owner, bcs, hp, gamma, *(dummy if x is None else x
                                                          for x in (scale, sel, dec, dec_flags, ema, dense)),
            TY=ty, SF=sf, GATE=res is not None, GUARD=res is not None and factor is not None, DECAY_Z=decay_z,
            ALIGNED=aligned, EMULATE=interpreting(), BLOCK=block, num_warps=warps, enable_fp_fusion=False)


def group_launch(params, grads, seconds, vs):
    """What a launch over a group's blocks needs: ((numel, first, owner, nblocks) of :func:`._multi._layout`,
    the (n, 4) address table of p, g, m|z, v, whether every address is 16-byte aligned); None when there is
    nothing to launch (no tensor, or only empty ones)."""
    if not params:
        return None
    block, _ = elementwise_block()
    layout = _layout(tuple(p.numel() for p in params), block, str(params[0].device))
    if layout[3] == 0:
        return None
    addr, aligned = address_table([t.data_ptr() for row in zip(params, grads, seconds, vs) for t in row],
                                  params[0].device)
    return layout, addr, aligned


def scalar_step_reference_(params, grads, ms, vs, zs, gamma, res, sel, bcs, hp, *, sf: bool, policy: str,
                           decay_z: bool, factor: float | None, tickets: torch.Tensor | None = None) -> None:
    """Pure-torch oracle of :func:`scalar_step_`: the compiled path's group function, run eagerly (a
    ``RecentRule`` evaluated by its torch form; ``tickets``, the kernels' scratch, unused)."""
    from nonans_optim.optimizers._compiled import _group_kernel
    if res is not None and isinstance(res[1], RecentRule):
        res = (res[0], res[1].flags(), *res[2:])
    _group_kernel(params, grads, ms, vs, zs, gamma, res, sel, bcs, hp, sf=sf, policy=policy, decay_z=decay_z,
                  factor=factor)
