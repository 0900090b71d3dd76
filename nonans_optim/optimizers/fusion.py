"""Fusion: one composed optimizer, and its presets SFNorMuon, FullFusion and Muon.

``components`` ⊆ {"ns5", "normuon", "sf", "mona", "shampoo"} selects the stages of the spectral path
(:mod:`._spectral`); parameters routed to the scalar path (:mod:`nonans_optim.routing`) take AdamW, or
schedule-free AdamW when "sf" is in the components. One ``lr`` and one ``weight_decay`` serve both paths
because spectral updates are RMS-matched to exactly 0.2 (Moonlight's AdamW-matching target, applied as
NorMuon's renormalisation: :func:`nonans_optim.functional.normuon.rms_match` says where it departs from
Moonlight's fixed factor).

Polyak step (``polyak=True``, active once :meth:`set_loss` has been called): γ = lr · clamp(L̄/Ḡ, 0.1, 10)
for every parameter, with FusionOpt's EMAs (:mod:`nonans_optim.functional.polyak`). Without a loss the
multiplier is 1.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .._base import NonansOptimizer
from .._global_state import needs_init
from .._distributed import check_group, sum_polyak_stats
from .._validation import FP32_MAX, FP32_TINY, _check_float, _check_int, check_betas
from ..detection import inspect
from ..functional.polyak import update_polyak
from ..functional.schedule_free import SF_BETA_MIN, to_x_, to_y_
from ..resolution import STAGE_INDEX
from ..ns5 import hot_dtype
from ..routing import route
from ._common import dense_counts
from ._scalar import scalar_init_state, scalar_update
from ._spectral import spectral_init_state, spectral_update

__all__ = ["Fusion", "SFNorMuon", "FullFusion", "Muon", "COMPONENTS"]

COMPONENTS = frozenset({"ns5", "normuon", "sf", "mona", "shampoo"})
MOMENTUM_DTYPES = ("auto", "param", "bf16")


class Fusion(NonansOptimizer):
    """Composed spectral optimizer with a built-in resolution step.

    Args:
        params: parameters, named parameters, or groups (a group may set ``path`` to "spectral"/"scalar").
        components: subset of {"ns5", "normuon", "sf", "mona", "shampoo"}.
        lr, weight_decay: shared by both paths (decay at z on schedule-free paths, decoupled otherwise).
        momentum, nesterov: spectral momentum μ (B ← lerp(B, G, 1-μ)) and Nesterov.
        betas, eps: scalar-path Adam (betas[0] is the schedule-free interpolation weight when "sf").
        sf_beta: spectral schedule-free interpolation weight β of y = (1-β) z + β x.
        normuon_beta2, normuon_eps: NorMuon row second moment.
        mona_alpha, mona_beta: MONA G̃ = G + α·EMA_β(G - G_prev). Defaults are the secondary sources'
            (+0.1, 0.9): the paper's values (arXiv 2605.26842) are unconfirmed.
        shampoo_beta, shampoo_refresh_every: KL-Shampoo factor EMA and QR basis refresh period.
        ns_steps, ns5_dtype: NS5 iterations and hot dtype ("auto", "bf16", "fp32", "fp16", "fp16_safe").
        momentum_dtype: storage of the spectral ``momentum_buffer``: "param" (the parameter's dtype),
            "bf16" (half the bytes; the update is computed in fp32 and rounded once per step) or "auto"
            (default: bf16 when NS5's hot dtype is bf16 — the buffer only feeds that bf16 iteration — and
            the parameter is wider, else the parameter's dtype). ``python -m experiments momentum-dtype``
            measured, at 200 steps and 3 seeds, paired final val-loss differences of at most 2e-4 on charlm
            and paired val-error differences of up to 0.25 (SF-NorMuon) and 0.76 (FullFusion) points on
            digits (seed sd 0.25-0.67), and a shift within the seed spread on the bench's KL-Shampoo
            workload (RESULTS.md, "bf16 momentum buffer for SF-NorMuon"; results/momentum_dtype.json); it is
            what brings SF-NorMuon's state under AdamW's 8 bytes per parameter.
        warmup_steps: linear lr warmup (also shapes the schedule-free weights).
        polyak: use the Polyak multiplier once set_loss() has been called.
        polyak_group: under data-parallel or sharded training (DDP, ZeroRedundancyOptimizer), the process
            group (e.g. ``dist.group.WORLD``) over which the Polyak statistics — loss, Σ|g|, entries — are
            summed inside step(), so that every rank takes the step size a single process would on the
            whole batch (:mod:`nonans_optim._distributed`). Every rank must then step, and call set_loss()
            each step. None (default): this process's loss and gradients alone. A copy or unpickled
            optimizer has none (a process group does not pickle): pass it again.
        resolution: "repair" (default), "skip" or "off".
        spike_factor: rescale a finite gradient whose norm exceeds this multiple of its running mean
            (default 10, chosen by ``python -m experiments spikes``; None: off;
            :mod:`nonans_optim.functional.spike`).
        impl: "auto" (default: "fused" where its native CPU loops or, on CUDA, its Triton kernels cover a
            group, else "foreach" — never torch.compile), "foreach" (batched NS5 per
            shape), "loop" (ground truth), "compiled" (the
            elementwise work under torch.compile: :mod:`._compiled` and :mod:`._compiled_spectral`) or
            "fused" (that work as native C loops on CPU: :mod:`._fused` and :mod:`._fused_spectral`; on
            CUDA the Triton kernels of :mod:`._fused_triton`, for the AdamW tensors and NS5 spectral groups;
            groups neither covers — "fp16_safe" NS5, 16-bit parameters on CUDA, fp16 ones on CPU — run
            "compiled", or with KL-Shampoo "foreach").
    """

    _impls = ("auto", "loop", "foreach", "compiled", "fused")

    def __init__(self, params, *, components, lr: float = 1e-3, weight_decay: float = 0.01,
                 momentum: float = 0.95, nesterov: bool = True, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, sf_beta: float = 0.9, normuon_beta2: float = 0.95,
                 normuon_eps: float = 1e-8, mona_alpha: float = 0.1, mona_beta: float = 0.9,
                 shampoo_beta: float = 0.95, shampoo_refresh_every: int = 10, ns_steps: int = 5,
                 ns5_dtype: str = "auto", warmup_steps: int = 0, polyak: bool = True,
                 resolution: str = "repair", impl: str = "auto", spike_factor: float | None = 10.0,
                 momentum_dtype: str = "auto", polyak_group=None):
        if isinstance(components, str):  # before frozenset(): "ns5" would read as {'n', 's', '5'}
            raise ValueError(f"components must be a collection of names, e.g. ({components!r},), not the string "
                             f"{components!r}; choose from {sorted(COMPONENTS)}")
        comps = frozenset(components)
        unknown = sorted(comps - COMPONENTS)
        if unknown:
            raise ValueError(f"unknown components {unknown}; choose from {sorted(COMPONENTS)}")
        if not isinstance(polyak, bool):
            raise ValueError(f"Invalid polyak: {polyak!r} (must be True or False)")
        check_betas("betas", betas)  # before tuple(): a scalar must get this message, not a TypeError
        self.components = comps
        self._schedule_free = "sf" in comps
        self._uses_polyak = bool(polyak)
        self._polyak_group = check_group(polyak_group)  # (not pickled: a process group is not)
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        betas=tuple(betas), eps=eps, sf_beta=sf_beta, normuon_beta2=normuon_beta2,
                        normuon_eps=normuon_eps, mona_alpha=mona_alpha, mona_beta=mona_beta,
                        shampoo_beta=shampoo_beta, shampoo_refresh_every=shampoo_refresh_every,
                        ns_steps=ns_steps, ns5_dtype=ns5_dtype, warmup_steps=warmup_steps,
                        momentum_dtype=momentum_dtype, path=None)
        if "sf" in comps:
            defaults["sf_weight_sum"] = 0.0
        super().__init__(params, defaults, resolution=resolution, impl=impl, spike_factor=spike_factor)

    def _check_group(self, group: dict[str, Any]) -> None:
        """The constructor's arguments and every param group's (a group may override any of them), checked
        where they are given rather than at the first step(); ``ns_steps``, ``shampoo_refresh_every`` and
        ``mona_alpha`` are normalised in place (int, int, float)."""
        super()._check_group(group)
        for name in ("momentum", "sf_beta", "normuon_beta2", "mona_beta", "shampoo_beta"):
            _check_float(name, group[name], high=1.0, high_open=True)
        _check_float("normuon_eps", group["normuon_eps"], high=FP32_MAX)
        if not group["normuon_eps"] >= FP32_TINY:  # a dead row (a unit whose gradient is all zeros) has v = 0
            raise ValueError(f"Invalid normuon_eps: {group['normuon_eps']} (must be at least {FP32_TINY:.6g}, "
                             "fp32's smallest normal: a row whose moment is 0 — a dead unit — divides by eps "
                             "alone, and 1/eps must stay finite in fp32 or that row holds the whole matrix)")
        # any finite real (MONA's mixing weight may be negative), a CPU tensor as any hyperparameter; stored
        # as a float. ±Inf used to pass and overflowed the MONA buffers at every step.
        _check_float("mona_alpha", group["mona_alpha"], low=-math.inf)
        group["mona_alpha"] = float(group["mona_alpha"])
        if not isinstance(group["nesterov"], bool):
            raise ValueError(f"Invalid nesterov: {group['nesterov']!r} (must be True or False)")
        if "sf" in self.components and not min(group["sf_beta"], group["betas"][0]) >= SF_BETA_MIN:
            raise ValueError(f"schedule-free needs sf_beta and betas[0] of at least {SF_BETA_MIN} (x is rebuilt "
                             f"by dividing by β in fp32), got {group['sf_beta']} and {group['betas'][0]}")
        for name in ("ns_steps", "shampoo_refresh_every"):
            group[name] = _check_int(name, group[name], low=1)
        try:  # resolve the name now, not at the first step(): a typo should fail where it was made
            hot = hot_dtype("cpu", group["ns5_dtype"])
        except ValueError as err:
            raise ValueError(f"Invalid ns5_dtype: {err}") from None
        if not hot.is_floating_point:
            raise ValueError(f"Invalid ns5_dtype: {group['ns5_dtype']!r} (NS5 needs a floating-point dtype)")
        if group["momentum_dtype"] not in MOMENTUM_DTYPES:
            raise ValueError(f"momentum_dtype must be one of {MOMENTUM_DTYPES}, got {group['momentum_dtype']!r}")
        path = group["path"]
        if path not in (None, "spectral", "scalar"):
            raise ValueError(f"group 'path' must be 'spectral', 'scalar' or None, got {path!r}")
        low = [tuple(p.shape) for p in group.get("params", ()) if path == "spectral" and p.ndim < 2]
        if low:
            raise ValueError(f"group 'path' is 'spectral' but it holds parameters of shape {low}: only "
                             "matrices (2-D or more) can take the spectral path")
        empty = [tuple(p.shape) for p in group.get("params", ()) if path == "spectral" and p.numel() == 0]
        if empty and "shampoo" in self.components:
            raise ValueError(f"group 'path' is 'spectral' but it holds empty parameters {empty}: KL-Shampoo "
                             "needs a non-empty matrix (leave 'path' unset and they take the scalar path)")

    def _adam_path(self, group: dict[str, Any], j: int, p: torch.Tensor) -> bool:
        return self._path_of(group, j, p) == "scalar"

    def _path_of(self, group: dict, j: int, p: torch.Tensor) -> str:
        if group.get("path") is not None:
            if group["path"] == "spectral" and p.ndim < 2:
                raise ValueError(f"a {p.ndim}-D parameter cannot take the spectral path")
            return group["path"]
        names = group.get("param_names")
        return route(p, names[j] if names else None)

    def _before_groups(self, ctx: dict[str, Any]) -> None:
        super()._before_groups(ctx)
        pg = getattr(self, "_polyak_group", None)  # (absent on an optimizer unpickled from an older version)
        given = self._global().get("loss_given", False)
        if not (self._uses_polyak and (given or pg is not None)):
            return
        grads = [p.grad for p in self._all_params() if p.grad is not None]
        if not grads and pg is None:
            return
        # summed in fp32 whatever the gradients' dtype: an fp16 L1 norm overflows once Σ|g| > 65504, and a
        # finite gradient would be dropped from Ḡ as if it were non-finite
        # (fp64 when a gradient is fp64: a norm may only widen its input)
        wide = torch.float64 if any(g.dtype is torch.float64 for g in grads) else torch.float32
        if grads:
            l1 = torch.stack(torch._foreach_norm(grads, 1, dtype=wide)).float()
            ok = torch.isfinite(l1)
            numels = self._device_constant("numels", tuple(g.numel() for g in grads), l1.device, torch.float32)
            l1_sum = torch.where(ok, l1, torch.zeros_like(l1)).sum()
            count = torch.where(ok, numels, torch.zeros_like(numels)).sum()
        else:  # a rank with no gradient this step still enters the collective
            l1_sum = count = torch.zeros((), dtype=torch.float32, device=self._first_param().device)
        loss = ctx["loss"]
        if pg is not None:  # every rank the same statistics: the same multiplier (_distributed)
            l1_sum, count, mean_loss = sum_polyak_stats(l1_sum, count, loss, pg)
            loss = mean_loss if loss is not None else None
            if not (given and grads):
                return
        mult, loss_bad = update_polyak(self._global()["polyak"], loss, l1_sum, count)
        ctx["gamma_mult"] = mult
        if ctx["resolution"] is not None and ctx["loss"] is not None:
            # (this rank's own loss) in fp32, as update_polyak folds it in: a finite fp64 loss past fp32's
            # range is dropped from the EMA there, so it is an Inf "loss" event here, not a silent drop
            _, counts = inspect(ctx["loss"].to(device=l1_sum.device, dtype=torch.float32).reshape(1))
            # Into the dense block, not the sparse dict: a compiled step records nothing else there, and one
            # dict entry would make the step assemble all P×S entries on the host.
            dense_counts(ctx, l1_sum.device)[0, STAGE_INDEX["loss"]] += counts

    def _expected_state(self, group: dict[str, Any], j: int, p: torch.Tensor) -> dict[str, Any]:
        return self._init_state(group, j, p)

    def _buffer_dtype(self, group: dict[str, Any], j: int, p: torch.Tensor) -> torch.dtype | None:
        if self._path_of(group, j, p) != "spectral":
            return None
        return torch.bfloat16 if _momentum_dtype(group, p) == "bf16" else p.dtype

    def _init_state(self, group: dict[str, Any], j: int, p: torch.Tensor) -> dict[str, torch.Tensor]:
        comps = self.components
        if self._path_of(group, j, p) == "spectral":
            return spectral_init_state(p, comps, _momentum_dtype(group, p))
        return scalar_init_state(p, sf="sf" in comps)

    def _step_group(self, group: dict[str, Any], ctx: dict[str, Any]) -> None:
        comps = self.components
        lists = {"spectral": ([], [], [], []), "scalar": ([], [], [], [])}
        found = self._gradients(group, ctx)
        for j, p in enumerate(group["params"]):
            if j not in found:
                continue
            path = self._path_of(group, j, p)
            st = self.state[p]
            if needs_init(st):
                st.update(self._init_state(group, j, p))
            for lst, item in zip(lists[path], (p, found[j], st, ctx["index"] + j)):
                lst.append(item)
        if not (lists["spectral"][0] or lists["scalar"][0]):
            self._idle_group(group, ctx)
            return
        gamma, c = self._schedule(group, ctx)
        if lists["spectral"][0]:
            spectral_update(*lists["spectral"], group, ctx, comps=comps, gamma=gamma, c=c, impl=self.impl)
        if lists["scalar"][0]:
            scalar_update(*lists["scalar"], group, ctx, sf="sf" in comps, gamma=gamma, c=c, impl=self.impl)

    @torch.no_grad()
    def _swap(self, *, to_train: bool) -> None:
        if "sf" not in self.components:
            return
        for group in self.param_groups:
            for p in group["params"]:
                z = self.state[p].get("z") if p in self.state else None
                if z is not None:
                    beta = group["sf_beta"] if "momentum_buffer" in self.state[p] else group["betas"][0]
                    (to_y_ if to_train else to_x_)(p, z, beta)


def _momentum_dtype(group: dict[str, Any], p: torch.Tensor) -> str:
    """Resolve a group's ``momentum_dtype`` for one parameter ("param" for groups saved before it existed)."""
    choice = group.get("momentum_dtype", "param")
    if choice != "auto":
        return choice
    narrower = p.dtype.itemsize > 2 and hot_dtype(p.device, group["ns5_dtype"]) == torch.bfloat16
    return "bf16" if narrower else "param"


class SFNorMuon(Fusion):
    """Schedule-free NorMuon (SF-NorMuon, arXiv 2605.23061): components {ns5, normuon, sf}.

    Momentum μ = 0.8 and weight decay 0.05 are the values a re-implementation attributes to the paper's
    Appendix F (unconfirmed against the paper)."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.05, *, momentum: float = 0.8,
                 **kwargs):
        super().__init__(params, components=("ns5", "normuon", "sf"), lr=lr, weight_decay=weight_decay,
                         momentum=momentum, **kwargs)


class FullFusion(Fusion):
    """All five components: MONA → momentum → KL-Shampoo → NS5 → NorMuon → Schedule-Free."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.05, *, momentum: float = 0.8,
                 **kwargs):
        super().__init__(params, components=tuple(COMPONENTS), lr=lr, weight_decay=weight_decay,
                         momentum=momentum, **kwargs)


class Muon(Fusion):
    """NS5 only (Muon with RMS-matched updates and an AdamW scalar path) — for ablations."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.01, **kwargs):
        kwargs.setdefault("polyak", False)
        super().__init__(params, components=("ns5",), lr=lr, weight_decay=weight_decay, **kwargs)
