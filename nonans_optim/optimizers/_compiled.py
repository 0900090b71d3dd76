"""impl="compiled": the (SF-)AdamW + resolution math of :func:`._scalar.scalar_update` under ``torch.compile``.

Why: in eager mode the resolution stage costs several extra passes over every tensor (``isfinite`` alone is
four ATen kernels: ``x == x``, ``abs``, ``!= inf``, ``&``) plus one small kernel per count, so on CPU a
"repair" AdamW step is several times a fused AdamW step. Compiled, the gate, the moments, the direction,
the update and the four counts of one tensor become one or two generated loops that read each input once.

How the graph is kept stable (no recompilation during training):

* the whole parameter list of a group is one call (one guard check, one generated module; per-tensor
  calls would pay the Python/guard cost once per tensor);
* every per-step number is a tensor input: the bias corrections ``1-β₁ᵗ`` and ``1-β₂ᵗ`` (per tensor, from
  the CPU ``state['step']``, built on the host in double and rounded once to fp32 — the same rounding
  eager applies to a Python scalar operand), the schedule-free weight ``c`` and its coefficient
  ``β(1-c)-1``, the step size γ (a device tensor: lr · warmup · Polyak) and the escalation scales, so an
  lr schedule or the Polyak multiplier never recompiles;
* hyperparameters (β₁, β₂, ε, λ) are passed as one fp32 tensor as well, again exactly the fp32 values
  eager uses for its Python-scalar operands;
* ``dynamic=False``: shapes are fixed per parameter group, so the generated loops have constant trip counts.

Semantics are those of ``impl="loop"`` (tests/test_compiled.py checks parameters, state and event counts):
"repair" gates per entry, "skip" computes the same thing and then keeps the old parameter and state of a
tensor whose gradient had any non-finite entry (no snapshot copy needed: the old values are still the
inputs), "off" is stock arithmetic. Results agree with eager within float tolerance, not bit for bit: the
C++ code generator may contract a·b+c into an FMA.

When ``torch.compile`` cannot work here (no C++ compiler, unsupported Python), the first failure is
reported with a warning and every later step takes the ``foreach`` implementation.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from ..resolution import finite_mask  # |x| < inf: one vectorised compare once compiled

__all__ = ["compiled_scalar_update", "compile_available"]

_BROKEN: list[str] = []  # the first compile failure of this process, if any


def _count(mask: torch.Tensor) -> torch.Tensor:
    """Number of True entries, accumulated in int32 when the tensor is small enough (shapes are static, so
    this is decided at trace time): on CPU, five int64 vector accumulators in one loop run ~2x slower than
    int32 ones (register pressure), and no count of a tensor under 2**31 entries can overflow int32."""
    if mask.numel() < 2 ** 31:
        return mask.sum(dtype=torch.int32).to(torch.int64)
    return mask.sum(dtype=torch.int64)


def _nonfinite_counts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(nan count, all non-finite count) of x. ``x != x`` rather than ``isnan``: inductor's CPU backend
    vectorises the compare but runs ``isnan`` element by element; both reductions share one loop."""
    return _count(x != x), _count(~finite_mask(x))


def _one_tensor(p, g, m, v, z, lr, bc1, bc2, hp, sf: bool, policy: str, decay_z: bool, recent=None):
    """One tensor's step, writing p, m/v (and z) in place; returns (3, 2) int64 [nan, inf] counts for the
    stages grad, moment, update (None under "off", where nothing is detected).

    hp = [1-β₁, β₂, 1-β₂, ε, λ, c, β(1-c)-1] (the last two only matter for schedule-free)."""
    one_m_b1, b2, one_m_b2, eps, wd = hp[0], hp[1], hp[2], hp[3], hp[4]
    gate = policy != "off"
    zero = torch.zeros((), dtype=torch.int64, device=p.device)
    g_ok = finite_mask(g)
    g_nan, g_bad = _nonfinite_counts(g)
    # v sees the raw gradient: a non-finite entry makes v_new non-finite there, and the gate below keeps
    # the previous v (missing observation). g·g with (1-β₂) first: addcmul's association, (w·g)·g.
    v_new = v * b2 + one_m_b2 * g * g
    if sf:
        # No first moment (β₁ is the interpolation weight): the gated gradient (0 where missing, so a
        # missing entry moves nothing) is the direction input, as in scalar_update's loop form.
        m_new = torch.where(g_ok, g, torch.zeros_like(g)) if gate else g
    else:
        g_in = torch.where(g_ok, g, m) if gate else g  # lerp(m, m, w) = m: m keeps its value there
        m_new = torch.lerp(m, g_in, one_m_b1)
    if gate:
        v_ok = finite_mask(v_new)
        overflow = _count(~v_ok) - g_bad  # v non-finite with a finite gradient: g² overflowed fp32
        v_new = torch.where(v_ok, v_new, v)
    denom = torch.sqrt(v_new / bc2) + eps
    d = m_new / denom if sf else (m_new / bc1) / denom
    if sf:
        c, coef = hp[5], hp[6]
        if decay_z:  # eager skips the add when λ = 0 (0·z would turn an infinite z into NaN)
            d = d + z * wd
        y_new = torch.lerp(p, z, c) + d * (lr * coef)
        z_new = z - d * lr
    else:
        y_new = p * (1 - lr * wd) - lr * d
        z_new = None
    counts = None
    if gate:
        if recent is not None:  # _common.hold_flag: persistent whole-tensor loss holds the parameter
            hold = recent & (g_bad == g.numel())
            y_new = torch.where(hold, p, y_new)
            if z_new is not None:
                z_new = torch.where(hold, z, z_new)
        u_nan, u_bad = _nonfinite_counts(y_new)
        y_new = torch.where(finite_mask(y_new), y_new, p)
        if z_new is not None:
            zn, zb = _nonfinite_counts(z_new)
            u_nan, u_bad = u_nan + zn, u_bad + zb
            z_new = torch.where(finite_mask(z_new), z_new, z)
        counts = torch.stack((torch.stack((g_nan, g_bad - g_nan)), torch.stack((zero, overflow)),
                              torch.stack((u_nan, u_bad - u_nan))))
    if policy == "skip":  # GradScaler semantics per tensor: keep everything when any entry was bad
        ok = g_bad == 0
        y_new = torch.where(ok, y_new, p)
        v_new = torch.where(ok, v_new, v)
        if sf:
            z_new = torch.where(ok, z_new, z)
        else:
            m_new = torch.where(ok, m_new, m)
    p.copy_(y_new)
    v.copy_(v_new)
    if sf:
        z.copy_(z_new)
    else:
        m.copy_(m_new)
    return counts


