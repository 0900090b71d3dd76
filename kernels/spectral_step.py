"""The elementwise work around NS5 on the spectral path as multi-tensor Triton launches (CUDA).

What ``impl="fused"`` runs on a GPU for NS5 groups with any of MONA, KL-Shampoo, NorMuon and schedule-free —
SF-NorMuon, FullFusion, Muon — where the foreach path issues a few dozen small launches per matrix (SF-NorMuon's
GPT step: 4244 under "repair", 752 under "off" on an H100, the sync-audit of 2026-11-25 as published at commit
42143de, no longer in RESULTS.md), and a step of a small model is bound by the host issuing them. The arithmetic
is that of ``nonans_optim/optimizers/_compiled_spectral.py`` (``_pre`` and ``_post``), whose CPU twin is
``nonans_optim/native/spectral_pre.c`` / ``spectral_post.c``; the ground truth is ``impl="loop"``
(tests/test_kernels_spectral_step.py compares with it under every policy, with faults).

Launches per group (no host synchronisation: each decision is read from device memory by the next launch):

* under "repair"/"skip" first ``decisions._stats_kernel`` and ``_decide_kernel`` (or both as one launch,
  ``decisions._stats_decide_kernel``) — the gradient's norm and non-finite counts, then per tensor the spike
  guard's scale, the hold / keep-all flags and "any entry bad" (the NorMuon row gate needs to know whether
  to look at the rows at all);
* ``_msq_kernel``: per block, Σ M² of the NS5 input M (the gated momentum, + Nesterov), in float64 — the
  Frobenius norm must be known before any entry of X = M / ‖M‖ is written, so M is computed twice (from g
  and the buffer, 8 bytes per fp32 entry read) rather than stored and re-read (a 4-byte write and read more);
* ``_norm_kernel``: per tensor, the block partials added in block order (deterministic, like the C loop's
  row order), 1/‖M‖;
* ``_write_kernel``: the momentum buffer (and MONA's G_prev and A) and X in the hot dtype into each shape
  bucket's (B, m, n) stack, the gradient and moment counts; a tensor's first block commits the guard's EMA
  and spike count;
* (the caller runs the batched NS5 iteration on each bucket: matmuls, nothing to fuse);
* ``_rows_kernel`` (in ``_spectral_post.py``, with the next two): one program per matrix row — Σⱼ O²,
  Σⱼ O, the NorMuon row moment (gated by whether the row's gradient was entirely finite) and 1/dᵢ;
* ``_scale_kernel``: per tensor, ‖Ô‖_F from the row partials in row order, the RMS-matching factor, and
  the direction count (ΣU is finite iff every entry of U is);
* ``_apply_kernel``: per block, U = O·(factor/dᵢ), the (schedule-free) update with the update guard, the
  hold rule and "skip", and the update counts.

"off" issues the six launches of ``_msq_kernel`` … ``_apply_kernel``; "repair" adds the two decision
launches, one when folded (and the optimizer's one-launch record after the step). MONA is elementwise and rides in the
momentum launches (``spectral_blocks._mona``). KL-Shampoo preconditions M before it is normalised: ``raw`` skips the two
norm launches, the write kernel stores M itself (fp32), and the caller runs the preconditioner's matmuls
and the normalisation between it and NS5 (``nonans_optim/optimizers/_kl_stacks.py``), with this step's
decisions read there as device tensors.

``_write_kernel`` is the first persistent write: a launch failing before it (a compile error on another
Triton version) leaves the optimizer as it was and the caller falls back to ``impl="compiled"``. The three
kernels after it are therefore compiled before it, once per configuration (:func:`spectral_post_` with
``warmup``), so that their compile errors surface while nothing has been written.

Tensors are reached through int64 address tables (four columns; column 1 is the gradient, which the shared
statistics kernel reads): pre (buffer, g, X slot, row moment v; with MONA n rows more, (G_prev, A, -, -),
read through the view from row n) and post (p, g, z, O slot). Parameters, gradients, z and MONA's buffers
are fp32; the momentum buffer fp32 or bf16; X/O fp32 or bf16. Math is fp32 (the norms float64), compiled
without FMA contraction so that the "repair" and "off" variants of every kernel compute the same bits on a
clean step.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nonans_optim._transfer import to_device
from nonans_optim.functional.normuon import RMS_TARGET

from ._elementwise import elementwise_block, policy_code
from ._multi import _GRAD_INF, _GRAD_NAN, _MOMENT_INF, _ROW, _SPIKE, _add_count, _block, _layout, address_table
from ._multi import supported as one_launch
from ._runtime import interpreting, on_device, tl_dtype
from ._spectral_post import _apply_kernel, _rows_kernel, _scale_kernel
from .decisions import _RBLOCK, decisions
from .spectral_blocks import _pre_block, _write_block, _write_speculative

__all__ = ["spectral_prepare_", "spectral_write_", "spectral_post_", "supported", "PreResult"]

_BLOCK_C = 32 if interpreting() else 1024  # columns per iteration of the row loop


@triton.jit
def _msq_kernel(ADDR, MONA_ADDR, NUMEL, FIRST, BLOCK_TENSOR, HP, DEC, MSQ, NESTEROV: tl.constexpr,
                GATE: tl.constexpr, GUARD: tl.constexpr, MONA: tl.constexpr, G_TY: tl.constexpr,
                BUF_TY: tl.constexpr, ALIGNED: tl.constexpr, EMULATE: tl.constexpr, BLOCK: tl.constexpr):
    """MSQ[pid] = Σ M² over this program's block, in float64 (no fp32 square overflows or underflows there,
    so the NS5 input is scale invariant over fp32's whole range). Writes nothing else."""
    pid, t, start, rem = _block(BLOCK_TENSOR, FIRST, NUMEL, BLOCK)
    s = 1.0
    if GUARD:
        s = tl.load(DEC + 2 * t)
    idx = tl.arange(0, BLOCK)
    if rem >= BLOCK:
        M, _, _, _, _, _, _, _, _, _ = _pre_block(ADDR, MONA_ADDR, t, start, idx, idx < rem, HP, s, NESTEROV, GATE,
                                                  MONA, G_TY, BUF_TY, ALIGNED, EMULATE, False)
    else:
        M, _, _, _, _, _, _, _, _, _ = _pre_block(ADDR, MONA_ADDR, t, start, idx, idx < rem, HP, s, NESTEROV, GATE,
                                                  MONA, G_TY, BUF_TY, ALIGNED, EMULATE, True)
    m64 = M.to(tl.float64)
    tl.store(MSQ + pid, tl.sum(m64 * m64, axis=0))


