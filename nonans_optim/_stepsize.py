"""The step size of a parameter group at a step: γ = lr · warmup (· the Polyak multiplier) as a 0-d device
tensor, and the schedule-free weight c — the one place a step turns the group's scheduled ``lr`` into device
arithmetic (see :meth:`StepSize._schedule` for why a tensor lr stays on the device and when it cannot).
``metrics()`` (``_telemetry.py``) reports the γ the last step took, rounded as it was taken.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from .functional.schedule_free import sf_weight

__all__ = ["StepSize", "gamma_dtype", "warmup"]


def gamma_dtype(group: dict[str, Any]) -> torch.dtype:
    """The dtype of a group's step size γ: fp64 where the group holds fp64 parameters (an fp32 γ put every
    fp64 step 4e-8 off torch's AdamW, 7.7e-7 after 20 steps, and rounded a decay factor 1 - lr·wd above
    1 - 6e-8 to exactly 1), fp32 otherwise."""
    return torch.float64 if any(p.dtype is torch.float64 for p in group["params"]) else torch.float32


def warmup(group: dict[str, Any], step: int) -> float:
    """Linear warmup factor min(1, t / warmup_steps) of a group (1 without warmup)."""
    warm = group.get("warmup_steps", 0)
    return min(1.0, step / warm) if warm > 0 else 1.0


class StepSize:
    """Mixin of :class:`._base.NonansOptimizer`: the per-group step size a ``_step_group`` asks for."""

    def _schedule(self, group: dict[str, Any], ctx: dict[str, Any]) -> tuple[torch.Tensor, float]:
        """(γ as a 0-d device tensor — fp32, fp64 for a group with fp64 parameters —, schedule-free weight c)
        for this group and step.

        lr_t = lr · min(1, t / warmup_steps) is host arithmetic on the scheduled lr; the Polyak multiplier
        (when active) is a device tensor, so γ never needs a sync. c follows SF-NorMuon: η_t² / Σ η_k².

        A tensor lr (torch.optim's convention; an LR scheduler keeps it one, through ``fill_``) on the
        parameters' device is used where it is: γ = lr · warmup as a device op, for a CUDA lr no host read.
        Only the schedule-free weight c needs η_t as a host number; there a CUDA lr is read every step (a
        sync, with a warning once). A CPU lr for CUDA parameters is read on the host (no device sync)."""
        lr, warm = group["lr"], warmup(group, ctx["step"])
        device = ctx["unit_scale"].device
        dtype = gamma_dtype(group)
        c = 0.0
        if isinstance(lr, torch.Tensor) and lr.device == device and "sf_weight_sum" not in group:
            gamma = lr.detach().reshape(()).to(dtype) * warm
        else:
            if isinstance(lr, torch.Tensor) and not lr.is_cpu and "sf_weight_sum" in group:
                warnings.warn(f"lr is a {lr.device.type} tensor: the schedule-free weight needs its value on the "
                              "host, so every step reads it (a device sync); pass a float or a CPU tensor",
                              RuntimeWarning, stacklevel=4)
            lr_t = float(lr) * warm
            if "sf_weight_sum" in group:
                c, group["sf_weight_sum"] = sf_weight(lr_t, group["sf_weight_sum"])
            gamma = torch.full((), lr_t, dtype=dtype, device=device)
        if ctx["gamma_mult"] is not None:
            gamma = gamma * ctx["gamma_mult"]
        if group is self.param_groups[0]:  # metrics()' fusion/gamma_curr (a reference: nothing writes into it)
            self._last_gamma = gamma
        return gamma, c
