"""The per-tensor decisions of a resolution step on the Triton path: the spike guard's scale and norm EMA, the
hold / keep-all flags, "a bad entry" — everything the update kernels of ``scalar_step.py`` and
``spectral_step.py`` must know before they write. Nothing here writes persistent state: the update kernels
commit the EMA and the spike count, so a launch that fails before them leaves the optimizer as it was.

Two launches, or one:

1. ``_stats_kernel`` (under "skip", and "repair" with the spike guard): per block, the gradient's sum of
   squares and non-finite count. A decision that must precede any write needs them — the spike guard the
   norm, "skip" whether any entry is bad, the hold rule whether every entry is. One read of g: 4 of the 32
   bytes per fp32 entry. Under "repair" without the guard (the AdamW family's default) it is not launched:
   the decide kernel reads only a tensor that can be held (a recent event, and a non-finite first entry),
   so a clean step pays one launch for the decisions, not two, and no program per block.
2. ``_decide_kernel``, one program per tensor: adds its blocks' partials *in block order* (so the norm,
   and a triggered guard's scale, do not depend on scheduling), then the guard's scale and new EMA, the
   spike flag, and the hold / keep-all flags.

``_stats_decide_kernel`` is both in one launch (``tickets`` given to :func:`decisions`; the default since the
H200 run of 2026-11-27, ``NONANS_TRITON_FOLD_DECIDE=0`` returns to two launches): every block program writes its
partials, then takes a ticket of its tensor (an acq_rel atomic at GPU scope after a barrier, as the one-launch
AdamW step does, ``scalar_one.py``); the program that takes a tensor's last ticket has every partial of that
tensor visible, reads them through L2 only (``.cg``), runs the decide kernel's body for it and puts the ticket
back to zero. No program waits for another, so nothing assumes co-residency (checked under the interpreter with
the programs in three orders, ``tests/test_kernels_program_order.py``, and on an H200 by the ``gpu`` copies of
``tests/test_kernels_decisions.py``). Why: on gpt2-small the spectral optimizers' "repair" step launched the
statistics and decide kernels once per parameter group — three groups, six launches of tens of µs of host time
each on an H200's host (RESULTS.md "sync-audit-unfolded") —, against issue 3's budget of 0.3% of a training
step. Folded, each group launches one. The partials are added in block order by one program either way; only
the reduction's lane layout follows the launch's warps (one warp for the decide kernel, the statistics launch's
for the folded one), so on a GPU the float64 norm may differ in its last bit between the two forms — never
between two runs of one form. A tensor with no entry has no block and so no program of the folded launch: the
callers (``scalar_step.scalar_step_``, ``spectral_step.spectral_prepare_``) pass no tickets for a group that has
one. Not yet measured: the price on a large, GPU-bound step. Every program takes an acq_rel ticket, and the
one-launch AdamW kernel, which does the same, spent about 25% more GPU time than its update kernel alone on a
67M-entry step (``scalar_one.py``); the fold became the default on gpt2-small's host-bound step, where launches
cost more. ``python -m experiments kernels`` times the spectral step folded and not ("repair, unfolded").
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nonans_optim.functional.spike import SPIKE_BETA, TINY
from nonans_optim.resolution import STAGES, RecentRule

from ._elementwise import elementwise_block
from ._multi import _block, _column, _finite, _load
from ._runtime import interpreting

__all__ = ["decisions", "_recent", "_stats_kernel", "_decide_kernel", "_stats_decide_kernel", "_RBLOCK"]

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
def _stats_block(ADDR, NUMEL, FIRST, BLOCK_TENSOR, SS, BAD, TY: tl.constexpr, ALIGNED: tl.constexpr,
                 BLOCK: tl.constexpr):
    """This program's block: SS[pid] = Σ g² over the finite entries (float64: finite for any finite entries;
    the guard's norm is of the finite part, see functional/spike.py), BAD[pid] = #non-finite g. Returns
    (pid, tensor)."""
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
    return pid, t


@triton.jit
def _stats_kernel(ADDR, NUMEL, FIRST, BLOCK_TENSOR, SS, BAD, TY: tl.constexpr, ALIGNED: tl.constexpr,
                  BLOCK: tl.constexpr):
    """:func:`_stats_block` for every block of the group. (Not launched under "repair" without the guard:
    :func:`_decide_kernel`'s LAZY.)"""
    _stats_block(ADDR, NUMEL, FIRST, BLOCK_TENSOR, SS, BAD, TY, ALIGNED, BLOCK)


@triton.jit
def _partials(SS, BAD, b0, b1, RBLOCK: tl.constexpr, FRESH: tl.constexpr):
    """(Σ SS, Σ BAD as int64) over blocks b0..b1-1, added in block order. FRESH: written by other programs of
    this launch, so read through L2 only (``.cg``), never from a stale L1 line."""
    acc = tl.zeros((RBLOCK,), dtype=tl.float64)
    bad = tl.zeros((RBLOCK,), dtype=tl.int32)
    for start in range(b0, b1, RBLOCK):
        idx = start + tl.arange(0, RBLOCK)
        if FRESH:
            acc += tl.load(SS + idx, mask=idx < b1, other=0.0, cache_modifier=".cg")
            bad += tl.load(BAD + idx, mask=idx < b1, other=0, cache_modifier=".cg")
        else:
            acc += tl.load(SS + idx, mask=idx < b1, other=0.0)
            bad += tl.load(BAD + idx, mask=idx < b1, other=0)
    return tl.sum(acc, axis=0), tl.sum(bad, axis=0).to(tl.int64)


@triton.jit
def _decide(t, ss, nbad, NUMEL, SEL, EMA, RECENT, STREAK, EVENTS, DEC, FLAGS_OUT, factor, beta, window,
            POLICY: tl.constexpr, GUARD: tl.constexpr, RULE: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr,
            LOSS: tl.constexpr):
    """Tensor t's decisions from its gradient's finite sum of squares ``ss`` (float64; read only with
    GUARD) and non-finite count ``nbad``: DEC[t] = (guard scale, new EMA), FLAGS_OUT[t] = bit 0 hold, 1 keep
    all, 2 spike, 3 a bad entry."""
    sel = tl.load(SEL + t)
    scale = 1.0
    new_ema = 0.0
    trig = nbad < 0  # False
    if GUARD:
        # float64, as spike_scale's comparison and cap / norm (sqrt and / on fp64 are the IEEE-rounded
        # sqrt.rn.f64 and div.rn.f64: sqrt_rn/div_rn exist for fp32 only, whose defaults are approximate)
        norm = tl.sqrt(ss)
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
def _decide_kernel(SS, BAD, FIRST, NUMEL, SEL, EMA, RECENT, STREAK, EVENTS, DEC, FLAGS_OUT, ADDR, factor, beta,
                   window, POLICY: tl.constexpr, GUARD: tl.constexpr, RULE: tl.constexpr, S: tl.constexpr,
                   S_PAD: tl.constexpr, LOSS: tl.constexpr, LAZY: tl.constexpr, TY: tl.constexpr,
                   ALIGNED: tl.constexpr, RBLOCK: tl.constexpr):
    """Per tensor: :func:`_decide` from the statistics launch's partials. Writes nothing persistent.

    LAZY ("repair" without the spike guard, where the statistics only serve the hold rule — every entry bad
    on a parameter with a recent event): no statistics launch ran; only a hold candidate (a recent event and
    a non-finite first entry) reads its own gradient here, RBLOCK entries at a time, stopping at the first
    block with a finite entry (a tensor with one is not held). Its "bad entry" bit is then only "every
    entry bad". Why: the statistics launch ran a program per block of every gradient on every clean step
    (on gpt2-small some 60,000) to decide a rule that a clean step never triggers; a persistent whole-tensor
    fault now pays its scan instead (the C loop's rule, scalar_step.c, in one pass per candidate)."""
    t = tl.program_id(0)
    if LAZY:
        sel = tl.load(SEL + t)
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
        nbad = tl.where(every_bad, n_t, 0)
        ss = 0.0  # (LAZY has no guard: no norm to add up)
    else:
        ss, nbad = _partials(SS, BAD, tl.load(FIRST + t), tl.load(FIRST + t + 1), RBLOCK, False)
    _decide(t, ss, nbad, NUMEL, SEL, EMA, RECENT, STREAK, EVENTS, DEC, FLAGS_OUT, factor, beta, window, POLICY,
            GUARD, RULE, S, S_PAD, LOSS)


@triton.jit
def _stats_decide_kernel(ADDR, NUMEL, FIRST, BLOCK_TENSOR, SS, BAD, TICKETS, SEL, EMA, RECENT, STREAK, EVENTS, DEC,
                         FLAGS_OUT, factor, beta, window, TY: tl.constexpr, ALIGNED: tl.constexpr,
                         BLOCK: tl.constexpr, POLICY: tl.constexpr, GUARD: tl.constexpr, RULE: tl.constexpr,
                         S: tl.constexpr, S_PAD: tl.constexpr, LOSS: tl.constexpr, RBLOCK: tl.constexpr):
    """The statistics and decide kernels in one launch (module docstring): TICKETS (int32, one per tensor)
    are zero before the launch and after it."""
    pid, t = _stats_block(ADDR, NUMEL, FIRST, BLOCK_TENSOR, SS, BAD, TY, ALIGNED, BLOCK)
    tl.debug_barrier()  # every thread's partials of this program before its ticket
    ticket = tl.atomic_add(TICKETS + t, 1, sem="acq_rel", scope="gpu")
    b0, b1 = tl.load(FIRST + t), tl.load(FIRST + t + 1)
    if ticket == b1 - b0 - 1:  # the tensor's last program: its other blocks' partials are visible
        tl.debug_barrier()
        ss, nbad = _partials(SS, BAD, b0, b1, RBLOCK, True)
        _decide(t, ss, nbad, NUMEL, SEL, EMA, RECENT, STREAK, EVENTS, DEC, FLAGS_OUT, factor, beta, window, POLICY,
                GUARD, RULE, S, S_PAD, LOSS)
        tl.store(TICKETS + t, 0)


def decisions(addr, layout, sel, res, code: int, factor: float | None, ty, aligned: bool, *, lazy: bool,
              tickets: torch.Tensor | None = None):
    """Launch the statistics and decide kernels over the gradients in column 1 of ``addr`` (the group's
    address table, four columns; ``lazy``: the decide kernel alone, see its LAZY); returns (DEC (n, 2)
    fp32: guard scale and new EMA, flags (n,) int32: bit 0 hold, 1 keep all, 2 spike, 3 a bad entry).
    Writes only this scratch. ``layout``: (numel, first, owner, nblocks) of ``_multi._layout``; ``res``:
    (scale, recent, ema, dense) as ``scalar_step.scalar_step_`` takes it. ``tickets``: an int32 tensor of at
    least n entries, zero, left zero — both launches as one (``_stats_decide_kernel``); only for a group
    every tensor of which has an entry (the caller knows the sizes: an empty tensor would be left undecided;
    fewer blocks than tensors is refused here), and not with ``lazy`` (one launch already)."""
    numel, first, owner, nblocks = layout
    n = numel.shape[0]
    device = numel.device
    block, warps = elementwise_block()
    _, recent, ema, _ = res
    dec = torch.empty(n, 2, dtype=torch.float32, device=device)
    dec_flags = torch.empty(n, dtype=torch.int32, device=device)
    rule = isinstance(recent, RecentRule)
    # the hold rule's inputs (a RecentRule's counters, or the flags; the others never read)
    hold_in = ((dec_flags, recent.clean_streak, recent.events, recent.window) if rule
               else (recent, dec_flags, dec_flags, 0))
    shared = dict(POLICY=code, GUARD=factor is not None, RULE=rule, S=_S, S_PAD=_S_PAD,
                  LOSS=recent.loss_stage if rule else 0)
    if tickets is not None and (lazy or tickets.dtype != torch.int32 or tickets.numel() < n or nblocks < n):
        raise ValueError("tickets: an int32 tensor of one entry per tensor, for a group whose every tensor "
                         "has an entry, and not with lazy")
    ss = bad = dec_flags  # under LAZY never read (no statistics launch)
    if not lazy:
        ss = torch.empty(nblocks, dtype=torch.float64, device=device)
        bad = torch.empty(nblocks, dtype=torch.int32, device=device)
    if tickets is not None:
        _stats_decide_kernel[(nblocks,)](addr, numel, first, owner, ss, bad, tickets, sel, ema, *hold_in[:3], dec,
                                         dec_flags, float(factor or 0.0), SPIKE_BETA, hold_in[3], TY=ty,
                                         ALIGNED=aligned, BLOCK=block, RBLOCK=_RBLOCK, num_warps=warps, **shared)
        return dec, dec_flags
    if not lazy:
        _stats_kernel[(nblocks,)](addr, numel, first, owner, ss, bad, TY=ty, ALIGNED=aligned, BLOCK=block,
                                  num_warps=warps)
    # LAZY scans a hold candidate's gradient a block at a time, with an elementwise launch's shape
    _decide_kernel[(n,)](ss, bad, first, numel, sel, ema, *hold_in[:3], dec, dec_flags, addr, float(factor or 0.0),
                         SPIKE_BETA, hold_in[3], LAZY=lazy, TY=ty, ALIGNED=aligned,
                         RBLOCK=block if lazy else _RBLOCK, num_warps=warps if lazy else 1, **shared)
    return dec, dec_flags
