"""The whole (SF-)AdamW + resolution step of a parameter group as multi-tensor Triton launches (the update;
under a resolution policy first the decisions, one or two launches).

``fused_adamw.py`` is one tensor's AdamW with detection and repair; this module is what ``impl="fused"``
runs on CUDA: every tensor of a group in one launch per pass (a launch per tensor would cost more host time
than a small model's whole step), with the library's full resolution semantics — the spike guard, the
hold rule, "skip", the last-line update guard, the escalation scale and the dense (P, S, 2) event counts.
The arithmetic is that of ``nonans_optim/optimizers/_compiled.py::_one_tensor`` line for line (the CPU twin
is ``nonans_optim/native/scalar_step.c``), and :func:`scalar_step_reference_` — the compiled path's own
group function, run eagerly — is the test oracle with the same signature.

Launches (no host synchronisation: every decision is read from device memory by the next launch):

1. ``_stats_kernel`` (under "skip", and "repair" with the spike guard): per block, the gradient's sum of
   squares and non-finite count. A decision that must precede any write needs them — the spike guard the
   norm, "skip" whether any entry is bad, the hold rule whether every entry is. One read of g: 4 of the 32
   bytes per fp32 entry. Under "repair" without the guard (the AdamW family's default) it is not launched:
   the decide kernel reads only a tensor that can be held (a recent event, and a non-finite first entry),
   so a clean step pays one launch for the decisions, not two, and no program per block.
2. ``_decide_kernel``, one program per tensor: adds its blocks' partials *in block order* (so the norm,
   and a triggered guard's scale, do not depend on scheduling), then the guard's scale and new EMA, the
   spike flag, and the hold / keep-all flags — into scratch only: the update kernel commits the EMA and
   the spike count, so every persistent write happens in the last launch (a launch that fails to compile,
   say on another Triton version, leaves the optimizer as it was: ``_fused_triton`` then falls back).
3. ``_update_kernel``: per block, read p, g, m (or z), v once, write them once; detection, the gates and
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

from nonans_optim.functional.spike import SPIKE_BETA, TINY
from nonans_optim.resolution import STAGES, RecentRule

from ._elementwise import elementwise_block, policy_code
from ._multi import _ROW, _SPIKE, _block, _column, _finite, _layout, _load, address_table, supported
from ._runtime import interpreting, on_device, tl_dtype
from .scalar_update import _speculative_update, _update_block

__all__ = ["scalar_step_", "scalar_step_reference_", "supported", "_stats_kernel", "_decide_kernel",
           "_update_kernel"]

_RBLOCK = 64 if interpreting() else 1024  # partials summed per iteration of the decide loop
_S = len(STAGES)
# at import: on triton 3.6 next_power_of_2 is a constexpr function, whose host-side call costs microseconds
_S_PAD = triton.next_power_of_2(_S)
_TINY = tl.constexpr(TINY)  # the guard's smallest scale (functional/spike.py): one definition for every path


@triton.jit
def _recent(RECENT, STREAK, EVENTS, sel, window, RULE: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr,
            LOSS: tl.constexpr):
    """The hold rule's "recent event" of global parameter ``sel`` (``Resolution.recent``): RULE, from the
    counters STREAK (P,) and EVENTS (P, S) — an event on one of its own stages (all but LOSS) within
    ``window`` steps, as ``resolution.RecentRule.flags`` computes it —, else the precomputed flags RECENT."""
    if RULE:
        stage = tl.arange(0, S_PAD)
        own = (stage < S) & (stage != LOSS)
        ev = tl.load(EVENTS + sel * S + stage, mask=own, other=0)
        recent = (tl.load(STREAK + sel) < window) & (tl.max((ev > 0).to(tl.int32), axis=0) > 0)
    else:
        recent = tl.load(RECENT + sel) != 0
    return recent


@triton.jit
def _stats_kernel(ADDR, NUMEL, FIRST, BLOCK_TENSOR, SS, BAD, TY: tl.constexpr, ALIGNED: tl.constexpr,
                  BLOCK: tl.constexpr):
    """SS[pid] = Σ g² over the finite entries (float64: finite for any finite entries; the guard's norm is
    of the finite part, see functional/spike.py) and BAD[pid] = #non-finite g over this program's block.
    (Not launched under "repair" without the guard: :func:`_decide_kernel`'s LAZY.)"""
    pid, t, start, rem = _block(BLOCK_TENSOR, FIRST, NUMEL, BLOCK)
    g_ptr = _column(ADDR, t, 1, TY, start, ALIGNED)
    idx = tl.arange(0, BLOCK)
    if rem >= BLOCK:
        g = _load(g_ptr, idx, idx < rem, False)
    else:
        g = _load(g_ptr, idx, idx < rem, True)  # masked entries read 0: finite, no square
    ok = _finite(g)
    g64 = tl.where(ok, g, 0.0).to(tl.float64)
    tl.store(SS + pid, tl.sum(g64 * g64, axis=0))
    tl.store(BAD + pid, tl.sum((~ok).to(tl.int32), axis=0))


@triton.jit
def _decide_kernel(SS, BAD, FIRST, NUMEL, SEL, EMA, RECENT, STREAK, EVENTS, DEC, FLAGS_OUT, ADDR, factor, beta,
                   window, POLICY: tl.constexpr, GUARD: tl.constexpr, RULE: tl.constexpr, S: tl.constexpr,
                   S_PAD: tl.constexpr, LOSS: tl.constexpr, LAZY: tl.constexpr, TY: tl.constexpr,
                   ALIGNED: tl.constexpr, RBLOCK: tl.constexpr):
    """Per tensor: the spike guard (functional/spike.py::spike_scale) and the hold / keep-all flags, into
    DEC (scale, new EMA) and FLAGS_OUT (bit 0 hold, 1 keep all, 2 spike, 3 a bad entry). Writes nothing
    persistent: the update kernel commits the EMA and the spike count, so a launch that fails before it changes nothing.
    The hold rule's "recent event": :func:`_recent`.

    LAZY ("repair" without the spike guard, where the statistics only serve the hold rule — every entry bad
    on a parameter with a recent event): no statistics launch ran; only a hold candidate (a recent event and
    a non-finite first entry) reads its own gradient here, RBLOCK entries at a time, stopping at the first
    block with a finite entry (a tensor with one is not held). Its "bad entry" bit is then only "every
    entry bad". Why: the statistics launch ran a program per block of every gradient on every clean step
    (on gpt2-small some 60,000) to decide a rule that a clean step never triggers; a persistent whole-tensor
    fault now pays its scan instead (the C loop's rule, scalar_step.c, in one pass per candidate)."""
    t = tl.program_id(0)
    sel = tl.load(SEL + t)
    if LAZY:
        n_t = tl.load(NUMEL + t)
        g_ptr = _column(ADDR, t, 1, TY, 0, ALIGNED)
        first = tl.load(g_ptr, mask=n_t > 0, other=0.0).to(tl.float32)  # (an empty tensor: finite 0)
        every_bad = _recent(RECENT, STREAK, EVENTS, sel, window, RULE, S, S_PAD, LOSS) & ~_finite(first)
        start = n_t * 0
        while every_bad & (start < n_t):
            idx = start + tl.arange(0, RBLOCK)
            g = tl.load(g_ptr + idx, mask=idx < n_t, other=float("nan")).to(tl.float32)
            every_bad = tl.sum(_finite(g).to(tl.int32), axis=0) == 0
            start += RBLOCK
        nbad = tl.where(every_bad, n_t, 0)  # (LAZY has no guard: no norm to add up)
    else:
        b0, b1 = tl.load(FIRST + t), tl.load(FIRST + t + 1)
        acc = tl.zeros((RBLOCK,), dtype=tl.float64)
        bad = tl.zeros((RBLOCK,), dtype=tl.int32)
        for start in range(b0, b1, RBLOCK):
            idx = start + tl.arange(0, RBLOCK)
            acc += tl.load(SS + idx, mask=idx < b1, other=0.0)
            bad += tl.load(BAD + idx, mask=idx < b1, other=0)
        nbad = tl.sum(bad, axis=0).to(tl.int64)
    scale = 1.0
    new_ema = 0.0
    trig = nbad < 0  # False
    if GUARD:
        # float64, as spike_scale's comparison and cap / norm (sqrt and / on fp64 are the IEEE-rounded
        # sqrt.rn.f64 and div.rn.f64: sqrt_rn/div_rn exist for fp32 only, whose defaults are approximate)
        norm = tl.sqrt(tl.sum(acc, axis=0))
        ema = tl.load(EMA + sel)
        fin = _finite(norm)
        seeded = ema > 0.0
        cap = factor * ema
        cap64 = cap.to(tl.float64)
        trig = fin & seeded & (norm > cap64)
        # at least the smallest fp32 subnormal (2^-149): a capped ±Inf entry stays ±Inf, as in spike_scale
        # (the divisor replaced where the guard does not fire: a zero norm would divide by zero)
        scale = tl.where(trig, tl.maximum(cap64 / tl.where(trig, norm, 1.0), _TINY).to(tl.float32), 1.0)
        observed = tl.where(trig, cap, norm.to(tl.float32))
        # only a complete gradient updates the EMA, and only a non-zero one (spike_scale)
        fits = fin & _finite(observed) & (nbad == 0) & (observed > 0.0)
        new_ema = tl.where(fits, tl.where(seeded, ema * beta + (1.0 - beta) * observed, observed), ema)
    hold = nbad < 0  # False
    keep_all = nbad < 0
    if POLICY != 0:  # a persistent whole-tensor loss: every entry bad, and an event within the window
        # (under "repair" and "skip", as the loop's _common.keep_flags: a held "skip" tensor counts no update)
        recent = _recent(RECENT, STREAK, EVENTS, sel, window, RULE, S, S_PAD, LOSS)
        hold = recent & (nbad.to(tl.int64) == tl.load(NUMEL + t))
    if POLICY == 2:
        keep_all = nbad > 0
    tl.store(DEC + 2 * t, scale)
    tl.store(DEC + 2 * t + 1, new_ema)
    # bit 3, "some entry was bad" (exact unless the statistics were LAZY): the spectral path's NorMuon row
    # gate reads a tensor's gradient rows again only then
    tl.store(FLAGS_OUT + t, hold.to(tl.int32) + 2 * keep_all.to(tl.int32) + 4 * trig.to(tl.int32)
             + 8 * (nbad > 0).to(tl.int32))


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
                 factor: float | None) -> None:
    """The group step of ``_compiled._group_kernel`` (same arguments): ``ms`` (AdamW) or ``zs``
    (schedule-free) hold the second state tensor, the other list Nones; ``res`` is None under "off", else
    (scale, recent, norm EMA, dense counts) — the Resolution tensors, updated in place, where ``recent`` is
    the (P,) flags or a ``resolution.RecentRule`` (the decide kernel then reads the counters itself, which
    saves the host the five launches of evaluating it: what ``impl="fused"`` passes); ``sel`` the global
    parameter indices; ``bcs`` (n, 2) fp32 bias corrections, ``hp`` the seven fp32 hyperparameters,
    ``gamma`` the 0-d step size, all on the tensors' device. Nothing is read back to the host."""
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
            dec, dec_flags = decisions(addr, (numel, first, owner, nblocks), sel, res, code, factor, ty, aligned,
                                       lazy=code == 1 and factor is None)
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


