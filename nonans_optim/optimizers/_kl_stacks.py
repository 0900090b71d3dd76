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

from ..functional.kl_shampoo import kl_shampoo_precondition, kl_shampoo_update_
from ..ns5 import normalise
from ..resolution import STAGE_INDEX
from ..routing import matrix_shape
from ._common import dense_counts

__all__ = ["precondition_stacks"]

Flag = torch.Tensor | bool


def precondition_stacks(raws: list[torch.Tensor], inputs: list[torch.Tensor], buckets, params, grads, states,
                        indices: list[int], group: dict[str, Any], ctx: dict[str, Any], *,
                        scales: Sequence[torch.Tensor | float | None], oks: Sequence[torch.Tensor],
                        keep_damping: Sequence[Flag]) -> None:
    """Precondition each matrix of the fp32 stacks ``raws`` in place, update its factors, and write each
    bucket normalised into ``inputs`` (the NS5 input stacks, any float dtype).

    Per tensor: ``scales`` the guard's scale of its gradient (None or 1.0: not scaled; a 0-d device tensor
    is always applied — ×1 is exact); ``oks`` a 0-d bool, "the gradient was entirely finite";
    ``keep_damping`` True (or a 0-d bool tensor) for a "skip" tensor with a bad entry, whose damping is put
    back (the loop restores all its state; its factors do not move anyway, that gradient being no
    observation). Counts the direction events (a bypassed preconditioner or an internal overflow) into this
    step's dense block under a resolution policy with a few ops for the whole group — stacked flags and one
    ``index_add_`` — where a count per matrix took four (device launches on a GPU: the host's time)."""
    gate = ctx["resolution"] is not None
    flags, order = [], []
    for R, X, (members, _) in zip(raws, inputs, buckets):
        for j, i in enumerate(members):
            st = states[i]
            keep = keep_damping[i]
            damping = st["kl_damping"].clone() if keep is not False else None
            P, bypassed = kl_shampoo_precondition(st, R[j])
            R[j].copy_(P)
            g = grads[i].reshape(matrix_shape(params[i]))
            scale = scales[i]
            if scale is not None and not (isinstance(scale, float) and scale == 1.0):
                g = g * scale  # the guard fired: the factors see the rescaled gradient, as in the loop
            internal_bad = kl_shampoo_update_(st, g, oks[i], int(st["step"]), beta=group["shampoo_beta"],
                                              refresh_every=group["shampoo_refresh_every"])
            if keep is True:
                st["kl_damping"].copy_(damping)
            elif damping is not None:  # decided on the device: select, no sync
                torch.where(keep, damping, st["kl_damping"], out=st["kl_damping"])
            if gate:
                flags.append((internal_bad, bypassed))
                order.append(indices[i])
        X.copy_(normalise(R))
    if gate:
        device = params[0].device
        dense = dense_counts(ctx, device)
        internal, bypassed = (torch.stack(f) for f in zip(*flags))
        dense[:, STAGE_INDEX["direction"], 1].index_add_(0, ctx["device_indices"](order, device),
                                                         (internal | bypassed).to(torch.int64))
