"""impl="fused": the (SF-)AdamW + resolution step as one native CPU loop (:mod:`nonans_optim.native`).

Semantics are those of ``impl="loop"`` (tests/test_fused.py compares parameters, state and event counts
under NaN/Inf injection, the hold rule, "skip" and the spike guard): the C loop is the arithmetic of
``_compiled._one_tensor`` line for line. What it changes is the memory traffic: one read of p, g, m, v and
one write of p, m, v per entry, like torch's fused AdamW, with the detection and the counts in registers;
a second, read-only pass over g only when a decision must come before any write (the spike guard's norm,
"skip", the hold rule), and each thread re-reads the range it has just pulled into its own L2 cache.
The per-tensor scalars (step counts, bias corrections, step sizes, the hold rule's "recent event") are
computed in the same call: on a 52-tensor model, doing them as small torch ops cost more than the repair.
For the same reason, when the group is the step's only producer of counts (one AdamW/SFAdamW group), the
call also folds them into the Resolution counters (``Resolution.record_step``'s work) instead of leaving a
(P, S, 2) tensor for a second C call: the repair-only Python glue of a step went from about 23 to 7 us,
and to about 3 us once the counters' pointers were cached per index list (``Resolution.native_args``;
52 tiny tensors, where "off" takes 183 us and torch's fused AdamW 243 us).

Scope: contiguous CPU tensors (parameter, gradient, state, and an fp32 ``state['step']``), all fp32 or all
bf16 in one call. bf16 runs the fp32 arithmetic on widened entries and rounds each result once as it is
stored, as torch's fused AdamW does (native/scalar_step.c's header has the rest). Until 2026-11-26 this
function sent bf16 groups to ``impl="compiled"`` and ``impl="auto"`` sent them to the eager foreach step:
22x torch's fused AdamW on the default GPT in bf16 (RESULTS.md, "A bf16 model's (SF-)AdamW step on CPU",
where the loop now runs at 0.97x). CUDA groups go to the multi-tensor Triton kernels instead
(:mod:`._fused_triton`, ``NONANS_FUSED_BACKEND``). Any other group — fp16 or fp64, channels_last, a strided
gradient, fp32 and bf16 tensors mixed — runs ``impl="compiled"`` with identical semantics, and so does
everything when the kernel cannot be built (one warning). No host synchronisation: on CPU the tensors
already live in host memory, and the kernel reads nothing the step has not already computed.
"""
from __future__ import annotations

import ctypes
import warnings
from typing import Any

import torch

from .. import kernels, native
from ..native import Int64Array
from ..functional.spike import SPIKE_BETA
from ._common import check_sizes, dense_counts, mark_written, resolution_written
from ._compiled import compiled_scalar_update
from ._fused_triton import backend, triton_scalar_update

__all__ = ["fused_scalar_update", "native_scalar_update", "auto_choice", "Int64Array", "pointers",
           "pointer_table", "resolution_pointers", "run_covered", "NATIVE_SCALAR_DTYPES"]

_POLICY = {"off": 0, "repair": 1, "skip": 2}
# The tensor dtypes the native (SF-)AdamW loop steps (every tensor of one call has the same one).
NATIVE_SCALAR_DTYPES = (torch.float32, torch.bfloat16)
_WARNED: list[bool] = []


def pointers(tensors: list[torch.Tensor], dtype: torch.dtype = torch.float32) -> Int64Array | None:
    """The data pointers, or None unless every tensor is a contiguous CPU tensor of ``dtype`` (a pointer
    to anything else — a CUDA address, a strided view — must never reach the C loops) with storage of its
    own: a wrapper subclass (DTensor) reports all of that and a null pointer, which segfaulted."""
    table = pointer_table(((tensors, dtype),))
    return None if table is None else table[0]


def pointer_table(lists: tuple[tuple[list[torch.Tensor], torch.dtype], ...],
                  tail: list[int] | None = None) -> tuple[Int64Array, list[int]] | None:
    """:func:`pointers` of several (tensors, dtype) lists in one array, followed by the ints ``tail``:
    (the array, the address of each list's block and then of the tail), or None unless every tensor
    passes :func:`pointers`' checks. The array owns the memory the addresses point into: keep it until the
    C call returns. One array where a native step built seven (five :func:`pointers`, the null pointers, the
    sizes), each with a fixed cost of about a microsecond and a pass of its own: 14 -> 11 us for one
    tensor's lists, 103 -> 91 us for 40 tensors' (timeit), and single-tensor AdamW and SFAdamW steps
    0.92-0.98x as long (the two functions swapped in one process, 30 interleaved rounds; scratch scripts,
    2026-11-27, not in RESULTS.md). What remains is the per-tensor checks, about 0.45 us per tensor and
    list: the floor short of trusting a cached pointer, which a ``p.data = ...`` elsewhere would leave
    dangling."""
    ptrs = [t.data_ptr() for tensors, dtype in lists for t in tensors
            if t.is_cpu and t.dtype is dtype and t.is_contiguous()]
    if len(ptrs) != sum(len(tensors) for tensors, _ in lists):
        return None
    if 0 in ptrs and any(not t.data_ptr() and t.numel() for tensors, _ in lists for t in tensors):
        return None
    table = Int64Array(ptrs + tail if tail else ptrs)
    base = table._as_parameter_.value or 0
    addresses, at = [], base
    for tensors, _ in lists:
        addresses.append(at)
        at += 8 * len(tensors)
    return table, addresses + [at]


