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
   (:func:`_speculative_block`); only a block where a gate would select something reads its inputs again
   for the gated recomputation.

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

from ._elementwise import elementwise_block, kept_finite, policy_code
from ._multi import (_B_GRAD_INF, _B_GRAD_NAN, _B_MOMENT, _B_UPDATE2_INF, _B_UPDATE2_NAN, _B_UPDATE_INF,
                     _B_UPDATE_NAN, _BEFORE_UPDATE, _PACK_BLOCK, _ROW, _SPIKE, _add_packed, _block, _column, _finite,
                     _flag, _layout, _lerp, _load, _packed_counts, _store, address_table, supported)
from ._runtime import interpreting, on_device, tl_dtype

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
def _update_values(g, po, so, vo, hp_ptr, bc1, bc2, lr, s, hold, keep_all, TY: tl.constexpr, SF: tl.constexpr,
                   GATE: tl.constexpr, DECAY_Z: tl.constexpr, EMULATE: tl.constexpr):
    """The step of _compiled._one_tensor on loaded values: (new p, new v, new m or z, event codes — each
    entry's events as the bits of one int32 (_multi._flag), 0 without GATE). Every gate tests the value
    as it will be stored (:func:`._elementwise.kept_finite`)."""
    one_m_b1, b2, one_m_b2 = tl.load(hp_ptr), tl.load(hp_ptr + 1), tl.load(hp_ptr + 2)
    eps, wd, c, coef = tl.load(hp_ptr + 3), tl.load(hp_ptr + 4), tl.load(hp_ptr + 5), tl.load(hp_ptr + 6)
    ok = _finite(g)
    gs = g * s  # s == 1.0 exactly unless the spike guard fired
    g2 = one_m_b2 * gs * gs
    vn = vo * b2 + g2
    g_in = gs
    if SF:  # no first moment: a missing entry moves nothing
        if GATE:
            g_in = tl.where(ok, gs, 0.0)
        mn = g_in
    else:  # missing: m keeps its value (lerp(m, m, w) == m)
        if GATE:
            g_in = tl.where(ok, gs, so)
        mn = _lerp(so, g_in, one_m_b1)
    v_ok = kept_finite(vn, TY, EMULATE)  # before the gate: a bad g makes it False too (subtracted below)
    if GATE:  # new v or (AdamW) new m not kept finite: a missing observation — both moments keep their
        # values, the entry moves nothing in z (functional/adam.py::_observed)
        seen = v_ok
        if SF:
            mn = tl.where(seen, mn, 0.0)
        else:  # g - m inside the lerp can overflow with both finite
            m_ok = kept_finite(mn, TY, EMULATE)
            seen = v_ok & m_ok
            mn = tl.where(seen, mn, so)
        vn = tl.where(seen, vn, vo)
    denom = tl.sqrt_rn(tl.div_rn(vn, bc2)) + eps
    if SF:
        d = tl.div_rn(mn, denom)
        if DECAY_Z:  # eager skips the add when λ = 0 (0·z would turn an infinite z into NaN)
            d = d + so * wd
        y = _lerp(po, so, c) + d * (lr * coef)
        sn = so - d * lr
    else:
        d = tl.div_rn(tl.div_rn(mn, bc1), denom)
        y = po * (1.0 - lr * wd) - lr * d
        sn = mn
    code = v_ok.to(tl.int32) * 0
    if GATE:
        over = ok & ~v_ok  # new v overflowed with a finite g (the loop's moment stage)
        if not SF:  # entries where v or m overflowed, once each (functional/adam.py)
            over = ok & ~(v_ok & m_ok)
        y_ok = kept_finite(y, TY, EMULATE)
        code = (_flag(g != g, _B_GRAD_NAN) | _flag(~ok & (g == g), _B_GRAD_INF) | _flag(over, _B_MOMENT)
                | _flag(y != y, _B_UPDATE_NAN) | _flag(~y_ok & (y == y), _B_UPDATE_INF))
        y = tl.where(y_ok & ~hold, y, po)
        if SF:
            z_ok = kept_finite(sn, TY, EMULATE)
            code = code | _flag(sn != sn, _B_UPDATE2_NAN) | _flag(~z_ok & (sn == sn), _B_UPDATE2_INF)
            sn = tl.where(z_ok & ~hold, sn, so)
        y = tl.where(keep_all, po, y)  # "skip": the tensor had a bad entry; counted, nothing written
        vn = tl.where(keep_all, vo, vn)
        sn = tl.where(keep_all, so, sn)
    return y, vn, sn, code


@triton.jit
def _update_block(p_ptr, g_ptr, s_ptr, v_ptr, idx, mask, hp_ptr, bc1, bc2, lr, s, hold, keep_all,
                  TY: tl.constexpr, SF: tl.constexpr, GATE: tl.constexpr, DECAY_Z: tl.constexpr,
                  EMULATE: tl.constexpr, MASKED: tl.constexpr):
    """:func:`_update_values` on one block, in place; returns its counts (grad NaN, grad ±Inf, m/v overflow,
    update NaN, update ±Inf) packed in one int64 (:func:`._multi._packed_counts`), 0 without GATE."""
    tl.static_assert(idx.shape[0] <= _PACK_BLOCK, "packed counts: a field holds at most 2 per entry")
    g = _load(g_ptr, idx, mask, MASKED)
    po = _load(p_ptr, idx, mask, MASKED)
    so = _load(s_ptr, idx, mask, MASKED)  # exp_avg, or z when schedule-free
    vo = _load(v_ptr, idx, mask, MASKED)
    y, vn, sn, code = _update_values(g, po, so, vo, hp_ptr, bc1, bc2, lr, s, hold, keep_all, TY, SF, GATE,
                                     DECAY_Z, EMULATE)
    _store(p_ptr, idx, y, mask, TY, EMULATE, MASKED)
    _store(v_ptr, idx, vn, mask, TY, EMULATE, MASKED)
    _store(s_ptr, idx, sn, mask, TY, EMULATE, MASKED)
    total = tl.zeros((), dtype=tl.int64)
    if GATE:
        total = _packed_counts(code, mask, MASKED)
        total = tl.where(hold, total & _BEFORE_UPDATE, total)  # a held tensor counts no update
    return total


