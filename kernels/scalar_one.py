"""The (SF-)AdamW "repair" step without the spike guard — the AdamW family's default — in one launch: the
hold decisions, the update and the resolution record that ``scalar_step.py`` and ``record.py`` spread over
three launches (decide, update, record). The default on CUDA since its first GPU run measured it
(``NONANS_TRITON_ONE_LAUNCH=0`` opts out): see ``nonans_optim/optimizers/_fused_triton.py``.

Why: a small model's step is host-bound on a GPU, and every Triton launch costs the host tens of
microseconds (RESULTS.md "sync-audit": 46–90 µs per launch on an H200's host), while issue 3's target for
"repair" over "off" is 0.3% of a training step — 20 µs of the default GPT's 6.8 ms there. "off" is one
launch; so is this.

How, without any program waiting for another (so no co-residency assumption and no possible deadlock):

* The decisions. Under "repair" without the guard the one decision that must precede a write is the hold
  rule: a parameter with a recent event whose gradient has no finite entry is held (nothing written). Its
  tensor is then a *candidate*: a recent event and a non-finite first entry (the decide kernel's LAZY
  test), which each program checks for its own tensor — the first entry and the parameter's counters, a
  few cached loads. A non-candidate's block (every block of a clean step) is updated at once, as the
  update kernel does. A candidate's block that holds a finite gradient entry proves its tensor is not held:
  it flags that and is updated at once. A candidate's block with no finite entry is *deferred*: its id is
  appended to a list and nothing of it is written.
* The last program. Every program takes a ticket once its counts are added (an acq_rel atomic after a
  barrier); the one that takes the last ticket has every other program's counts, flags and deferred ids
  visible. It updates the deferred blocks — held where no block of their tensor had a finite entry (a held
  block writes nothing and counts its gradient entries, as in the update kernel) —, folds the step's
  counts into the counters (``record.record``, the record kernel's body) and zeroes the scratch for the
  next launch.

The cost moves to the fault: deferred blocks run one after another in one program, so a persistent
whole-tensor fault on a large tensor serialises that tensor (the three-launch path's decide kernel also
scans a held candidate's gradient in one program). A clean step adds to each program its tensor's first
gradient entry, its parameter's counters and one atomic; the record runs in the last program instead of a
launch of its own.

What the ticket costs a large step (an open question). On an H200 (RESULTS.md "Triton kernels on a GPU",
launch-shape table, 2026-11-27) this kernel took 580 µs of GPU time on 8 tensors of 67M entries in 32,768
programs, where "off" (the update kernel, no ticket) took 465; 1218 µs in 65,536 programs (1024-entry blocks;
"off" 455) and 2516 in 131,072 (512-entry blocks; "off" 452): an extra cost per program that grows as blocks
shrink, where the three-launch path's gated update kernel, which takes no ticket, stayed at "off"'s time (476
µs with its decide and record launches, the run at 21e5331). It is not the queue of atomics on the one ticket
counter: a ticket tree (each program's ticket on its group's counter, 128 programs per group on lines of
their own, and only each group's last on the launch's) changed nothing when timed in the same session's
last device minutes (``python -m experiments kernels``' sweep, whose JSON the device time did not leave
written: repair without/with the tree 0.589/0.594 ms at 2048 x 4, 1.220/1.217 at 1024 x 8, 2.505/2.499 at
512 x 4), so it was not kept (commit 1ddf1b2). What else a program does that the update kernel's does not,
each a per-program cost: (1) the acq_rel ticket's fence, which waits until the program's own stores of p, m
and v — the whole block's — are visible, under a saturated memory system possibly microseconds during which
the program keeps its place on the SM (taking the ticket before those stores would test it: the last program
reads none of them); (2) the chain of dependent loads before the block's own (its tensor, the gradient's
first entry, the parameter's counters for the hold rule); (3) the stack the register limit spills to
(``python -m experiments kernel-static``: 72–88 bytes per thread here, none in the update kernel). A GPU run
of timing-only variants, one suspect removed in each, would tell them apart; fewer programs, each looping
over several blocks, would divide all three.

Memory ordering (PTX memory model): the counts, flags and deferred ids are written with atomics or before
the barrier that precedes the ticket; the ticket is an acq_rel atomic at GPU scope, so the last program's
acquire sees every release before it, and it reads what other programs wrote through L2 only (``.cg``).
Verified under the Triton interpreter with the programs run in ascending, reversed and shuffled order
(``tests/test_kernels_program_order.py``: a last program chosen by id instead of by ticket passes the
ascending run only), compiled for sm_90 on a CPU, and run on an H200 (its gpu-marked tests, 2026-11-27).
"""
from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from nonans_optim.resolution import STAGE_INDEX, STAGES

