"""The resolution contract for non-finite values that arise inside the step, from finite gradients: a
gradient whose square or lerp overflows a moment, a direction whose squares overflow, 16-bit state that
overflows only as stored, a non-finite loss (the Polyak input) and a non-finite step size. The invariant holds
(finite parameters and state before the step, finite after), the stage that saw the values counts them, and
each implementation counts what the loop does. Faults injected into the gradients: tests/test_resolution.py."""
from __future__ import annotations

import pytest
import torch

import nonans_optim as no
from optim_infos import (IDS, INFOS, all_finite, assert_params_and_state_close, assert_resolution_matches,
                         impl_cases, impl_ids, loss_fn, make_batch, make_model, train_steps)


def test_fp64_loss_beyond_fp32_is_a_loss_event():
    """A finite fp64 loss past fp32's range is dropped from the Polyak EMA (which folds it in fp32): that is
    an Inf "loss" event, as the same value given as a Python float is — it was checked in fp64 and dropped
    silently (an audit, 2026-11-26)."""
    for value in (torch.tensor(1e39, dtype=torch.float64), 1e39):
        model = make_model()
        opt = no.SFNorMuon(model.parameters(), lr=1e-2)
        train_steps(model, opt, 1)
        ema = opt._global()["polyak"]["loss_ema"].clone()
        loss_fn(model, make_batch(5)).backward()
        opt.set_loss(value)
        opt.step()
        assert torch.equal(opt._global()["polyak"]["loss_ema"], ema)
        assert [(e.stage, e.param, e.nan_count, e.inf_count) for e in opt.events] == [("loss", None, 0, 1)]


@pytest.mark.parametrize("info", INFOS, ids=IDS)
def test_nonfinite_loss_leaves_polyak_emas(info):
    model = make_model()
    opt = info.make(model.named_parameters())
    train_steps(model, opt, 3)
    if not getattr(opt, "_uses_polyak", False):
        pytest.skip("no Polyak step")
    ema = dict(opt._global()["polyak"])
    ema = {k: v.clone() for k, v in ema.items()}
    opt.zero_grad()
    loss_fn(model, make_batch(77)).backward()
    opt.set_loss(torch.tensor(float("nan")))
    opt.step()
    assert torch.equal(opt._global()["polyak"]["loss_ema"], ema["loss_ema"])
    assert all_finite(model, opt)
    assert opt.metrics()["resolution/events_loss"] == 1.0


@pytest.mark.parametrize("info", INFOS, ids=IDS)
def test_gradient_overflowing_the_second_moment_is_contained(info):
    """Without the spike guard (which would rescale the giant first: tests/test_spike_guard.py), a finite
    gradient whose square overflows reaches the second moment: contained and counted."""
    model = make_model()
    opt = info.make(model.named_parameters(), spike_factor=None)
    train_steps(model, opt, 2)
    opt.zero_grad()
    loss_fn(model, make_batch(3)).backward()
    model.head.bias.grad.fill_(3e38)  # finite, but g² overflows fp32
    opt.step()
    assert all_finite(model, opt)
    assert opt.metrics()["resolution/events_moment"] + opt.metrics()["resolution/events_update"] >= 1


OVERFLOW_CASES = impl_cases(("loop", "foreach", "compiled"))


@pytest.mark.parametrize("policy", ["repair", "skip"])
@pytest.mark.parametrize("info, impl", OVERFLOW_CASES, ids=impl_ids(OVERFLOW_CASES))
def test_finite_gradients_that_overflow_a_moment_are_contained(info, impl, policy):
    """Every gradient finite, but -3e38, then +3e38: lerp(m, g, w) = m + w·(g - m) overflows in g - m
    (AdamW's exp_avg, the spectral momentum buffer, MONA's average), g² overflows v. Each of those
    buffers keeps its value there, the invariant holds, and the moment stage counts the entries. All the
    optimizers and implementations used to leave +Inf in the momentum state. The spike guard is off: it
    would rescale these gradients before any moment saw them. SmallNet: the compiled cases compile per tensor."""
    model = make_model(small=True)
    opt = info.make(model.named_parameters(), impl=impl, resolution=policy, spike_factor=None)
    train_steps(model, opt, 2)
    gen = torch.Generator().manual_seed(0)
    for sign in (-1.0, 1.0, -1.0, 1.0):
        opt.zero_grad()
        loss_fn(model, make_batch(3)).backward()
        for p in model.parameters():
            p.grad.copy_(sign * 3e38 * (1 + 0.1 * torch.rand(p.shape, generator=gen)))
        opt.step()
        assert all_finite(model, opt)
    assert opt.metrics()["resolution/events_moment"] >= 1
    assert opt.metrics()["resolution/inf_moment"] > 0


