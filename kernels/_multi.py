"""What every multi-tensor Triton launch of ``impl="fused"`` shares (``scalar_step.py``, ``spectral_step.py``).

A group's tensors are reached through an int64 table of their addresses, four columns per tensor, turned
back into typed pointers in the kernel (:func:`_column`); flat launches run one program per block of one
tensor (:func:`_block`, over the static :func:`_layout` of the group's sizes). Math is fp32 whatever the
storage dtype: :func:`_load` widens and :func:`_store` rounds once, to nearest even also under the
interpreter (:func:`._cast.cast_rtne`).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from nonans_optim._transfer import to_device
from nonans_optim.resolution import STAGE_INDEX, STAGES

from ._cast import cast_rtne
from ._runtime import interpreting

__all__ = ["supported", "address_table"]

# Offsets inside one parameter's (S, 2) [nan, inf] row of the dense count block (resolution.STAGES).
_GRAD_NAN = tl.constexpr(2 * STAGE_INDEX["grad"])
_GRAD_INF = tl.constexpr(2 * STAGE_INDEX["grad"] + 1)
_MOMENT_INF = tl.constexpr(2 * STAGE_INDEX["moment"] + 1)
_DIR_NAN = tl.constexpr(2 * STAGE_INDEX["direction"])
_DIR_INF = tl.constexpr(2 * STAGE_INDEX["direction"] + 1)
_UPDATE_NAN = tl.constexpr(2 * STAGE_INDEX["update"])
_UPDATE_INF = tl.constexpr(2 * STAGE_INDEX["update"] + 1)
_SPIKE = tl.constexpr(2 * STAGE_INDEX["spike"] + 1)
_ROW = tl.constexpr(2 * len(STAGES))


@triton.jit
def _finite(x):
    return tl.abs(x) < float("inf")


@triton.jit
def _lerp(a, b, w):
    """torch.lerp's formula (aten/src/ATen/native/Lerp.h): exact at both ends, so lerp(m, m, w) == m."""
    return tl.where(tl.abs(w) < 0.5, a + w * (b - a), b - (b - a) * (1.0 - w))


@triton.jit
def _block(BLOCK_TENSOR, FIRST, NUMEL, BLOCK: tl.constexpr):
    """This program's id, its tensor, the block's first entry in that tensor, and how many entries are left
    from there (at least BLOCK except in a tensor's last block)."""
    pid = tl.program_id(0)
    t, start, rem = _block_of(pid, BLOCK_TENSOR, FIRST, NUMEL, BLOCK)
    return pid, t, start, rem


@triton.jit
def _block_of(pid, BLOCK_TENSOR, FIRST, NUMEL, BLOCK: tl.constexpr):
    """:func:`_block` for block ``pid`` of the launch's layout, whichever program handles it."""
    t = tl.load(BLOCK_TENSOR + pid)
    start = (pid.to(tl.int64) - tl.load(FIRST + t)) * BLOCK
    return t, start, tl.load(NUMEL + t) - start


@triton.jit
def _column(ADDR, t, COLUMN: tl.constexpr, TY: tl.constexpr, start, ALIGNED: tl.constexpr):
    """Typed pointer to the block's first entry in one column of the address table (column 1: g).

    An address read from memory tells the compiler nothing about its alignment, so it would emit one
    scalar access per entry; ALIGNED (the host checked every address is 16-byte aligned) restores the
    128-bit vector accesses a pointer argument gets from the JIT's specialisation."""
    base = tl.load(ADDR + t * 4 + COLUMN).to(tl.pointer_type(TY))
    if ALIGNED:
        base = tl.multiple_of(base, 16)
    return base + start


@triton.jit
def _load(ptr, idx, mask, MASKED: tl.constexpr):
    """fp32 block; only a tensor's last block is masked (a mask from a loaded length would also stop the
    compiler from vectorising the full blocks)."""
    if MASKED:
        x = tl.load(ptr + idx, mask=mask, other=0.0)
    else:
        x = tl.load(ptr + idx)
    return x.to(tl.float32)


