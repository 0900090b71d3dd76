"""The multi-tensor Triton (SF-)AdamW step (``kernels/scalar_step.py``): against its oracle.

Same two-faced layout as ``test_kernels_elementwise.py``: a normal run re-runs this file under
``TRITON_INTERPRET=1`` in a subprocess (on the CPU), and runs the ``gpu``-marked copies on CUDA.

Pinned down:
* kernel vs oracle (the compiled path's group function, run eagerly) for AdamW and schedule-free, every
  policy, guard on and off, with NaN/±Inf entries, a finite spike (the guard fires) and a whole-tensor loss
  on a parameter with a recent event (the hold rule): parameters, moments, the norm EMAs and the exact
  dense event counts; 16-bit storage within one ulp of the fp32 oracle rounded once;
* views one entry into a buffer (unaligned addresses) take the scalar-access path correctly;
* ``supported``: what one launch can take.

The step wired into ``impl="fused"`` (against ``impl="loop"``, its fallback, the one-launch step, the launch
counts, no host synchronisation) is tested in ``test_kernels_scalar_one.py``, split from this file; the
helpers both use (``break_kernel``, ``steps_never_sync``, ``count_launches``, ``step_launches``) are in
``triton_launches.py``.
"""
from __future__ import annotations

import os

import pytest
import torch
from interpreted import GPU_COPY, assert_interpreted_suite_passes, marker

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
SIZES = [1000, 300, 513, 1]  # ragged: partial last blocks, a one-entry tensor
HP = [0.1, 0.999, 0.001, 1e-8, 0.01, 0.3, -0.1]  # 1-β₁, β₂, 1-β₂, ε, λ, c, β(1-c)-1


def _case(device, dtype, seed=0):
    """Group tensors with every fault kind; Resolution tensors for P = len(SIZES) + 2 parameters."""
    gen = torch.Generator().manual_seed(seed)

    def rand(n, fn=torch.randn):
        return fn(n, generator=gen).to(device=device, dtype=dtype)

    ps, gs, ms = ([rand(n) for n in SIZES] for _ in range(3))
    vs = [rand(n, torch.rand) for n in SIZES]
    gs[0][3], gs[1][0], gs[1][-1] = float("nan"), float("inf"), float("-inf")
    gs[2].mul_(1e3)  # finite spike: over the guard's cap
    if dtype != torch.float16:  # ... and one whose fp32 square overflows: the guard's norm must stay finite
        gs[2][7] = 1e25
    gs[3].fill_(float("nan"))  # whole-tensor loss on a parameter with a recent event: held under "repair"
    if dtype == torch.float32:  # finite, but g - m inside m's lerp overflows: m keeps its value (moment stage)
        ms[1][5], gs[1][5] = -3.0e38, 3.3e38
    P = len(SIZES) + 2
    scale = (torch.rand(P, generator=gen) + 0.5).to(device)
    ema = (torch.rand(P, generator=gen) * 10).to(device)
    ema[-2] = 0  # the one-entry tensor's guard is not seeded yet
    res = (scale, torch.ones(P, dtype=torch.bool, device=device), ema,
           torch.zeros(P, 6, 2, dtype=torch.int64, device=device))
    sel = torch.arange(1, len(SIZES) + 1, device=device)
    bcs = torch.tensor([[0.1, 0.01], [0.2, 0.02], [0.3, 0.03], [0.4, 0.04]], device=device)
    hp = torch.tensor(HP, dtype=torch.float32, device=device)
    return ps, gs, ms, vs, res, sel, bcs, hp, torch.tensor(1e-2, device=device)


def _step(fn, case, *, sf, policy, factor, upcast=False, copy=torch.clone):
    ps, gs, ms, vs, res, sel, bcs, hp, gamma = case
    ps, gs, ms, vs = ([copy(t).float() if upcast else copy(t) for t in x] for x in (ps, gs, ms, vs))
    res = None if policy == "off" else tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in res)
    nones = [None] * len(ps)
    fn(ps, gs, nones if sf else ms, vs, ms if sf else nones, gamma, res, None if res is None else sel, bcs, hp,
       sf=sf, policy=policy, decay_z=sf, factor=factor)
    return ps, ms, vs, res


