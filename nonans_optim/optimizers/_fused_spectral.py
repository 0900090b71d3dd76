"""impl="fused" for the spectral path: the elementwise work around NS5 as two native C loops.

The shape of ``impl="compiled"`` (:mod:`._compiled_spectral`: a momentum-side pass producing the NS5
inputs, the batched eager NS5 iteration, a direction-side pass), with the two graphs replaced by
``nonans_spectral_pre`` and ``nonans_spectral_post`` (``nonans_optim/native/spectral_pre.c`` and
``spectral_post.c``). Measured reason (a scratch profile, 2026-11-22, commit d737121; not in RESULTS.md): on a
3.4M-parameter GPT the two compiled graphs took about 14.5 ms per SF-NorMuon step against about 20.5 ms of NS5
matmuls — several times the time their byte traffic needs. Published since (RESULTS.md, "Optimizer step
time"): SF-NorMuon's whole step, median, 56.08 ms compiled and 45.46 ms fused.

Covered: NS5 with any of MONA, KL-Shampoo, NorMuon and schedule-free (SF-NorMuon, FullFusion, Muon),
under every policy, for contiguous fp32 or bf16 CPU parameters and gradients (a bf16 gradient row is widened,
a parameter row — and MONA's rows, held in the parameter's dtype — rounded once as it is stored, the gates
testing finiteness as stored; KL-Shampoo reads the bf16 gradient in torch, as impl="loop" does), a bf16 or
fp32 momentum buffer, and a bf16, fp32 or fp16 hot dtype (fp16: the loops write X in fp32, NS5 casts it).
Off the CPU (or with ``NONANS_FUSED_BACKEND=triton``) the group goes to the multi-tensor Triton kernels
instead (``_fused_triton.triton_spectral_update``, the same components).
Anything neither covers (``ns5_dtype="fp16_safe"``, fp16 parameters, say) returns False and the caller runs
``impl="compiled"``. "skip" (the loop snapshots every state tensor and restores a tensor whose
gradient had a bad entry): the loops compute and count such a tensor's whole step and write nothing of
it, KL-Shampoo's damping included. Semantics are those of ``impl="loop"`` (tests/test_fused_spectral.py).

MONA is elementwise and rides in the pre loop. KL-Shampoo is matrix products: with it, pre writes the
momentum M itself (fp32), and between the two loops each matrix is preconditioned and its factors updated
(:mod:`._kl_stacks`: the loop's functions, fed the gradient the spike guard scaled and the "entirely
finite" flag that pre counted), then normalised as :func:`nonans_optim.ns5.ns5` does and cast to the hot
dtype. The resolution's elementwise work stays in the C loops either way.
"""
from __future__ import annotations

import ctypes
from typing import Any

import torch

from .. import native
from .._workspace import Workspace
from ..functional.spike import SPIKE_BETA
from ..ns5 import KELLER_COEFFICIENTS, hot_dtype, iterate
from ..routing import matrix_shape
from ._compiled_spectral import _buckets
from ._common import check_spectral_sizes, mark_written, resolution_written
from ._fused import Int64Array, pointers, resolution_pointers, run_covered
from ._fused_triton import backend, triton_spectral_update
from ._kl_stacks import precondition_stacks

__all__ = ["fused_spectral_update"]

_COVERED = frozenset({"ns5", "normuon", "sf", "mona", "shampoo"})
_POLICY = {"off": 0, "repair": 1, "skip": 2}


def _member_pointers(stacks: list[torch.Tensor], buckets, n: int):
    """Per-tensor pointers into the stacked (B, m, n) bucket tensors, in the group's tensor order."""
    ptrs = [0] * n
    for X, (members, _) in zip(stacks, buckets):
        step = X[0].numel() * X.element_size()
        for j, i in enumerate(members):
            ptrs[i] = X.data_ptr() + j * step
    return Int64Array(ptrs)


def _workspace(owner: dict, group: dict, shapes: tuple, buckets, hot: torch.dtype, raw: bool):
    """The NS5 input stacks, one NS5 workspace per bucket and the row/hold flags of a group, kept between
    steps: fresh buffers each step are handed back to the OS and page-faulted in again (see
    :mod:`nonans_optim._workspace`). Safe to reuse: all of them only live inside one step, and each bucket's
    NS5 output stays in its own workspace until post reads it. ``raw`` (KL-Shampoo): fp32 stacks for pre's
    M as well, and per tensor the guard's scale and the non-finite count of g.

    Kept in ``owner``, the optimizer's own dict (``ctx["workspaces"]``), one set per param group: they go
    with the optimizer (a module-level dict keyed by a parameter outlived a deleted optimizer for as long as
    the model did, an audit found), and a group whose gradient set changes replaces its set rather than
    adding one. Keyed by the group's first parameter *with a gradient*, they grew with every expert that
    came first in an MoE group's routed subset: 16 sets (60 MiB, 3.8x the experts' parameters) after 200
    steps of top-2 routing over 16 experts, where one step needs one (the memory audit, 2026-11-26)."""
    entry = owner.get(id(group))
    if entry is None or entry[0] is not group:  # (the optimizer holds its groups: ids are not reused)
        entry = owner[id(group)] = (group, {})
    cache = entry[1]
    key = (shapes, hot, raw)
    if key not in cache:
        cache.clear()
        n = len(shapes)
        inputs = [torch.empty((len(members), *shapes[members[0]]), dtype=hot) for members, _ in buckets]
        raws = [torch.empty(x.shape, dtype=torch.float32) for x in inputs] if raw else None
        flags = torch.empty(sum(s[0] for s in shapes) + n, dtype=torch.uint8)
        # per row "entirely finite" and per tensor "hold": written by pre before post reads them
        cache[key] = (inputs, [Workspace() for _ in buckets], flags[:-n], flags[-n:], raws,
                      (ctypes.c_float * n)(), (ctypes.c_int64 * n)())
    return cache[key]