from ._elementwise import elementwise_block
from ._multi import _ROW, _block, _block_of, _column, _finite
from ._runtime import interpreting, on_device, tl_dtype
from .record import BLOCK_P, record
from .decisions import _recent
from .scalar_step import _columns, group_launch
from .scalar_update import _speculative_update

__all__ = ["scalar_step_one_", "scratch_size", "MAXNREG"]

_S = len(STAGES)
_S_PAD = triton.next_power_of_2(_S)
# Registers per thread the compiler may use (ptxas .maxnreg). Left to itself the compiler gives this kernel
# (the decisions, the deferred blocks and the record around the update) more than 96 on sm_90 — 2 resident
# blocks of 8 warps per SM where the update kernel holds 3 —; at 80 it holds 3 and spills a few dozen bytes per
# thread to the stack, under triton 3.9 and the GPU image's 3.6 alike (``python -m experiments kernel-static``,
# both sections, "stack bytes"). Which is faster is for a GPU run to say.
MAXNREG = 80


def scratch_size(n: int, nblocks: int) -> int:
    """int32 entries of the scratch a launch over ``n`` tensors in ``nblocks`` blocks needs: the ticket
    count, the deferred count, a flag per tensor ("a finite gradient entry seen") and the deferred ids."""
    return 2 + n + nblocks


@triton.jit
def _update_one(ADDR, NUMEL, FIRST, BLOCK_TENSOR, BC, HP, GAMMA, SCALE, SEL, DENSE, pid, hold, TY: tl.constexpr,
                SF: tl.constexpr, DECAY_Z: tl.constexpr, ALIGNED: tl.constexpr, EMULATE: tl.constexpr,
                BLOCK: tl.constexpr):
    """Block ``pid`` of the group as the update kernel's gated variant computes it (speculative, counted)."""
    t, start, rem = _block_of(pid, BLOCK_TENSOR, FIRST, NUMEL, BLOCK)
    p_ptr, g_ptr, s_ptr, v_ptr = _columns(ADDR, t, start, TY, ALIGNED)
    sel = tl.load(SEL + t)
    lr = tl.load(GAMMA) * tl.load(SCALE + sel)
    _speculative_update(p_ptr, g_ptr, s_ptr, v_ptr, rem, HP, tl.load(BC + 2 * t), tl.load(BC + 2 * t + 1), lr, 1.0,
                        hold, pid < 0, DENSE + sel * _ROW, TY, SF, DECAY_Z, EMULATE, BLOCK)