@triton.jit
def _store(ptr, idx, x, mask, TY: tl.constexpr, EMULATE: tl.constexpr, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + idx, cast_rtne(x, TY, EMULATE), mask=mask)
    else:
        tl.store(ptr + idx, cast_rtne(x, TY, EMULATE))


@triton.jit
def _sum_masked(x, mask, MASKED: tl.constexpr):
    """Σ x over a block's live entries (only a tensor's last block is masked)."""
    if MASKED:
        x = tl.where(mask, x, 0)
    return tl.sum(x, axis=0)


@triton.jit
def _add_count(ROW, OFFSET: tl.constexpr, n):
    if n > 0:
        tl.atomic_add(ROW + OFFSET, n.to(tl.int64))


# A block's event counts without one reduction per count. Why: every tl.sum over a block is a cross-warp
# exchange through shared memory with its barriers, and what it reduces stays live until then; five of them
# in the (SF-)AdamW update took it from 66 to 126 registers per thread on sm_90 and added 28 barriers to the
# PTX, where the "off" variant, which counts nothing, streams at copy bandwidth. So each entry keeps its
# events as bits of one int32 (:func:`_flag`); a block reduces them once (a max: is anything set?), and only
# a block with an event expands them into the int64 bit fields of its counts and sums those
# (:func:`_packed_counts`): 108 registers (104 schedule-free), 14 barriers in the PTX, of which a clean
# block runs the max's alone — and it skips the expansion, which is most of the counting's instructions
# (the gated variant compiles to 2456 SASS instructions, off 1512: kernel-static as published at 55a6a4c;
# 1720 without counts: a scratch cuobjdump, 2026-11-26, commit 989996a, not published). Since then the update
# speculates (scalar_update._speculative_block: the "AdamW, repair" row, 80 registers, three blocks per SM as
# "off"; results/kernel_static.json), and the counts are packed only where it recomputes. Every count above is
# triton 3.9's compile; the GPU image's triton 3.6 allocates differently (its own kernel-static section,
# results/kernel_static_triton-3.6.json, "AdamW, repair": 904171a's gated update 173 registers, one block per
# SM; the speculative one 76, three blocks per SM). Static counts of the compiled kernels: `python -m
# experiments kernel-static` (RESULTS.md, both "Static sm_90 resources of the fused kernels" sections, before
# and after); what they do to the time is for a GPU run of `python -m experiments kernels` to say (its
# per-kernel table).
_B_GRAD_NAN = tl.constexpr(0)
_B_GRAD_INF = tl.constexpr(1)
_B_MOMENT = tl.constexpr(2)
_B_UPDATE_NAN = tl.constexpr(3)  # the update (y) ...
_B_UPDATE_INF = tl.constexpr(4)
_B_UPDATE2_NAN = tl.constexpr(5)  # ... and the schedule-free z, counted in the same stage
_B_UPDATE2_INF = tl.constexpr(6)
# (shift, width) of each count in the packed int64: at most 2 per entry, so blocks of <= _PACK_BLOCK entries
_PACK_BLOCK = tl.constexpr(2048)
_F_GRAD_NAN = tl.constexpr(0)  # 12 bits
_F_GRAD_INF = tl.constexpr(12)
_F_MOMENT = tl.constexpr(24)
_F_UPDATE_NAN = tl.constexpr(36)  # 13 bits
_F_UPDATE_INF = tl.constexpr(49)  # ..61
_W12 = tl.constexpr(4095)  # field masks (written out: the interpreter cannot shift an int by a constexpr)
_W13 = tl.constexpr(8191)
_BEFORE_UPDATE = tl.constexpr(68719476735)  # (1 << _F_UPDATE_NAN) - 1: the gradient and moment fields


@triton.jit
def _flag(cond, BIT: tl.constexpr):
    """cond as bit BIT of an entry's int32 event code."""
    return cond.to(tl.int32) << BIT


@triton.jit
def _bit(code, BIT: tl.constexpr):
    return (code >> BIT) & 1


