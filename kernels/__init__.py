"""Triton kernels for nonans_optim (installed as ``nonans_optim.kernels``).

Importing this package never imports triton: ``nonans_optim`` must work where triton is missing, so the
public functions are resolved lazily (PEP 562 ``__getattr__``) from their modules on first use, and
:func:`available` answers whether that can succeed. Public entry points:

* NS5 (``ns5.py``, ``ns5_gram.py``, ``ns5_axpb.py``): ``ns5_iterate``, ``ns5_iterate_fp16_safe``, ``gram``,
  ``poly``, ``axpb`` and their torch references ``*_reference``.
* Elementwise (``fused_adamw.py``, ``momentum.py``): ``fused_adamw_``, ``momentum_update_`` and their
  references ``fused_adamw_reference_``, ``momentum_update_reference_``.
* The multi-tensor (SF-)AdamW + resolution step of ``impl="fused"`` on CUDA (``scalar_step.py``):
  ``scalar_step_`` and its reference ``scalar_step_reference_``; its default "repair" step runs with the
  decisions and the record in the same launch (``scalar_one.py``; ``NONANS_TRITON_ONE_LAUNCH=0`` opts out).
"""
from __future__ import annotations

import functools
import importlib

__all__ = ["available", "ns5_iterate", "ns5_iterate_fp16_safe", "gram", "poly", "axpb", "fused_adamw_",
           "momentum_update_", "scalar_step_", "ns5_iterate_reference", "ns5_iterate_fp16_safe_reference",
           "gram_reference", "poly_reference", "axpb_reference", "fused_adamw_reference_",
           "momentum_update_reference_", "scalar_step_reference_"]

_HOMES = {
    "ns5_iterate": "ns5", "ns5_iterate_fp16_safe": "ns5", "ns5_iterate_reference": "ns5",
    "ns5_iterate_fp16_safe_reference": "ns5",
    "gram": "ns5_gram", "poly": "ns5_gram", "gram_reference": "ns5_gram", "poly_reference": "ns5_gram",
    "axpb": "ns5_axpb", "axpb_reference": "ns5_axpb",
    "fused_adamw_": "fused_adamw", "fused_adamw_reference_": "fused_adamw",
    "momentum_update_": "momentum", "momentum_update_reference_": "momentum",
    "scalar_step_": "scalar_step", "scalar_step_reference_": "scalar_step",
}


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True when triton (with ``triton.language``) can be imported, i.e. the kernels can be built."""
    try:
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except Exception:
        return False
    return True


def __getattr__(name: str):
    if name in _HOMES:
        module = importlib.import_module(f"{__name__}.{_HOMES[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
