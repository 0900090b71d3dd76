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
* ``dynamic=False``: shapes are fixed per parameter group, so the generated loops have constant trip counts;
* the resolution bookkeeping is in the graph too: the spike guard (norm, EMA, rescale), the escalation
  scale, the hold flag, and the counts, which are added into the step's dense (P, S, 2) block with one
  ``index_add_`` — per-tensor Python bookkeeping cost more than the arithmetic (≈35 µs per tensor; a scratch
  profile, 2026-11-22, commit 97f1d19; not in RESULTS.md).

Memory passes (read from the generated code, TORCH_LOGS=output_code): the gradient is read once for its norm
and counts (the spike guard and the hold rule need them before any write), then one fused loop reads p, g,
m, v and writes p, m, v. Without the spike guard that loop also accumulates the update counts; with it,
inductor (torch 2.13) materialises the new parameter and counts it in a third pass — not fused whatever
the count is taken on (tried: the new value, the unheld value, the direction), so the step moves about
1.4x the bytes of "off" (counted from that generated code, 2026-11-22, commit 66a3804; not timed). That, and
per-tensor loops for the small tensors, is why "repair" is still several times "off" on a many-tensor model
(RESULTS.md, "Resolution overhead on clean steps": AdamW (compiled) step ratio 2.53). The moment-stage count here is
"finite g whose (1-β₂)·g·g term is non-finite" — the same expression v adds, so it equals the eager "new v
non-finite with a finite g" unless v itself was already within a rounding of fp32's maximum (counting from
the new v would split the loop in two: it reads the buffer the loop writes).

Semantics are those of ``impl="loop"`` (tests/test_compiled.py checks parameters, state and event counts):
"repair" gates per entry, "skip" computes the same thing and then keeps the old parameter and state of a
tensor whose gradient had any non-finite entry (no snapshot copy needed: the old values are still the
inputs), "off" is stock arithmetic. Results agree with eager within float tolerance, not bit for bit: the
C++ code generator may contract a·b+c into an FMA.

When ``torch.compile`` cannot work here (no C++ compiler, unsupported Python), the first failure is
reported with a warning and every later step takes the ``foreach`` implementation.
"""
from __future__ import annotations

import ctypes
import functools
import warnings
from typing import Any

import torch
from torch.autograd.graph import increment_version

from .._transfer import to_device
from ..detection import finite_mask, storable_mask  # |x| < inf: one vectorised compare once compiled
from ..functional.spike import spike_scale
from ..resolution import STAGES
from ._common import eager_guard

__all__ = ["compiled_scalar_update", "compile_available", "compiled", "count", "nonfinite_counts",
           "guard_spikes", "stage_rows", "group_kernel_args"]

_BROKEN: list[str] = []  # the first compile failure of this process, if any


def count(mask: torch.Tensor) -> torch.Tensor:
    """Number of True entries, accumulated in int32 when the tensor is small enough (shapes are static, so
    this is decided at trace time): on CPU, five int64 vector accumulators in one loop run ~2x slower than
    int32 ones (register pressure; a scratch measurement, 2026-11-22, commit 67f5ecd; not in RESULTS.md),
    and no count of a tensor under 2**31 entries can overflow int32."""
    if mask.numel() < 2 ** 31:
        return mask.sum(dtype=torch.int32).to(torch.int64)
    return mask.sum(dtype=torch.int64)


def nonfinite_counts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(nan count, all non-finite count) of x. ``x != x`` rather than ``isnan``: inductor's CPU backend
    vectorises the compare but runs ``isnan`` element by element; both reductions share one loop."""
    return count(x != x), count(~finite_mask(x))


