"""The per-entry arithmetic of the fused (SF-)AdamW step and the speculative block that runs it (the Triton
twin of ``nonans_optim/native/scalar_entry.h``), shared by the group kernel (``scalar_step.py``) and the
one-launch step (``scalar_one.py``).

The arithmetic is ``nonans_optim/optimizers/_compiled.py::_one_tensor`` line for line; a clean block
computes exactly what "off" computes and stores it after one test, and only a block where a gate would
select something is recomputed with the gates and the event counts (:func:`_speculative_block` says why:
registers).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._elementwise import kept_finite
from ._multi import (_B_GRAD_INF, _B_GRAD_NAN, _B_MOMENT, _B_UPDATE2_INF, _B_UPDATE2_NAN, _B_UPDATE_INF,
                     _B_UPDATE_NAN, _BEFORE_UPDATE, _PACK_BLOCK, _add_packed, _finite, _flag, _lerp, _load,
                     _packed_counts, _store)


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
