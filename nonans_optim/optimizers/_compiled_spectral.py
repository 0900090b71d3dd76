"""impl="compiled" for the spectral path: the elementwise work around NS5 under ``torch.compile``.

Why: an eager SF-NorMuon step on a 3.4M-parameter GPT spent about as long in elementwise passes and
Python (≈25 ms: gate, MONA, momentum, stacking, normalisation, NorMuon, schedule-free update, update guard,
counts, each a separate pass per tensor) as in the NS5 matmuls themselves (≈22 ms; a scratch profile,
2026-11-22, commit 97f1d19; not in RESULTS.md). Two compiled graphs
per parameter group replace them, with the batched NS5 iteration (matmuls, nothing to fuse) eager between:

1. ``_pre``: spike guard, gradient gate and counts, MONA, momentum (+ Nesterov), and the NS5 input — each
   shape bucket's matrices stacked wide-side-last, Frobenius-normalised and cast to the hot dtype in the
   same graph (what :func:`nonans_optim.ns5.ns5` would do in a separate pass per step);
2. ``_post``: NorMuon (batched per bucket) or RMS matching, the direction counts, the schedule-free (or
   plain) update with weight decay at z, the update guard and hold rule, the counts into the step's dense
   block.

The math is that of :mod:`._spectral` (``impl="loop"`` is the ground truth; tests/test_compiled_spectral.py
compares parameters, state and counts within float tolerance — the generated code may contract a·b+c into
an FMA, and the Frobenius normalisation divides by the max-abs entry instead of the nearest power of two,
which changes the last bit, not the value). Not covered, so those groups run ``impl="foreach"``:
KL-Shampoo (its factor updates, QR refresh and bypass are matrix work with data-dependent control, already
dominated by matmuls). "skip" runs the gated graphs of "repair" between an eager snapshot of the group's
parameters and state and a whole-tensor restore where the gradient had a non-finite entry (what the loop
does): it used to run foreach, whose normalisation differs from the graphs' in the last bit, so a clean
"skip" step differed from a clean "off" step of the same ``impl`` (1 ulp in fp32, 0.016 on a bf16
parameter in four steps), which the resolution contract forbids.

Known limit (an audit, 2026-11-26): against ``"off"`` the gated graphs are equal to rounding, not bit for
bit. The two are different graphs, and inductor decides per graph how to loop a reduction: on a 4096x3
matrix the "off" graph sums the NorMuon-weighted norm in one scalar loop, the gated one in 16 vector
lanes, so the sums differ in the last bit (fp32 5.96e-8 on the parameter after four steps, bf16 3e-5 with
two matrices in a bucket). Pinning the order would mean an eager reduction between two graphs or a
pairwise tree; the other implementations are exact, and this one is not the default anywhere.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from .._transfer import to_device
from ..detection import finite_mask, storable_mask
from ..functional.normuon import RMS_TARGET
from ..ns5 import KELLER_COEFFICIENTS, hot_dtype, iterate
from ..routing import matrix_shape
from ._common import restore_if_bad, take_snapshot
from ._compiled import (compile_available, compiled, count, guard_spikes, host_steps, nonfinite_counts,
                        report_failure, resolution_args, stage_rows, undo_steps)

__all__ = ["compiled_spectral_update", "supports"]

def supports(comps: frozenset[str], group: dict[str, Any], params: list[torch.Tensor]) -> bool:
    """Whether this compiled path covers a group (else the caller runs the foreach path): no KL-Shampoo,
    no fp16_safe NS5 (its rescaled coefficients live in ns5()), contiguous parameters (the graphs work on
    matrix views of them). Every policy."""
    return ("shampoo" not in comps and group["ns5_dtype"] != "fp16_safe"
            and all(p.is_contiguous() for p in params) and compile_available())


def _normalised(M: torch.Tensor, hot: torch.dtype) -> torch.Tensor:
    """(B, m, n) → unit Frobenius norm per matrix in the hot dtype, layout kept (a tall bucket is iterated
    tall, ns5.iterate(tall=True)); zero stays zero. The sum of squares is accumulated in fp64, where no
    fp32 value's square can overflow or underflow, so one reduction in the loop that produces M replaces
    ns5.normalise's max-abs pass and norm pass (ns5.normalise scales by the nearest power of two for
    bit-exact scale invariance; here the last bit may differ, the value does not)."""
    sumsq = M.double().square().sum(dim=(-2, -1), keepdim=True)
    inv = torch.where(sumsq > 0, sumsq.rsqrt(), torch.zeros_like(sumsq))
    return (M.double() * inv).to(hot)


def _pre(grads, bufs, prevs, davgs, first, res, sel, hp, buckets, *, gate: bool, factor, nesterov: bool,
         mona: bool, ns5: bool, hot: torch.dtype):
    """Momentum side of the step. Returns (NS5 inputs per bucket, (grad counts (n, 2), spike rows or None,
    moment-overflow counts (n, 2)) or None, hold flags (n,) or None). hp = [1-μ, μ, 1-β_a, α]."""
    one_m_mu, mu, one_m_ba, alpha = hp[0], hp[1], hp[2], hp[3]
    scales = rows = None
    if gate:
        _, recent, ema, _ = res
        scales, rows = guard_spikes(grads, ema, sel, factor)
    Ms, g_counts, m_counts = [], [], []
    for i, g_raw in enumerate(grads):
        G = g_raw * scales[i].to(g_raw.dtype) if scales is not None else g_raw
        ok = finite_mask(g_raw) if gate else None
        overflow = None
        if mona:
            prev, davg = prevs[i], davgs[i]
            start = torch.where(ok, G, torch.zeros_like(G)) if gate else G
            prev_eff = torch.where(first[i], start, prev)
            new_avg = torch.lerp(davg, G - prev_eff, one_m_ba)
            if gate:  # missing entry, or an overflow with a finite G (functional/momentum.py): A keeps its value
                keep_avg = ok & storable_mask(new_avg, davg.dtype)
                overflow = ok & ~keep_avg
                new_avg = torch.where(keep_avg, new_avg, davg)
                prev.copy_(torch.where(ok, G, prev_eff))
            else:
                prev.copy_(G)
            davg.copy_(new_avg)
            G = G + new_avg * alpha
        buf = bufs[i].to(G.dtype)  # a bf16 buffer (momentum_dtype="bf16"): fp32 update, rounded on the write
        g_in = torch.where(ok, G, buf) if gate else G
        new_buf = torch.lerp(buf, g_in, one_m_mu)
        if gate:  # finite as stored, else the old value (an overflow inside the lerp)
            buf_ok = storable_mask(new_buf, bufs[i].dtype)
            overflow = count(~buf_ok if overflow is None else overflow | ~buf_ok)  # entries, as the loop counts
            new_buf = torch.where(buf_ok, new_buf, buf)
            g_in = torch.where(buf_ok, g_in, buf)  # a missing observation there: M is the old buffer
        bufs[i].copy_(new_buf)
        Ms.append(torch.lerp(g_in, new_buf, mu) if nesterov else new_buf)
        if gate:
            g_nan, g_bad = nonfinite_counts(g_raw)
            g_counts.append(torch.stack((g_nan, g_bad - g_nan)))
            m_counts.append(torch.stack((torch.zeros_like(overflow), overflow)))
    inputs = []
    for members, _ in buckets:
        X = torch.stack([Ms[i].float() for i in members])
        inputs.append(_normalised(X, hot) if ns5 else X)
    if not gate:
        return inputs, None, None
    gc = torch.stack(g_counts)
    hold = recent.index_select(0, sel) & (gc.sum(-1) == torch.tensor([g.numel() for g in grads],
                                                                      device=gc.device))
    return inputs, (gc, rows, torch.stack(m_counts)), hold


def _post(outs, params, grads, zs, vs, pre_counts, hold, gamma, res, sel, hp, buckets, *, gate: bool,
          ns5: bool, normuon: bool, sf: bool, decay: bool):
    """Direction side: NorMuon / RMS match, the update, the guard and the counts. hp = [1-β₂ᴺ, εᴺ, λ,
    c, β(1-c)-1]. The NorMuon row gate (rows whose gradient was entirely finite) is computed here, in
    the row-wise loop that reduces O² anyway, not in the pre-graph's flat loops."""
    one_m_b2, eps, wd, c, coef = hp[0], hp[1], hp[2], hp[3], hp[4]
    n = len(params)
    Us: list[Any] = [None] * n
    dir_counts: list[Any] = [None] * n
    mom_counts: list[Any] = [None] * n  # NorMuon rows whose moment overflowed (no NS5 only)
    for (members, tall), O in zip(buckets, outs):
        # A tall matrix is iterated tall (ns5.iterate(tall=True)), so O arrives in the parameter's own layout:
        # a transposed read inside the graph made inductor tile the update loop in 2-D and split the flat
        # count reductions off it (two extra passes, measured), and a transposed copy costs a pass too.
        # Everything the direction needs reduces per row, so one row-wise pass over O gives it: Σⱼ O²ᵢⱼ (the
        # NorMuon moment and, weighted by 1/dᵢ², the squared norm of Ô = O/d) and Σⱼ Oᵢⱼ (the direction
        # count's total). Ô itself is never stored: the update loop forms O·(factor/dᵢ) from O directly.
        O = O.float()
        row_sq = O.square().sum(dim=-1)  # (B, m)
        row_sum = O.sum(dim=-1) if gate else None
        if not ns5:  # O is the momentum itself: its squares may pass fp32's maximum (functional/normuon.py)
            row_sq64 = O.double().square().sum(dim=-1)
            row_sum = O.double().sum(dim=-1) if gate else None
        if normuon:
            v = torch.stack([vs[i] for i in members])
            v_new = torch.lerp(v, row_sq / O.shape[-1], one_m_b2)
            if gate:
                row_ok = torch.stack([finite_mask(grads[i]).all(dim=-1) for i in members])
                if ns5:  # bounded O: v_new cannot overflow; the finiteness gate below only guards storage
                    v_new = torch.where(row_ok, v_new, v)
                else:  # an overflow with a finite gradient row keeps v and divides by it: the moment stage
                    fresh = finite_mask(v_new)
                    over = (row_ok & ~fresh).sum(dim=-1)
                    v_new = torch.where(row_ok & fresh, v_new, v)
                    for j, i in enumerate(members):
                        mom_counts[i] = over[j]
            inv = 1.0 / (v_new.sqrt() + eps)  # 1/dᵢ
            if gate:
                v_new = torch.where(finite_mask(v_new), v_new, v)
            for j, i in enumerate(members):
                vs[i].copy_(v_new[j])
        else:
            inv = torch.ones_like(row_sq)
        numel = O.shape[-1] * O.shape[-2]
        if ns5:
            norm = (row_sq * inv * inv).sum(dim=-1, keepdim=True).sqrt()  # ‖Ô‖_F, (B, 1)
            factor = torch.where(norm > 0, RMS_TARGET * numel ** 0.5 / norm, torch.zeros_like(norm))
            row_scale = inv * factor  # (B, m)
        else:  # in float64, where no square of an fp32 value overflows: a finite Ô gives RMS 0.2, not 0
            inv64 = inv.double()
            norm = (row_sq64 * inv64 * inv64).sum(dim=-1, keepdim=True).sqrt()
            factor = torch.where(norm > 0, RMS_TARGET * numel ** 0.5 / norm, torch.zeros_like(norm))
            row_scale = (inv64 * factor).float()
        U = O * row_scale.unsqueeze(-1)
        if gate:  # ΣU = Σᵢ row_scaleᵢ·ΣⱼOᵢⱼ: finite iff every entry of U is (RMS 0.2: no overflow)
            totals = (row_sum * row_scale).sum(dim=-1).reshape(-1, 1, 1)
        for j, i in enumerate(members):
            Us[i] = U[j]
            if gate:
                total = totals[j, 0, 0]
                dir_counts[i] = torch.stack((total != total, total.abs() == float("inf"))).to(torch.int64)
    scale = res[0] if gate else None
    lrs = gamma * scale.index_select(0, sel).to(gamma.dtype) if gate else None  # (see _compiled's)
    upd = []
    for i, p in enumerate(params):
        lr = lrs[i] if gate else gamma
        P = p.view(Us[i].shape)
        d = Us[i].to(p.dtype)
        if sf:
            z = zs[i].view(P.shape)
            if decay:
                d = d + z * wd
            y_new = torch.lerp(P, z, c) + d * (lr * coef).to(p.dtype)
            z_new = z - d * lr.to(p.dtype)
        else:
            y_new, z_new, z = P * (1 - lr * wd) - lr * d, None, None
        if not gate:
            P.copy_(y_new)
            if z_new is not None:
                z.copy_(z_new)
            continue
        keep = hold[i]
        zero = torch.zeros((), dtype=torch.int64, device=p.device)
        y_ok = storable_mask(y_new, P.dtype)  # finite as stored (a 16-bit parameter)
        u_nan, u_bad = count(y_new != y_new), count(~y_ok)
        P.copy_(torch.where(y_ok & ~keep, y_new, P))
        if z_new is not None:
            z_ok = storable_mask(z_new, z.dtype)
            u_nan, u_bad = u_nan + count(z_new != z_new), u_bad + count(~z_ok)
            z.copy_(torch.where(z_ok & ~keep, z_new, z))
        upd.append(torch.stack((torch.where(keep, zero, u_nan), torch.where(keep, zero, u_bad - u_nan))))
    if gate:
        gc, spike, mc = pre_counts
        if normuon and not ns5:
            mc = mc + torch.stack([torch.stack((torch.zeros_like(k), k)) for k in mom_counts])
        per_stage = {"grad": gc, "moment": mc, "direction": torch.stack(dir_counts), "update": torch.stack(upd)}
        if spike is not None:
            per_stage["spike"] = spike
        res[3].index_add_(0, sel, stage_rows(per_stage, n, sel.device))