def guard_spikes(grads: list[torch.Tensor], ema: torch.Tensor, sel: torch.Tensor, factor: float | None):
    """In-graph spike guard (the eager guard's arithmetic): returns (per-tensor scales — multiply each
    gradient by its own, inside the consuming loop —, spike rows (n, 2)), or (None, None) without a
    factor; updates the norm EMAs of ``sel`` in place. A scale is finite and > 0 (at least the smallest
    subnormal), so it changes no entry's finiteness nor a ±Inf into NaN: the gradient counts can be taken
    on the raw gradient in the norm's pass."""
    if factor is None:
        return None, None
    # spike.py: why float64, and why over the finite entries only
    ok = [finite_mask(g) for g in grads]
    norms = torch.stack([torch.linalg.vector_norm(torch.where(o, g, 0.0), dtype=torch.float64)
                         for g, o in zip(grads, ok)])
    complete = torch.stack([o.all() for o in ok])
    scale, new_ema, trigger = spike_scale(norms, ema.index_select(0, sel), factor, complete=complete)
    ema.index_copy_(0, sel, new_ema)
    flags = trigger.to(torch.int64)
    return scale, torch.stack((torch.zeros_like(flags), flags), 1)


def stage_rows(per_stage: dict[str, torch.Tensor], n: int, device) -> torch.Tensor:
    """(n, S, 2) block from {stage: (n, 2) counts}; stages not given are zero."""
    zero = torch.zeros(n, 2, dtype=torch.int64, device=device)
    return torch.stack([per_stage.get(s, zero) for s in STAGES], 1)


def _one_tensor(p, g_raw, m, v, z, lr, bc1, bc2, hp, sf: bool, policy: str, decay_z: bool, recent=None,
                spike=None):
    """One tensor's step, writing p, m/v (and z) in place; returns {stage: [nan, inf]} for grad, moment
    and update (empty under "off", where nothing is detected). ``spike``: the guard's 0-d scale or None.

    hp = [1-β₁, β₂, 1-β₂, ε, λ, c, β(1-c)-1] (the last two only matter for schedule-free)."""
    if p.dim() == 0:  # decided when the graph is traced: no cost at run time
        # A 0-d tensor as a 1-entry view of the same storage: inductor (torch 2.13, CPU) lost the in-place
        # writes to 0-d fp64 tensors — a 0-d parameter's moments never moved and its step went 1e-2 off
        # torch's AdamW in five steps — and writes 1-entry ones, which reach the parameter and its state.
        p, g_raw, v = p.view(1), g_raw.view(1), v.view(1)
        m, z = (None if t is None else t.view(1) for t in (m, z))
    one_m_b1, b2, one_m_b2, eps, wd = hp[0], hp[1], hp[2], hp[3], hp[4]
    gate = policy != "off"
    zero = torch.zeros((), dtype=torch.int64, device=p.device)
    g = g_raw * spike.to(g_raw.dtype) if spike is not None else g_raw
    g_ok = finite_mask(g_raw)
    # v sees the raw gradient: a non-finite entry makes v_new non-finite there, and the gate below keeps
    # the previous v (missing observation). g·g with (1-β₂) first: addcmul's association, (w·g)·g.
    g2 = one_m_b2 * g * g
    v_new = v * b2 + g2
    if sf:
        # No first moment (β₁ is the interpolation weight): the gated gradient (0 where missing, so a
        # missing entry moves nothing) is the direction input, as in scalar_update's loop form.
        m_new = torch.where(g_ok, g, torch.zeros_like(g)) if gate else g
    else:
        g_in = torch.where(g_ok, g, m) if gate else g  # lerp(m, m, w) = m: m keeps its value there
        m_new = torch.lerp(m, g_in, one_m_b1)
    if gate:
        # finite as stored: a 16-bit state's value is held in fp32 inside the graph (resolution.storable_mask).
        # An entry where either new moment is not is a missing observation: both keep their values (the
        # schedule-free direction input is 0 there), functional/adam.py::_observed
        v_ok = storable_mask(v_new, v.dtype)
        seen = v_ok if sf else v_ok & storable_mask(m_new, m.dtype)  # (g - m in the lerp can overflow)
        v_new = torch.where(seen, v_new, v)
        m_new = torch.where(seen, m_new, torch.zeros_like(m_new) if sf else m)
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
    out: dict[str, torch.Tensor] = {}
    if gate:
        g_nan, g_bad = nonfinite_counts(g_raw)
        # The moment stage counts entries where v or m overflowed with a finite g (functional/adam.py).
        # An m overflow needs |g - m| > fp32 max, so |g| > ~1e31, so (1-β₂)·g² overflows v at that entry
        # too (β₂ < 1 in double gives 1-β₂ ≥ 1.1e-16): counting v alone is the same count. It matters:
        # a reduction over m's mask doubled this graph's time on CPU (inductor, 5 → 10 ms per step on the
        # bench model in scratch A/Bs, 2026-11-23, commit 8e4c7a0, not in RESULTS.md; the gate itself costs
        # nothing measurable). The parity tests check the counts.
        overflow = count(g_ok & ~v_ok)
        # The update guard as _common._guarded_write: keep the old value where the new one is not finite
        # or the tensor is held (_common.keep_flags: a persistent whole-tensor loss); a held tensor writes
        # nothing, so it counts nothing. Counting the unheld y_new keeps the count in the writing loop.
        keep = torch.zeros((), dtype=torch.bool, device=p.device)
        if recent is not None:
            keep = recent & (g_bad == g.numel())
        y_ok = storable_mask(y_new, p.dtype)
        u_nan, u_bad = count(y_new != y_new), count(~y_ok)
        y_new = torch.where(y_ok & ~keep, y_new, p)
        if z_new is not None:
            z_ok = storable_mask(z_new, z.dtype)
            u_nan, u_bad = u_nan + count(z_new != z_new), u_bad + count(~z_ok)
            z_new = torch.where(z_ok & ~keep, z_new, z)
        u_nan, u_bad = torch.where(keep, zero, u_nan), torch.where(keep, zero, u_bad)
        out = {"grad": torch.stack((g_nan, g_bad - g_nan)), "moment": torch.stack((zero, overflow)),
               "update": torch.stack((u_nan, u_bad - u_nan))}
    if policy == "skip":  # GradScaler semantics per tensor: keep everything when any entry was bad
        ok = out["grad"].sum() == 0
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
    return out


