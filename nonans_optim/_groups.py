"""How a parameter group is admitted — the constructor's groups and every later ``add_param_group`` —
for :class:`nonans_optim._base.NonansOptimizer`: torch's own checks, then what this library's step needs
of a group, checked before the group is kept, so that a bad value fails where it is given and not halfway
through a step with earlier groups already updated (torch's optimizers check their constructor's
arguments only; a group added later used to pass and fail inside ``step()``).

What a group must be: no tensor twice, real (not complex), plain tensors (not DTensor or another wrapper
subclass: the fused kernels read storage such a tensor does not have), all on one device (the counters,
γ and the Polyak EMAs live on one), valid hyperparameters (:meth:`GroupAdmission._check_group`,
extended by each optimizer), and names that can be matched to their tensors.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ._validation import FP32_MAX, _check_float, _check_int, check_betas, check_unsupported

__all__ = ["GroupAdmission"]


class GroupAdmission:
    """Mixin of the optimizer shell (before ``torch.optim.Optimizer`` in the bases): ``add_param_group``
    with this library's checks; a refused group is not added."""

    def _align_names(self, group: dict[str, Any]) -> None:
        """A group whose ``param_names`` has another length than its ``params`` cannot say which name is
        whose: ZeroRedundancyOptimizer copies a group's whole name list into each rank's shard of it, and
        torch accepts that, so names routed the wrong tensors (an embedding to the spectral path) and
        labelled events with other parameters' names. Its names become None (routing by ``path`` or
        shape, events by index), with a warning; never a wrong name."""
        names = group.get("param_names")
        if names is None or len(names) == len(group["params"]):
            return
        warnings.warn(f"{type(self).__name__}: a param group has {len(names)} param_names for "
                      f"{len(group['params'])} params (ZeroRedundancyOptimizer passes each rank the whole list), "
                      "so no name can be matched to its tensor: the names are dropped — routing falls back to "
                      "the group's 'path' or the shapes, events name parameters by index. To route embeddings "
                      "and heads, give groups a 'path' (no.param_groups(model) does).", RuntimeWarning,
                      stacklevel=4)
        group["param_names"] = [None] * len(group["params"])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's add_param_group (the constructor's groups come through here too), then the group's
        hyperparameters checked as the constructor checks its arguments: a bad value in a group added later
        used to pass and fail halfway through a step, earlier groups already updated. A refused group is
        not added."""
        super().add_param_group(param_group)  # raises for a tensor already in another group
        try:
            params = self.param_groups[-1]["params"]
            self._align_names(self.param_groups[-1])
            if len({id(p) for p in params}) != len(params):
                raise ValueError("params contains duplicate parameters (a tensor appears twice)")
            complex_ = [p.dtype for p in params if p.is_complex()]
            if complex_:
                raise ValueError(f"complex parameters are not supported (got {complex_[0]}); "
                                 "view them as real with torch.view_as_real")
            wrapped = [type(p).__name__ for p in params if is_traceable_wrapper_subclass(p)]
            if wrapped:  # the fused kernels read storage such a tensor does not have (DTensor: a null pointer)
                raise ValueError(f"{wrapped[0]} parameters are not supported (FSDP2's fully_shard and tensor "
                                 "parallelism shard parameters as DTensors: the native and Triton kernels read a "
                                 "tensor's own storage, which a DTensor does not have, the resolution counters "
                                 "are per whole parameter, and the spectral step needs whole matrices): use DDP "
                                 "or a single device")
            devices = {p.device for g in self.param_groups for p in g["params"]}
            if len(devices) > 1:  # the counters, γ and the Polyak EMAs live on the first parameter's device,
                # and a kernel given another device's addresses would read the wrong memory
                raise ValueError(f"parameters on more than one device ({', '.join(sorted(map(str, devices)))}): "
                                 "the step keeps its counters and step sizes on one device; build one "
                                 "optimizer per device")
            self._check_group(self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()
            raise
        self._warn_fp16_adam(self.param_groups[-1])
        self._resolution = None  # grown on next use: existing parameters keep their counters, new ones start at 0

    def _adam_path(self, group: dict[str, Any], j: int, p: torch.Tensor) -> bool:
        """True when parameter ``j`` of ``group`` takes the (SF-)AdamW arithmetic (every one, here)."""
        return True

    def _warn_fp16_adam(self, group: dict[str, Any]) -> None:
        """Warn once per group with fp16 parameters on the Adam path. Its state lives in the parameter's
        dtype, and in fp16 (1-β₂)·g² of an ordinary gradient (|g| ~ 1e-3) and eps = 1e-8 both round to 0:
        the eager paths then divide 0 by 0 every step — "repair" keeps p, counts an update event and backs
        the step off, so the parameter never moves — and the fused one takes ~8x the fp32 step (an audit's
        scratch run, 2026-11-25, commit 21608b4; not in RESULTS.md). torch.optim.AdamW gives NaN there. bf16
        (fp32's exponent range) is fine."""
        half = [tuple(p.shape) for j, p in enumerate(group["params"])
                if p.dtype == torch.float16 and self._adam_path(group, j, p)]
        if half:
            warnings.warn(f"{type(self).__name__}: {len(half)} float16 parameter(s) (shapes {half[:3]}) take the "
                          "Adam update, whose moments underflow in float16 (v and eps round to 0): keep fp32 "
                          "master weights (autocast) or use bfloat16", UserWarning, stacklevel=3)

    def _check_group(self, group: dict[str, Any]) -> None:
        """Raise ValueError naming a bad hyperparameter of ``group`` (the defaults, or one param group);
        subclasses add theirs. ``warmup_steps`` is normalised to an int in place."""
        check_unsupported(group, type(self).__name__)
        _check_float("lr", group["lr"], high=FP32_MAX, device_ok=True)
        _check_float("weight_decay", group.get("weight_decay", 0.0), high=FP32_MAX)
        if "eps" in group:
            _check_float("eps", group["eps"], high=FP32_MAX)
        if "betas" in group:
            check_betas("betas", group["betas"])
        if "warmup_steps" in group:
            group["warmup_steps"] = _check_int("warmup_steps", group["warmup_steps"])