@triton.jit
def _speculative_block(p_ptr, g_ptr, s_ptr, v_ptr, rem, hp_ptr, bc1, bc2, lr, s, hold, keep_all,
                       TY: tl.constexpr, SF: tl.constexpr, DECAY_Z: tl.constexpr, EMULATE: tl.constexpr,
                       MASKED: tl.constexpr, BLOCK: tl.constexpr):
    """A gated block as "off" computes it, verified: the stock arithmetic, one test of the new values — a
    non-finite gradient entry makes its new v non-finite (NaN² is NaN, ±Inf² is Inf), an overflowing m
    makes y so, and z can overflow alone — and the stores, unless the test (or the tensor's keep-all flag)
    says a gate would select something: then the block is recomputed from memory, which nothing has written
    yet, with the gates and the counts (:func:`_update_block`), a quarter of a block at a time. Returns the
    packed counts.

    Why: the gated arithmetic keeps every old value live until its select, and the counts' codes beside
    them; on sm_90 the gated update held 108 registers against "off"'s 66 — two resident blocks per SM
    instead of three — for selects that select nothing on a clean step. Here the clean path is "off"'s
    arithmetic plus one test and one reduction, and the recomputation, a part of the block at a time, needs
    fewer registers than the whole block did. How it is split decides the kernel's registers (sm_90,
    ``python -m experiments kernel-static`` with triton 3.9 and with the GPU image's 3.6): two unrolled halves
    held 77 (3.9) but 122 (3.6, two resident blocks per SM), four quarters in a loop the compiler does not
    unroll hold 80 and 76 — three blocks per SM, as "off", under both. A clean block stores
    exactly what "off" stores: the same arithmetic, compiled without FMA contraction. The native loops
    (``nonans_optim/native/scalar_avx512.h``) speculate the same way, four vectors at a time."""
    idx = tl.arange(0, BLOCK)
    mask = idx < rem
    g = _load(g_ptr, idx, mask, MASKED)  # masked entries read 0: every new value there is finite
    po = _load(p_ptr, idx, mask, MASKED)
    so = _load(s_ptr, idx, mask, MASKED)
    vo = _load(v_ptr, idx, mask, MASKED)
    y, vn, sn, _ = _update_values(g, po, so, vo, hp_ptr, bc1, bc2, lr, s, hold, keep_all, TY, SF, False,
                                  DECAY_Z, EMULATE)
    if TY == tl.float32:  # a NaN or ±Inf in any term makes the sum non-finite (an overflowing sum only
        fine = _finite(vn + y + sn)  # takes the exact path)
    else:  # as stored: a 16-bit tensor's overflow is in the rounding, which a sum in fp32 would not see
        fine = kept_finite(vn, TY, EMULATE) & kept_finite(y, TY, EMULATE) & kept_finite(sn, TY, EMULATE)
    total = tl.zeros((), dtype=tl.int64)
    # (a held tensor has no finite gradient entry, so its every block fails the test; "skip" keeps a whole
    # tensor with one bad entry, so its clean blocks must not store either)
    if (tl.min(fine.to(tl.int32), axis=0) == 1) & ~keep_all:
        _store(p_ptr, idx, y, mask, TY, EMULATE, MASKED)
        _store(v_ptr, idx, vn, mask, TY, EMULATE, MASKED)
        _store(s_ptr, idx, sn, mask, TY, EMULATE, MASKED)
    else:
        PART: tl.constexpr = BLOCK // 4
        for h in range(4):  # (a loop the compiler keeps: see the docstring)
            sub = h * PART + tl.arange(0, PART)
            total += _update_block(p_ptr, g_ptr, s_ptr, v_ptr, sub, sub < rem, hp_ptr, bc1, bc2, lr, s, hold,
                                   keep_all, TY, SF, True, DECAY_Z, EMULATE, MASKED)
    return total


@triton.jit
def _speculative_update(p_ptr, g_ptr, s_ptr, v_ptr, rem, hp_ptr, bc1, bc2, lr, s, hold, keep_all, ROW,
                       TY: tl.constexpr, SF: tl.constexpr, DECAY_Z: tl.constexpr, EMULATE: tl.constexpr,
                       BLOCK: tl.constexpr):
    """:func:`_speculative_block` on a block of one tensor (masked only as the tensor's last, ``rem`` < BLOCK),
    its counts added to the parameter's ROW of the dense count block."""
    if rem >= BLOCK:
        total = _speculative_block(p_ptr, g_ptr, s_ptr, v_ptr, rem, hp_ptr, bc1, bc2, lr, s, hold, keep_all, TY, SF,
                                   DECAY_Z, EMULATE, False, BLOCK)
    else:
        total = _speculative_block(p_ptr, g_ptr, s_ptr, v_ptr, rem, hp_ptr, bc1, bc2, lr, s, hold, keep_all, TY, SF,
                                   DECAY_Z, EMULATE, True, BLOCK)
    _add_packed(ROW, total)


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