def decisions(addr, layout, sel, res, code: int, factor: float | None, ty, aligned: bool, *, lazy: bool):
    """Launch the statistics and decide kernels over the gradients in column 1 of ``addr`` (the group's
    address table, four columns; ``lazy``: the decide kernel alone, see its LAZY); returns (DEC (n, 2)
    fp32: guard scale and new EMA, flags (n,) int32: bit 0 hold, 1 keep all, 2 spike, 3 a bad entry).
    Writes only this scratch. ``layout``: (numel, first, owner, nblocks) of :func:`_layout`; ``res``:
    (scale, recent, ema, dense) as :func:`scalar_step_` takes it."""
    numel, first, owner, nblocks = layout
    n = numel.shape[0]
    device = numel.device
    block, warps = elementwise_block()
    _, recent, ema, _ = res
    dec = torch.empty(n, 2, dtype=torch.float32, device=device)
    dec_flags = torch.empty(n, dtype=torch.int32, device=device)
    ss = bad = dec_flags  # under LAZY never read (no statistics launch)
    if not lazy:
        ss = torch.empty(nblocks, dtype=torch.float64, device=device)
        bad = torch.empty(nblocks, dtype=torch.int32, device=device)
        _stats_kernel[(nblocks,)](addr, numel, first, owner, ss, bad, TY=ty, ALIGNED=aligned, BLOCK=block,
                                  num_warps=warps)
    rule = isinstance(recent, RecentRule)
    # the hold rule's inputs (a RecentRule's counters, or the flags; the others never read)
    hold_in = ((dec_flags, recent.clean_streak, recent.events, recent.window) if rule
               else (recent, dec_flags, dec_flags, 0))
    stages = dict(RULE=rule, S=_S, S_PAD=_S_PAD, LOSS=recent.loss_stage if rule else 0)
    # LAZY scans a hold candidate's gradient a block at a time, with an elementwise launch's shape
    _decide_kernel[(n,)](ss, bad, first, numel, sel, ema, *hold_in[:3], dec, dec_flags, addr, float(factor or 0.0),
                         SPIKE_BETA, hold_in[3], POLICY=code, GUARD=factor is not None, LAZY=lazy, TY=ty,
                         ALIGNED=aligned, RBLOCK=block if lazy else _RBLOCK, num_warps=warps if lazy else 1,
                         **stages)
    return dec, dec_flags


def scalar_step_reference_(params, grads, ms, vs, zs, gamma, res, sel, bcs, hp, *, sf: bool, policy: str,
                           decay_z: bool, factor: float | None) -> None:
    """Pure-torch oracle of :func:`scalar_step_`: the compiled path's group function, run eagerly (a
    ``RecentRule`` evaluated by its torch form)."""
    from nonans_optim.optimizers._compiled import _group_kernel
    if res is not None and isinstance(res[1], RecentRule):
        res = (res[0], res[1].flags(), *res[2:])
    _group_kernel(params, grads, ms, vs, zs, gamma, res, sel, bcs, hp, sf=sf, policy=policy, decay_z=decay_z,
                  factor=factor)