@triton.jit(do_not_specialize=["n", "nblocks", "step", "P"])
def _one_launch_kernel(ADDR, NUMEL, FIRST, BLOCK_TENSOR, BC, HP, GAMMA, SCALE, SEL, DENSE, STREAK, EVENTS, window,
                       SCRATCH, n, nblocks, COUNTS, RING_COUNTS, RING_STEP, RING_ESC, RING_HELD, RING_PTR, ESCALATIONS,
                       RES_NUMEL, step, P, K, backoff, min_scale, growth, TY: tl.constexpr, SF: tl.constexpr,
                       DECAY_Z: tl.constexpr, ALIGNED: tl.constexpr, EMULATE: tl.constexpr, BLOCK: tl.constexpr,
                       S: tl.constexpr, S_PAD: tl.constexpr, LOSS: tl.constexpr, GRAD: tl.constexpr,
                       BLOCK_P: tl.constexpr):
    """One program per block of the group (see the module docstring). SCRATCH (int32, zero before the
    launch and after it): [tickets, deferred count, finite-seen flag per tensor (n), deferred ids]."""
    pid, t, start, rem = _block(BLOCK_TENSOR, FIRST, NUMEL, BLOCK)
    sel = tl.load(SEL + t)
    first = tl.load(_column(ADDR, t, 1, TY, 0, ALIGNED)).to(tl.float32)  # (a tensor with a block is not empty)
    candidate = _recent(STREAK, STREAK, EVENTS, sel, window, True, S, S_PAD, LOSS) & ~_finite(first)
    deferred = pid < 0  # False
    if candidate:
        idx = tl.arange(0, BLOCK)
        g = tl.load(_column(ADDR, t, 1, TY, start, ALIGNED) + idx, mask=idx < rem, other=float("nan")).to(tl.float32)
        if tl.max(_finite(g).to(tl.int32), axis=0) > 0:
            tl.atomic_max(SCRATCH + 2 + t, 1)  # the tensor has a finite entry: it is not held
        else:
            slot = tl.atomic_add(SCRATCH + 1, 1)
            tl.atomic_xchg(SCRATCH + 2 + n + slot, pid)
            deferred = pid >= 0  # True
    # Two call sites of the update (the program's own block; the deferred ones in the last program): one call
    # site in a loop over both spilled far more under the GPU image's triton 3.6 at the register limit
    # (kernel-static, both Triton versions).
    if ~deferred:
        _update_one(ADDR, NUMEL, FIRST, BLOCK_TENSOR, BC, HP, GAMMA, SCALE, SEL, DENSE, pid, pid < 0, TY, SF, DECAY_Z,
                    ALIGNED, EMULATE, BLOCK)
    tl.debug_barrier()  # every thread's counts and flags of this program before its ticket
    ticket = tl.atomic_add(SCRATCH, 1, sem="acq_rel", scope="gpu")
    if ticket == nblocks - 1:  # the last program: every other one has added its counts
        tl.debug_barrier()
        for i in range(tl.load(SCRATCH + 1, cache_modifier=".cg")):
            other = tl.load(SCRATCH + 2 + n + i, cache_modifier=".cg")
            held = tl.load(SCRATCH + 2 + tl.load(BLOCK_TENSOR + other), cache_modifier=".cg") == 0
            _update_one(ADDR, NUMEL, FIRST, BLOCK_TENSOR, BC, HP, GAMMA, SCALE, SEL, DENSE, other, held, TY, SF,
                        DECAY_Z, ALIGNED, EMULATE, BLOCK)
        tl.debug_barrier()  # the deferred blocks' counts before the record reads them
        record(DENSE, COUNTS, EVENTS, RING_COUNTS, RING_STEP, RING_ESC, RING_HELD, RING_PTR, SCALE, STREAK,
               ESCALATIONS, RES_NUMEL, step, P, K, backoff, min_scale, growth, window, S, S_PAD, LOSS, GRAD, True,
               True, BLOCK_P)
        for at in range(0, 2 + n, BLOCK):  # the ticket and deferred counts and the flags; the ids are
            idx = at + tl.arange(0, BLOCK)  # overwritten before they are read again
            tl.store(SCRATCH + idx, tl.zeros_like(idx), mask=idx < 2 + n)


def scalar_step_one_(params, grads, ms, vs, zs, gamma, bcs, hp, *, sf: bool, decay_z: bool, sel: torch.Tensor,
                     counters: dict[str, torch.Tensor], numel: torch.Tensor, dense: torch.Tensor,
                     scratch: Callable[[int], torch.Tensor], step: int, backoff: float, min_scale: float,
                     growth_interval: int, repeat_window: int) -> None:
    """``scalar_step_(..., policy="repair", factor=None)`` followed by ``record.record_step_(counters, dense,
    step, consume=True, ...)``, in one launch. ``counters``: the Resolution tensors (``Resolution.tensors``,
    updated in place); ``numel`` their (P,) sizes; ``dense`` the step's (P, S, 2) count block,
    zero on entry and zeroed again; ``scratch(size)`` returns an int32 tensor of at least ``size`` entries
    (:func:`scratch_size`), zero on entry and left zero. Nothing is read back to the host."""
    launch = group_launch(params, grads, zs if sf else ms, vs)
    if launch is None:
        return
    (layout_numel, first, owner, nblocks), addr, aligned = launch
    n = len(params)
    work = scratch(scratch_size(n, nblocks))
    if work.numel() < scratch_size(n, nblocks) or work.dtype != torch.int32:
        raise ValueError(f"scratch must be int32 with at least {scratch_size(n, nblocks)} entries")
    block, warps = elementwise_block()
    P, K = dense.shape[0], counters["ring_step"].shape[0]
    c = counters
    with on_device(params[0]):
        _one_launch_kernel[(nblocks,)](
            addr, layout_numel, first, owner, bcs, hp, gamma, c["scale"], sel, dense, c["clean_streak"], c["events"],
            int(repeat_window), work, n, nblocks, c["counts"], c["ring_counts"], c["ring_step"],
            c["ring_escalated"], c["ring_held"], c["ring_ptr"], c["escalations"], numel, int(step), P, K,
            float(backoff), float(min_scale), int(growth_interval), TY=tl_dtype(params[0].dtype), SF=sf,
            DECAY_Z=decay_z, ALIGNED=aligned, EMULATE=interpreting(), BLOCK=block, S=_S, S_PAD=_S_PAD,
            LOSS=STAGE_INDEX["loss"], GRAD=STAGE_INDEX["grad"], BLOCK_P=BLOCK_P, num_warps=warps,
            enable_fp_fusion=False, maxnreg=MAXNREG)