def native_part(params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict], indices: list[int],
                group: dict[str, Any], ctx: dict[str, Any], *, comps: frozenset[str], gamma: torch.Tensor,
                c: float) -> tuple:
    """impl="auto" after :func:`fused_spectral_update` refused the whole group: step the matrices the native
    loops cover (parameter, gradient and fp32 state as :func:`._fused.pointers` takes them, and one
    momentum dtype) there and return the others for the foreach path (:func:`._fused.run_covered`). One
    channels_last conv kernel sent the whole group to foreach (SF-NorMuon/Muon 2.1-2.5x slower on a GPT-sized
    model: an audit script's paired ratios, 2026-11-26, commit a59fea2; the script is not in the repository
    and the numbers are not in RESULTS.md). The loops never fold counts themselves here, so both parts'
    counts reach the step's record."""
    def covers(dtype, ps, gs, sts) -> list[bool]:  # one call per parameter dtype
        covered = [_covers(p, g, st, dtype) for p, g, st in zip(ps, gs, sts)]
        bufs = [st["momentum_buffer"] for st in sts]
        first = next((b.dtype for b, ok in zip(bufs, covered) if ok), None)  # the loops take one buffer dtype
        return [ok and pointers([b], first) is not None for b, ok in zip(bufs, covered)]

    return run_covered((params, grads, states, indices), _PARAM_DTYPES, covers,
                       lambda *part: fused_spectral_update(*part, group, ctx, comps=comps, gamma=gamma, c=c))


_PARAM_DTYPES = (torch.float32, torch.bfloat16)  # the parameter dtypes the loops take


def _covers(p: torch.Tensor, g: torch.Tensor, st: dict, dtype: torch.dtype) -> bool:
    """Whether the loops take this matrix as a ``dtype`` parameter: parameter, gradient, z and MONA's buffers
    of that dtype (``zeros_like(p)``), NorMuon's row moment fp32, all contiguous CPU tensors."""
    own = [p, g] + [st[k] for k in ("z", "mona_prev_grad", "mona_diff_avg") if k in st]
    return (pointers(own, dtype) is not None
            and ("normuon_row_sq" not in st or pointers([st["normuon_row_sq"]]) is not None))


