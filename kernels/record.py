"""One launch for the resolution record of a step: ``Resolution.record_step`` on CUDA.

Why a kernel for bookkeeping: the torch record (``nonans_optim/resolution.py``, the ground truth this
kernel is tested against) is about thirty small ops — compares, reductions, ``where``s, four ``index_copy_``
into the event ring — and on a GPU each op costs the host several microseconds to issue however little the
device does. On an H100 (2026-11-25, ``python -m experiments sync-audit``) "repair" launched 56 kernels
per AdamW(impl="fused") step where "off" launched 3; the record was most of the difference. The CPU has
the same record as a C loop (``nonans_optim/native``) for the same reason.

The whole record is a single program: the event ring's write pointer advances when *any* (parameter,
stage) had an event, a reduction over every parameter, and one program looping over blocks of parameters
computes it without atomics or a second launch. P (parameters) is at most a few thousand and S (stages)
six, so the loop is a few iterations of a few hundred bytes each.

Every counter is updated in place (the torch record replaces ``scale`` and ``clean_streak`` by new tensors,
with the same values). The float arithmetic is the torch record's: ``scale·backoff`` clamped below at
``min_scale``, ``scale·2`` clamped above at 1, in fp32, so the two agree bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._runtime import on_device

__all__ = ["record_step_", "record", "BLOCK_P"]

BLOCK_P = 64  # parameters per loop iteration: a (64, 8) tile of int64 counts is 4 KiB per operand


@triton.jit
def _record_kernel(SC, COUNTS, EVENTS, RING_COUNTS, RING_STEP, RING_ESC, RING_HELD, RING_PTR, SCALE, STREAK,
                   ESCALATIONS, NUMEL, step, P, K, backoff, min_scale, growth, window,
                   S: tl.constexpr, S_PAD: tl.constexpr, LOSS: tl.constexpr, GRAD: tl.constexpr,
                   CONSUME: tl.constexpr, BLOCK_P: tl.constexpr):
    record(SC, COUNTS, EVENTS, RING_COUNTS, RING_STEP, RING_ESC, RING_HELD, RING_PTR, SCALE, STREAK, ESCALATIONS,
           NUMEL, step, P, K, backoff, min_scale, growth, window, S, S_PAD, LOSS, GRAD, CONSUME, False, BLOCK_P)


@triton.jit
def record(SC, COUNTS, EVENTS, RING_COUNTS, RING_STEP, RING_ESC, RING_HELD, RING_PTR, SCALE, STREAK, ESCALATIONS,
           NUMEL, step, P, K, backoff, min_scale, growth, window, S: tl.constexpr, S_PAD: tl.constexpr,
           LOSS: tl.constexpr, GRAD: tl.constexpr, CONSUME: tl.constexpr, FRESH: tl.constexpr,
           BLOCK_P: tl.constexpr):
    """The record of :func:`_record_kernel`, for one program — also the last program of
    ``scalar_one.py``'s launch, which folds the counts the other programs of that launch added to SC:
    FRESH reads SC through L2 only (``.cg``), never from an L1 line this SM may hold from before those
    atomics (the other counters are written only here)."""
    ptr = tl.load(RING_PTR)
    slot = ptr % K
    s = tl.arange(0, S_PAD)
    s_ok = s < S
    own = s_ok & (s != LOSS)  # the loss stage sits in row 0 but is nobody's event (resolution.PARAM_STAGES)
    any_event = tl.zeros((), dtype=tl.int64)
    for start in range(0, P, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        p_ok = p < P
        m2 = p_ok[:, None] & s_ok[None, :]
        cell = p[:, None] * S + s[None, :]  # (parameter, stage) in a (P, S) block
        if FRESH:
            nan = tl.load(SC + 2 * cell, mask=m2, other=0, cache_modifier=".cg")
            inf = tl.load(SC + 2 * cell + 1, mask=m2, other=0, cache_modifier=".cg")
        else:
            nan = tl.load(SC + 2 * cell, mask=m2, other=0)
            inf = tl.load(SC + 2 * cell + 1, mask=m2, other=0)
        if CONSUME:  # leave the step's block zeroed for the next step (each tile is read only here)
            tl.store(SC + 2 * cell, tl.zeros_like(nan), mask=m2)
            tl.store(SC + 2 * cell + 1, tl.zeros_like(inf), mask=m2)
        stage_event = (nan + inf) > 0
        param_event = tl.max((stage_event & own[None, :]).to(tl.int32), axis=1) > 0
        ev = tl.load(EVENTS + cell, mask=m2, other=0)
        seen = tl.max(((ev > 0) & own[None, :]).to(tl.int32), axis=1) > 0
        streak = tl.load(STREAK + p, mask=p_ok, other=0)
        scale = tl.load(SCALE + p, mask=p_ok, other=1.0)
        # GradScaler-style escalation (Resolution.record_step): only a repeated event backs off
        repeated = param_event & seen & (streak < window)
        grown = ((streak + 1) % growth) == 0
        backed = tl.maximum(scale * backoff, min_scale)
        regrown = tl.minimum(scale * 2.0, 1.0)
        new_scale = tl.where(repeated, backed, tl.where(grown & ~param_event, regrown, scale))
        escalated = repeated & (new_scale < scale)
        grad_total = tl.sum(tl.where(s[None, :] == GRAD, nan + inf, 0), axis=1)
        numel = tl.load(NUMEL + p, mask=p_ok, other=0)
        held = repeated & (grad_total == numel) & (numel > 0)  # the update kernels' hold rule

        tl.store(COUNTS + 2 * cell, tl.load(COUNTS + 2 * cell, mask=m2, other=0) + nan, mask=m2)
        tl.store(COUNTS + 2 * cell + 1, tl.load(COUNTS + 2 * cell + 1, mask=m2, other=0) + inf, mask=m2)
        tl.store(EVENTS + cell, ev + stage_event.to(tl.int64), mask=m2)
        esc = tl.load(ESCALATIONS + p, mask=p_ok, other=0)
        tl.store(ESCALATIONS + p, esc + escalated.to(tl.int64), mask=p_ok)
        tl.store(STREAK + p, tl.where(param_event, 0, streak + 1), mask=p_ok)
        tl.store(SCALE + p, new_scale, mask=p_ok)
        ring = slot * P * S + cell
        tl.store(RING_COUNTS + 2 * ring, nan, mask=m2)
        tl.store(RING_COUNTS + 2 * ring + 1, inf, mask=m2)
        tl.store(RING_ESC + slot * P + p, escalated, mask=p_ok)
        tl.store(RING_HELD + slot * P + p, held, mask=p_ok)
        any_event = tl.maximum(any_event, tl.max(tl.where(m2, stage_event, 0).to(tl.int64)))
    tl.store(RING_STEP + slot, step)
    tl.store(RING_PTR, ptr + any_event)


def record_step_(t: dict[str, torch.Tensor], step_counts: torch.Tensor, step: int, *, numel: torch.Tensor,
                 backoff: float, min_scale: float, growth_interval: int, repeat_window: int,
                 loss_stage: int, grad_stage: int, consume: bool = False) -> None:
    """Fold one step's (P, S, 2) int64 ``step_counts`` into the Resolution tensors ``t`` in place: what
    ``Resolution.record_step`` computes, in one launch. Every tensor must be contiguous and on one device.
    ``consume``: also zero ``step_counts`` once read (``Resolution.count_block`` reuses it next step)."""
    P, S, _ = step_counts.shape
    K = t["ring_step"].shape[0]
    if P == 0:
        return
    names = ("counts", "events", "ring_counts", "ring_step", "ring_escalated", "ring_held", "ring_ptr", "scale",
             "clean_streak", "escalations")
    args = [step_counts] + [t[k] for k in names] + [numel]
    index = step_counts.get_device()  # (an int: comparing torch.device objects costs more, every step)
    if not (all([a.is_contiguous() for a in args]) and all([a.get_device() == index for a in args])):
        raise ValueError("record_step_ needs contiguous tensors on one device")
    with on_device(step_counts):
        _record_kernel[(1,)](*args, int(step), P, K, float(backoff), float(min_scale), int(growth_interval),
                             int(repeat_window), S=S, S_PAD=1 << (S - 1).bit_length(), LOSS=loss_stage,
                             GRAD=grad_stage, CONSUME=bool(consume), BLOCK_P=BLOCK_P, num_warps=4)
