"""The spectral path: (MONA →) momentum (→ KL-Shampoo) (→ NS5) (→ NorMuon) (→ Schedule-Free) on matrices.

Every stage is optional (the ``components`` of :class:`~nonans_optim.Fusion`). The direction is always
RMS-matched to 0.2 (Moonlight), so one ``lr`` / ``weight_decay`` serves this path and the scalar AdamW path.

Two implementations: ``loop`` runs NS5 and NorMuon one matrix at a time (ground truth); ``foreach`` stacks
same-shape matrices into one batched NS5 and one batched NorMuon (transformers have many equal shapes).

Resolution inside the path (beyond the gradient gate in :mod:`~nonans_optim.functional.momentum`):

* KL-Shampoo factors see a gradient only when it is entirely finite (a factor mixes every entry, so a
  partial observation would bias it); a non-finite preconditioned result bypasses the preconditioner;
* a non-finite NS5/NorMuon result (impossible for finite input with :func:`ns5`'s fp32 normalisation, but
  counted anyway, per matrix) reaches the update guard, which keeps the parameter where it was at those
  entries; the NorMuon row moment keeps its previous value wherever the new one is not finite;
* without NS5 the direction is the momentum itself, whose squares can overflow fp32 although it is finite:
  RMS matching then takes a scaled norm (a finite direction always gives an update of RMS 0.2), and a
  NorMuon row whose new moment overflows with a finite gradient row keeps its moment, divides by it, and
  is counted at the "moment" stage (functional/normuon.py);
* the new parameter / z is kept only where finite.
"""
from __future__ import annotations

from typing import Any

import torch

from ..detection import finite_mask, tally, tensor_counts
from ..functional.momentum import momentum_, mona_
from ..functional.normuon import normuon, rms_match
from ..functional.schedule_free import sf_update_
from ..ns5 import ns5
from ..routing import matrix_shape
from ._common import (commit_update, eager_guard, keep_flags, record, record_inf, record_tally, restore_if_bad,
                      take_snapshot)
from ._compiled_spectral import compiled_spectral_update
from ._fused_spectral import fused_spectral_update, native_part

__all__ = ["spectral_init_state", "spectral_update"]