def _one_param_res(device, ema: float = 0.0):
    """The Resolution tensors ``scalar_step_`` takes for one parameter: scale 1, no recent event, the guard's
    norm EMA at ``ema``, an empty (1, S, 2) count block."""
    return (torch.ones(1, device=device), torch.zeros(1, dtype=torch.bool, device=device),
            torch.full((1,), ema, device=device), torch.zeros(1, 6, 2, dtype=torch.int64, device=device))


# ----------------------------------------------------------------------------------------------- cases
def case_kernel_matches_oracle(device, sf, policy, factor, dtype):
    from nonans_optim.kernels.scalar_step import scalar_step_, scalar_step_reference_

    case = _case(device, dtype)
    got = _step(scalar_step_, case, sf=sf, policy=policy, factor=factor)
    want = _step(scalar_step_reference_, case, sf=sf, policy=policy, factor=factor, upcast=True)
    # fp32: a few ulps (torch's vectorised lerp and the GPU contract into FMAs); 16-bit: the fp32 oracle
    # rounded once, so at most one ulp of the storage format
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -8, atol=0)
    for name, a, b in zip(("param", "exp_avg|z", "exp_avg_sq"), got[:3], want[:3]):
        for i, (x, y) in enumerate(zip(a, b)):
            torch.testing.assert_close(x, y.to(x.dtype), equal_nan=True, msg=f"{name}[{i}]", **tol)
    if policy == "off":
        assert got[3] is None
        assert not torch.isfinite(got[0][0]).all()  # stock arithmetic: the NaN got through
        return
    assert all(torch.isfinite(p).all() for p in got[0])
    dense_got, dense_want = got[3][3], want[3][3]
    assert torch.equal(dense_got, dense_want), (dense_got.tolist(), dense_want.tolist())
    torch.testing.assert_close(got[3][2], want[3][2], rtol=1e-6, atol=0)
    # every fault kind was counted where it was injected (rows are global indices 1..4)
    assert dense_got[1, 0].tolist() == [1, 0] and dense_got[2, 0].tolist() == [0, 2]
    assert dense_got[4, 0, 0] == 1
    assert dense_got[3, 5, 1] == (1 if factor else 0)  # the spike
    if policy == "repair":  # the whole-tensor loss with a recent event: held, so the value is unchanged
        assert torch.equal(got[0][3], case[0][3])


def case_zero_gradient_leaves_the_guard_ema(device):
    """An all-zero gradient (an MoE expert no token reached, under zero_grad(set_to_none=False)) is no
    observation of the norm: the EMA keeps its value, in the kernel as in functional/spike.py. It decayed
    by β per step before, so the first ordinary gradient after a long stretch of zeros "spiked" (an audit,
    2026-11-26). A non-zero gradient still moves it."""
    from nonans_optim.kernels.scalar_step import scalar_step_, scalar_step_reference_

    n = 300
    sel, bcs = torch.zeros(1, dtype=torch.int64, device=device), torch.tensor([[0.1, 0.01]], device=device)
    hp, gamma = torch.tensor(HP, dtype=torch.float32, device=device), torch.tensor(1e-2, device=device)
    for grad, moved in ((torch.zeros(n), False), (torch.full((n,), 0.05), True)):
        emas = []
        for fn in (scalar_step_, scalar_step_reference_):
            p, m, v = (torch.zeros(n, device=device) for _ in range(3))
            r = _one_param_res(device, ema=2.0)
            fn([p], [grad.to(device)], [m], [v], [None], gamma, r, sel, bcs, hp, sf=False, policy="repair",
               decay_z=False, factor=10.0)
            emas.append(r[2].cpu())
        assert torch.equal(emas[0], emas[1])
        assert (emas[0].item() != 2.0) == moved


