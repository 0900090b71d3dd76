"""What an optimizer reports between steps: ``events`` (the resolved singularities, as
:class:`~nonans_optim.resolution.SingularityEvent`) and ``metrics()`` (scalars for a logger). Both read the
device counters, so both synchronise — which is why they are read here, on demand, and never inside
``step()``.
"""
from __future__ import annotations

import torch

from ._stepsize import gamma_dtype, warmup
from .resolution import Resolution, SingularityEvent

__all__ = ["Telemetry"]


class Telemetry:
    """Mixin of :class:`._base.NonansOptimizer`: its ``events`` and ``metrics()``."""

    @property
    def events(self) -> list[SingularityEvent]:
        """Resolved singularities of the last steps that had any (materialised now: this syncs). Counters
        recorded before the policy was switched to "off" are still reported."""
        st = self._global_state()
        if st is None or (self.resolution_policy == "off" and "resolution" not in st):
            return []
        res = self._get_resolution()
        return res.materialise(self._param_names(), [p.numel() for p in self._all_params()])

    def metrics(self) -> dict[str, float]:
        """Scalars for logging (this synchronises with the device, as reading ``events`` does; step() never does)."""
        st = self._global_state()
        out: dict[str, float] = {"optim/step": float(st["step"] if st else 0)}
        if self._uses_polyak:
            pol = st["polyak"] if st else None
            out["fusion/loss_ema"] = float(pol["loss_ema"]) if pol is not None else 0.0
            out["fusion/gnorm_ema"] = float(pol["gnorm_ema"]) if pol is not None else 0.0
            mult = float(pol["gamma_mult"]) if pol is not None else 1.0
            out["fusion/gamma_mult"] = mult
            g0 = self.param_groups[0]
            # the step size the first group's last step took, γ = lr·warmup·multiplier: with a scheduler
            # stepped after step() (torch's order), the group's lr is already the next step's. Before the
            # first step (or after a load) the current lr, with warmup's factor at the current t (0 with
            # warmup before any step — nothing has moved yet — and 1 without)
            last = getattr(self, "_last_gamma", None)
            if last is None:  # rounded as _schedule rounds γ: a resumed run reports what the saved one did
                lr_t = float(g0["lr"]) * warmup(g0, st["step"] if st else 0)
                last = torch.tensor(lr_t, dtype=gamma_dtype(g0))
                last = last * pol["gamma_mult"].cpu() if pol is not None else last
            out["fusion/gamma_curr"] = float(last)
        if st is not None and "resolution" in st:  # also under "off": what was recorded before stays visible
            out.update(self._get_resolution().summary())
        elif self.resolution_policy != "off":
            out.update(Resolution(self._policy, 0, torch.device("cpu")).summary())  # the same keys, zero
        return out
