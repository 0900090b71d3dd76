"""The direction side of the Triton spectral step (``spectral_step.py`` launches them): from the NS5 output
O, NorMuon's rows, the RMS-matching factor and the update — ``_compiled_spectral._post`` as three launches
(the CPU twin is ``nonans_optim/native/spectral_post.c``)."""
from __future__ import annotations

import triton
import triton.language as tl

from ._cast import cast_rtne
from ._elementwise import kept_finite
from ._multi import (_DIR_INF, _DIR_NAN, _MOMENT_INF, _ROW, _UPDATE_INF, _UPDATE_NAN, _add_count, _block, _column,
                     _finite, _lerp, _load, _store, _sum_masked)


@triton.jit
def _row_has_bad(g_ptr, C, look, BLOCK_C: tl.constexpr):
    """Whether the row's gradient has a non-finite entry, read only where ``look`` (its tensor's gradient had
    one: bit 3 of the decisions), in a loop of its own after the row's sums. Why not inside the sums' loop:
    its accumulator and its reduction were paid by every row of every gated step (NorMuon rows "repair": 54
    registers where "off" has 30, now 32 — `python -m experiments kernel-static`), where only a step with a
    bad entry needs them."""
    bad = look & False
    if look:
        acc = tl.zeros((BLOCK_C,), dtype=tl.int32)
        for c0 in range(0, C, BLOCK_C):
            idx = c0 + tl.arange(0, BLOCK_C)
            g = tl.load(g_ptr + idx, mask=idx < C, other=0.0).to(tl.float32)
            acc += (~_finite(g)).to(tl.int32)
        bad = tl.sum(acc, axis=0) > 0
    return bad


@triton.jit
def _row_sq_wide(o_ptr, C, inv, BLOCK_C: tl.constexpr):
    """Σⱼ (Oᵢⱼ/dᵢ)² of one row in float64, where no square of an fp32 value overflows: the rare path of the
    row's share of ‖Ô‖_F², run only when the fp32 Σⱼ O² (or its product with 1/dᵢ²) came out non-finite.
    NS5's output never gets there; a finite O with entries past ~1e19 would otherwise make ‖Ô‖_F = +Inf and
    the update silently 0 (functional/normuon.py). A non-finite O stays non-finite (the direction count)."""
    acc = tl.zeros((BLOCK_C,), dtype=tl.float64)
    for c0 in range(0, C, BLOCK_C):
        idx = c0 + tl.arange(0, BLOCK_C)
        o = tl.load(o_ptr + idx, mask=idx < C, other=0.0).to(tl.float32).to(tl.float64)
        acc += o * o
    inv64 = inv.to(tl.float64)
    return tl.sum(acc, axis=0) * (inv64 * inv64)


