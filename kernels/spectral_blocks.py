"""The per-block momentum arithmetic of the spectral write and Σ M² kernels (``spectral_step.py``): MONA,
the gated momentum buffer and Nesterov's M, loaded from and stored through the address tables, and the
speculative block that runs "off"'s arithmetic first — what ``nonans_optim/native/spectral_rows.h`` is to
the C loop's passes.

The arithmetic is ``nonans_optim/optimizers/_compiled_spectral.py::_pre`` line for line; under a gate a
missing gradient entry is a missing observation (the buffers keep their values), and a buffer that overflows
as stored with a finite gradient is one too.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._elementwise import kept_finite
from ._multi import _column, _finite, _lerp, _load, _store, _sum_masked


@triton.jit
def _mona(G, ok, po, ao, first, alpha, one_m_beta, GATE: tl.constexpr):
    """(G̃ = G + α·A, new G_prev, new A, A overflowed with a finite g) of one block: functional/momentum.py's
    ``mona_`` (A ← lerp(A, G - G_prev, 1-β), G_prev starting as the first gradient). Under GATE a missing
    entry keeps both buffers, and A keeps its value where the new one overflowed although g was finite."""
    start = G
    if GATE:
        start = tl.where(ok, G, 0.0)
    prev = tl.where(first, start, po)
    na = _lerp(ao, G - prev, one_m_beta)
    over = ok & ~ok
    an = na
    pn = G
    if GATE:
        keep = ok & _finite(na)
        over = ok & ~keep
        an = tl.where(keep, na, ao)
        pn = tl.where(ok, G, prev)
    return G + alpha * an, pn, an, over


@triton.jit
def _momentum(g, bo, po, ao, s, HP, first, NESTEROV: tl.constexpr, GATE: tl.constexpr, MONA: tl.constexpr,
              BUF_TY: tl.constexpr, EMULATE: tl.constexpr):
    """(M, new buffer, g finite, a buffer overflowed, MONA's new G_prev and A) of one block:
    _compiled_spectral._pre's momentum (MONA first, when on; ``po``/``ao`` are ignored otherwise). HP =
    [1-μ, μ, α, 1-β, ...]. A missing entry keeps the buffer's value; under GATE a buffer that overflows as
    stored with a finite g is a missing observation too (it and M continue from the old value)."""
    ok = _finite(g)
    G = g * s  # s == 1.0 exactly unless the spike guard fired
    over = ok & ~ok
    pn, an = po, ao
    if MONA:
        G, pn, an, over = _mona(G, ok, po, ao, first, tl.load(HP + 2), tl.load(HP + 3), GATE)
    g_in = G
    if GATE:
        g_in = tl.where(ok, G, bo)
    nb = _lerp(bo, g_in, tl.load(HP))
    if GATE:
        nb_ok = kept_finite(nb, BUF_TY, EMULATE)
        over = over | ~nb_ok
        nb = tl.where(nb_ok, nb, bo)
        g_in = tl.where(nb_ok, g_in, bo)
    M = nb
    if NESTEROV:
        M = _lerp(g_in, nb, tl.load(HP + 1))
    return M, nb, ok, over, pn, an


@triton.jit
def _pre_block(ADDR, MONA_ADDR, t, start, idx, mask, HP, s, NESTEROV: tl.constexpr, GATE: tl.constexpr,
               MONA: tl.constexpr, G_TY: tl.constexpr, BUF_TY: tl.constexpr, ALIGNED: tl.constexpr,
               EMULATE: tl.constexpr, MASKED: tl.constexpr):
    """The inputs at ``idx`` of a block and their momentum: (M, new buffer, old buffer, g, g finite, overflow,
    MONA's old and new G_prev and A). MONA_ADDR: rows (G_prev, A, -, -) of the address table, one per
    tensor."""
    g_ptr = _column(ADDR, t, 1, G_TY, start, ALIGNED)
    b_ptr = _column(ADDR, t, 0, BUF_TY, start, ALIGNED)
    g = _load(g_ptr, idx, mask, MASKED)  # masked entries read 0: M = 0 there, no square
    bo = _load(b_ptr, idx, mask, MASKED)
    po, ao = g, g
    first = t < 0
    if MONA:
        po = _load(_column(MONA_ADDR, t, 0, tl.float32, start, ALIGNED), idx, mask, MASKED)
        ao = _load(_column(MONA_ADDR, t, 1, tl.float32, start, ALIGNED), idx, mask, MASKED)
        first = tl.load(HP + 4 + t) != 0.0
    M, nb, ok, over, pn, an = _momentum(g, bo, po, ao, s, HP, first, NESTEROV, GATE, MONA, BUF_TY, EMULATE)
    return M, nb, bo, g, ok, over, po, ao, pn, an


@triton.jit
def _write_out(ADDR, MONA_ADDR, t, start, idx, mask, x, nb, pn, an, MONA: tl.constexpr, BUF_TY: tl.constexpr,
               X_TY: tl.constexpr, ALIGNED: tl.constexpr, EMULATE: tl.constexpr, MASKED: tl.constexpr):
    """Store a block's X (hot dtype), new buffer and MONA's G_prev and A at ``idx``."""
    _store(_column(ADDR, t, 2, X_TY, start, ALIGNED), idx, x, mask, X_TY, EMULATE, MASKED)
    _store(_column(ADDR, t, 0, BUF_TY, start, ALIGNED), idx, nb, mask, BUF_TY, EMULATE, MASKED)
    if MONA:
        _store(_column(MONA_ADDR, t, 0, tl.float32, start, ALIGNED), idx, pn, mask, tl.float32, EMULATE, MASKED)
        _store(_column(MONA_ADDR, t, 1, tl.float32, start, ALIGNED), idx, an, mask, tl.float32, EMULATE, MASKED)


@triton.jit
def _write_block(ADDR, MONA_ADDR, t, start, idx, mask, HP, s, inv, keep_all, NESTEROV: tl.constexpr,
                 GATE: tl.constexpr, MONA: tl.constexpr, G_TY: tl.constexpr, BUF_TY: tl.constexpr,
                 X_TY: tl.constexpr, ALIGNED: tl.constexpr, EMULATE: tl.constexpr, MASKED: tl.constexpr):
    """The write kernel's work at ``idx``: the new buffers (kept whole under keep-all) and X = M·inv; under
    GATE its NaN g, non-finite g and moment-overflow counts as 16-bit fields of one int64 (one reduction,
    not three; at most one event per entry, so BLOCK < 65536 entries fit), else 0."""
    M, nb, bo, g, ok, over, po, ao, pn, an = _pre_block(ADDR, MONA_ADDR, t, start, idx, mask, HP, s, NESTEROV,
                                                        GATE, MONA, G_TY, BUF_TY, ALIGNED, EMULATE, MASKED)
    x = (M.to(tl.float64) * inv).to(tl.float32)
    _write_out(ADDR, MONA_ADDR, t, start, idx, mask, x, tl.where(keep_all, bo, nb), tl.where(keep_all, po, pn),
               tl.where(keep_all, ao, an), MONA, BUF_TY, X_TY, ALIGNED, EMULATE, MASKED)
    total = tl.zeros((), dtype=tl.int64)
    if GATE:
        tl.static_assert(idx.shape[0] < 65536, "the packed gradient counts hold 1 per entry in 16 bits")
        code = (g != g).to(tl.int64) + ((~ok).to(tl.int64) << 16) + (over.to(tl.int64) << 32)
        total = _sum_masked(code, mask, MASKED)
    return total


@triton.jit
def _write_speculative(ADDR, MONA_ADDR, t, start, rem, HP, s, inv, keep_all, NESTEROV: tl.constexpr,
                       MONA: tl.constexpr, G_TY: tl.constexpr, BUF_TY: tl.constexpr, X_TY: tl.constexpr,
                       ALIGNED: tl.constexpr, EMULATE: tl.constexpr, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    """A gated block of the write kernel as "off" computes it, verified (scalar_update._speculative_block's
    method): the stock momentum, one test of the new buffer as stored — a non-finite g makes it non-finite,
    and so does MONA's A where it overflows (G + α·A feeds the buffer), and a value that rounds to ±Inf in
    a bf16 buffer — and the stores, unless the test fails or the tensor is kept whole ("skip"): then the
    block is computed again from memory, with the gates and counts, half a block at a time. Returns the
    packed counts. Where the test passes no gate would have selected anything, so the stock values are the
    gated ones. sm_90 (``python -m experiments kernel-static``): the gated variants held 73-112 registers
    against "off"'s 48 (106 with MONA), three or two resident blocks per SM instead of five (two) — triton
    3.9's compile; the GPU image's 3.6 has its own kernel-static section."""
    idx = tl.arange(0, BLOCK)
    mask = idx < rem
    M, nb, _, _, _, _, _, _, pn, an = _pre_block(ADDR, MONA_ADDR, t, start, idx, mask, HP, s, NESTEROV, False,
                                                 MONA, G_TY, BUF_TY, ALIGNED, EMULATE, MASKED)
    fine = kept_finite(nb, BUF_TY, EMULATE)  # (masked entries read 0: finite)
    total = tl.zeros((), dtype=tl.int64)
    if (tl.min(fine.to(tl.int32), axis=0) == 1) & ~keep_all:
        _write_out(ADDR, MONA_ADDR, t, start, idx, mask, (M.to(tl.float64) * inv).to(tl.float32), nb, pn, an, MONA,
                   BUF_TY, X_TY, ALIGNED, EMULATE, MASKED)
    else:
        HALF: tl.constexpr = BLOCK // 2
        for h in tl.static_range(2):
            sub = h * HALF + tl.arange(0, HALF)
            total += _write_block(ADDR, MONA_ADDR, t, start, sub, sub < rem, HP, s, inv, keep_all, NESTEROV, True,
                                  MONA, G_TY, BUF_TY, X_TY, ALIGNED, EMULATE, MASKED)
    return total