@triton.jit
def _norm_kernel(MSQ, FIRST, INV, RBLOCK: tl.constexpr):
    """INV[t] = 1/‖M‖_F of tensor t (0 for a zero M: zero stays zero), its block partials added in block
    order."""
    t = tl.program_id(0)
    b0, b1 = tl.load(FIRST + t), tl.load(FIRST + t + 1)
    acc = tl.zeros((RBLOCK,), dtype=tl.float64)
    for start in range(b0, b1, RBLOCK):
        idx = start + tl.arange(0, RBLOCK)
        acc += tl.load(MSQ + idx, mask=idx < b1, other=0.0)
    ss = tl.sum(acc, axis=0)
    tl.store(INV + t, tl.where(ss > 0.0, 1.0 / tl.sqrt(tl.where(ss > 0.0, ss, 1.0)), 0.0))


@triton.jit
def _write_kernel(ADDR, MONA_ADDR, NUMEL, FIRST, BLOCK_TENSOR, HP, INV, SEL, DEC, DEC_FLAGS, EMA, DENSE,
                  NESTEROV: tl.constexpr, GATE: tl.constexpr, GUARD: tl.constexpr, MONA: tl.constexpr,
                  G_TY: tl.constexpr, BUF_TY: tl.constexpr, X_TY: tl.constexpr, ALIGNED: tl.constexpr,
                  EMULATE: tl.constexpr, BLOCK: tl.constexpr):
    """The new momentum buffer and MONA's G_prev and A (all kept whole for a "skip" tensor with a bad entry)
    and X = M/‖M‖ in the hot dtype (M itself for KL-Shampoo: INV all ones, X fp32); under GATE the gradient
    and moment counts (one atomic per count, only for a block that has something to count) and, in a
    tensor's first block, the guard's EMA and spike count."""
    pid, t, start, rem = _block(BLOCK_TENSOR, FIRST, NUMEL, BLOCK)
    s = 1.0
    keep_all = t < 0
    if GATE:
        flags = tl.load(DEC_FLAGS + t)
        keep_all = (flags & 2) != 0
        sel = tl.load(SEL + t)
        if GUARD:
            s = tl.load(DEC + 2 * t)
            if start == 0:
                tl.store(EMA + sel, tl.load(DEC + 2 * t + 1))
                spike_row = DENSE + sel * _ROW
                tl.store(spike_row + _SPIKE, tl.load(spike_row + _SPIKE) + ((flags >> 2) & 1).to(tl.int64))
    inv = tl.load(INV + t)
    if GATE:
        if rem >= BLOCK:
            total = _write_speculative(ADDR, MONA_ADDR, t, start, rem, HP, s, inv, keep_all, NESTEROV, MONA, G_TY,
                                       BUF_TY, X_TY, ALIGNED, EMULATE, False, BLOCK)
        else:
            total = _write_speculative(ADDR, MONA_ADDR, t, start, rem, HP, s, inv, keep_all, NESTEROV, MONA, G_TY,
                                       BUF_TY, X_TY, ALIGNED, EMULATE, True, BLOCK)
        row = DENSE + sel * _ROW
        gn, gb = total & 65535, (total >> 16) & 65535
        _add_count(row, _GRAD_NAN, gn)
        _add_count(row, _GRAD_INF, gb - gn)
        _add_count(row, _MOMENT_INF, total >> 32)
    else:
        idx = tl.arange(0, BLOCK)
        if rem >= BLOCK:
            _write_block(ADDR, MONA_ADDR, t, start, idx, idx < rem, HP, s, inv, keep_all, NESTEROV, False, MONA,
                         G_TY, BUF_TY, X_TY, ALIGNED, EMULATE, False)
        else:
            _write_block(ADDR, MONA_ADDR, t, start, idx, idx < rem, HP, s, inv, keep_all, NESTEROV, False, MONA,
                         G_TY, BUF_TY, X_TY, ALIGNED, EMULATE, True)