def spectral_init_state(p: torch.Tensor, comps: frozenset[str], momentum_dtype: str = "param"
                        ) -> dict[str, torch.Tensor]:
    m, n = matrix_shape(p)
    dtype = torch.bfloat16 if momentum_dtype == "bf16" else p.dtype
    st: dict[str, torch.Tensor] = {"step": torch.tensor(0.0),
                                   "momentum_buffer": torch.zeros_like(p, dtype=dtype,
                                                                       memory_format=torch.contiguous_format)}
    if "mona" in comps:
        st["mona_prev_grad"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        st["mona_diff_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
    if "normuon" in comps:
        st["normuon_row_sq"] = torch.zeros(m, dtype=torch.float32, device=p.device)
    if "sf" in comps:
        st["z"] = p.detach().clone(memory_format=torch.contiguous_format)
    if "shampoo" in comps:
        from ..functional.kl_shampoo import kl_shampoo_init_state
        st.update(kl_shampoo_init_state((m, n), p.device))
    return st


def _directions(Ms: list[torch.Tensor], vs: list[torch.Tensor | None], row_oks: list, group: dict,
                comps: frozenset[str], batched: bool, count: bool) -> tuple[list[torch.Tensor], list, list, list]:
    """NS5 (+ NorMuon) on a list of same-shape fp32 matrices: one batched call or a loop. ``count``: also
    each direction's tensor-level [nan, inf] counts (:func:`tensor_counts` of its sum), for a batch from
    one reduction over the stack rather than five small ops per matrix; else Nones. Last, per matrix, the
    number of NorMuon rows whose moment overflowed with a finite gradient row (0-d int64), or None: only
    without NS5 can that happen (functional/normuon.py), so only then is it gated and counted."""
    bounded = "ns5" in comps  # NS5's output cannot overflow a square: the plain norms, today's bits

    def one(M, v, row_ok):
        O = ns5(M, group["ns_steps"], dtype=group["ns5_dtype"]).float() if bounded else M.float()
        overflow = None
        if "normuon" in comps:
            U, v_new, overflow = normuon(O, v, row_ok, beta2=group["normuon_beta2"], eps=group["normuon_eps"],
                                         bounded=bounded)
        else:
            U, v_new = rms_match(O, bounded=bounded), None
        over = torch.count_nonzero(overflow, dim=-1) if overflow is not None else None
        return U, v_new, (tensor_counts(U.sum((-2, -1))) if count else None), over

    if not batched or len(Ms) == 1:
        out = [one(M, v, r) for M, v, r in zip(Ms, vs, row_oks)]
        return [o[0] for o in out], [o[1] for o in out], [o[2] for o in out], [o[3] for o in out]
    M = torch.stack(Ms)
    v = torch.stack(vs) if vs[0] is not None else None
    r = torch.stack(row_oks) if row_oks[0] is not None else None
    U, v_new, counts, over = one(M, v, r)
    n = len(Ms)

    def unbound(x):
        return list(x.unbind(0)) if x is not None else [None] * n

    return unbound(U), unbound(v_new), unbound(counts), unbound(over)


def spectral_update(params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict],
                    indices: list[int], group: dict[str, Any], ctx: dict[str, Any], *,
                    comps: frozenset[str], gamma: torch.Tensor, c: float, impl: str) -> None:
    # "auto" takes the native loops (CPU) and the Triton kernels (CUDA) too: see _fused.auto_choice for the
    # GPU timing that decided it
    if impl in ("fused", "auto") and fused_spectral_update(params, grads, states, indices, group, ctx,
                                                            comps=comps, gamma=gamma, c=c):
        return
    if impl == "auto" and params[0].is_cpu:  # the loops may cover some matrices: those run there, the rest below
        params, grads, states, indices = native_part(params, grads, states, indices, group, ctx, comps=comps,
                                                     gamma=gamma, c=c)
        if not params:
            return
    # fused falls back to compiled where its loops do not cover the group; auto falls back to foreach
    if impl in ("compiled", "fused") and compiled_spectral_update(params, grads, states, indices, group, ctx,
                                                                  comps=comps, gamma=gamma, c=c):
        return
    if impl in ("compiled", "fused", "auto"):  # the base left the guard to the kernels
        grads, impl = eager_guard(grads, indices, ctx), "foreach"
    res = ctx["resolution"]
    repair = res is not None
    for st in states:
        st["step"] += 1
    snapshot = None
    if repair and res.policy == "skip":
        snapshot = take_snapshot(params, states)
    Ms, vs, row_oks, tensor_oks, g_tallies, dampings = [], [], [], [], [], []
    for p, g, st, idx in zip(params, grads, states, indices):
        shape = matrix_shape(p)
        G = g.reshape(shape)
        ok = tensor_ok = None
        if repair:
            ok, t = tally(G)
            record_tally(ctx, idx, "grad", t)
            g_tallies.append(t)
            if snapshot is not None or "shampoo" in comps:
                tensor_ok = t.complete()
        overflow = None
        if "mona" in comps:
            G, overflow = mona_(G, st["mona_prev_grad"].view(shape), st["mona_diff_avg"].view(shape), ok,
                                alpha=group["mona_alpha"], beta=group["mona_beta"], first=int(st["step"]) == 1)
        M, buf_overflow = momentum_(G, st["momentum_buffer"].view(shape), ok, mu=group["momentum"],
                                    nesterov=group["nesterov"])
        if repair:  # entries where a buffer overflowed with a finite gradient (and kept its value): the moment stage
            record_inf(ctx, idx, "moment",
                       torch.count_nonzero(buf_overflow if overflow is None else overflow | buf_overflow))
        if "shampoo" in comps:
            from ..functional.kl_shampoo import kl_shampoo_precondition, kl_shampoo_update_
            # The paper's order (yorkerlin/KL-Methods kl_opt.py): precondition with the factors of the
            # previous steps, then fold this gradient in — the preconditioner never sees its own input.
            if repair:  # put back below if the parameter is held (_kl_stacks.precondition_stacks: why)
                dampings.append(st["kl_damping"].clone())
            M, bypassed = kl_shampoo_precondition(st, M)
            t_ok = tensor_ok if repair else torch.ones((), dtype=torch.bool, device=G.device)
            internal_bad = kl_shampoo_update_(st, g.reshape(shape), t_ok, int(st["step"]),
                                              beta=group["shampoo_beta"],
                                              refresh_every=group["shampoo_refresh_every"])
            if repair:
                record_inf(ctx, idx, "direction", internal_bad | bypassed)
        Ms.append(M.float())
        vs.append(st.get("normuon_row_sq"))
        row_oks.append(ok.all(dim=-1) if (repair and "normuon" in comps) else None)
        tensor_oks.append(tensor_ok)

    # Bucket by shape: one batched NS5 per bucket (foreach) or one per matrix (loop).
    buckets: dict[tuple, list[int]] = {}
    for i, M in enumerate(Ms):
        buckets.setdefault(tuple(M.shape), []).append(i)
    Us: list[torch.Tensor | None] = [None] * len(Ms)
    for members in buckets.values():
        U_b, v_b, c_b, o_b = _directions([Ms[i] for i in members], [vs[i] for i in members],
                                         [row_oks[i] for i in members], group, comps, batched=impl != "loop",
                                         count=repair)
        for i, U, v_new, counts, over in zip(members, U_b, v_b, c_b, o_b):
            Us[i] = U
            if repair:  # a non-finite entry of U makes y_new non-finite there: the update guard keeps p
                record(ctx, indices[i], "direction", counts)
            if over is not None:  # NorMuon rows whose moment overflowed (and kept its value): the moment stage
                record_inf(ctx, indices[i], "moment", over)
            if v_new is not None:
                v_old = states[i]["normuon_row_sq"]
                if repair:
                    torch.where(finite_mask(v_new), v_new, v_old, out=v_old)
                else:
                    v_old.copy_(v_new)

    wd = group["weight_decay"]
    keeps = keep_flags(ctx, indices, g_tallies) if repair else [None] * len(params)
    for i, (p, st, idx) in enumerate(zip(params, states, indices)):
        U = Us[i].view_as(p).to(p.dtype)
        lr_i = gamma * (res.scale(idx) if res is not None else ctx["unit_scale"])
        if "sf" in comps:
            y_new, z_new = sf_update_(p, st["z"], U, lr_i, c=c, beta=group["sf_beta"], weight_decay=wd)
        else:
            y_new, z_new = p * (1 - lr_i * wd) - lr_i * U, None
        commit_update(p, st, y_new, z_new, ctx, idx, repair, keeps[i])
        if dampings:  # a held parameter keeps its state: the damping its stale momentum may have raised too
            torch.where(keeps[i], st["kl_damping"], dampings[i], out=st["kl_damping"])
        if snapshot is not None:
            restore_if_bad(p, st, snapshot[i], tensor_oks[i])
