"""The scalar path: AdamW or schedule-free AdamW on a list of tensors, with resolution.

Used by :class:`~nonans_optim.AdamW`, :class:`~nonans_optim.SFAdamW` and by :class:`~nonans_optim.Fusion`
for biases, norms, embeddings and heads. State keys follow torch: ``step``, ``exp_avg``, ``exp_avg_sq``;
schedule-free adds ``z`` (the parameter holds y).

Policies (see :mod:`nonans_optim.resolution`):
* ``repair`` — per-entry gating inside the moment updates, then the last-line update guard
  (``_common.commit_update``) on the new parameter (and z); on a clean step every gate selects the stock
  value;
* ``skip`` — the same computation, then the whole tensor's parameter and state are restored when its
  gradient had any non-finite entry (GradScaler semantics per tensor);
* ``off`` — stock arithmetic, no detection.
"""
from __future__ import annotations

from typing import Any

import torch

from ..detection import finite_mask
from ..functional.adam import adam_direction, adam_moments_foreach, adam_moments_loop, sf_moments
from ..functional.schedule_free import sf_update_
from ._common import (commit_update, eager_guard, keep_flags, record_inf, record_tally, restore_if_bad,
                      take_snapshot)
from ._compiled import compiled_scalar_update
from ._fused import NATIVE_SCALAR_DTYPES, fused_scalar_update, native_scalar_update, pointers, run_covered
from ._fused_triton import backend, triton_scalar_update

__all__ = ["scalar_init_state", "scalar_update", "foreach_spans", "FOREACH_SPAN"]


def scalar_init_state(p: torch.Tensor, *, sf: bool) -> dict[str, torch.Tensor]:
    st = {"step": torch.tensor(0.0),
          "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    if sf:
        st["z"] = p.detach().clone(memory_format=torch.preserve_format)
    else:
        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return st


def _native_part(params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict], indices: list[int],
                 group: dict[str, Any], ctx: dict[str, Any], *, sf: bool, gamma: torch.Tensor, c: float) -> tuple:
    """Step the tensors of a group the native loop covers (parameter, gradient and moments as
    :func:`._fused.pointers` takes them: contiguous CPU, fp32 or bf16) there — one call per dtype — and
    return the others for the foreach path (:func:`._fused.run_covered`). One channels_last tensor (or,
    before the loop took bf16, one bf16 tensor) sent the whole group to foreach, 14-21x torch's fused AdamW
    on a GPT-sized model where the loop is under 1x (an audit, 2026-11-26). The counts of every part go to
    the step's record, not the loop's own (``record_in_kernel`` off for these calls: the foreach part, or
    the other dtype's call, produces counts too)."""
    key = "z" if sf else "exp_avg"

    def covers(dtype, ps, gs, sts) -> list[bool]:
        return [pointers([p, g, st[key], st["exp_avg_sq"]], dtype) is not None for p, g, st in zip(ps, gs, sts)]

    def step(*part) -> bool:
        saved, ctx["record_in_kernel"] = ctx["record_in_kernel"], False
        try:
            return native_scalar_update(*part, group, ctx, sf=sf, gamma=gamma, c=c)
        finally:
            ctx["record_in_kernel"] = saved

    return run_covered((params, grads, states, indices), NATIVE_SCALAR_DTYPES, covers, step)


def scalar_update(params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict],
                  indices: list[int], group: dict[str, Any], ctx: dict[str, Any], *, sf: bool,
                  gamma: torch.Tensor, c: float, impl: str) -> None:
    """One step of (SF-)AdamW for ``params``; ``gamma`` is the 0-d step size (lr · warmup · Polyak).

    ``impl="auto"``: the native loop where it covers the group (contiguous fp32 or bf16 CPU tensors and a C
    compiler), the multi-tensor Triton kernels for a CUDA group (see :func:`._fused.auto_choice`) — or the
    one ``NONANS_FUSED_BACKEND`` names, as on the spectral path (this path ignored it, and a bad value, until
    2026-11-26) —, else "foreach": never torch.compile, which a default must not bring."""
    if impl == "auto":
        first = backend(params[0].device)
        if first == "native" and native_scalar_update(params, grads, states, indices, group, ctx, sf=sf,
                                                      gamma=gamma, c=c):
            return None
        if first == "triton" and triton_scalar_update(params, grads, states, indices, group, ctx, sf=sf,
                                                      gamma=gamma, c=c):
            return None
        if first == "native":  # the loop covers some tensors of the group: those run there, the rest below
            params, grads, states, indices = _native_part(params, grads, states, indices, group, ctx, sf=sf,
                                                          gamma=gamma, c=c)
            if not params:
                return None
        grads, impl = eager_guard(grads, indices, ctx), "foreach"
    if impl == "fused":
        return fused_scalar_update(params, grads, states, indices, group, ctx, sf=sf, gamma=gamma, c=c)
    if impl == "compiled":
        return compiled_scalar_update(params, grads, states, indices, group, ctx, sf=sf, gamma=gamma, c=c)
    spans = foreach_spans([p.numel() for p in params]) if impl == "foreach" else [(0, len(params))]
    for a, b in spans:
        _eager_update(params[a:b], grads[a:b], states[a:b], indices[a:b], group, ctx, sf=sf, gamma=gamma, c=c,
                      impl=impl)


