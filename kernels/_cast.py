"""Round-to-nearest-even casts that also hold under the Triton interpreter.

On a GPU ``x.to(tl.bfloat16)`` rounds to nearest even. The CPU interpreter (triton 3.9,
``runtime/interpreter.py`` ``cast_impl``) converts fp32 -> bf16 by *truncating* the mantissa, which doubles
the rounding error and biases it toward zero — enough to make an interpreter test of a bf16 kernel fail
against torch for the wrong reason. Under the interpreter (``EMULATE``) we therefore round the fp32 bits to
the nearest bf16 value ourselves (add 0x7FFF plus the lowest kept bit, clear the low half: the classic RTNE
bit trick) so the truncating cast that follows is exact. NaN is passed through untouched (the trick could
carry a NaN payload into Inf). fp16 casts go through numpy and already round to nearest even.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cast_rtne(x, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """``x.to(DTYPE)`` with round-to-nearest-even for fp32 -> bf16 also under the interpreter."""
    if EMULATE and DTYPE == tl.bfloat16:
        x = x.to(tl.float32)
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    return x.to(DTYPE)
