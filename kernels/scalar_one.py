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

What this kernel costs a large step (an open question). On an H200 (RESULTS.md "Triton kernels on a GPU",
2026-11-27) it took 580 µs of GPU time on 8 tensors of 67M entries in 32,768 programs, where "off" (the
update kernel) took 465 and the three-launch path's gated update kernel, with its decide and record launches,
476 (the run at 21e5331): about 25% more, 0.75 of copy bandwidth instead of 0.96. The launch-shape table's
"repair" rows at smaller blocks did not run this kernel at those shapes (the sweep patched the layout's block
and not this kernel's own, fixed since): they ran it at 2048 x 8 with 2x and 4x the programs, the extra ones
owning no entry — and took 1218 and 2516 µs, so a program that moves no data cost about 19 ns of the kernel's
time. That per-program cost is not the queue of atomics on the one ticket counter: a ticket tree (each
program's ticket on its group's counter, 128 programs per group on lines of their own, and only each group's
last on the launch's) changed nothing when timed in the same session's last device minutes (``python -m
experiments kernels``' sweep, whose JSON the device time did not leave written: repair without/with the tree
0.589/0.594 ms at 2048 x 4, 1.220/1.217 at "1024 x 8", 2.505/2.499 at "512 x 4"), so it was not kept (commit
1ddf1b2). What a program does that the update kernel's does not, each a per-program cost: (1) the acq_rel
ticket's fence at GPU scope; (2) the chain of dependent loads before the block's own (its tensor, the
gradient's first entry, the parameter's counters for the hold rule); (3) the stack the register limit spills
to (``python -m experiments kernel-static``: 72–88 bytes per thread here, none in the update kernel). The
timing-only variants of :data:`ABLATIONS` remove one suspect each (``python -m experiments kernels``, its
"per-program cost" table). Fewer programs, each looping over several blocks, would divide all three:
``scalar_step_one_(programs=...)`` launches that (LOOP; the same results, tested beside the one-program-per-
block launch), which the same table times at 3 and 12 programs per SM; the library does not use it until a GPU
run says it wins. The folded decisions (``decisions.py``) take an acq_rel ticket per program too.

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
from ._multi import _ROW, _block_of, _column, _finite
from ._runtime import interpreting, on_device, tl_dtype
from .record import BLOCK_P, record
from .decisions import _recent
from .scalar_step import _columns, group_launch
from .scalar_update import _speculative_update

__all__ = ["scalar_step_one_", "scratch_size", "MAXNREG", "ABLATIONS"]

_S = len(STAGES)
_S_PAD = triton.next_power_of_2(_S)
# Registers per thread the compiler may use (ptxas .maxnreg). Left to itself the compiler gives this kernel
# (the decisions, the deferred blocks and the record around the update) more than 96 on sm_90 — 2 resident
# blocks of 8 warps per SM where the update kernel holds 3 —; at 80 it holds 3 and spills a few dozen bytes per
# thread to the stack, under triton 3.9 and the GPU image's 3.6 alike (``python -m experiments kernel-static``,
# both sections, "stack bytes"). Which is faster is for a GPU run to say.
MAXNREG = 80


# Timing-only variants of the kernel (the ``ablate`` bits of :func:`scalar_step_one_`; the library always passes
# 0): each removes one suspect of its per-program cost (module docstring), so that one GPU run can say which it
# is. Their results are not the step's: a relaxed ticket lets the last program read counts before they are
# visible, and without the prologue no tensor is ever a candidate, so the hold rule never holds.
# Bits (written as literals in the kernel: the interpreter cannot combine an int with a constexpr global):
# 1, the ticket a relaxed atomic (no fence); 2, no hold-rule prologue (no tensor a candidate).
RELAXED_TICKET, NO_PROLOGUE = 1, 2
_ABLATE_BITS = RELAXED_TICKET | NO_PROLOGUE
# name -> (ablate bits, register limit): the shipped kernel first
ABLATIONS: dict[str, tuple[int, int | None]] = {
    "as shipped": (0, MAXNREG),
    "ticket without acq_rel (relaxed)": (RELAXED_TICKET, MAXNREG),
    "no hold-rule prologue": (NO_PROLOGUE, MAXNREG),
    "no register limit (no spills)": (0, None),
    "all three": (RELAXED_TICKET | NO_PROLOGUE, None),
}


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


@triton.jit
def _own_block(pid, ADDR, NUMEL, FIRST, BLOCK_TENSOR, BC, HP, GAMMA, SCALE, SEL, DENSE, STREAK, EVENTS, window, SCRATCH,
               n, TY: tl.constexpr, SF: tl.constexpr, DECAY_Z: tl.constexpr, ALIGNED: tl.constexpr,
               EMULATE: tl.constexpr, BLOCK: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr, LOSS: tl.constexpr,
               ABLATE: tl.constexpr):
    """Block ``pid`` as its own program takes it (module docstring): updated at once unless its tensor is a
    candidate and the block has no finite gradient entry, in which case its id joins the deferred list."""
    t, start, rem = _block_of(pid, BLOCK_TENSOR, FIRST, NUMEL, BLOCK)
    sel = tl.load(SEL + t)
    if ABLATE & 2:  # NO_PROLOGUE
        candidate = pid < 0  # False
    else:
        first = tl.load(_column(ADDR, t, 1, TY, 0, ALIGNED)).to(tl.float32)  # (a tensor with a block has one)
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


@triton.jit(do_not_specialize=["n", "nblocks", "nprog", "step", "P"])
def _one_launch_kernel(ADDR, NUMEL, FIRST, BLOCK_TENSOR, BC, HP, GAMMA, SCALE, SEL, DENSE, STREAK, EVENTS, window,
                       SCRATCH, n, nblocks, nprog, COUNTS, RING_COUNTS, RING_STEP, RING_ESC, RING_HELD, RING_PTR,
                       ESCALATIONS, RES_NUMEL, step, P, K, backoff, min_scale, growth, TY: tl.constexpr,
                       SF: tl.constexpr, DECAY_Z: tl.constexpr, ALIGNED: tl.constexpr, EMULATE: tl.constexpr,
                       BLOCK: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr, LOSS: tl.constexpr,
                       GRAD: tl.constexpr, BLOCK_P: tl.constexpr, ABLATE: tl.constexpr, LOOP: tl.constexpr):
    """One program per block of the group (see the module docstring), or with LOOP ``nprog`` programs, each
    taking blocks pid, pid + nprog, ... before its one ticket (a candidate fix for the per-program cost, timed
    by ``python -m experiments kernels``). SCRATCH (int32, zero before the launch and after it): [tickets,
    deferred count, finite-seen flag per tensor (n), deferred ids]. ABLATE: 0, or the timing-only bits of
    :data:`ABLATIONS`."""
    pid = tl.program_id(0)
    # (the loop with nprog == nblocks would serve both launches, but its form is compiled differently: under
    # triton 3.9 it spills 112 bytes per thread against 72 for the one call — kernel-static, both rows)
    if LOOP:
        for i in range(pid, nblocks, nprog):
            blk = pid * 0 + i  # a tensor under the interpreter too, whose range yields ints
            _own_block(blk, ADDR, NUMEL, FIRST, BLOCK_TENSOR, BC, HP, GAMMA, SCALE, SEL, DENSE, STREAK, EVENTS, window,
                       SCRATCH, n, TY, SF, DECAY_Z, ALIGNED, EMULATE, BLOCK, S, S_PAD, LOSS, ABLATE)
    else:
        _own_block(pid, ADDR, NUMEL, FIRST, BLOCK_TENSOR, BC, HP, GAMMA, SCALE, SEL, DENSE, STREAK, EVENTS, window,
                   SCRATCH, n, TY, SF, DECAY_Z, ALIGNED, EMULATE, BLOCK, S, S_PAD, LOSS, ABLATE)
    tl.debug_barrier()  # every thread's counts and flags of this program before its ticket
    if ABLATE & 1:  # RELAXED_TICKET
        ticket = tl.atomic_add(SCRATCH, 1, sem="relaxed", scope="gpu")
    else:
        ticket = tl.atomic_add(SCRATCH, 1, sem="acq_rel", scope="gpu")
    if ticket == nprog - 1:  # the last program: every other one has added its counts
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
                     growth_interval: int, repeat_window: int, programs: int | None = None, ablate: int = 0,
                     maxnreg: int | None = MAXNREG) -> None:
    """``scalar_step_(..., policy="repair", factor=None)`` followed by ``record.record_step_(counters, dense,
    step, consume=True, ...)``, in one launch. ``counters``: the Resolution tensors (``Resolution.tensors``,
    updated in place); ``numel`` their (P,) sizes; ``dense`` the step's (P, S, 2) count block,
    zero on entry and zeroed again; ``scratch(size)`` returns an int32 tensor of at least ``size`` entries
    (:func:`scratch_size`), zero on entry and left zero. Nothing is read back to the host. ``programs``: at
    most that many programs, each looping over blocks (None: one per block, the library's launch). ``ablate``
    and ``maxnreg``: the timing-only variants of :data:`ABLATIONS` (the library passes neither)."""
    if isinstance(ablate, bool) or not isinstance(ablate, int) or ablate < 0 or ablate & ~_ABLATE_BITS:
        raise ValueError(f"ablate takes the bits of ABLATIONS (0-{_ABLATE_BITS}), got {ablate!r}")
    if programs is not None and (isinstance(programs, bool) or not isinstance(programs, int) or programs < 1):
        raise ValueError(f"programs must be a positive int or None, got {programs!r}")
    launch = group_launch(params, grads, zs if sf else ms, vs)
    if launch is None:
        return
    (layout_numel, first, owner, nblocks), addr, aligned = launch
    n = len(params)
    work = scratch(scratch_size(n, nblocks))
    if work.numel() < scratch_size(n, nblocks) or work.dtype != torch.int32:
        raise ValueError(f"scratch must be int32 with at least {scratch_size(n, nblocks)} entries")
    block, warps = elementwise_block()
    nprog = nblocks if programs is None else min(programs, nblocks)
    P, K = dense.shape[0], counters["ring_step"].shape[0]
    c = counters
    with on_device(params[0]):
        _one_launch_kernel[(nprog,)](
            addr, layout_numel, first, owner, bcs, hp, gamma, c["scale"], sel, dense, c["clean_streak"], c["events"],
            int(repeat_window), work, n, nblocks, nprog, c["counts"], c["ring_counts"], c["ring_step"],
            c["ring_escalated"], c["ring_held"], c["ring_ptr"], c["escalations"], numel, int(step), P, K,
            float(backoff), float(min_scale), int(growth_interval), TY=tl_dtype(params[0].dtype), SF=sf,
            DECAY_Z=decay_z, ALIGNED=aligned, EMULATE=interpreting(), BLOCK=block, S=_S, S_PAD=_S_PAD,
            LOSS=STAGE_INDEX["loss"], GRAD=STAGE_INDEX["grad"], BLOCK_P=BLOCK_P, ABLATE=int(ablate),
            LOOP=programs is not None, num_warps=warps, enable_fp_fusion=False,
            **({} if maxnreg is None else {"maxnreg": maxnreg}))
