"""impl="fused" off the CPU: the (SF-)AdamW + resolution step as the multi-tensor Triton kernels of
``nonans_optim.kernels.scalar_step`` (per group: gradient statistics where a decision needs them,
per-tensor decisions, the one-pass update), the GPU counterpart of the native C loop in :mod:`._fused`.

Which backend runs (``NONANS_FUSED_BACKEND``, read at each step):

* ``"auto"`` (default): the C loop for CPU tensors, Triton for CUDA tensors;
* ``"triton"``: Triton wherever it can run — on the CPU only under the Triton interpreter
  (``TRITON_INTERPRET=1``), which is how CI checks this path against ``impl="loop"`` without a GPU;
* ``"native"``: the C loop only; CUDA groups then run ``impl="compiled"``.

A group the kernels cannot take (mixed dtypes, a strided gradient, triton missing) runs ``impl="compiled"``,
whose semantics are the same. So does every group after a launch failed (say, a kernel that does not compile
on the installed Triton): the kernels write nothing persistent before their last launch, the step counts
are put back, one warning names the error, and the step runs ``impl="compiled"``.

Host work per step: one small host→device copy of the tensors' addresses (gradients are new tensors after
every backward) and of the bias corrections; nothing is read back. Launches: "off" one; "repair" adds the
decisions and the record (two; three with the spike guard's statistics) — none where the step's only
decision is the hold rule (the default "repair" step, ``kernels/scalar_one.py``; ``NONANS_TRITON_ONE_LAUNCH=0``
returns it to three launches, :func:`one_launch`). The statistics and decisions run as one launch where both
run (``kernels/decisions.py``; ``NONANS_TRITON_FOLD_DECIDE=0`` returns them to two).
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from .. import kernels, switches
from .._transfer import to_device
from ..ns5 import KELLER_COEFFICIENTS, hot_dtype, iterate
from ..routing import matrix_shape
from ._common import check_sizes, check_spectral_sizes, mark_written, resolution_written
from ._compiled import group_kernel_args, host_steps, resolution_args, undo_steps
from ._compiled_spectral import _buckets
from ._kl_stacks import precondition_stacks

__all__ = ["backend", "one_launch", "triton_scalar_update", "triton_spectral_update"]

_FAILED: list[str] = []  # the first launch failure of this process, if any


def backend(device: torch.device) -> str:
    """"native" or "triton": which fused kernel a group on ``device`` should try first."""
    choice = switches.fused_backend()
    if choice == "auto":
        return "native" if device.type == "cpu" else "triton"
    return choice


def triton_scalar_update(params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict],
                         indices: list[int], group: dict[str, Any], ctx: dict[str, Any], *, sf: bool,
                         gamma: torch.Tensor, c: float) -> bool:
    """The step of ``scalar_update(..., impl="loop")`` on the Triton kernels; False (nothing done) when they
    cannot take this group."""
    if _FAILED or not kernels.available():
        return False
    from ..kernels import scalar_step as k  # imports triton: only once a fused GPU step needs it

    seconds = [st["z" if sf else "exp_avg"] for st in states]  # schedule-free keeps z, AdamW m
    vs = [st["exp_avg_sq"] for st in states]
    if not k.supported(params + grads + seconds + vs) or gamma.device != params[0].device:
        return False
    sizes = [p.numel() for p in params]
    check_sizes(sizes, "z" if sf else "exp_avg", seconds)
    check_sizes(sizes, "exp_avg_sq", vs)
    res = ctx["resolution"]
    policy = "off" if res is None else res.policy
    # one launch (kernels/scalar_one.py) where the step's only decision is the hold rule and this group is the
    # step's only producer of counts, so its last program may fold them into the counters
    one = (policy == "repair" and ctx["spike_factor"] is None and ctx["record_in_kernel"] and not ctx["counts"]
           and ctx["dense"] is None and one_launch())
    args = group_kernel_args(params, grads, states, indices, group, ctx, sf=sf, gamma=gamma.float(), c=c,
                             recent_rule=True)
    decay_z = sf and group["weight_decay"] != 0
    tickets = None if one else _tickets(res, indices, params[0].device)
    try:
        if one:
            _scalar_one(args, indices, res, ctx["step"], sf=sf, decay_z=decay_z)
        else:
            k.scalar_step_(*args, sf=sf, policy=policy, decay_z=decay_z, factor=ctx["spike_factor"], tickets=tickets)
    except Exception as err:  # noqa: BLE001 — e.g. a compile error: nothing persistent was written
        if one or tickets is not None:
            res.drop_scratch()  # (a launch that stopped part way may have left tickets behind)
        _failed(err, states)
        return False
    mark_written(params, seconds, vs, resolution_written(ctx))
    if one:
        ctx["recorded"] = True  # the base's record_step must not fold this step a second time
        res.count_block_consumed()
    return True


def one_launch() -> bool:
    """``NONANS_TRITON_ONE_LAUNCH`` ("1", the default, or "0"), read at each step: "1" runs the (SF-)AdamW
    "repair" step without the spike guard as one Triton launch (``kernels/scalar_one.py``) instead of three
    (decide, update, record); "0" keeps the three, the same results (tests/test_kernels_scalar_one.py).

    Default since its first GPU run (H200, 2026-11-27, in one lease with the three-launch runs): its
    gpu-marked tests passed, and on gpt2-small the AdamW / SFAdamW "repair" step cost 1.050 / 1.069 of "off"
    against 1.151 / 1.126 with three launches, the host's extra time per step +30 / +56 µs against
    +194 / +283 µs (RESULTS.md "overhead-gpu-gpt2-small", "overhead-gpu-gpt2-small-three-launch",
    "sync-audit")."""
    return switches.one_launch()


def _tickets(res, indices: list[int], device: torch.device) -> torch.Tensor | None:
    """The zeroed scratch that lets a group's statistics and decide launches run as one
    (``kernels/decisions.py``), under a resolution policy unless ``NONANS_TRITON_FOLD_DECIDE=0``; else None."""
    if res is None or not switches.fold_decide():
        return None
    return res.kernel_scratch(("decide", indices[0], len(indices)), len(indices), device)


def _scalar_one(args: tuple, indices: list[int], res, step: int, *, sf: bool, decay_z: bool) -> None:
    """The group's step and the step's record in one launch: ``args`` as :func:`group_kernel_args` made them."""
    from ..kernels import scalar_one

    params, grads, ms, vs, zs, gamma, (_, _, _, dense), sel, bcs, hp = args
    device = params[0].device
    scalar_one.scalar_step_one_(params, grads, ms, vs, zs, gamma, bcs, hp, sf=sf, decay_z=decay_z, sel=sel,
                                counters=res.tensors, numel=res.numel, dense=dense, step=step,
                                scratch=lambda size: res.kernel_scratch((indices[0], len(indices)), size, device),
                                backoff=res.backoff, min_scale=res.min_scale, growth_interval=res.growth_interval,
                                repeat_window=res.repeat_window)


def _failed(err: Exception, states: list[dict]) -> None:
    """A launch failed before anything persistent was written: put the step counts back, remember the
    error (every later group of this process skips the Triton kernels) and warn once."""
    undo_steps(states)
    _FAILED.append(f"{type(err).__name__}: {err}")
    warnings.warn(f"impl='fused': the Triton kernels failed ({_FAILED[0][:300]}); falling back to "
                  "impl='compiled' where it covers a group, else (and under impl='auto') 'foreach'", RuntimeWarning,
                  stacklevel=7)


_SPECTRAL = frozenset({"ns5", "normuon", "sf", "mona", "shampoo"})
_SHAPES: dict[tuple, tuple] = {}


def _group_shapes(params: list[torch.Tensor]) -> tuple:
    """(matrix shapes, NS5 buckets, sizes, row counts) of a group, computed once per list of parameter
    shapes: static for a group, and recomputing them cost about a tenth of this path's host time per step."""
    key = tuple(p.shape for p in params)
    if key not in _SHAPES:
        if len(_SHAPES) > 64:
            _SHAPES.clear()
        shapes = [matrix_shape(p) for p in params]
        _SHAPES[key] = (shapes, _buckets(params), [p.numel() for p in params], [m for m, _ in shapes])
    return _SHAPES[key]


