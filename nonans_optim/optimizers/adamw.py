"""AdamW and schedule-free AdamW with the resolution step.

``AdamW`` matches ``torch.optim.AdamW`` (decoupled decay, bias correction) on clean steps; ``SFAdamW`` is the
memory-efficient schedule-free AdamW (Defazio et al. 2024) with weight decay at z (the library's choice for
every schedule-free path; ``facebookresearch/schedule_free`` decays at y by default).
"""
from __future__ import annotations

from typing import Any

import torch

from .._base import NonansOptimizer
from .._global_state import needs_init
from .._validation import check_betas
from ..functional.schedule_free import SF_BETA_MIN, to_x_, to_y_
from ._scalar import scalar_init_state, scalar_update

__all__ = ["AdamW", "SFAdamW", "torch_flags"]


class _ScalarOnly(NonansOptimizer):
    _sf = False
    _impls = ("auto", "loop", "foreach", "compiled", "fused")
    _counts_from_one_call = True  # one group, one scalar_update call

    def _expected_state(self, group: dict[str, Any], j: int, p: torch.Tensor) -> dict[str, Any]:
        return scalar_init_state(p, sf=self._sf)

    def _step_group(self, group: dict[str, Any], ctx: dict[str, Any]) -> None:
        params, grads, states, indices = [], [], [], []
        found = self._gradients(group, ctx)
        for j, p in enumerate(group["params"]):
            if j not in found:
                continue
            st = self.state[p]
            if needs_init(st):
                st.update(scalar_init_state(p, sf=self._sf))
            params.append(p)
            grads.append(found[j])
            states.append(st)
            indices.append(ctx["index"] + j)
        if not params:
            self._idle_group(group, ctx)
            return
        gamma, c = self._schedule(group, ctx)
        scalar_update(params, grads, states, indices, group, ctx, sf=self._sf, gamma=gamma, c=c,
                      impl=self.impl)


def torch_flags(impl: str, *, amsgrad: Any, maximize: Any, foreach: Any, capturable: Any, differentiable: Any,
                fused: Any) -> str:
    """``impl`` after ``torch.optim.AdamW``'s own keyword arguments, which :class:`AdamW` takes so that code
    and configs written for torch's (Hydra, Lightning, a sweep that spells out torch's defaults) construct
    ours unchanged — they raised "unexpected keyword argument" (an audit, 2026-11-26). Each is accepted at
    its torch default; ``foreach=True`` / ``fused=True`` choose that implementation (torch's meaning: which
    implementation, never the result); a value this library does not implement is refused by name:
    ``amsgrad``, ``maximize``, ``capturable`` (a CUDA-graph-capturable step), ``differentiable``."""
    for name, value in (("amsgrad", amsgrad), ("maximize", maximize), ("capturable", capturable),
                        ("differentiable", differentiable)):
        if value:  # (falsy values, 0 or None, mean the default, as torch reads them)
            raise ValueError(f"AdamW does not implement {name}={value!r} (torch.optim.AdamW's {name}; only its "
                             "default, False, is accepted)")
    for name, value in (("foreach", foreach), ("fused", fused)):
        if value not in (None, True, False):
            raise ValueError(f"Invalid {name}: {value!r} (must be None, True or False)")
    if foreach and fused:
        raise ValueError("foreach=True and fused=True cannot be given together (as in torch.optim.AdamW)")
    wanted = "fused" if fused else "foreach" if foreach else None
    if wanted is None or impl == wanted:
        return impl
    if impl != "auto":
        raise ValueError(f"impl={impl!r} and {wanted}=True ask for two implementations; give one")
    return wanted