@torch.compiler.disable  # ctypes and a build cache: run eagerly inside a compiled step
def fused_spectral_update(params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict],
                          indices: list[int], group: dict[str, Any], ctx: dict[str, Any], *,
                          comps: frozenset[str], gamma: torch.Tensor, c: float) -> bool:
    """Run the group's spectral step in the native loops (or, where the backend is Triton, the Triton
    kernels); False (nothing changed) when they do not cover it."""
    device = params[0].device
    if backend(device) == "triton":
        return triton_spectral_update(params, grads, states, indices, group, ctx, comps=comps, gamma=gamma, c=c)
    policy = "off" if ctx["resolution"] is None else ctx["resolution"].policy
    if "ns5" not in comps or not comps <= _COVERED or policy not in _POLICY or not device.type == "cpu" \
            or group["ns5_dtype"] == "fp16_safe":
        return False
    hot = hot_dtype(device, group["ns5_dtype"])
    # the loops write X in fp32 or bf16. An fp16 NS5 iterates on their fp32 X cast to fp16 — ns5's own order:
    # normalise in fp32, then cast — and its output is widened back for post (the loop would otherwise run
    # the whole group eagerly: 1.42x "off" under "repair" on the bench's fp16 workload, RESULTS.md "bench")
    stage = torch.float32 if hot is torch.float16 else hot
    lib = native.library()
    bufs = [st["momentum_buffer"] for st in states]
    buf_dtype = bufs[0].dtype
    if lib is None or stage not in (torch.bfloat16, torch.float32) or buf_dtype not in (torch.bfloat16, torch.float32):
        return False
    normuon, sf, mona, shampoo = "normuon" in comps, "sf" in comps, "mona" in comps, "shampoo" in comps
    steps = [st["step"] for st in states]
    zs = [st["z"] for st in states] if sf else []
    vs = [st["normuon_row_sq"] for st in states] if normuon else []
    mona_bufs = ([st["mona_prev_grad"] for st in states], [st["mona_diff_avg"] for st in states]) if mona else ([], [])
    shapes = [matrix_shape(p) for p in params]
    check_spectral_sizes([p.numel() for p in params], [m for m, _ in shapes], bufs, zs if sf else None,
                         vs if normuon else None, mona_bufs if mona else None)
    p_dtype = params[0].dtype
    if p_dtype not in _PARAM_DTYPES:
        return False
    ptrs = [pointers(params, p_dtype), pointers(grads, p_dtype), pointers(bufs, buf_dtype), pointers(steps),
            pointers(zs, p_dtype) if sf else True, pointers(vs) if normuon else True,
            pointers(mona_bufs[0], p_dtype) if mona else True, pointers(mona_bufs[1], p_dtype) if mona else True]
    if any(x is None for x in ptrs) or not gamma.is_cpu:
        return False
    gamma = gamma.float()  # fp32, as native_scalar_update takes it (why there)
    p_ptr, g_ptr, b_ptr, step_ptr, z_ptr, v_ptr, prev_ptr, avg_ptr = ptrs
    n = len(params)
    nulls = Int64Array([0] * n)
    rows, cols = Int64Array([s[0] for s in shapes]), Int64Array([s[1] for s in shapes])
    buckets = _buckets(params)
    inputs, workspaces, row_ok, hold, raws, scale, bad = _workspace(ctx.get("workspaces", {}), group,
                                                                     tuple(shapes), buckets, stage, shampoo)
    gate = policy != "off"
    r = resolution_pointers(ctx, indices)
    threads = torch.get_num_threads()
    hp_pre = (ctypes.c_float * 2)(1 - group["momentum"], group["momentum"])
    hp_mona = (ctypes.c_float * 2)(group["mona_alpha"], 1 - group["mona_beta"])
    rc = lib.nonans_spectral_pre(
        n, g_ptr, b_ptr, int(buf_dtype is torch.bfloat16), _member_pointers(raws if shampoo else inputs, buckets, n),
        int(stage is torch.bfloat16 and not shampoo), rows, cols, step_ptr,
        ctypes.addressof(hp_pre), int(group["nesterov"]), prev_ptr if mona else None, avg_ptr if mona else None,
        ctypes.addressof(hp_mona) if mona else None, int(shampoo), _POLICY[policy], r["factor"], SPIKE_BETA,
        1 - SPIKE_BETA, r["ema"], r["sel"], r["streak"], r["events"], r["window"],
        row_ok.data_ptr() if gate else None, hold.data_ptr(), ctypes.addressof(scale), ctypes.addressof(bad),
        r["dense"], threads, int(p_dtype is torch.bfloat16), int(mona and p_dtype is torch.bfloat16))
    if rc != 0:
        raise MemoryError("impl='fused': the native spectral kernel could not allocate its scratch memory")
    if shampoo:  # the host reads are of CPU memory the pre loop has just written: no device
        # a held tensor's damping is kept as a "skip" tensor's is (pre's hold flags: bit 0 held, bit 1 skip)
        keep = [h != 0 for h in hold.tolist()] if gate else [False] * n
        precondition_stacks(raws, inputs, buckets, params, grads, states, indices, group, ctx, scales=list(scale),
                            oks=[torch.tensor(b == 0) for b in bad], keep_damping=keep)
    coefficients = [KELLER_COEFFICIENTS] * group["ns_steps"]
    outs = [iterate(X.to(hot), coefficients, tall=tall, workspace=ws).to(stage).contiguous()
            for X, (_, tall), ws in zip(inputs, buckets, workspaces)]
    coef = group["sf_beta"] * (1 - c) - 1 if sf else 0.0
    hp_post = (ctypes.c_float * 5)(1 - group["normuon_beta2"], group["normuon_eps"], group["weight_decay"], c,
                                   coef)
    rc = lib.nonans_spectral_post(
        n, _member_pointers(outs, buckets, n), int(outs[0].dtype is torch.bfloat16), p_ptr,
        z_ptr if sf else nulls, v_ptr if normuon else nulls, rows, cols,
        row_ok.data_ptr() if gate else None, hold.data_ptr(), gamma.data_ptr(), ctypes.addressof(hp_post),
        int(normuon), int(sf), int(sf and group["weight_decay"] != 0), _POLICY[policy], r["sel"], r["scale"],
        r["dense"], threads, int(p_dtype is torch.bfloat16))
    if rc != 0:
        raise MemoryError("impl='fused': the native spectral kernel could not allocate its scratch memory")
    mark_written(params, bufs, steps, zs, vs, *mona_bufs, resolution_written(ctx))
    return True