@triton.jit
def _packed_counts(code, mask, MASKED: tl.constexpr):
    """A block's counts from its entries' event codes (:func:`_flag`), packed as int64 bit fields (0 for a
    clean block, which pays one int32 max and none of the expansion)."""
    if MASKED:
        code = tl.where(mask, code, 0)
    total = tl.zeros((), dtype=tl.int64)
    if tl.max(code, axis=0) != 0:  # a clean block pays this one int32 reduction
        c = code.to(tl.int64)
        tally = ((_bit(c, _B_GRAD_NAN) << _F_GRAD_NAN) + (_bit(c, _B_GRAD_INF) << _F_GRAD_INF)
                 + (_bit(c, _B_MOMENT) << _F_MOMENT)
                 + ((_bit(c, _B_UPDATE_NAN) + _bit(c, _B_UPDATE2_NAN)) << _F_UPDATE_NAN)
                 + ((_bit(c, _B_UPDATE_INF) + _bit(c, _B_UPDATE2_INF)) << _F_UPDATE_INF))
        total = tl.sum(tally, axis=0)
    return total


@triton.jit
def _field(total, SHIFT: tl.constexpr, MASK: tl.constexpr):
    return (total >> SHIFT) & MASK


@triton.jit
def _add_packed(ROW, total):
    """Add a block's packed counts (:func:`_packed_counts`) to its parameter's row of the dense count block: one
    branch on a clean block, an atomic per nonzero count otherwise."""
    if total != 0:
        _add_count(ROW, _GRAD_NAN, _field(total, _F_GRAD_NAN, _W12))
        _add_count(ROW, _GRAD_INF, _field(total, _F_GRAD_INF, _W12))
        _add_count(ROW, _MOMENT_INF, _field(total, _F_MOMENT, _W12))
        _add_count(ROW, _UPDATE_NAN, _field(total, _F_UPDATE_NAN, _W13))
        _add_count(ROW, _UPDATE_INF, _field(total, _F_UPDATE_INF, _W13))


def supported(tensors: list[torch.Tensor]) -> bool:
    """True when one launch can take these tensors: one floating dtype the kernels implement, contiguous,
    all on one device (a CUDA device, or the CPU under the Triton interpreter)."""
    first = tensors[0]
    dtype, index = first.dtype, first.get_device()
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if not (first.is_cuda or (first.is_cpu and interpreting())):
        return False
    # Run every step over all of a group's tensors (4 per parameter), so written for the host's time: list
    # comprehensions and get_device() (an int) instead of one generator comparing torch.device objects took
    # 66 -> ~38 us for 208 tensors. A device index alone cannot tell cuda:0 from another backend's 0; a
    # parameter group never mixes backends (torch's foreach ops refuse it before this runs).
    return (all([t.dtype == dtype for t in tensors]) and all([t.get_device() == index for t in tensors])
            and all([t.is_contiguous() for t in tensors]))


@functools.lru_cache(maxsize=64)
def _layout(numels: tuple[int, ...], block: int, device: str):
    """(numel, first block of each tensor + total, owning tensor of each block) on ``device``, built once per
    group shape: the layout is static while the addresses (gradients are new tensors every backward) are not."""
    blocks = [triton.cdiv(n, block) for n in numels]
    first = torch.tensor([0] + blocks, dtype=torch.int64).cumsum(0)
    owner = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), torch.tensor(blocks))
    return (to_device(torch.tensor(numels, dtype=torch.int64), device), to_device(first, device),
            to_device(owner, device), int(first[-1]))  # (pinned: no sync, even the first time)


def address_table(addresses: list[int], device: torch.device) -> tuple[torch.Tensor, bool]:
    """The (n, 4) int64 address table on ``device`` from a flat row-major list of addresses, and whether
    every address is 16-byte aligned (the kernels' ALIGNED). Pinned on the host (torch's caching host
    allocator: no allocation per step once warm), so the copy is truly asynchronous; the allocator keeps
    the block until the copy has run. A flat list, then a view: nested lists cost about 1.5x the host time."""
    host = torch.tensor(addresses, dtype=torch.int64, pin_memory=device.type == "cuda").view(-1, 4)
    return host.to(device, non_blocking=True), bool((host % 16 == 0).all())