def case_guard_scale_floor(device, sf):
    """A spike so far over a tiny running norm that cap / norm is below fp32's range: the guard's scale is
    clamped at 2^-149 (functional/spike.py's TINY), not rounded to 0 — a 0 scale would zero the gradient,
    and turn an infinite entry into NaN. Here cap / norm ≈ 6e-47, so without the floor every g·s is 0."""
    from nonans_optim.functional.spike import TINY
    from nonans_optim.kernels.scalar_step import scalar_step_, scalar_step_reference_

    n = 300
    gen = torch.Generator().manual_seed(1)
    g = (torch.rand(n, generator=gen) + 0.5) * 1e37  # finite; norm ≈ 1.7e38 (fp64), ema·factor = 1e-8
    zeros = torch.zeros(n, device=device)  # fresh state: the scaled gradient is all that moves it
    base = ([zeros.clone()], [g.to(device)], [zeros.clone()], [zeros.clone()])
    res = _one_param_res(device, ema=1e-9)
    sel, bcs = torch.zeros(1, dtype=torch.int64, device=device), torch.tensor([[0.1, 0.01]], device=device)
    hp, gamma = torch.tensor(HP, dtype=torch.float32, device=device), torch.tensor(1e-2, device=device)
    out = []
    for fn in (scalar_step_, scalar_step_reference_):
        ps, gs, ms, vs = ([t.clone() for t in x] for x in base)
        r = tuple(t.clone() for t in res)
        nones = [None]
        fn(ps, gs, nones if sf else ms, vs, ms if sf else nones, gamma, r, sel, bcs, hp, sf=sf, policy="repair",
           decay_z=sf, factor=10.0)
        out.append((ps[0], ms[0], vs[0], r))
    (p1, m1, v1, r1), (p2, m2, v2, r2) = out
    for a, b in ((p1, p2), (m1, m2), (v1, v2)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0)
    assert r1[3][0, 5].tolist() == [0, 1]  # the spike was counted
    # the floor was what bound: v is (1-β₂)·(g·TINY)² — not 0 (a scale flushed to 0) nor (1-β₂)·g² (no guard)
    torch.testing.assert_close(v1.cpu(), HP[2] * (g * TINY) ** 2, rtol=1e-5, atol=0)
    assert (v1 > 0).all() and (p1 != 0).all()