@triton.jit
def _rows_kernel(PRE, POST, ROW_FIRST, ROW_OWNER, NCOLS, HP, DEC_FLAGS, SEL, DENSE, ROW_INV, ROW_SQ, ROW_SUM,
                 NORMUON: tl.constexpr, GATE: tl.constexpr, WIDE: tl.constexpr, G_TY: tl.constexpr,
                 O_TY: tl.constexpr, ROWS_ALIGNED: tl.constexpr, BLOCK_C: tl.constexpr):
    """One matrix row of one tensor: Σⱼ O², (GATE) Σⱼ O and, NORMUON, the row moment
    v ← lerp(v, Σⱼ O²/n, 1-β₂) — kept where the row's gradient had a bad entry (read only for a tensor
    that had one) or where the new value is not finite, and not written for a "skip" tensor — and
    1/dᵢ = 1/(√v + ε) from the gated value, as _compiled_spectral._post. ROW_SQ receives the row's
    Σⱼ (O/dᵢ)² (fp32; float64 under WIDE).

    WIDE: O may have squares past fp32's maximum (a direction that is not NS5's output, which is bounded;
    functional/normuon.py). Then, under GATE, a finite gradient row whose moment overflows keeps v, divides
    by the kept v (not by +Inf, which zeroes the row) and counts one Inf at the "moment" stage in DENSE (one
    atomic, only for such a row; SEL/DENSE are read nowhere else), and a row whose fp32 Σⱼ (O/dᵢ)² is not
    finite is summed again in float64 (:func:`_row_sq_wide`). A constexpr, not a runtime test alone: the
    rare path's code cost the NS5 variants registers and instructions they run on every row (sm_90, triton
    3.9: "off" 30 → 44 registers, 584 → 928 SASS), for an event their input cannot produce."""
    r_glob = tl.program_id(0)
    t = tl.load(ROW_OWNER + r_glob)
    r = r_glob - tl.load(ROW_FIRST + t)
    C = tl.load(NCOLS + t)
    o_ptr = _column(POST, t, 3, O_TY, r * C, False)
    g_ptr = _column(POST, t, 1, G_TY, r * C, False)
    if ROWS_ALIGNED:  # the host checked: every row starts 16-byte aligned and C is a multiple of 8
        C = tl.multiple_of(C, 8)
        o_ptr = tl.multiple_of(o_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
    flags = t * 0
    if GATE:
        flags = tl.load(DEC_FLAGS + t)
    sq = tl.zeros((BLOCK_C,), dtype=tl.float32)
    sm = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        idx = c0 + tl.arange(0, BLOCK_C)
        m = idx < C
        o = tl.load(o_ptr + idx, mask=m, other=0.0).to(tl.float32)
        sq += o * o
        if GATE:
            sm += o
    row_sq = tl.sum(sq, axis=0)
    inv = 1.0
    if NORMUON:
        one_m_b2, eps = tl.load(HP), tl.load(HP + 1)
        v_ptr = _column(PRE, t, 3, tl.float32, r, False)
        vo = tl.load(v_ptr)
        vn = _lerp(vo, tl.div_rn(row_sq, C.to(tl.float32)), one_m_b2)
        if GATE:
            bad = _row_has_bad(g_ptr, C, (flags & 8) != 0, BLOCK_C)
            if WIDE:  # a finite gradient row that overflows v: a missing observation too, divided by the kept v
                over = ~bad & ~_finite(vn)
                bad = bad | over
                if over:
                    tl.atomic_add(DENSE + tl.load(SEL + t) * _ROW + _MOMENT_INF, over.to(tl.int64))
            vn = tl.where(bad, vo, vn)
        inv = tl.div_rn(1.0, tl.sqrt_rn(vn) + eps)
        if GATE:
            vn = tl.where(_finite(vn) & ((flags & 2) == 0), vn, vo)
        tl.store(v_ptr, vn)
    tl.store(ROW_INV + r_glob, inv)
    part = row_sq * inv * inv
    if WIDE:  # ROW_SQ is float64 here, so that the rare path's sum fits
        wide = part.to(tl.float64)
        if ~_finite(part):
            wide = _row_sq_wide(o_ptr, C, inv, BLOCK_C)
        tl.store(ROW_SQ + r_glob, wide)
    else:
        tl.store(ROW_SQ + r_glob, part)
    if GATE:
        tl.store(ROW_SUM + r_glob, tl.sum(sm, axis=0))


@triton.jit
def _scale_kernel(ROW_FIRST, TARGET, ROW_INV, ROW_SQ, ROW_SUM, SEL, DENSE, FACTOR, GATE: tl.constexpr,
                  RBLOCK: tl.constexpr):
    """Per tensor: ‖Ô‖_F (Ô = O/d) from its rows' partials in row order (float64), the RMS-matching factor
    0.2·√(mn)/‖Ô‖_F (0 for a zero direction), and under GATE the direction count: ΣU = Σᵢ (factor/dᵢ)·ΣⱼOᵢⱼ
    is finite iff every entry of U is (RMS 0.2 cannot overflow)."""
    t = tl.program_id(0)
    r0, r1 = tl.load(ROW_FIRST + t), tl.load(ROW_FIRST + t + 1)
    acc = tl.zeros((RBLOCK,), dtype=tl.float64)
    for start in range(r0, r1, RBLOCK):
        idx = start + tl.arange(0, RBLOCK)
        acc += tl.load(ROW_SQ + idx, mask=idx < r1, other=0.0).to(tl.float64)
    norm = tl.sqrt(tl.sum(acc, axis=0)).to(tl.float32)
    factor = tl.where(norm > 0.0, tl.div_rn(tl.load(TARGET + t), tl.where(norm > 0.0, norm, 1.0)), 0.0)
    tl.store(FACTOR + t, factor)
    if GATE:
        tot = tl.zeros((RBLOCK,), dtype=tl.float32)
        for start in range(r0, r1, RBLOCK):
            idx = start + tl.arange(0, RBLOCK)
            m = idx < r1
            tot += tl.load(ROW_SUM + idx, mask=m, other=0.0) * (tl.load(ROW_INV + idx, mask=m, other=0.0) * factor)
        total = tl.sum(tot, axis=0)
        row = DENSE + tl.load(SEL + t) * _ROW
        _add_count(row, _DIR_NAN, (total != total).to(tl.int32))
        _add_count(row, _DIR_INF, (tl.abs(total) == float("inf")).to(tl.int32))


@triton.jit
def _apply_block(p_ptr, z_ptr, o_ptr, rinv_ptr, idx, mask, col0, C, factor, HP, lr, hold, keep_all,
                 P_TY: tl.constexpr, O_TY: tl.constexpr, SF: tl.constexpr, DECAY: tl.constexpr, GATE: tl.constexpr,
                 EMULATE: tl.constexpr, MASKED: tl.constexpr):
    """The update of _compiled_spectral._post on one block, in place; its update counts as one int32, NaN
    in the low 16 bits and non-finite above (0 without GATE). ``rinv_ptr`` points at 1/dᵢ of the block's
    first row, ``col0`` is the block's column offset in that row. Every gate tests the value as it will be
    stored.

    Why packed: each ``tl.sum`` over a block is a cross-warp exchange through shared memory with its
    barriers. Counting NaN and non-finite y (and z) as separate sums took four of them in the schedule-free
    variant; one sum of the packed codes gives the same counts (at most 2 per entry, 4096 per block, fit 16
    bits). Compiled for sm_90 (``python -m experiments kernel-static``, RESULTS.md): gated schedule-free
    66 → 64 registers, 26 → 14 barriers in the PTX, 1384 → 1296 SASS instructions; gated plain 48 → 40,
    14 → 10, 976 → 960. The GPU time is for ``python -m experiments kernels`` to say."""
    wd, c, coef = tl.load(HP + 2), tl.load(HP + 3), tl.load(HP + 4)
    rows = (col0 + idx) // C  # int32: the block's rows relative to its first
    o = _load(o_ptr, idx, mask, MASKED)
    po = _load(p_ptr, idx, mask, MASKED)
    if MASKED:
        rinv = tl.load(rinv_ptr + rows, mask=mask, other=0.0)
    else:
        rinv = tl.load(rinv_ptr + rows)
    d = cast_rtne(o * (rinv * factor), P_TY, EMULATE).to(tl.float32)  # U in the parameter's dtype
    if SF:
        zo = _load(z_ptr, idx, mask, MASKED)
        if DECAY:  # eager adds λ·z only when λ != 0 (0·z would turn an infinite z into NaN)
            d = d + zo * wd
        y = _lerp(po, zo, c) + d * (lr * coef)
        zn = zo - d * lr
    else:
        zo = po
        zn = po
        y = po * (1.0 - lr * wd) - lr * d
    total = tl.zeros((), dtype=tl.int32)
    if GATE:  # per entry, its NaN count (y and z) in the low 16 bits of one int32, its non-finite count above
        tl.static_assert(idx.shape[0] * 2 < 65536, "the packed update counts hold 2 per entry in 16 bits")
        y_ok = kept_finite(y, P_TY, EMULATE)
        code = (y != y).to(tl.int32) + ((~y_ok).to(tl.int32) << 16)
        y = tl.where(y_ok & ~hold & ~keep_all, y, po)
        if SF:
            z_ok = kept_finite(zn, P_TY, EMULATE)
            code += (zn != zn).to(tl.int32) + ((~z_ok).to(tl.int32) << 16)
            zn = tl.where(z_ok & ~hold & ~keep_all, zn, zo)
        total = tl.where(hold, 0, _sum_masked(code, mask, MASKED))  # a held tensor writes nothing: counts none
    _store(p_ptr, idx, y, mask, P_TY, EMULATE, MASKED)
    if SF:
        _store(z_ptr, idx, zn, mask, P_TY, EMULATE, MASKED)
    return total


@triton.jit
def _apply_kernel(POST, NUMEL, FIRST, BLOCK_TENSOR, ROW_FIRST, NCOLS, ROW_INV, FACTOR, HP, GAMMA, SCALE, SEL,
                  DEC_FLAGS, DENSE, P_TY: tl.constexpr, O_TY: tl.constexpr, SF: tl.constexpr, DECAY: tl.constexpr,
                  GATE: tl.constexpr, ALIGNED: tl.constexpr, EMULATE: tl.constexpr, BLOCK: tl.constexpr):
    """One block of one tensor: U = O·(factor/dᵢ) and the update. GATE: SCALE/SEL/DEC_FLAGS/DENSE are real
    (the escalation scale, hold bit 0, "skip" bit 1), otherwise never dereferenced."""
    pid, t, start, rem = _block(BLOCK_TENSOR, FIRST, NUMEL, BLOCK)
    p_ptr = _column(POST, t, 0, P_TY, start, ALIGNED)
    z_ptr = _column(POST, t, 2, P_TY, start, ALIGNED)
    o_ptr = _column(POST, t, 3, O_TY, start, ALIGNED)
    C = tl.load(NCOLS + t)
    row0 = start // C
    col0 = (start - row0 * C).to(tl.int32)
    rinv_ptr = ROW_INV + tl.load(ROW_FIRST + t) + row0
    factor = tl.load(FACTOR + t)
    lr = tl.load(GAMMA)
    hold = t < 0
    keep_all = t < 0
    if GATE:
        sel = tl.load(SEL + t)
        lr = lr * tl.load(SCALE + sel)
        flags = tl.load(DEC_FLAGS + t)
        hold = (flags & 1) != 0
        keep_all = (flags & 2) != 0
    idx = tl.arange(0, BLOCK)
    c32 = C.to(tl.int32)
    if rem >= BLOCK:
        total = _apply_block(p_ptr, z_ptr, o_ptr, rinv_ptr, idx, idx < rem, col0, c32, factor, HP, lr, hold,
                             keep_all, P_TY, O_TY, SF, DECAY, GATE, EMULATE, False)
    else:
        total = _apply_block(p_ptr, z_ptr, o_ptr, rinv_ptr, idx, idx < rem, col0, c32, factor, HP, lr, hold,
                             keep_all, P_TY, O_TY, SF, DECAY, GATE, EMULATE, True)
    if GATE:
        row = DENSE + sel * _ROW
        un, ub = total & 65535, total >> 16
        _add_count(row, _UPDATE_NAN, un)
        _add_count(row, _UPDATE_INF, ub - un)