# Entries per span of the eager foreach step (foreach_spans). Under "repair" the step holds out-of-place
# candidates of the moments (g gated, new m, new v: 12 bytes per fp32 entry, and the masks), and under "skip"
# a copy of parameter and state, for the list it is given: on a whole group that was a peak of 12.4 and 24.4
# bytes per parameter, where torch's foreach AdamW takes 4.0 — 12 to 24 GB more per billion parameters on a
# GPU without Triton, where "auto" runs this path. In spans of at most this many entries (64 MiB per fp32
# temporary) the extra is bounded by the span, whatever the model: 3.2 and 6.0 bytes per parameter on a
# 67M-parameter model (peak RSS of one CPU step above the RSS before it, glibc's mmap threshold at 64 KiB;
# an audit's script, 2026-11-26, scratch). The values do not change (every op is per tensor); the launches
# grow by a few per span.
FOREACH_SPAN = 1 << 24


def foreach_spans(sizes: list[int], limit: int | None = None) -> list[tuple[int, int]]:
    """[a, b) ranges of consecutive tensors, each holding at most ``limit`` entries (default
    :data:`FOREACH_SPAN`, read at the call) — a tensor larger than that is a span of its own."""
    limit = FOREACH_SPAN if limit is None else limit
    spans, a, total = [], 0, 0
    for i, n in enumerate(sizes):
        if i > a and total + n > limit:
            spans.append((a, i))
            a, total = i, 0
        total += n
    if sizes:
        spans.append((a, len(sizes)))
    return spans


def _eager_update(params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict], indices: list[int],
                  group: dict[str, Any], ctx: dict[str, Any], *, sf: bool, gamma: torch.Tensor, c: float,
                  impl: str) -> None:
    """impl="loop" or "foreach" on ``params`` (the foreach step takes a group in spans: :data:`FOREACH_SPAN`)."""
    policy = "off" if ctx["resolution"] is None else ctx["resolution"].policy
    repair = policy != "off"
    beta1, beta2 = group["betas"]
    eps, wd = group["eps"], group["weight_decay"]
    for st in states:
        st["step"] += 1
    steps = [int(st["step"]) for st in states]  # CPU tensors: no device sync
    snapshot = None
    if policy == "skip":
        snapshot = take_snapshot(params, states)
    v_list = [st["exp_avg_sq"] for st in states]
    moments = adam_moments_loop if impl == "loop" else adam_moments_foreach
    n = len(grads)
    if sf:
        m_list, g_counts, m_counts = sf_moments(grads, v_list, beta2=beta2, repair=repair)
    else:
        m_list = [st["exp_avg"] for st in states]
        g_counts, m_counts = moments(grads, m_list, v_list, beta1=beta1, beta2=beta2, repair=repair)
    if not repair:
        g_counts = m_counts = [None] * n
    res = ctx["resolution"]
    keeps = keep_flags(ctx, indices, g_counts) if repair else [None] * n
    for i, (p, g, st, step) in enumerate(zip(params, grads, states, steps)):
        idx = indices[i]
        # The same tensor arithmetic under every policy, so a clean "repair" step is bit-identical to
        # "off" (the escalation scale is exactly 1.0 until an event).
        lr_i = gamma * (res.scale(idx) if res is not None else ctx["unit_scale"])
        d = adam_direction(m_list[i], v_list[i], step, beta1, beta2, eps, first_moment=not sf)
        if sf:
            y_new, z_new = sf_update_(p, st["z"], d, lr_i, c=c, beta=beta1, weight_decay=wd)
        else:
            y_new = p * (1 - lr_i * wd) - lr_i * d
            z_new = None
        if repair:
            record_tally(ctx, idx, "grad", g_counts[i])
            record_inf(ctx, idx, "moment", *m_counts[i])
        commit_update(p, st, y_new, z_new, ctx, idx, repair, keeps[i])
        if snapshot is not None:
            restore_if_bad(p, st, snapshot[i], finite_mask(g).all())