NO_NS5 = [("normuon",), ("mona", "normuon"), ("sf",), ()]


def _huge_direction_run(impl, comps, policy, steps=4):
    """Fusion without NS5 on a bucket of two (4, 6) matrices and a (6, 4) one, every gradient ±2^70 (about
    1.2e21) with a fixed sign pattern: the momentum is finite (≥ 5.9e19) and every square of it is past fp32's
    maximum. Weight decay 0, so only the direction moves the parameters."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s)) for s in [(4, 6), (4, 6), (6, 4)]]
    signs = [torch.sign(torch.randn(p.shape)) for p in ps]
    opt = no.Fusion([{"params": ps, "path": "spectral"}], components=comps, impl=impl, resolution=policy,
                    lr=0.02, weight_decay=0.0, spike_factor=None)
    first = None
    for t in range(steps):
        before = [p.detach().clone() for p in ps]
        for p, s in zip(ps, signs):
            p.grad = 2.0 ** 70 * s
        opt.step()
        if t == 0:
            first = [p.detach() - b for p, b in zip(ps, before)]
    return ps, signs, opt, first


@pytest.mark.parametrize("policy", ["repair", "skip"])
@pytest.mark.parametrize("comps", NO_NS5, ids=["-".join(c) or "none" for c in NO_NS5])
@pytest.mark.parametrize("impl", ["loop", "foreach", "compiled", "fused"])
def test_finite_direction_whose_squares_overflow_still_steps(impl, comps, policy):
    """Without NS5 the direction is the momentum itself, and a finite momentum of ~1e20 has squares past
    fp32's maximum. ‖Ô‖_F came out +Inf, the RMS-matching factor 0 and the update silently 0; NorMuon's row
    moment overflowed to +Inf with a finite gradient row, the division used it (1/(√Inf + ε) = 0) and the
    repair kept the old v without a count. Now the step is the RMS-0.2 direction against the gradient's sign,
    every state stays finite, each overflowing NorMuon row keeps its moment and counts one Inf at the
    "moment" stage, and the counts are the loop's in every implementation."""
    ps, signs, opt, first = _huge_direction_run(impl, comps, policy)
    for p, s, d in zip(ps, signs, first):
        assert torch.isfinite(p).all()
        assert torch.equal(torch.sign(d), -s)  # every entry moved, against the gradient
        if "sf" not in comps:  # the first step: lr·U, U of RMS 0.2 (uniform: ±0.2 everywhere)
            torch.testing.assert_close(d, -0.02 * 0.2 * s, rtol=1e-3, atol=0)
    assert all(torch.isfinite(t).all() for p in ps for t in opt.state[p].values()
               if isinstance(t, torch.Tensor) and t.is_floating_point())
    metrics = opt.metrics()
    rows = 4 + 4 + 6 if "normuon" in comps else 0  # every row of every matrix overflows, every step
    assert metrics["resolution/inf_moment"] == 4 * rows
    assert metrics["resolution/events_direction"] == metrics["resolution/events_update"] == 0
    if "normuon" in comps:
        assert {e.stage for e in opt.events} == {"moment"}
        assert all(torch.equal(opt.state[p]["normuon_row_sq"], torch.zeros(p.shape[0])) for p in ps)  # kept
    if impl != "loop":
        ref_ps, _, ref_opt, _ = _huge_direction_run("loop", comps, policy)
        assert_params_and_state_close(ref_ps, ref_opt, ps, opt)
        assert_resolution_matches(ref_opt, opt)


# compiled for one composition only: each other one compiles two more graphs (~5 s each on CI's cold cache)
# for the same ns5=False code
_CLEAN_NO_NS5 = [(impl, c) for impl in ("loop", "foreach") for c in NO_NS5] + [("compiled", ("normuon",))]


@pytest.mark.parametrize("impl,comps", _CLEAN_NO_NS5,
                         ids=[f"{impl}-{'-'.join(c) or 'none'}" for impl, c in _CLEAN_NO_NS5])
