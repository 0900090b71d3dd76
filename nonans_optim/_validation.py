"""Argument checks shared by the optimizers: each raises ValueError naming the argument, where it is given
(the constructor, or ``add_param_group``) rather than inside a later ``step()``."""
from __future__ import annotations

import math
import numbers
from typing import Any, Iterable

import numpy as np
import torch

__all__ = ["_check_float", "_check_int", "check_betas", "check_unsupported", "FP32_MAX", "FP32_TINY",
           "UNSUPPORTED"]

#: The largest and the smallest normal fp32 values. The step computes in fp32 (γ is built as an fp32 tensor,
#: the native loops take fp32 arguments): lr, weight_decay and eps above FP32_MAX made ``step()`` raise
#: halfway ("value cannot be converted to type float without overflow"), after the global step had
#: advanced, and a NorMuon eps below FP32_TINY turned 1/(√v + eps) into Inf on a dead row, so 0·Inf = NaN
#: every step in the fused and compiled paths (the fuzz audit, 2026-11-26).
FP32_MAX = float(torch.finfo(torch.float32).max)
FP32_TINY = float(torch.finfo(torch.float32).tiny)


def _check_float(name: str, value: Any, *, low: float = 0.0, high: float = math.inf,
                 high_open: bool = False, device_ok: bool = False) -> None:
    """A finite number in [low, high] (or [low, high)); a one-element tensor counts as its value.

    A tensor on another device than the CPU is refused unless ``device_ok`` (lr: γ = lr · warmup is a
    device op, see ``_stepsize.StepSize._schedule``): the step reads every other hyperparameter on the host —
    into the native loops' arguments, the Triton kernels' constant table, Python arithmetic — and reading
    a CUDA tensor there is a device sync at every ``step()``, which the resolution contract forbids."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number, got a tensor of shape {tuple(value.shape)}")
        if not (device_ok or value.is_cpu):
            raise ValueError(f"{name} is a {value.device.type} tensor: step() reads {name} on the host, which "
                             "for a device tensor is a sync at every step; pass a float or a CPU tensor (only lr "
                             "may live on the parameters' device)")
        value = float(value)  # construction time only, never inside step()
    # numbers.Real, not (int, float): numpy's scalars (np.float32(1e-3), a value read from a config array)
    # were refused as "not a finite number", which torch.optim.AdamW accepts
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)) or not math.isfinite(value):
        raise ValueError(f"Invalid {name}: {value!r} (must be a finite number)")
    if value < low or value > high or (high_open and value >= high):
        bound = f"[{low}, {high})" if high_open else f"[{low}, {high}]"
        raise ValueError(f"Invalid {name}: {value!r} (must be in {bound})")


def _check_int(name: str, value: Any, *, low: int = 0) -> int:
    """``value`` as an int >= ``low``; an integral float (10.0) is accepted, 2.5 or "10" are not (int()
    would silently truncate the one and parse the other)."""
    ok = isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not ok or value < low:
        raise ValueError(f"Invalid {name}: {value!r} (must be an integer >= {low})")
    return int(value)


def check_betas(name: str, betas: Iterable[float]) -> None:
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise ValueError(f"Invalid {name}: {betas!r} (must be a pair (beta1, beta2))")
    for i, b in enumerate(betas):
        _check_float(f"{name}[{i}]", b, high=1.0, high_open=True)


# torch.optim.AdamW group flags whose non-default value changes the algorithm; this library has neither.
UNSUPPORTED = {"amsgrad": False, "maximize": False}


def check_unsupported(group: dict[str, Any], name: str) -> None:
    """Refuse a group that sets a torch.optim flag this library does not implement: ``maximize=True`` was
    accepted and ignored, so a run meant to ascend descended (an audit, 2026-11-26), and the optimizer
    could not load its own state_dict afterwards."""
    used = sorted(k for k, off in UNSUPPORTED.items() if group.get(k, off) != off)
    if used:
        hint = " (minimise the negated objective instead)" if "maximize" in used else ""
        raise ValueError(f"{name} does not implement {', '.join(f'{k}={group[k]!r}' for k in used)}{hint}")