def _group_kernel(params, grads, ms, vs, zs, gamma, res, sel, bcs, hp, sf: bool, policy: str,
                  decay_z: bool, factor: float | None):
    """All tensors of a group in one graph. ``res`` is None under "off", else (scale, recent, norm EMA,
    dense counts) — the Resolution tensors, updated in place."""
    if res is None:
        for i, (p, g, m, v, z) in enumerate(zip(params, grads, ms, vs, zs)):
            _one_tensor(p, g, m, v, z, gamma, bcs[i, 0], bcs[i, 1], hp, sf, policy, decay_z)
        return
    scale, recent, ema, dense = res
    spike_scales, spike = guard_spikes(grads, ema, sel, factor)
    # in gamma's dtype: a 1-D fp32 scale times the 0-d fp64 γ of an fp64 group promotes to fp32 (a 0-d
    # operand does not decide the type), which rounded every fp64 step size under "repair"
    lrs, rec = gamma * scale.index_select(0, sel).to(gamma.dtype), recent.index_select(0, sel)
    rows = [_one_tensor(p, g, m, v, z, lrs[i], bcs[i, 0], bcs[i, 1], hp, sf, policy, decay_z,
                        rec[i],  # the hold rule, under "repair" and "skip" (_common.keep_flags)
                        spike_scales[i] if spike_scales is not None else None)
            for i, (p, g, m, v, z) in enumerate(zip(params, grads, ms, vs, zs))]
    per_stage = {s: torch.stack([r[s] for r in rows]) for s in ("grad", "moment", "update")}
    if spike is not None:
        per_stage["spike"] = spike
    dense.index_add_(0, sel, stage_rows(per_stage, len(rows), sel.device))