def run_covered(lists: tuple[list, ...], dtypes: tuple[torch.dtype, ...], covers, step) -> tuple[list, ...]:
    """impl="auto" on a group the native loops refused as a whole: for each dtype in turn, ``step(*part)``
    (a native update taking (params, grads, states, indices), True when it ran) on the entries that
    ``covers(dtype, params, grads, states)`` marks among those still left, and the lists of the others
    returned for the foreach path. A dtype's part is left alone when it is empty, when it is the whole group
    (then the refusal was the group's own: no library, its components, its device), or when ``step``
    refused it. Each tensor's step is its own, so running a group in parts changes no value beyond the
    rounding that separates the paths (``_scalar._native_part``, ``_fused_spectral.native_part``)."""
    rest = lists
    for dtype in dtypes:
        covered = covers(dtype, *rest[:3])
        if not any(covered) or (rest is lists and all(covered)):
            continue
        mine, others = ([[x for x, c in zip(xs, covered) if c == want] for xs in rest] for want in (True, False))
        if step(*mine):
            rest = tuple(others)
    return rest


_OFF = dict(ema=None, sel=None, scale=None, streak=None, events=None, dense=None, window=0, factor=0.0, rec=None,
            written=[])


def resolution_pointers(ctx: dict[str, Any], indices: list[int], *, record: bool = False) -> dict[str, Any]:
    """The Resolution tensors the C loops read and update (CPU: the optimizer checked the device), as
    data pointers (``Resolution.native_args``, cached); None and zeros under "off". ``written``: the
    counter tensors the call may write (for :func:`mark_written`).

    ``record``: the caller's kernel can fold the step's counts into the counters itself (``rec``, see
    ``nonans_scalar_step``): it then does when the optimizer said this group is the step's only producer of
    counts (``ctx["record_in_kernel"]``), nothing has been recorded yet and the native record covers the
    counters, and there is no dense count block (``dense`` None); otherwise ``rec`` is None."""
    res = ctx["resolution"]
    if res is None:
        return _OFF
    a = res.native_args(indices, ctx["device_indices"])
    rec = a.pack if (record and a.pack is not None and ctx.get("record_in_kernel") and not ctx["counts"]
                     and ctx["dense"] is None) else None
    dense = None if rec is not None else dense_counts(ctx, res.tensors["scale"].device).data_ptr()
    return dict(ema=a.ema, sel=a.sel, scale=a.scale, streak=a.streak, events=a.events, dense=dense,
                window=res.repeat_window, factor=ctx["spike_factor"] or 0.0, rec=rec,
                written=a.written if rec is not None else resolution_written(ctx))


def auto_choice(device: torch.device | str) -> str:
    """What ``impl="auto"`` runs for fp32 contiguous groups on ``device`` — for reports that must say which
    path they measured: "fused" (the native loops) on a CPU where they build; on CUDA "fused" (the Triton
    kernels) where triton imports, for the (SF-)AdamW step and the spectral step alike; else "foreach".

    Why Triton by default on CUDA: the foreach steps are host-bound there — hundreds to thousands of small
    kernel launches, several times more under "repair" (``python -m experiments sync-audit``). On an H200
    (2026-11-26, ``python -m experiments overhead --device cuda``, RESULTS.md "overhead-gpu") the AdamW step
    of that experiment's small GPT took 6.7 ms (foreach) against 0.7 ms (Triton) "off", and SF-NorMuon's
    11.7 ms against 3.7 ms; on the 124M-parameter GPT (``--model gpt2-small``, "overhead-gpu-gpt2-small")
    SF-NorMuon's whole training step took 174 ms with the foreach optimizer step and 162 ms with the Triton
    one, FullFusion's 349 ms and 242 ms. The spectral path's torch.compile fallback is never taken under
    "auto" (a group the kernels do not cover runs foreach). Triton caches its one-time JIT compile on
    disk."""
    device = torch.device(device)
    if device.type == "cpu":
        return "fused" if native.library() is not None else "foreach"
    if device.type == "cuda" and kernels.available():
        return "fused"
    return "foreach"


