"""Shared pieces of the fused elementwise optimizer kernels (``fused_adamw.py``, ``momentum.py``).

Resolution policies (the contract in ``nonans_optim/resolution.py``; README.md "Resolution"):

* ``"repair"`` — a non-finite gradient entry is a *missing observation*: the moments keep their old value
  there (``torch.where``-style select, never a 0/1 multiply: 0·NaN is NaN) and the parameter still takes the
  step the old moments prescribe (a continuation step). Finite entries follow the stock update exactly,
  except where a value overflows with finite inputs (g - m inside a lerp, g², a huge step): that moment,
  or the parameter, keeps its old value — tested as stored (:func:`kept_finite`). Under ``"skip"`` the
  same gates apply to a tensor that is written at all.
* ``"skip"`` — if ANY entry of the tensor is non-finite, param and state are left untouched bit for bit.
  That needs the whole tensor's verdict before any element may be written, which one elementwise pass
  cannot know. Choice: a precomputed device flag when the caller has one (e.g. from a fused global check),
  otherwise a first pass, :func:`count_nonfinite`, reads only the gradient (1 of the 7 tensor accesses of an
  AdamW step: +14% traffic) and the update kernel reads its verdict from device memory — no host sync.
* ``"off"`` — stock math, no detection, no counting.

Event counters: an int64 device tensor ``[nan_count, inf_count]``; each program adds its block's counts with
one atomic, and only when the block has any (atomics on one address serialise, so a clean step issues none).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._cast import cast_rtne
from ._runtime import interpreting

__all__ = ["POLICIES", "policy_code", "check_counters", "count_nonfinite", "elementwise_block",
           "block_counts", "add_counts", "kept_finite"]

POLICIES = {"off": 0, "repair": 1, "skip": 2}
_BLOCK = 256 if interpreting() else 2048
_WARPS = 1 if interpreting() else 8


def elementwise_block() -> tuple[int, int]:
    """(BLOCK, num_warps): 2048 elements x 8 warps = 8 fp32 per thread, 16-byte vector accesses."""
    return _BLOCK, _WARPS


def policy_code(policy: str) -> int:
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {policy!r}")
    return POLICIES[policy]


def check_counters(counters: torch.Tensor | None, device: torch.device) -> None:
    if counters is None:
        return
    if counters.dtype != torch.int64 or counters.numel() < 2 or not counters.is_contiguous():
        raise ValueError("counters must be a contiguous int64 tensor with at least 2 entries [nan, inf]")
    if counters.device != device:
        raise ValueError(f"counters live on {counters.device}, the tensors on {device}")


@triton.jit
def block_counts(g, mask):
    """(nan count, inf count) of the fp32 block ``g`` over ``mask``, as int64 scalars."""
    is_nan = (g != g) & mask
    is_inf = (tl.abs(g) == float("inf")) & mask
    return tl.sum(is_nan.to(tl.int64), axis=0), tl.sum(is_inf.to(tl.int64), axis=0)


@triton.jit
def kept_finite(x, TY: tl.constexpr, EMULATE: tl.constexpr):
    """Finite *as stored*: the kernels compute in fp32, but a finite fp32 value can round to ±Inf in a
    16-bit tensor (fp16 above 65504). The eager paths, computing in that dtype, see the Inf and gate it;
    so the kernels gate on the value rounded to the storage dtype ``TY``. The oracles use
    :func:`nonans_optim.resolution.storable_mask`, the same verdict as a threshold compare."""
    if TY == tl.float32:
        return tl.abs(x) < float("inf")
    return tl.abs(cast_rtne(x, TY, EMULATE).to(tl.float32)) < float("inf")


@triton.jit
def add_counts(COUNTS, n_nan, n_inf):
    """Atomically add a block's counts, skipping the atomics when the block is clean."""
    if n_nan + n_inf > 0:
        tl.atomic_add(COUNTS, n_nan)
        tl.atomic_add(COUNTS + 1, n_inf)


@triton.jit
def _count_kernel(G, SCRATCH, N, BLOCK: tl.constexpr):
    """SCRATCH[0] += #NaN, SCRATCH[1] += #Inf, SCRATCH[2] += #non-finite (the skip verdict) of G."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < N
    g = tl.load(G + offsets, mask=mask, other=0.0).to(tl.float32)
    n_nan, n_inf = block_counts(g, mask)
    if n_nan + n_inf > 0:
        tl.atomic_add(SCRATCH, n_nan)
        tl.atomic_add(SCRATCH + 1, n_inf)
        tl.atomic_add(SCRATCH + 2, n_nan + n_inf)


def count_nonfinite(grad: torch.Tensor, counters: torch.Tensor | None = None) -> torch.Tensor:
    """First pass of ``"skip"``: a fresh int64 device tensor ``[nan, inf, nan + inf]`` of ``grad``.

    Also adds ``[nan, inf]`` into ``counters`` (device-side, no sync). ``result[2:]`` is the skip flag."""
    scratch = torch.zeros(3, dtype=torch.int64, device=grad.device)
    block, warps = elementwise_block()
    n = grad.numel()
    if n:
        _count_kernel[(triton.cdiv(n, block),)](grad, scratch, n, BLOCK=block, num_warps=warps)
    if counters is not None:
        counters[:2] += scratch[:2]
    return scratch


@triton.jit
def load_grad_block(G, COUNTS, FLAG, N, COUNT: tl.constexpr, HAS_FLAG: tl.constexpr, BLOCK: tl.constexpr):
    """The opening every resolve-and-update kernel shares: this program's offsets and mask, its fp32
    gradient block, the block's NaN/Inf counts added to COUNTS (when COUNT), and whether to write at all
    (False when a "skip" FLAG says the tensor had a non-finite entry)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < N
    g = tl.load(G + offsets, mask=mask, other=0.0).to(tl.float32)
    if COUNT:
        n_nan, n_inf = block_counts(g, mask)
        add_counts(COUNTS, n_nan, n_inf)
    go = True
    if HAS_FLAG:
        go = tl.load(FLAG) == 0
    return offsets, mask, g, go


def skip_flag_and_count(code: int, grad: torch.Tensor, counters: torch.Tensor | None,
                        skip_flag: torch.Tensor | None) -> tuple[torch.Tensor | None, bool]:
    """(the skip flag the kernel reads or None, whether the kernel itself still counts). Under "skip" without
    a precomputed flag, a first pass over ``grad`` makes the verdict and does the counting."""
    count = counters is not None and code != 0
    if code != 2:
        return None, count
    if skip_flag is not None:
        return skip_flag, count
    return count_nonfinite(grad, counters if count else None)[2:], False


def reference_counts_and_skip(g: torch.Tensor, counters: torch.Tensor | None, code: int,
                              skip_flag: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The torch oracles' shared part: (finite mask of fp32 ``g``, 0-d skip verdict under "skip" else None),
    adding [nan, inf] into ``counters`` unless the policy is "off"."""
    finite = torch.isfinite(g)
    if counters is not None and code != 0:
        counters[0] += torch.isnan(g).sum()
        counters[1] += torch.isinf(g).sum()
    skip = None
    if code == 2:
        skip = ~finite.all() if skip_flag is None else skip_flag.reshape(()) != 0
    return finite, skip