def compiled(fn, name: str):
    """``torch.compile`` of a copy of ``fn`` under its own code object: dynamo keeps its cache (and its
    recompile limit of 8) per code object, and variants sharing one would evict each other."""
    code = fn.__code__.replace(co_name=name)
    return torch.compile(type(fn)(code, fn.__globals__, name), dynamic=False, fullgraph=True)


@functools.lru_cache(maxsize=64)
def _compiled_kernel(sf: bool, policy: str, factor: float | None, dtype: torch.dtype = torch.float32):
    """The compiled group kernel. One code object per (variant, parameter dtype): dynamo's recompile limit
    (8) counts per code object, and a process that steps fp32, bf16 and fp16 models (the test suite does)
    used to exhaust it, which turns compiled paths off for the rest of the process.

    The spike factor is a constant of the graph, so each value compiles once — about a second per tensor of
    the group on an empty inductor cache, as every graph here spans the whole group (``python -m experiments
    compile-time``, RESULTS.md: 0.7-1.2 s added per tensor on 2 cores); the cache is bounded, because a run
    that kept changing ``spike_factor`` kept every graph for the life of the process (the memory audit,
    2026-11-26: six values, seven graphs, +8 MiB after ``del opt``)."""
    name = f"_group_kernel_{'sf' if sf else 'adamw'}_{policy}_{str(dtype).replace('torch.', '')}"
    return functools.partial(compiled(_group_kernel, name), sf=sf, policy=policy, factor=factor)


def compile_available() -> bool:
    """False once a compile has failed in this process (then impl="compiled" runs the foreach path)."""
    return not _BROKEN and hasattr(torch, "compile")


def report_failure(err: Exception) -> None:
    """Remember the first compile failure and warn once; the caller then runs the eager path."""
    _BROKEN.append(f"{type(err).__name__}: {err}")
    warnings.warn(f"impl='compiled': torch.compile failed ({_BROKEN[0][:300]}); using impl='foreach'",
                  RuntimeWarning, stacklevel=4)


def host_steps(states: list[dict]) -> list[float]:
    """Advance every ``state['step']`` (CPU tensors: no device sync) and return the new values.

    Why not ``torch._foreach_add_``: on 0-d CPU tensors it dispatches one add per tensor, and with the
    reads back that cost about 95 us per step for a 52-tensor model on this project's CPU — a fifth of the
    host time of a whole Triton AdamW step, on GPUs where that step is host-bound. The common case (fp32
    scalars in host memory, torch's own convention) is advanced in place through their addresses instead
    (about 15 us), in double arithmetic rounded once to fp32 — fp32's own x + 1 for every count below
    2^53 — and their version counters are bumped as an in-place op would; anything else takes foreach."""
    steps = [st["step"] for st in states]
    cells = _step_cells(steps)
    if cells is None:
        torch._foreach_add_(steps, 1.0)
        return [float(s) for s in steps]
    out = []
    for cell in cells:
        cell.value += 1.0
        out.append(cell.value)
    increment_version(steps)
    return out


def undo_steps(states: list[dict]) -> None:
    """Put back what :func:`host_steps` advanced, for a kernel that failed after it (error paths only)."""
    torch._foreach_add_([st["step"] for st in states], -1.0)


def _step_cells(steps: list[torch.Tensor]) -> list[ctypes.c_float] | None:
    """ctypes views of one-element fp32 CPU step tensors, or None unless every one is such a tensor with
    storage of its own (not a fake or wrapper tensor, whose address is 0, nor one autograd tracks)."""
    if not all([s.is_cpu and s.dtype is torch.float32 and s.numel() == 1 and not s.requires_grad for s in steps]):
        return None
    addresses = [s.data_ptr() for s in steps]
    return None if 0 in addresses else [ctypes.c_float.from_address(a) for a in addresses]


