"""The environment switches the library reads, each parsed and validated in one place.

Why one module: the step reads most of these as it goes (per group, per NS5 call), so that a test or a user
can flip one between steps. A value that is not one of the allowed ones then raised part way through a step:
after the global step count had moved and, with several parameter groups, after the groups before the one
that read the switch had been updated — a second ``step()`` once the value was fixed would apply that
gradient to them again. Every optimizer therefore checks them all when it is constructed
(:func:`check_all`), before any state exists; the readers below raise the same errors if a value is changed
to a bad one later. Checking them at every step instead would cost the host about 6 µs per step (six
``os.environ.get`` calls under timeit on the project's 2-core Xeon, a scratch measurement of 2026-11-27) —
more than 2% (issue 3's CPU budget for "repair") of a small tensor's ~120 µs step.

``NONANS_NATIVE`` and ``NONANS_CACHE_DIR`` take any value ("0" disables the C library; a path), and
``TRITON_INTERPRET`` is Triton's own: none of them can be invalid.
"""
from __future__ import annotations

import os

__all__ = ["fused_backend", "one_launch", "fold_decide", "ns5_backend", "ns5_triton_min_dim", "ns5_method",
           "native_simd", "check_all", "FUSED_BACKENDS", "NS5_BACKENDS", "NS5_METHODS", "SIMD_MODES"]

FUSED_BACKENDS = ("auto", "native", "triton")
NS5_BACKENDS = ("auto", "torch", "triton")
NS5_METHODS = ("auto", "standard", "gram")
SIMD_MODES = ("auto", "portable", "avx2", "portable-avx2", "generic")


def _choice(name: str, default: str, allowed: tuple[str, ...], *, empty_is_default: bool = False) -> str:
    value = os.environ.get(name, default)
    if empty_is_default and not value:
        value = default
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    return value


def fused_backend() -> str:
    """``NONANS_FUSED_BACKEND``: which fused kernel a group tries first (optimizers/_fused_triton.py)."""
    return _choice("NONANS_FUSED_BACKEND", "auto", FUSED_BACKENDS)


def one_launch() -> bool:
    """``NONANS_TRITON_ONE_LAUNCH`` ("1", the default, or "0"): the (SF-)AdamW "repair" step in one Triton
    launch or three (optimizers/_fused_triton.py::one_launch says why one is the default)."""
    return _choice("NONANS_TRITON_ONE_LAUNCH", "1", ("0", "1")) == "1"


def fold_decide() -> bool:
    """``NONANS_TRITON_FOLD_DECIDE`` ("1", the default, or "0"): "1" runs a group's gradient statistics and
    decisions on the Triton path as one launch instead of two (``kernels/decisions.py`` says why and how);
    "0" returns them to two launches. Opt-in until the H200 run of 2026-11-27 (RESULTS.md,
    "overhead-gpu-gpt2-small" beside "-unfolded"), as ``one_launch`` went."""
    return _choice("NONANS_TRITON_FOLD_DECIDE", "1", ("0", "1")) == "1"


def ns5_backend() -> str:
    """``NONANS_NS5_BACKEND``: what ``backend="auto"`` of ``ns5`` means (unset or empty: "auto")."""
    return _choice("NONANS_NS5_BACKEND", "auto", NS5_BACKENDS, empty_is_default=True)


def ns5_triton_min_dim(default: int) -> int:
    """``NONANS_NS5_TRITON_MIN_DIM``: the smallest matrix side from which ``backend="auto"`` runs the Triton
    NS5 on CUDA (unset or empty: ``default``, the measured crossover)."""
    raw = os.environ.get("NONANS_NS5_TRITON_MIN_DIM") or str(default)
    if not raw.strip().isdigit():
        raise ValueError(f"NONANS_NS5_TRITON_MIN_DIM must be a non-negative integer, got {raw!r}")
    return int(raw)


def ns5_method() -> str:
    """``NONANS_NS5_METHOD``: what ``method="auto"`` of ``ns5`` means (unset or empty: "auto")."""
    return _choice("NONANS_NS5_METHOD", "auto", NS5_METHODS, empty_is_default=True)


def native_simd() -> str:
    """``NONANS_NATIVE_SIMD``: which form of the C loops the native library is built with (native/)."""
    return _choice("NONANS_NATIVE_SIMD", "auto", SIMD_MODES)


def check_all() -> None:
    """Raise ValueError naming the first switch whose value is not allowed (see the module docstring)."""
    fused_backend()
    one_launch()
    fold_decide()
    ns5_backend()
    ns5_triton_min_dim(0)
    ns5_method()
    native_simd()