def supported(params, grads, bufs, zs, vs, monas=()) -> bool:
    """True when these launches can take the group: fp32 parameters, gradients, z and MONA buffers (``monas``:
    G_prev and A of every tensor, or empty), an fp32 or bf16 momentum buffer, fp32 row moments, all
    contiguous on one device (a CUDA device, or the CPU under the Triton interpreter). 16-bit parameters run
    ``impl="compiled"``: its eager arithmetic rounds at every op in that dtype, which these fp32 kernels
    would not reproduce."""
    if not one_launch(params + grads + [z for z in zs if z is not None] + list(monas)) \
            or params[0].dtype != torch.float32:
        return False
    return (one_launch(bufs) and bufs[0].dtype in (torch.float32, torch.bfloat16)
            and bufs[0].get_device() == params[0].get_device()
            and all(v is None or (v.dtype == torch.float32 and v.is_contiguous()
                                  and v.get_device() == params[0].get_device()) for v in vs))


@functools.lru_cache(maxsize=64)
def _shapes(shapes: tuple[tuple[int, int], ...], device: str):
    """Per group shape: the row layout (rows, first row of each tensor + total, owning tensor of each row,
    total rows) and per tensor the column count and the RMS target 0.2·√(mn) (float64 on the host, as the
    eager path's Python float, then fp32)."""
    rows = _layout(tuple(m for m, _ in shapes), 1, device)
    ncols = to_device(torch.tensor([n for _, n in shapes], dtype=torch.int64), device)
    target = to_device(torch.tensor([RMS_TARGET * math.sqrt(m * n) for m, n in shapes], dtype=torch.float32),
                       device)
    return rows, ncols, target


@dataclass
class PreResult:
    """What :func:`spectral_pre_` hands to :func:`spectral_post_`: the NS5 input stack of each bucket and the
    step's device-side decisions (None under "off")."""
    inputs: list[torch.Tensor]
    addr: torch.Tensor  # the pre table (buffer, g, X, v): the row kernel reads g and v through it
    dec: torch.Tensor | None  # (n, 2): the guard's scale of each gradient, its new norm EMA
    dec_flags: torch.Tensor | None
    sel: torch.Tensor | None
    res: tuple | None
    write: tuple  # (grid, args, constexprs) of the pending _write_kernel launch (spectral_write_)


