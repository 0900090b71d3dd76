"""Launch-side helpers shared by every kernel module: interpreter detection, dtype rules, scalar arguments.

Why this exists: the same kernel source must run in three places — compiled on a CUDA GPU, under the Triton
CPU interpreter (``TRITON_INTERPRET=1``, how CI tests the kernels), and ahead-of-time compiled for sm_90 on a
CPU-only machine (how CI catches compile errors). The differences are confined to a few compile-time flags
chosen here:

* ``UPCAST``: the interpreter keeps bf16 tensors as raw ``uint16`` words, so ``tl.dot`` on a bf16 tile
  multiplies integers (``triton/runtime/interpreter.py`` maps ``tl.bfloat16``
  to ``np.uint16``). Converting with ``.to(tl.float32)`` *is* handled correctly, so under the interpreter
  every operand is upcast right after its load. A bf16 value is exact in fp32 and ``tl.dot`` accumulates
  in fp32 anyway, so the arithmetic is the same as the bf16 MMA up to summation order.
* ``IEEE``: ``tl.dot`` on fp32 operands defaults to TF32 on CUDA (10-bit mantissa). torch's fp32 matmul
  does not (``torch.backends.cuda.matmul.allow_tf32`` is False by default), so fp32 kernels ask for
  ``input_precision="ieee"`` to be a faithful fp32 backend.
"""
from __future__ import annotations

import contextlib
import math

import torch
import triton.language as tl
from triton import knobs

__all__ = ["interpreting", "tl_dtype", "check_hot_dtype", "scalar_arg", "is_power_of_two", "on_device",
           "H100_SMEM_BYTES"]

# Largest dynamic shared memory one CTA may request on sm_90 (227 KiB); configs above it fail to launch.
H100_SMEM_BYTES = 227 * 1024

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def interpreting() -> bool:
    """True when ``@triton.jit`` builds interpreted functions (read at decoration time, like triton)."""
    return bool(knobs.runtime.interpret)


def tl_dtype(dtype: torch.dtype):
    """The ``tl`` dtype of a supported torch hot dtype."""
    try:
        return _TL_DTYPES[dtype]
    except KeyError:
        raise TypeError(f"kernels support float32, float16 and bfloat16, got {dtype}") from None


def check_hot_dtype(t: torch.Tensor, name: str) -> None:
    """Raise a clear error for a dtype the matmul kernels do not implement."""
    if t.dtype not in _TL_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def scalar_arg(value, name: str, device: torch.device):
    """(argument, is_pointer) for a scalar given as a Python number or a 0-d/1-element tensor.

    A device tensor is passed as a pointer and read inside the kernel, so a learning rate or a bias
    correction that lives on the GPU (capturable / CUDA-graph training) never forces a host sync; a Python
    number is passed by value."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar (one element), got shape {tuple(value.shape)}")
        if value.device != device:
            raise ValueError(f"{name} lives on {value.device}, the tensors on {device}")
        if not value.is_floating_point():
            value = value.float()
        return value, True
    return float(value), False


def is_power_of_two(x: float) -> bool:
    """True for 2**k (k any integer): such a scale is exact in every binary floating-point format."""
    if not (x > 0 and math.isfinite(x)):
        return False
    mantissa, _ = math.frexp(x)
    return mantissa == 0.5


def on_device(t: torch.Tensor):
    """Context that makes ``t``'s GPU current: Triton launches on the *current* CUDA device, so a tensor on
    cuda:1 with cuda:0 current would otherwise be handed to a kernel running on the wrong GPU."""
    if t.is_cuda:
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()