def test_clean_steps_without_ns5_identical_to_off(impl, comps):
    """The overflow handling of a direction without NS5 (the scaled norm, the row moment's gate) is
    arithmetic under every policy and a gate that selects nothing on a clean step: "repair" is "off" bit for
    bit there, as for the NS5 compositions (test_clean_steps_identical_to_off)."""
    runs = []
    for policy in ("repair", "off"):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s)) for s in [(4, 6), (4, 6), (6, 4)]]
        opt = no.Fusion([{"params": ps, "path": "spectral"}], components=comps, impl=impl, resolution=policy)
        gen = torch.Generator().manual_seed(1)
        for _ in range(5):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        runs.append((ps, opt))
    (a, oa), (b, ob) = runs
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        assert all(torch.equal(oa.state[p][k], ob.state[q][k]) for k in ob.state[q]
                   if isinstance(ob.state[q][k], torch.Tensor))
    assert oa.metrics()["resolution/events_total"] == 0.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("info, impl", OVERFLOW_CASES, ids=impl_ids(OVERFLOW_CASES))
def test_sixteen_bit_state_overflowing_as_stored_is_contained(info, impl, dtype):
    """16-bit parameters and state: g = ±3e4 (fp16) makes (1-β₂)·g² ≈ 9e5, and ±3e38 (bf16) overflows
    m's lerp: values that only become Inf when stored. The compiled graphs hold them in fp32 and used to
    write Inf into exp_avg_sq (fp16 AdamW, SFAdamW, and the scalar part of every Fusion optimizer)."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(16, 8).to(dtype)), torch.nn.Parameter(torch.randn(8).to(dtype))]
    opt = info.make(ps, impl=impl, spike_factor=None)
    big = 3e4 if dtype == torch.float16 else 3e38
    for step in range(4):
        for p in ps:
            g = torch.randn(p.shape).to(dtype)
            g.view(-1)[3] = big * (-1) ** step
            p.grad = g
        opt.step()
        assert all(torch.isfinite(p).all() for p in ps)
        assert all(torch.isfinite(t).all() for p in ps for t in opt.state[p].values()
                   if isinstance(t, torch.Tensor) and t.is_floating_point())
    assert opt.metrics()["resolution/inf_moment"] > 0


STEP_SIZE_CASES = impl_cases(("loop", "foreach"))  # and the "-fused" infos: every native and SIMD loop


def _bad_step_size_run(info, impl, policy, value):
    """Two clean steps, two with the tensor lr filled with ``value`` (NaN or +Inf: a scheduler that computed
    one), one with a finite lr again."""
    model = make_model()
    lr = torch.tensor(1e-2)
    opt = info.make(model.named_parameters(), lr=lr, impl=impl, resolution=policy)
    train_steps(model, opt, 2)
    lr.fill_(value)
    train_steps(model, opt, 2, seed=1)
    assert all_finite(model, opt)
    lr.fill_(1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    train_steps(model, opt, 1, seed=2)
    return model, opt, before


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("policy", ["repair", "skip"])
@pytest.mark.parametrize("info, impl", STEP_SIZE_CASES, ids=impl_ids(STEP_SIZE_CASES))
def test_nonfinite_step_size_is_contained(info, impl, policy, value):
    """A step size that is NaN or +Inf makes every new parameter non-finite from finite inputs: the last-line
    update guard keeps each parameter (and z) and the update stage counts every entry, in every
    implementation as in the loop; the run goes on once the lr is finite again. The AVX2 (SF-)AdamW loop's
    early test bounded the inputs only and stored the NaN parameters until 2026-11-27 (native/scalar_entry.h,
    finite_hyper_; tests/test_native_simd.py compares that build with the portable one on this run)."""
    model, opt, before = _bad_step_size_run(info, impl, policy, value)
    assert all_finite(model, opt)
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))  # stepping again
    metrics = opt.metrics()
    params = sum(1 for _ in model.parameters())
    assert metrics["resolution/events_update"] == 2 * params  # two bad steps, every parameter
    assert metrics["resolution/events_total"] == metrics["resolution/events_update"]  # nothing else (no grad)
    if impl != "loop":
        ref_model, ref_opt, _ = _bad_step_size_run(info, "loop", policy, value)
        assert_params_and_state_close(list(ref_model.parameters()), ref_opt, list(model.parameters()), opt)
        assert_resolution_matches(ref_opt, opt)