@functools.lru_cache(maxsize=None)
def _kernels(tag: str):
    return compiled(_pre, f"_spectral_pre_{tag}"), compiled(_post, f"_spectral_post_{tag}")


def _buckets(params: list[torch.Tensor]) -> tuple[tuple[tuple[int, ...], bool], ...]:
    """Same-shape matrices, in first-seen order: ((member positions), tall) per bucket — static per group,
    so it is a compile-time constant of both graphs."""
    order: dict[tuple[int, int], list[int]] = {}
    for i, p in enumerate(params):
        order.setdefault(matrix_shape(p), []).append(i)
    return tuple((tuple(m), shape[0] > shape[1]) for shape, m in order.items())


def compiled_spectral_update(params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict],
                             indices: list[int], group: dict[str, Any], ctx: dict[str, Any], *,
                             comps: frozenset[str], gamma: torch.Tensor, c: float) -> bool:
    """Run the group's spectral step compiled; False (nothing changed) when it cannot, and the caller
    then runs the foreach path."""
    policy = "off" if ctx["resolution"] is None else ctx["resolution"].policy
    if not supports(comps, group, params):
        return False
    gate = policy != "off"
    device = params[0].device
    buckets = _buckets(params)
    shapes = [matrix_shape(p) for p in params]
    G2 = [g.reshape(s) for g, s in zip(grads, shapes)]
    steps = host_steps(states)
    mona = "mona" in comps
    # Built on the host and copied without blocking (a blocking host→device copy would synchronise).
    first = to_device(torch.tensor([s == 1 for s in steps]), device) if mona else None
    hp_pre = to_device(torch.tensor([1 - group["momentum"], group["momentum"], 1 - group["mona_beta"],
                                     group["mona_alpha"]], dtype=torch.float32), device)
    coef = group["sf_beta"] * (1 - c) - 1
    hp_post = to_device(torch.tensor([1 - group["normuon_beta2"], group["normuon_eps"],
                                      group["weight_decay"], c, coef], dtype=torch.float32), device)
    bufs = [st["momentum_buffer"].view(s) for st, s in zip(states, shapes)]
    prevs = [st["mona_prev_grad"].view(s) for st, s in zip(states, shapes)] if mona else None
    davgs = [st["mona_diff_avg"].view(s) for st, s in zip(states, shapes)] if mona else None
    vs = [st.get("normuon_row_sq") for st in states]
    zs = [st.get("z") for st in states]
    sel, res, factor = resolution_args(ctx, indices, device)
    hot = hot_dtype(device, group["ns5_dtype"])
    # one code object per variant and parameter dtype (dynamo's recompile limit counts per code object);
    # "skip" runs the graphs of "repair"
    tag = "_".join(sorted(comps)) + ("_gated_" if gate else "_off_") + str(params[0].dtype).replace("torch.", "")
    # "skip": the pre-graph writes the momentum, MONA and NorMuon state in place, so the pre-step values
    # are copied first (take_snapshot, as the loop does) and put back below where the gradient was bad
    snapshot = take_snapshot(params, states) if policy == "skip" else None
    pre, post = _kernels(tag)
    try:
        inputs, pre_counts, hold = pre(
            G2, bufs, prevs, davgs, first, res, sel, hp_pre, buckets, gate=gate, factor=factor,
            nesterov=group["nesterov"], mona=mona, ns5="ns5" in comps, hot=hot)
    except Exception as err:  # noqa: BLE001 — the first failure disables compiled paths, nothing written
        report_failure(err)
        undo_steps(states)
        return False
    coefficients = [KELLER_COEFFICIENTS] * group["ns_steps"]
    outs = [iterate(X, coefficients, tall=tall) if "ns5" in comps else X
            for X, (_, tall) in zip(inputs, buckets)]
    post(outs, params, G2, zs, vs, pre_counts, hold, gamma, res, sel, hp_post, buckets, gate=gate,
         ns5="ns5" in comps, normuon="normuon" in comps, sf="sf" in comps, decay=group["weight_decay"] != 0)
    if snapshot is not None:  # the gradient counts (n, 2): a tensor with any NaN/±Inf entry keeps everything
        complete = (pre_counts[0].sum(-1) == 0).unbind()
        for p, st, snap, ok in zip(params, states, snapshot, complete):
            restore_if_bad(p, st, snap, ok)
    return True