class AdamW(_ScalarOnly):
    """AdamW (Loshchilov & Hutter 2019) that repairs NaN/Inf gradients inside ``step()``.

    Args mirror ``torch.optim.AdamW``, its ``amsgrad``, ``maximize``, ``foreach``, ``capturable``,
    ``differentiable`` and ``fused`` included (accepted at torch's defaults; ``foreach=True`` and
    ``fused=True`` pick that ``impl``; see :func:`torch_flags`); ``resolution`` is ``"repair"`` (default),
    ``"skip"`` or ``"off"``;
    ``impl`` is ``"auto"`` (default: ``"fused"``'s native loop where it covers a group — contiguous fp32
    CPU tensors, a C compiler —, else ``"foreach"``; never a compile step or a warning), ``"foreach"``,
    ``"loop"`` (the readable ground truth), ``"compiled"`` (torch.compile) or ``"fused"`` (one native CPU
    loop per step for contiguous fp32 CPU tensors, built with the system C compiler on first use, and
    multi-tensor Triton kernels on CUDA; everything else runs ``"compiled"``: see
    :mod:`nonans_optim.optimizers._fused` and ``._fused_triton``); ``warmup_steps`` ramps
    the lr linearly over the first steps (0: off); ``spike_factor`` rescales a finite gradient whose norm
    exceeds that multiple of its running mean (None, the default here: off; 10 is the factor
    ``python -m experiments spikes`` chose; see :mod:`nonans_optim.functional.spike`).

    Why the guard is opt-in on this path, while the spectral optimizers apply it by default: it needs each
    gradient's norm *before* the update may write anything, and the Adam step reads g exactly once, so the
    norm is one more read of every gradient — on a memory-bound step that is the one part of the
    resolution that is not free (``python -m experiments overhead``: the ``spike_factor=10`` rows, far
    above the 2% budget of issue 3, against a few percent without it). The spectral path computes the
    norm anyway for NS5's normalisation, so there it costs nothing. Without the guard, a clean or
    finite-spiked step is ``torch.optim.AdamW``'s arithmetic, in another order of operations (so equal up to
    rounding, not bit for bit: an update that nearly cancels the parameter differs in relative terms); pass
    ``spike_factor=10.0`` to trade that read for the recovery the ``spikes`` experiment measures
    (RESULTS.md)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, warmup_steps: int = 0, resolution: str = "repair", impl: str = "auto",
                 spike_factor: float | None = None):
        check_betas("betas", betas)  # before tuple(): a scalar must get this message, not a TypeError
        impl = torch_flags(impl, amsgrad=amsgrad, maximize=maximize, foreach=foreach, capturable=capturable,
                           differentiable=differentiable, fused=fused)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        warmup_steps=warmup_steps)
        super().__init__(params, defaults, resolution=resolution, impl=impl, spike_factor=spike_factor)


class SFAdamW(_ScalarOnly):
    """Schedule-free AdamW, memory-efficient form: the parameter holds y, ``state['z']`` holds z.

    ``betas[0]`` is the interpolation weight β of y = (1-β) z + β x (schedule_free's convention); call
    ``optimizer.eval()`` before evaluating/checkpointing (parameters become x) and ``optimizer.train()``
    before stepping again — ``step()`` in eval mode raises. Weight decay acts at z. ``spike_factor`` is
    opt-in (default None) for the reason :class:`AdamW` gives.

    Where it differs from ``schedulefree.AdamWScheduleFree`` (facebookresearch/schedule_free) besides weight
    decay at z and the averaging weight from η_t² (as SF-NorMuon, arXiv 2605.23061): the bias correction counts each
    parameter's own steps (``state['step']``, as torch's AdamW), not the group's — a parameter that skipped
    steps (no gradient) differs, every other is the same to fp32 rounding (an audit, 2026-11-26: 6.8e-3 on
    one that skipped 7 of 20 steps); and a new optimizer starts in train mode (the reference raises on a
    ``step()`` before ``train()``)."""

    _sf = True
    _schedule_free = True

    def __init__(self, params, lr: float = 2.5e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, warmup_steps: int = 0,
                 resolution: str = "repair", impl: str = "auto", spike_factor: float | None = None):
        check_betas("betas", betas)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        warmup_steps=warmup_steps, sf_weight_sum=0.0)
        super().__init__(params, defaults, resolution=resolution, impl=impl, spike_factor=spike_factor)

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        if not group["betas"][0] >= SF_BETA_MIN:
            raise ValueError(f"Invalid betas[0]: {group['betas'][0]} (the schedule-free interpolation weight "
                             f"must be at least {SF_BETA_MIN}: rebuilding x divides by it in fp32)")

    @torch.no_grad()
    def _swap(self, *, to_train: bool) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                z = self.state[p].get("z")
                if z is not None:
                    (to_y_ if to_train else to_x_)(p, z, group["betas"][0])