def _group_kernel(params, grads, ms, vs, zs, gamma, scale, indices, bcs, hp, sf: bool, policy: str,
                  decay_z: bool, recent=None):
    """All tensors of a group in one graph; returns (n, 3, 2) int64 counts (None under "off")."""
    out = []
    for i, (p, g, m, v, z) in enumerate(zip(params, grads, ms, vs, zs)):
        lr = gamma * scale[indices[i]] if scale is not None else gamma
        out.append(_one_tensor(p, g, m, v, z, lr, bcs[i, 0], bcs[i, 1], hp, sf, policy,
                               decay_z, recent[indices[i]] if recent is not None else None))
    return torch.stack(out) if policy != "off" else None


@functools.lru_cache(maxsize=None)
def _compiled_kernel(sf: bool, policy: str):
    """One compiled entry per (sf, policy), each on its own code object: dynamo keeps its cache (and its
    recompile limit of 8) per code object, and variants sharing one would evict each other."""
    code = _group_kernel.__code__.replace(co_name=f"_group_kernel_{'sf' if sf else 'adamw'}_{policy}")
    fn = type(_group_kernel)(code, _group_kernel.__globals__, code.co_name)
    compiled = torch.compile(fn, dynamic=False, fullgraph=True)
    return functools.partial(compiled, sf=sf, policy=policy)


def compile_available() -> bool:
    """False once a compile has failed in this process (then impl="compiled" runs the foreach path)."""
    return not _BROKEN and hasattr(torch, "compile")


def _host_scalars(group: dict[str, Any], steps: list[float], c: float, device: torch.device, sf: bool):
    beta1, beta2 = group["betas"]
    coef = group["sf_beta"] * (1 - c) - 1 if sf else 0.0
    hp = torch.tensor([1 - beta1, beta2, 1 - beta2, group["eps"], group["weight_decay"], c, coef],
                      dtype=torch.float32)
    bcs = torch.tensor([[1 - beta1 ** s, 1 - beta2 ** s] for s in steps], dtype=torch.float32)
    if device.type != "cpu":
        hp, bcs = hp.to(device, non_blocking=True), bcs.to(device, non_blocking=True)
    return hp, bcs


def compiled_scalar_update(params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict],
                           indices: list[int], group: dict[str, Any], ctx: dict[str, Any], *, sf: bool,
                           gamma: torch.Tensor, c: float) -> None:
    """Drop-in for ``scalar_update(..., impl="foreach")``: same arguments, same state and counts."""
    from ._common import record as _record
    from ._scalar import scalar_update  # deferred: _scalar imports this module

    if not compile_available():
        return scalar_update(params, grads, states, indices, group, ctx, sf=sf, gamma=gamma, c=c,
                             impl="foreach")
    res = ctx["resolution"]
    policy = "off" if res is None else res.policy
    for st in states:
        st["step"] += 1
    steps = [float(st["step"]) for st in states]  # CPU tensors: no device sync
    hp, bcs = _host_scalars(group, steps, c, params[0].device, sf)
    ms = [None if sf else st["exp_avg"] for st in states]
    zs = [st["z"] if sf else None for st in states]
    vs = [st["exp_avg_sq"] for st in states]
    scale = res.tensors["scale"] if res is not None else None
    try:
        counts = _compiled_kernel(sf, policy)(params, grads, ms, vs, zs, gamma, scale, tuple(indices),
                                              bcs, hp, decay_z=sf and group["weight_decay"] != 0,
                                              recent=ctx.get("recent") if policy == "repair" else None)
    except Exception as err:  # noqa: BLE001 — any compile failure: report once, then run eager
        _BROKEN.append(f"{type(err).__name__}: {err}")
        warnings.warn(f"impl='compiled': torch.compile failed ({_BROKEN[0][:300]}); using impl='foreach'",
                      RuntimeWarning, stacklevel=3)
        for st in states:
            st["step"] -= 1
        return scalar_update(params, grads, states, indices, group, ctx, sf=sf, gamma=gamma, c=c,
                             impl="foreach")
    if res is not None:
        for i, idx in enumerate(indices):
            for s, stage in enumerate(("grad", "moment", "update")):
                _record(ctx, idx, stage, counts[i, s])