def _host_scalars(group: dict[str, Any], steps: list[float], c: float, device: torch.device, sf: bool,
                  dtype: torch.dtype = torch.float32):
    """The hyperparameters and bias corrections as tensors in γ's dtype (fp64 for an fp64 group: in fp32
    the compiled fp64 step was 2e-7 off torch's AdamW after 20 steps and lost a decay lr·wd = 1e-8)."""
    beta1, beta2 = group["betas"]
    coef = beta1 * (1 - c) - 1 if sf else 0.0
    hp = torch.tensor([1 - beta1, beta2, 1 - beta2, group["eps"], group["weight_decay"], c, coef], dtype=dtype)
    bcs = torch.tensor([[1 - beta1 ** s, 1 - beta2 ** s] for s in steps], dtype=dtype)
    return to_device(hp, device), to_device(bcs, device)


def resolution_args(ctx: dict[str, Any], indices: list[int], device: torch.device, *, recent_rule: bool = False):
    """(sel, res tuple, spike factor) for a kernel call; (None, None, None) under "off". ``recent_rule``:
    the hold rule's "recent event" as a ``RecentRule`` for a kernel that evaluates it (not the flags)."""
    from ._common import dense_counts, recent_flags
    res = ctx["resolution"]
    if res is None:
        return None, None, None
    t = res.tensors
    sel = ctx["device_indices"](indices, t["scale"].device)
    recent = res.recent_rule() if recent_rule else recent_flags(ctx)
    return sel, (t["scale"], recent, t["grad_norm_ema"], dense_counts(ctx, device)), ctx["spike_factor"]


def group_kernel_args(params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict],
                      indices: list[int], group: dict[str, Any], ctx: dict[str, Any], *, sf: bool,
                      gamma: torch.Tensor, c: float, recent_rule: bool = False) -> tuple:
    """The positional arguments of :func:`_group_kernel` — and of ``kernels.scalar_step.scalar_step_``,
    which shares its signature — for one step: (params, grads, ms, vs, zs, gamma, res, sel, bcs, hp), with
    ``ms`` or ``zs`` (schedule-free) the second state tensor and the other list Nones. Advances every
    ``state['step']`` (the bias corrections need the new count); a caller whose kernel then fails puts
    them back. ``recent_rule``: see :func:`resolution_args` (the Triton kernels take it)."""
    device = params[0].device
    hp, bcs = _host_scalars(group, host_steps(states), c, device, sf, gamma.dtype)
    ms = [None if sf else st["exp_avg"] for st in states]
    zs = [st["z"] if sf else None for st in states]
    vs = [st["exp_avg_sq"] for st in states]
    sel, res, _ = resolution_args(ctx, indices, device, recent_rule=recent_rule)
    return params, grads, ms, vs, zs, gamma, res, sel, bcs, hp


def compiled_scalar_update(params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict],
                           indices: list[int], group: dict[str, Any], ctx: dict[str, Any], *, sf: bool,
                           gamma: torch.Tensor, c: float) -> None:
    """Drop-in for ``scalar_update(..., impl="foreach")``: same arguments, same state and counts."""
    from ._scalar import scalar_update  # deferred: _scalar imports this module

    def eager(grads):
        return scalar_update(params, eager_guard(grads, indices, ctx), states, indices, group, ctx, sf=sf,
                             gamma=gamma, c=c, impl="foreach")

    if not compile_available():
        return eager(grads)
    policy = "off" if ctx["resolution"] is None else ctx["resolution"].policy
    args = group_kernel_args(params, grads, states, indices, group, ctx, sf=sf, gamma=gamma, c=c)
    try:
        _compiled_kernel(sf, policy, ctx["spike_factor"], params[0].dtype)(
            *args, decay_z=sf and group["weight_decay"] != 0)
    except Exception as err:  # noqa: BLE001 — any compile failure: report once, then run eager
        report_failure(err)
        undo_steps(states)
        return eager(grads)