def spectral_prepare_(grads, bufs, vs, res, sel, hp, *, buckets, shapes, hot: torch.dtype, nesterov: bool,
                      policy: str, factor: float | None, monas=None, raw: bool = False,
                      tickets: torch.Tensor | None = None) -> PreResult:
    """The read-only launches of the momentum side: the spike guard and decisions (not under "off") and
    1/‖M‖ per matrix — nothing persistent is written, so a failure here leaves the optimizer as it was.
    :func:`spectral_write_` then writes the momentum buffers (and MONA's) and the NS5 inputs: one (B, m, n)
    stack in ``hot`` per bucket of ``buckets`` (``_compiled_spectral._buckets``: member positions, tall) in
    the parameters' own layout, each matrix at unit Frobenius norm. ``hp`` = [1-μ, μ, α, 1-β, first₀, …]
    (fp32, on the device; MONA's α and β and per tensor 1.0 on its first step, read only with ``monas``);
    ``res``/``sel`` as for ``scalar_step.scalar_step_`` (None under "off"); ``vs`` the NorMuon row moments
    or Nones; ``monas`` None or (G_prev list, A list). ``raw`` (KL-Shampoo, which preconditions M before
    it is normalised): the stacks receive M itself in fp32 (``hot`` must be fp32) and the two norm
    launches are skipped. ``tickets``: zeroed int32 scratch of one entry per tensor (left zeroed), which
    lets the two decision launches run as one (:mod:`.decisions`)."""
    code = policy_code(policy)
    if (res is None) != (code == 0):
        raise ValueError("res must be given exactly when the policy is not 'off'")
    device = grads[0].device
    block, warps = elementwise_block()
    sizes = tuple(g.numel() for g in grads)
    layout = _layout(sizes, block, str(device))
    numel, first, owner, nblocks = layout
    inputs = [torch.empty((len(members), *shapes[members[0]]), dtype=hot, device=device) for members, _ in buckets]
    xs = [0] * len(grads)
    for X, (members, _) in zip(inputs, buckets):
        for j, i in enumerate(members):
            xs[i] = X[j].data_ptr()
    if raw and hot is not torch.float32:
        raise ValueError("raw stacks hold M itself: hot must be torch.float32")
    n = len(grads)
    rows = [a for b, g, x, v in zip(bufs, grads, xs, vs)
            for a in (b.data_ptr(), g.data_ptr(), x, (g if v is None else v).data_ptr())]
    if monas is not None:  # rows n..2n-1: (G_prev, A, -, -), reached through the view addr[n:]
        rows += [a for pg, av in zip(*monas) for a in (pg.data_ptr(), av.data_ptr(), 0, 0)]
    table, aligned = address_table(rows, device)
    addr = table[:n]
    mona_addr = table[n:] if monas is not None else addr
    gate, guard = res is not None, res is not None and factor is not None
    kinds = dict(NESTEROV=nesterov, GATE=gate, GUARD=guard, MONA=monas is not None, G_TY=tl_dtype(grads[0].dtype),
                 BUF_TY=tl_dtype(bufs[0].dtype), ALIGNED=aligned, EMULATE=interpreting(), BLOCK=block)
    with on_device(grads[0]):
        dec = dec_flags = None
        if gate:
            dec, dec_flags = decisions(addr, layout, sel, res, code, factor, kinds["G_TY"], aligned, lazy=False,
                                       tickets=tickets if all(sizes) else None)
        if raw:
            inv = dummy = torch.ones(n, dtype=torch.float64, device=device)
        else:
            msq = torch.empty(nblocks, dtype=torch.float64, device=device)
            inv = torch.empty(n, dtype=torch.float64, device=device)
            dummy = msq  # never dereferenced without GATE / GUARD
            _msq_kernel[(nblocks,)](addr, mona_addr, numel, first, owner, hp, dec if guard else dummy, msq,
                                    num_warps=warps, enable_fp_fusion=False, **kinds)
            _norm_kernel[(n,)](msq, first, inv, RBLOCK=_RBLOCK, num_warps=1, enable_fp_fusion=False)
    write = ((nblocks,), (addr, mona_addr, numel, first, owner, hp, inv,
                          *(dummy if x is None else x for x in (sel, dec, dec_flags, res[2] if gate else None,
                                                                 res[3] if gate else None))),
             dict(X_TY=tl_dtype(hot), num_warps=warps, enable_fp_fusion=False, **kinds))
    return PreResult(inputs, addr, dec, dec_flags, sel, res, write)