def _warn_unavailable() -> None:
    if not _WARNED:
        _WARNED.append(True)
        warnings.warn(f"impl='fused': the native CPU kernel is unavailable ({native.failure()}); "
                      "using impl='compiled'", RuntimeWarning, stacklevel=5)


def fused_scalar_update(params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict],
                        indices: list[int], group: dict[str, Any], ctx: dict[str, Any], *, sf: bool,
                        gamma: torch.Tensor, c: float) -> None:
    """Drop-in for ``scalar_update(..., impl="loop")``: same arguments, same state and counts. CUDA groups
    (and any group when ``NONANS_FUSED_BACKEND=triton``) go to the Triton kernels (:mod:`._fused_triton`)."""
    if backend(params[0].device) == "triton":
        if triton_scalar_update(params, grads, states, indices, group, ctx, sf=sf, gamma=gamma, c=c):
            return None
        return compiled_scalar_update(params, grads, states, indices, group, ctx, sf=sf, gamma=gamma, c=c)
    if native_scalar_update(params, grads, states, indices, group, ctx, sf=sf, gamma=gamma, c=c):
        return None
    if params[0].is_cpu and native.failure() is not None:
        _warn_unavailable()
    return compiled_scalar_update(params, grads, states, indices, group, ctx, sf=sf, gamma=gamma, c=c)


@torch.compiler.disable  # ctypes and a build cache: run eagerly inside a compiled step
def native_scalar_update(params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict],
                         indices: list[int], group: dict[str, Any], ctx: dict[str, Any], *, sf: bool,
                         gamma: torch.Tensor, c: float) -> bool:
    """The step in the native CPU loop; False (nothing changed) when it does not cover the group (a CUDA
    tensor, one neither fp32 nor bf16 or not of the first parameter's dtype, a strided one, no C compiler):
    the caller picks the fallback."""
    lib = native.library() if params[0].is_cpu else None
    if lib is None or not gamma.is_cpu:
        return False
    # γ in fp32, as the loop takes every hyperparameter (and the Triton path does the same): a group holding
    # an fp64 tensor has an fp64 γ, and when that tensor runs foreach the group's fp32 tensors still run
    # here (_scalar._native_part) — refusing that γ sent all of them to foreach (33x slower in an audit,
    # 2026-11-26). The foreach path rounds γ to its fp32 tensors' dtype the same way inside each op.
    gamma = gamma.float()
    seconds = [st["z" if sf else "exp_avg"] for st in states]  # schedule-free keeps z, AdamW m
    vs, steps = [st["exp_avg_sq"] for st in states], [st["step"] for st in states]
    sizes = [p.numel() for p in params]
    check_sizes(sizes, "z" if sf else "exp_avg", seconds)
    check_sizes(sizes, "exp_avg_sq", vs)
    dtype = params[0].dtype
    if dtype not in NATIVE_SCALAR_DTYPES:
        return False
    # one array: the pointers of p, g, the second moment (or z), v and the step counts, then null
    # pointers for the moment this variant does not keep, then the sizes
    packed = pointer_table(((params, dtype), (grads, dtype), (seconds, dtype), (vs, dtype),
                            (steps, torch.float32)), [0] * len(params) + sizes)
    if packed is None:
        return False
    table, (p_ptr, g_ptr, second, v_ptr, step_ptr, nulls) = packed  # table: alive until the call returns
    numel = nulls + 8 * len(params)
    policy = "off" if ctx["resolution"] is None else ctx["resolution"].policy
    beta1, beta2 = group["betas"]
    coef = beta1 * (1 - c) - 1 if sf else 0.0
    # fp32 exactly as the other implementations round them: host doubles, rounded once.
    hp = (ctypes.c_float * 7)(1 - beta1, beta2, 1 - beta2, group["eps"], group["weight_decay"], c, coef)
    r = resolution_pointers(ctx, indices, record=True)
    rec, res = r["rec"], ctx["resolution"]
    rc = lib.nonans_scalar_step(
        len(params), p_ptr, g_ptr, nulls if sf else second, v_ptr, second if sf else nulls, step_ptr,
        numel, gamma.data_ptr(), beta1, beta2, ctypes.addressof(hp), _POLICY[policy],
        int(sf), int(sf and group["weight_decay"] != 0), r["factor"], SPIKE_BETA, 1 - SPIKE_BETA, r["ema"],
        r["sel"], r["scale"], r["streak"], r["events"], r["window"], r["dense"], torch.get_num_threads(),
        rec, res.backoff if rec is not None else 0.0, res.min_scale if rec is not None else 0.0, ctx["step"],
        int(dtype is torch.bfloat16))
    if rc != 0:
        raise MemoryError("impl='fused': the native kernel could not allocate its scratch memory")
    mark_written(params, seconds, vs, steps, r["written"])
    if rec is not None:
        ctx["recorded"] = True  # the base's record_step must not fold this step a second time
    return True