# Spectral configurations (and group shapes) whose direction kernels have compiled. A specialisation
# Triton first meets later (say, a differently aligned tensor) still compiles at its own launch.
_COMPILED: set[tuple] = set()


def triton_spectral_update(params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict],
                           indices: list[int], group: dict[str, Any], ctx: dict[str, Any], *,
                           comps: frozenset[str], gamma: torch.Tensor, c: float) -> bool:
    """The step of ``spectral_update(..., impl="loop")`` for NS5 groups with any of MONA, KL-Shampoo,
    NorMuon and schedule-free on the Triton kernels of ``nonans_optim.kernels.spectral_step`` around the
    batched torch NS5 iteration (and, with KL-Shampoo, :mod:`._kl_stacks` between the momentum side and
    NS5); False (nothing done) when they cannot take this group (no NS5, fp16_safe NS5, 16-bit
    parameters...: the caller then runs ``impl="compiled"``). An fp16 NS5 runs as on the CPU's loops
    (``_fused_spectral``): the kernels write X in fp32, NS5 iterates on it cast to fp16, its output is
    widened for the direction side."""
    if _FAILED or not kernels.available() or "ns5" not in comps or not comps <= _SPECTRAL \
            or group["ns5_dtype"] == "fp16_safe":
        return False
    from ..kernels import spectral_step as k  # imports triton: only once a fused GPU step needs it

    device = params[0].device
    bufs = [st["momentum_buffer"] for st in states]
    sf, normuon, mona, shampoo = "sf" in comps, "normuon" in comps, "mona" in comps, "shampoo" in comps
    zs = [st["z"] if sf else None for st in states]
    vs = [st["normuon_row_sq"] if normuon else None for st in states]
    monas = ([st["mona_prev_grad"] for st in states], [st["mona_diff_avg"] for st in states]) if mona else None
    hot = hot_dtype(device, group["ns5_dtype"])
    stage = torch.float32 if hot is torch.float16 else hot  # the dtype the kernels write X in and read O from
    if not k.supported(params, grads, bufs, zs, vs, (*monas[0], *monas[1]) if mona else ()) \
            or gamma.device != device or stage not in (torch.float32, torch.bfloat16):
        return False
    shapes, buckets, sizes, rows = _group_shapes(params)
    check_spectral_sizes(sizes, rows, bufs, zs if sf else None, vs if normuon else None, monas)
    policy = "off" if ctx["resolution"] is None else ctx["resolution"].policy
    steps = host_steps(states)
    sel, res, factor = resolution_args(ctx, indices, device, recent_rule=True)
    # one host→device copy: [1-β₂ᴺ, εᴺ, λ, c, β(1-c)-1] for the direction side, [1-μ, μ, α, 1-β,
    # first...] for the momentum side (MONA's G_prev starts as the gradient on a tensor's first step)
    hp = to_device(torch.tensor([1 - group["normuon_beta2"], group["normuon_eps"], group["weight_decay"], c,
                                 group["sf_beta"] * (1 - c) - 1, 1 - group["momentum"], group["momentum"],
                                 group["mona_alpha"] if mona else 0.0, 1 - group["mona_beta"] if mona else 0.0,
                                 *([float(s == 1) for s in steps] if mona else [])], dtype=torch.float32), device)
    hp_post, hp_pre = hp[:5], hp[5:]
    post = dict(buckets=buckets, shapes=shapes, normuon=normuon, sf=sf, decay=group["weight_decay"] != 0)
    key = (str(device), hot, bufs[0].dtype, policy, factor is None, group["nesterov"], normuon, sf, mona, shampoo,
           post["decay"], tuple(shapes))  # the matrix shapes determine the sizes and row counts too
    gamma = gamma.float()
    tickets = _tickets(ctx["resolution"], indices, device)
    try:
        pre = k.spectral_prepare_(grads, bufs, vs, res, sel, hp_pre, buckets=buckets, shapes=shapes,
                                  hot=torch.float32 if shampoo else stage, nesterov=group["nesterov"], policy=policy,
                                  factor=factor, monas=monas, raw=shampoo, tickets=tickets)
        # with KL-Shampoo pre.inputs hold M (fp32); NS5 reads stacks in the staging dtype, filled below
        inputs = [torch.empty_like(X, dtype=stage) for X in pre.inputs] if shampoo else pre.inputs
        if key not in _COMPILED:  # the direction side's compile errors, before the first persistent write
            k.spectral_post_(pre, inputs, params, grads, zs, gamma, hp_post, warmup=True, **post)
            if len(_COMPILED) > 64:
                _COMPILED.clear()
            _COMPILED.add(key)
        k.spectral_write_(pre)
    except Exception as err:  # noqa: BLE001 — e.g. a compile error: nothing persistent was written
        if tickets is not None:
            ctx["resolution"].drop_scratch()  # (a launch that stopped part way may have left tickets behind)
        _failed(err, states)
        return False
    if shampoo:
        _precondition(pre, inputs, buckets, params, grads, states, indices, group, ctx, policy)
    coefficients = [KELLER_COEFFICIENTS] * group["ns_steps"]
    outs = [iterate(X.to(hot), coefficients, tall=tall).to(stage).contiguous() for X, (_, tall) in zip(inputs, buckets)]
    k.spectral_post_(pre, outs, params, grads, zs, gamma, hp_post, **post)
    mark_written(params, bufs, [z for z in zs if z is not None], [v for v in vs if v is not None],
                 *(monas or ()), resolution_written(ctx))
    return True


def _precondition(pre, inputs, buckets, params, grads, states, indices, group, ctx, policy: str) -> None:
    """KL-Shampoo on the fp32 M stacks the write kernel left in ``pre.inputs``, with the kernels' per-tensor
    decisions as device tensors (the guard's scale, "entirely finite", held, "skip" with a bad entry: bit 3,
    bit 0 and bit 1 of the flags) — never read on the host."""
    n = len(params)
    if pre.dec is None:  # "off": every gradient is an observation, none scaled
        ok = torch.ones((), dtype=torch.bool, device=params[0].device)
        scales, oks, keep = [None] * n, [ok] * n, [False] * n
    else:
        scales = list(pre.dec[:, 0].unbind(0)) if ctx["spike_factor"] is not None else [None] * n
        oks = list(((pre.dec_flags & 8) == 0).unbind(0))
        # held (bit 0) or "skip" with a bad entry (bit 1): the damping is put back, as the rest of the state
        keep = (pre.dec_flags & (3 if policy == "skip" else 1)) != 0  # one (n,) flag: one select for the group
    precondition_stacks(pre.inputs, inputs, buckets, params, grads, states, indices, group, ctx, scales=scales,
                        oks=oks, keep_damping=keep)