def spectral_write_(pre: PreResult) -> None:
    """The first persistent write of the step: the momentum buffers (and a guard's EMA and spike count)
    and the NS5 input stacks ``pre.inputs``."""
    grid, args, constexprs = pre.write
    with on_device(pre.inputs[0]):
        _write_kernel[grid](*args, **constexprs)


def spectral_post_(pre: PreResult, outs, params, grads, zs, gamma, hp, *, buckets, shapes, normuon: bool,
                   sf: bool, decay: bool, warmup: bool = False, bounded: bool = True) -> None:
    """The direction side: from each bucket's NS5 output in ``outs`` ((B, m, n), the parameters' layout),
    NorMuon (the row moments given to :func:`spectral_prepare_`, updated in place) or RMS matching, the
    (schedule-free) update of ``params`` (and ``zs``) with the update guard, and the direction and update
    counts (kernels in :mod:`._spectral_post`). ``hp`` = [1-β₂ᴺ, εᴺ, λ, c, β(1-c)-1] (fp32,
    on the device), ``gamma`` the 0-d fp32 step size there. ``warmup``: compile the three kernels for
    these arguments without running them (``outs`` may then be ``pre.inputs``: same dtype and shapes), so
    that a compile error surfaces before :func:`spectral_write_` has written anything. ``bounded``: ``outs``
    are NS5's output (every group these kernels take today), whose squares cannot overflow fp32; False
    compiles in the row kernel's overflow handling (``_rows_kernel``'s WIDE) for a direction that may."""
    def launch(kernel, grid, *args, **constexprs):
        if warmup:
            kernel.warmup(*args, grid=grid, **constexprs)
        else:
            kernel[grid](*args, **constexprs)

    device = params[0].device
    block, warps = elementwise_block()
    numel, first, owner, nblocks = _layout(tuple(p.numel() for p in params), block, str(device))
    (_, row_first, row_owner, total_rows), ncols, target = _shapes(tuple(shapes), str(device))
    os_ = [0] * len(params)
    for O, (members, _) in zip(outs, buckets):
        for j, i in enumerate(members):
            os_[i] = O[j].data_ptr()
    post, aligned = address_table([a for p, g, z, o in zip(params, grads, zs, os_)
                                   for a in (p.data_ptr(), g.data_ptr(), (p if z is None else z).data_ptr(), o)],
                                  device)
    gate = pre.res is not None
    o_ty = tl_dtype(outs[0].dtype)
    row_inv = torch.empty(total_rows, dtype=torch.float32, device=device)
    row_sq = torch.empty(total_rows, dtype=torch.float32 if bounded else torch.float64, device=device)
    row_sum = torch.empty(total_rows, dtype=torch.float32, device=device) if gate else row_sq
    factor = torch.empty(len(params), dtype=torch.float32, device=device)
    dummy = row_sq  # never dereferenced without GATE
    scale, dense = (pre.res[0], pre.res[3]) if gate else (None, None)
    with on_device(params[0]):
        launch(_rows_kernel, (total_rows,), pre.addr, post, row_first, row_owner, ncols, hp,
               *(x if gate else dummy for x in (pre.dec_flags, pre.sel, dense)), row_inv, row_sq, row_sum,
               NORMUON=normuon, GATE=gate, WIDE=not bounded,
               G_TY=tl_dtype(grads[0].dtype), O_TY=o_ty, ROWS_ALIGNED=aligned and all(n % 8 == 0 for _, n in shapes),
               BLOCK_C=_BLOCK_C, num_warps=4, enable_fp_fusion=False)
        launch(_scale_kernel, (len(params),), row_first, target, row_inv, row_sq, row_sum,
               pre.sel if gate else dummy, dense if gate else dummy, factor, GATE=gate, RBLOCK=_RBLOCK, num_warps=1,
               enable_fp_fusion=False)
        launch(_apply_kernel, (nblocks,), post, numel, first, owner, row_first, ncols, row_inv, factor, hp, gamma,
               *(dummy if x is None else x for x in (scale, pre.sel, pre.dec_flags, dense)),
               P_TY=tl_dtype(params[0].dtype), O_TY=o_ty, SF=sf, DECAY=decay, GATE=gate, ALIGNED=aligned,
               EMULATE=interpreting(), BLOCK=block, num_warps=warps, enable_fp_fusion=False)