def case_recent_from_the_counters(device, policy, loss_only):
    """The decide kernel evaluating the hold rule's "recent event" itself from the counters (the
    ``RecentRule`` that impl="fused" passes) — as ``RecentRule.flags`` does: an event on one of the
    parameter's own stages within the window. Parameter 4 (sel) has an all-NaN gradient: held when its
    last event was a gradient event two steps ago, not when its only events are "loss" events (the stage
    that is nobody's); parameter 2's event is older than the window."""
    from nonans_optim.kernels.scalar_step import scalar_step_, scalar_step_reference_
    from nonans_optim.resolution import STAGE_INDEX, PARAM_STAGES, RecentRule

    ps, gs, ms, vs, res, sel, bcs, hp, gamma = _case(device, torch.float32)
    P = res[0].shape[0]
    events = torch.zeros(P, 6, dtype=torch.int64, device=device)
    events[4, STAGE_INDEX["loss" if loss_only else "grad"]] = 3
    events[2, STAGE_INDEX["update"]] = 1
    events[1, STAGE_INDEX["loss"]] = 1
    streak = torch.tensor([0, 0, 50, 0, 2, 0], device=device)
    rule = RecentRule(streak, events, torch.tensor(PARAM_STAGES, device=device), 10, STAGE_INDEX["loss"])
    assert rule.flags().tolist() == [False, False, False, False, not loss_only, False]
    case = (ps, gs, ms, vs, (res[0], rule, *res[2:]), sel, bcs, hp, gamma)
    got = _step(scalar_step_, case, sf=False, policy=policy, factor=None)
    want = _step(scalar_step_reference_, case, sf=False, policy=policy, factor=None)
    for a, b in zip(got[0] + got[1] + got[2], want[0] + want[1] + want[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[3][3], want[3][3])
    if policy == "repair":  # ("skip" keeps that tensor whole either way: the oracle comparison above covers it)
        held = torch.equal(got[0][3], ps[3])
        assert held == (not loss_only), "hold exactly when the all-NaN parameter had a gradient event recently"


def case_unaligned_views(device):
    """Tensors that are views one entry into a buffer (flat-parameter layouts): their addresses are not
    16-byte aligned, so the kernel must not take the vector path's alignment for granted."""
    from nonans_optim.kernels.scalar_step import scalar_step_, scalar_step_reference_

    def shifted(t):
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        buf[1:] = t
        assert buf[1:].data_ptr() % 16 != 0
        return buf[1:]

    case = _case(device, torch.float32)
    got = _step(scalar_step_, case, sf=False, policy="repair", factor=5.0, copy=shifted)
    want = _step(scalar_step_reference_, case, sf=False, policy="repair", factor=5.0)
    for a, b in zip(got[0] + got[1] + got[2], want[0] + want[1] + want[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[3][3], want[3][3])


def case_fp16_overflow_as_stored(device, sf):
    """The math is fp32 but the state is fp16: g = 3e4 gives (1-β₂)·g² ≈ 9e5, finite in fp32 and +Inf once
    stored. The gate must test the stored value (as the eager paths do, computing in fp16): v keeps its
    value there, the moment stage counts it, and nothing non-finite is written."""
    from nonans_optim.kernels.scalar_step import scalar_step_

    def t(values):
        return torch.tensor(values, dtype=torch.float16, device=device)

    n = 64
    p, m, v = t([0.5] * n), t([0.1] * n), t([0.01] * n)
    g = t([1.0] * n)
    g[5] = 3e4
    res = _one_param_res(device)
    v_before = v.clone()
    scalar_step_([p], [g], [None] if sf else [m], [v], [m] if sf else [None], torch.tensor(1e-3, device=device),
                 res, torch.zeros(1, dtype=torch.int64, device=device), torch.tensor([[0.1, 0.001]], device=device),
                 torch.tensor(HP, dtype=torch.float32, device=device), sf=sf, policy="repair", decay_z=sf,
                 factor=None)
    assert torch.isfinite(p).all() and torch.isfinite(m).all() and torch.isfinite(v).all()
    assert v[5] == v_before[5] and (v != v_before).sum() == n - 1
    assert res[3][0, 1].tolist() == [0, 1]  # the moment stage: one overflow, as stored


def case_z_overflow_alone(device):
    """Schedule-free, one entry whose new z overflows while its new v and y stay finite (z near fp32's
    maximum, p at 0, a step of lr 5e36 pushing z up): only the z term of the update kernel's speculative
    test sees it, and the gated recomputation must keep z there and count one update overflow — the oracle's
    verdict. Other entries are benign."""
    from nonans_optim.kernels.scalar_step import scalar_step_, scalar_step_reference_

    n = 64
    hp = torch.tensor([0.1, 0.9, 0.1, 1e-8, 0.0, 0.5, -0.55], device=device)  # 1-β₁ β₂ 1-β₂ ε λ c coef
    runs = []
    for fn in (scalar_step_, scalar_step_reference_):
        p, z, v, g = (torch.full((n,), x) for x in (0.1, 0.2, 1.0, 0.5))
        p[5], z[5], g[5] = 0.0, 3.38e38, -1.0
        p, z, v, g = (t.to(device) for t in (p, z, v, g))
        res = _one_param_res(device)
        fn([p], [g], [None], [v], [z], torch.tensor(5e36, device=device), res,
           torch.zeros(1, dtype=torch.int64, device=device), torch.tensor([[1.0, 1.0]], device=device), hp,
           sf=True, policy="repair", decay_z=False, factor=None)
        runs.append((p, z, v, res[3]))
    (p, z, v, dense), want = runs[0], runs[1]
    for got_t, want_t in zip((p, z, v), want[:3]):
        torch.testing.assert_close(got_t, want_t, rtol=1e-6, atol=0)
    assert torch.equal(dense, want[3])
    assert torch.isfinite(p).all() and torch.isfinite(z).all() and z[5] == 3.38e38 and p[5] > 1e38
    assert dense[0, 3].tolist() == [0, 1] and int(dense.sum()) == 1  # the update stage: one overflow


def _define(device, marks=()):
    mark = marker(marks)

    @mark
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
    @pytest.mark.parametrize("policy, factor", [("repair", None), ("repair", 5.0), ("skip", None),
                                                ("skip", 5.0), ("off", None)])  # "off" has no guard
    @pytest.mark.parametrize("sf", [False, True], ids=["adamw", "sf"])
    def test_kernel_matches_oracle(sf, policy, factor, dtype):
        case_kernel_matches_oracle(device, sf, policy, factor, dtype)

    @mark
    @pytest.mark.parametrize("loss_only", [False, True], ids=["grad-event", "loss-event"])
    @pytest.mark.parametrize("policy", ["repair", "skip"])
    def test_recent_from_the_counters(policy, loss_only):
        case_recent_from_the_counters(device, policy, loss_only)

    @mark
    @pytest.mark.parametrize("sf", [False, True], ids=["adamw", "sf"])
    def test_guard_scale_floor(sf):
        case_guard_scale_floor(device, sf)

    @mark
    def test_zero_gradient_leaves_the_guard_ema():
        case_zero_gradient_leaves_the_guard_ema(device)

    @mark
    def test_unaligned_views():
        case_unaligned_views(device)

    @mark
    @pytest.mark.parametrize("sf", [False, True], ids=["adamw", "sf"])
    def test_fp16_overflow_as_stored(sf):
        case_fp16_overflow_as_stored(device, sf)

    @mark
    def test_z_overflow_alone():
        case_z_overflow_alone(device)

    return (test_kernel_matches_oracle, test_unaligned_views, test_fp16_overflow_as_stored,
            test_recent_from_the_counters, test_guard_scale_floor, test_z_overflow_alone,
            test_zero_gradient_leaves_the_guard_ema)


def case_supported_takes_one_dtype_contiguous_group(device):
    """What one launch can take: a single floating dtype the kernels implement, contiguous tensors."""
    from nonans_optim.kernels.scalar_step import supported

    a, b = torch.randn(6, 4, device=device), torch.randn(5, device=device)
    assert supported([a, b])
    assert supported([a.bfloat16(), b.bfloat16()])
    assert not supported([a, b.bfloat16()])  # mixed dtypes: the compiled path
    assert not supported([a, a.t()])  # strided
    assert not supported([a.double(), b.double()])  # no fp64 kernel


if INTERPRETED:
    pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

    def test_supported_takes_one_dtype_contiguous_group():
        case_supported_takes_one_dtype_contiguous_group("cpu")

    (test_kernel_matches_oracle, test_unaligned_views, test_fp16_overflow_as_stored, test_recent_from_the_counters,
     test_guard_scale_floor, test_z_overflow_alone, test_zero_gradient_leaves_the_guard_ema) = _define("cpu")
else:
    @pytest.mark.parametrize("shard", range(2))
    def test_interpreter_suite(shard):
        """Run the cases under TRITON_INTERPRET=1 in fresh processes (see test_kernels_interpret.py), in two
        shards (tests/interpreted.py: the whole suite took 206 s, a long tail for CI's two workers; 76 s since
        tests/interpreter_patches.py, 2026-11-27, where the shards still let both workers share it; both
        times with the optimizer and one-launch cases, which now run in tests/test_kernels_scalar_one.py)."""
        assert_interpreted_suite_passes(__file__, timeout=600, shard=(shard, 2))

    def test_cpu_tensors_are_not_supported_without_the_interpreter():
        from nonans_optim.kernels.scalar_step import supported
        assert not supported([torch.randn(3), torch.randn(2)])

    (test_gpu_kernel_matches_oracle, test_gpu_unaligned_views, test_gpu_fp16_overflow_as_stored,
     test_gpu_recent_from_the_counters, test_gpu_guard_scale_floor, test_gpu_z_overflow_alone,
     test_gpu_zero_gradient_leaves_the_guard_ema) = _define("cuda", marks=GPU_COPY)

