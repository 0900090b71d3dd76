"""Guard against finite gradient spikes: rescale a tensor whose gradient norm jumps far above its history.

NaN/Inf are the resolution gate's business; a *finite* spike (an outlier batch, a loss spike, a flipped
exponent bit that stays finite) passes that gate and, in one step, writes itself into every moment buffer:
Adam's v remembers g² for ~1/(1-β₂) steps (a long, silent lr collapse), and a Muon momentum points along
the spike for ~1/(1-μ) steps. Two published families of guards:

* element-wise against the second moment (SPAM, arXiv 2501.06842: clip g where g² > θ·v) — needs v, so it
  only fits the Adam path, and v = 0 at step 1;
* a z-score / ratio on the norm (ZClip, AdaGC) — needs one scalar of history per tensor and fits every path.

We use the norm ratio: with ``ema`` the running mean of this tensor's gradient norm, a gradient with
‖g‖ > k·ema is rescaled to norm k·ema, and the EMA then takes k·ema (not the spike), so a genuine regime
change is followed within a few steps (the EMA grows by β + (1-β)k per step) while a one-step spike moves
nothing. The rescale is a ``where``-selected factor (exactly 1.0 when not triggered, so a clean step is
bit-identical).

NaN-safe: the norm is taken over the gradient's *finite* entries — the non-finite ones are missing
observations, which the resolution gate handles — and only a gradient with every entry finite enters the
EMA. Until 2026-11-25 the norm was over every entry, so one NaN made it non-finite and the guard stood
down for exactly the gradient that needed it most: the fp16-overflow pattern, a NaN beside a huge finite
entry (an audit's repro: one NaN and one 1e30 in AdamW's gradient took ``exp_avg`` to 9e28 and the weight
to 5e26, everything finite; SF-NorMuon's momentum still held 1e10 after 200 steps). The scale is at least
the smallest fp32 subnormal, never 0, so a capped ±Inf entry stays ±Inf (Inf·0 would be a NaN, and the
gate's NaN/Inf counts must not depend on the guard).

The norm is taken in float64. In fp32 the sum of squares overflows as soon as one entry exceeds about
1.8e19 (g² > FLT_MAX), and the guard then saw a "non-finite norm" and let the largest finite spikes — the
ones it exists for — through untouched: the raw gradient overflowed v, the moment stage kept the old v, and
m/√v took a step of the spike's size (found by a differential soak, impl="fused" against impl="loop": torch's
fp32 norm returns |g| for a one-entry tensor, the C loop's sum of squares overflowed). In float64 the norm of
finite fp32/bf16/fp16 entries is finite, so it triggers with scale cap/‖g‖; only the EMA needs an fp32 value,
and a norm beyond FLT_MAX never seeds it.

The default factor, 10, was chosen by ``python -m experiments spikes`` (RESULTS.md, "spikes"): the
largest factor with zero triggers on clean runs that recovers the most spiked runs (14 of 16 cells there,
against 7 of 16 unguarded). Its margin is thin — the largest clean norm ratio seen was about 6 — so a
workload with naturally bursty gradients may want a larger factor or None.

Where it is on by default: the spectral optimizers (SF-NorMuon, FullFusion, Muon — for their scalar
parameters too), whose step computes the gradient norm anyway. ``AdamW`` and ``SFAdamW`` default to None:
their step reads g once, and the guard's norm has to be known before anything is written, so it costs one
more read of every gradient — measured by ``python -m experiments overhead`` far above issue 3's 2% budget
on a memory-bound CPU step (RESULTS.md, the ``spike_factor=10`` rows); there it is one argument away.
"""
from __future__ import annotations

import torch

__all__ = ["spike_guard", "spike_scale", "finite_norms", "SPIKE_BETA", "TINY"]

SPIKE_BETA = 0.9
TINY = 2.0 ** -149  # the smallest fp32 subnormal: the guard's scale is never 0 (module docstring)


def spike_scale(norms: torch.Tensor, ema: torch.Tensor, factor: float, *, complete: torch.Tensor | None = None,
                beta: float = SPIKE_BETA) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The guard's arithmetic on the (n,) vector of gradient norms (float64: see the module docstring; a
    lower precision is widened): (fp32 scale to multiply each gradient by — exactly 1.0 unless triggered —,
    new fp32 EMA, trigger). Pure and shape-static, so the eager guard below and the compiled kernels
    (``optimizers/_compiled*.py``) share it; the native loops (``native/common.h::spike_``) and the Triton
    decision kernel (``kernels/scalar_step.py``) compute the same, op for op.

    The comparison and cap/‖g‖ are float64 (a norm above FLT_MAX still triggers, with a finite scale); the
    EMA arithmetic stays fp32, and a value that is not finite in fp32 never enters it. ``norms``: of each
    gradient's finite entries; ``complete``: (n,) bool, the gradient had no non-finite entry (None: all
    had none) — only those update the EMA, and only with a non-zero norm: an all-zero gradient (an MoE
    expert no token reached, a layer skipped, under ``zero_grad(set_to_none=False)``) says nothing about
    the gradient's scale, and letting it in decayed the EMA by β per step, so the first ordinary gradient
    after 100 such steps "spiked" at 10x and kept escalating: 26 spike events and the step size at 2⁻⁹ on
    an audit's run (2026-11-26), where None gradients over the same stretch gave none."""
    norms = norms.double()
    finite = norms.abs() < float("inf")
    seeded = ema > 0
    cap = factor * ema
    cap64 = cap.double()
    trigger = finite & seeded & (norms > cap64)
    scale = torch.where(trigger, torch.clamp(cap64 / norms, min=TINY).float(), torch.ones_like(ema))
    observed = torch.where(trigger, cap, norms.float())
    fits = finite & (observed.abs() < float("inf")) & (observed > 0)  # a zero gradient is no observation
    if complete is not None:
        fits = fits & complete
    new_ema = torch.where(fits, torch.where(seeded, ema * beta + (1 - beta) * observed, observed), ema)
    return scale, new_ema, trigger


def finite_norms(grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """((n,) float64 norms of each gradient's finite entries, (n,) bool "every entry finite"). The full
    norm (one pass, float64: finite for any finite entries) says which are complete; the finite part is
    taken again with the non-finite entries zeroed and used where it is not — no host branch, so every
    gradient pays the second pass on the eager paths (the native and Triton kernels sum the finite part
    in their one statistics pass)."""
    full = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64))
    complete = full.abs() < float("inf")
    zeroed = [torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0) for g in grads]
    part = torch.stack(torch._foreach_norm(zeroed, 2, dtype=torch.float64))
    return torch.where(complete, full, part), complete


def spike_guard(grads: list[torch.Tensor], ema: torch.Tensor, factor: float, *, beta: float = SPIKE_BETA
                ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Return (guarded gradients — new tensors, ``p.grad`` is never touched —, new EMA (n,), trigger (n,)).

    ``ema`` holds one fp32 norm EMA per gradient, 0 meaning "not seeded yet" (the first finite norm seeds)."""
    norms, complete = finite_norms(grads)
    scale, new_ema, trigger = spike_scale(norms, ema, factor, complete=complete, beta=beta)
    guarded = [g * s.to(g.dtype) for g, s in zip(grads, scale.unbind())]
    return guarded, new_ema, trigger
