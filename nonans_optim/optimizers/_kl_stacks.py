"""KL-Shampoo between the fused momentum side and NS5: what ``impl="fused"`` runs on every matrix of a
group whose momentum pass wrote M itself (fp32 stacks) instead of the normalised NS5 input.

Shared by the native CPU loops (:mod:`._fused_spectral`, whose per-tensor decisions are host values the C
pass has just written) and the Triton kernels (:mod:`._fused_triton`, whose decisions stay on the device:
reading them would be a host sync per step). Per matrix, as ``impl="loop"`` (:mod:`._spectral`) runs it:
precondition M with the factors of the previous steps (the paper's order, yorkerlin/KL-Methods
``kl_opt.py``: the preconditioner never sees its own input), then fold this gradient into the factors —
the gradient the spike guard scaled, and only when it was entirely finite (a factor mixes every entry, so
a partial observation would bias it). A bypassed preconditioner or an internal overflow is a "direction"
event. Each bucket is then normalised (:func:`nonans_optim.ns5.normalise`) into its hot-dtype NS5 input.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..functional.kl_shampoo import STATE_KEYS, kl_shampoo_precondition, kl_shampoo_update_
from ..ns5 import normalise
from ..resolution import STAGE_INDEX
from ..routing import matrix_shape
from ._common import dense_counts

__all__ = ["precondition_stacks"]

Flag = torch.Tensor | bool


# A stack of one bucket's factors, at most this many bytes: the call holds the stacked state, its new
# candidates and the basis refresh's products at once, a few times this on top of the optimizer's own state,
# so a bucket is cut into chunks (one batched call each). gpt2-small's MLP bucket (768×3072: 40 MB of factors
# a matrix) fits whole; a 4096×11008 projection (550 MB) goes one matrix at a time.
_BATCH_BYTES = 1 << 29


def precondition_stacks(raws: list[torch.Tensor], inputs: list[torch.Tensor], buckets, params, grads, states,
                        indices: list[int], group: dict[str, Any], ctx: dict[str, Any], *,
                        scales: Sequence[torch.Tensor | float | None], oks: Sequence[torch.Tensor],
                        keep_damping: Sequence[Flag] | torch.Tensor, batched: bool | None = None) -> None:
    """Precondition each matrix of the fp32 stacks ``raws`` in place, update its factors, and write each
    bucket normalised into ``inputs`` (the NS5 input stacks, any float dtype).

    Per tensor: ``scales`` the guard's scale of its gradient (None or 1.0: not scaled; a 0-d device tensor
    is always applied — ×1 is exact); ``oks`` a 0-d bool, "the gradient was entirely finite";
    ``keep_damping`` True (or a 0-d bool tensor; or, for the whole group, one (n,) bool tensor, restored with
    a single select) for a held tensor or a "skip" tensor with a bad entry, whose damping is put back (a held
    parameter keeps its value and state; "skip" restores all of it; its factors do not move anyway, that
    gradient being no observation). A held tensor's stale momentum could bypass the preconditioner and raise
    its damping ×10 for good (the fuzz audit, 2026-11-26). Counts the direction events (a bypassed
    preconditioner or an internal overflow) into this step's dense block under a resolution policy with a few
    ops for the whole group — stacked flags and one ``index_add_`` — where a count per matrix took four
    (device launches on a GPU: the host's time).

    ``batched`` (default: on CUDA): each bucket's matrices at the same step run as one stack through the
    functional core's batched form — its state stacked, stepped, and copied back with one multi-tensor copy
    per state key — so a bucket of B matrices costs the host about one matrix's launches instead of B
    (FullFusion's step on a GPU is bound by the host issuing KL-Shampoo's small ops: ~100 per matrix,
    ``python -m experiments op-count``). Off the GPU the matrices go one by one: there the matmuls are the
    cost, and stacking adds copies — FullFusion's fused step on the default GPT took 1.26x as long stacked on
    a 2-core CPU (14 rounds of two steps each, the two forms alternating in one process, paired median). The
    same arithmetic either way, up to the rounding of batched against single matrix products."""
    gate = ctx["resolution"] is not None
    device = params[0].device
    if batched is None:
        batched = _batch_on(device)
    group_keep = keep_damping if isinstance(keep_damping, torch.Tensor) else None
    if group_keep is not None:  # decided on the device for the whole group: one select after all matrices
        dampings = [st["kl_damping"] for st in states]
        before, keep_damping = torch.stack(dampings), [False] * len(params)
    flags, order = [], []
    for R, X, (members, _) in zip(raws, inputs, buckets):
        step_one = _batched_bucket if batched and len(members) > 1 else _one_by_one
        for rows, got in step_one(R, members, params, grads, states, group, scales, oks, keep_damping):
            if gate:
                flags.append(got)
                order.extend(indices[i] for i in rows)
        X.copy_(normalise(R))
    if group_keep is not None:
        torch._foreach_copy_(dampings, list(torch.where(group_keep, before, torch.stack(dampings)).unbind(0)))
    if gate and flags:
        dense = dense_counts(ctx, device)
        internal, bypassed = (torch.cat([f.reshape(-1) for f in fs]) for fs in zip(*flags))  # (views: free)
        dense[:, STAGE_INDEX["direction"], 1].index_add_(0, ctx["device_indices"](order, device),
                                                         (internal | bypassed).to(torch.int64))


def _batch_on(device: torch.device) -> bool:
    """The default of ``batched``: on CUDA (a function, so the CPU tests can run the batched form)."""
    return device.type == "cuda"


def _gradient(i: int, params, grads, scales) -> torch.Tensor:
    g = grads[i].reshape(matrix_shape(params[i]))
    scale = scales[i]
    if scale is not None and not (isinstance(scale, float) and scale == 1.0):
        g = g * scale  # the guard fired: the factors see the rescaled gradient, as in the loop
    return g


def _restore_damping(damping: torch.Tensor, before: torch.Tensor | None, keep: Flag) -> None:
    if keep is True:
        damping.copy_(before)
    elif before is not None:  # decided on the device: select, no sync
        torch.where(keep, before, damping, out=damping)


def _one_by_one(R, members, params, grads, states, group, scales, oks, keep_damping):
    """Per matrix, as the loop: yields ([tensor index], (internal_bad, bypassed))."""
    for j, i in enumerate(members):
        st = states[i]
        keep = keep_damping[i]
        before = st["kl_damping"].clone() if keep is not False else None
        P, bypassed = kl_shampoo_precondition(st, R[j])
        R[j].copy_(P)
        internal_bad = kl_shampoo_update_(st, _gradient(i, params, grads, scales), oks[i], int(st["step"]),
                                          beta=group["shampoo_beta"], refresh_every=group["shampoo_refresh_every"])
        _restore_damping(st["kl_damping"], before, keep)
        yield [i], (internal_bad, bypassed)


def _batched_bucket(R, members, params, grads, states, group, scales, oks, keep_damping):
    """One bucket as stacks, cut into chunks of at most ``_BATCH_BYTES`` of factors: yields (tensor indices,
    ((B,) internal_bad, (B,) bypassed)) per chunk. A bucket whose matrices are at different steps (the first
    step and a basis refresh run other code; a parameter added to the group later, say) goes one by one."""
    steps = {int(states[i]["step"]) for i in members}
    if len(steps) > 1:
        yield from _one_by_one(R, members, params, grads, states, group, scales, oks, keep_damping)
        return
    step = steps.pop()
    m, n = R.shape[-2:]
    chunk = max(1, _BATCH_BYTES // (4 * (m * m + n * n)))
    for c in range(0, len(members), chunk):
        rows = members[c:c + chunk]
        yield rows, _step_stack(R[c:c + len(rows)], rows, step, params, grads, states, group, scales, oks,
                                keep_damping)


def _stacked_gradients(rows, params, grads, scales) -> torch.Tensor:
    """The chunk's gradients as one (B, m, n) stack, each scaled by its guard's scale (one product for the
    stack when the scales are device tensors, as on the Triton path)."""
    own = [scales[i] for i in rows]
    if all(s is None or (isinstance(s, float) and s == 1.0) for s in own):
        return torch.stack([grads[i].reshape(matrix_shape(params[i])) for i in rows])
    if all(isinstance(s, torch.Tensor) for s in own):
        G = torch.stack([grads[i].reshape(matrix_shape(params[i])) for i in rows])
        return G * torch.stack(own).reshape(-1, 1, 1)
    return torch.stack([_gradient(i, params, grads, scales) for i in rows])


def _step_stack(M, rows, step, params, grads, states, group, scales, oks, keep_damping):
    """Precondition the stack ``M`` (a view of the bucket: written in place) and update its factors, the
    state of ``rows`` stacked for the call and copied back after it."""
    st = {k: torch.stack([states[i][k] for i in rows]) for k in STATE_KEYS}
    keeps = [keep_damping[i] for i in rows]
    before = st["kl_damping"].clone() if any(k is not False for k in keeps) else None
    P, bypassed = kl_shampoo_precondition(st, M)
    M.copy_(P)
    internal_bad = kl_shampoo_update_(st, _stacked_gradients(rows, params, grads, scales),
                                      torch.stack([oks[i] for i in rows]), step, beta=group["shampoo_beta"],
                                      refresh_every=group["shampoo_refresh_every"])
    if before is not None:  # a "skip" tensor's damping put back: True, False or decided on the device
        keep = torch.stack([k if isinstance(k, torch.Tensor) else
                            torch.full((), k, dtype=torch.bool, device=M.device) for k in keeps])
        _restore_damping(st["kl_damping"], before, keep)
    for k in STATE_KEYS:  # back into each parameter's own state tensors: one multi-tensor copy per key
        torch._foreach_copy_([states[i][k] for i in rows], list(st[k].unbind(0)))
    return internal_bad, bypassed
