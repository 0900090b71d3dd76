"""The finite-spike guard: rescales a gradient whose norm jumps above spike_factor × its running mean."""
from __future__ import annotations

import copy
import math

import pytest
import torch

import nonans_optim as no
from nonans_optim.functional.spike import spike_guard
from optim_infos import loss_fn, make_batch, make_model, state_tensors, train_steps


def test_guard_rescales_only_spikes_and_follows_a_regime_change():
    g = [torch.ones(4), torch.ones(3)]
    ema = torch.tensor([0.0, 1.0])
    out, new_ema, trig = spike_guard(g, ema, 10.0)
    assert torch.equal(out[0], g[0]) and new_ema[0] == 2.0  # first norm seeds
    big = [torch.full((4,), 100.0), torch.full((3,), 1e6)]
    out, new_ema2, trig = spike_guard(big, new_ema, 10.0)
    assert trig.tolist() == [True, True]
    cap = 10.0 * new_ema[1]
    torch.testing.assert_close(torch.linalg.vector_norm(out[1]), cap)
    torch.testing.assert_close(new_ema2[1], 0.9 * new_ema[1] + 0.1 * cap)  # the EMA takes the cap, not the spike
    ema = new_ema2
    for _ in range(12):  # a lasting 100x regime change is followed within a few steps
        out, ema, trig = spike_guard([torch.ones(4), torch.full((3,), 100.0)], ema, 10.0)
    assert not trig[1]


def test_guard_is_nan_safe():
    ema = torch.tensor([1.0, 1.0])
    g = [torch.tensor([float("nan"), 1.0]), torch.tensor([float("inf"), 1.0])]
    out, new_ema, trig = spike_guard(g, ema, 10.0)
    assert not trig.any() and torch.equal(new_ema, ema)
    assert torch.isnan(out[0][0]) and torch.isinf(out[1][0])  # left to the resolution gate


def test_guard_trigger_is_strictly_above_the_cap_and_its_scale_is_never_zero():
    """Two edges of functional/spike.py: a norm exactly k·ema is not a spike (‖g‖ > k·ema triggers), and
    the scale is at least the smallest fp32 subnormal, so a cap/‖g‖ that underflows fp32 (cap 1e-29 against
    a 1e30 entry) still leaves a capped +Inf entry +Inf rather than Inf·0 = NaN — the gate's NaN/Inf counts
    must not depend on the guard."""
    out, new_ema, trig = spike_guard([torch.tensor([6.0, 8.0])], torch.tensor([1.0]), 10.0)
    assert not trig[0] and torch.equal(out[0], torch.tensor([6.0, 8.0]))
    torch.testing.assert_close(new_ema, torch.tensor([1.9]))  # 0.9·1 + 0.1·10: the norm itself
    out, new_ema, trig = spike_guard([torch.tensor([1e30, float("inf")])], torch.tensor([1e-30]), 10.0)
    assert trig[0] and torch.equal(new_ema, torch.tensor([1e-30]))  # an incomplete gradient: EMA untouched
    assert out[0][1].item() == float("inf") and 0 < out[0][0].item() < 1e-14


@pytest.mark.parametrize("cls", [no.AdamW, no.SFNorMuon, no.SFAdamW])
def test_spike_does_not_poison_the_moments(cls):
    def run(factor):
        model = make_model()
        opt = cls(model.named_parameters(), lr=1e-2, spike_factor=factor)
        train_steps(model, opt, 5)
        opt.zero_grad()
        loss_fn(model, make_batch(9)).backward()
        model.fc2.bias.grad.mul_(1e6)
        raw = model.fc2.bias.grad.clone()
        opt.step()
        assert torch.equal(model.fc2.bias.grad, raw), "p.grad must never be mutated"
        return opt, model

    guarded, model = run(10.0)
    plain, _ = run(None)
    v_guarded = guarded.state[model.fc2.bias]["exp_avg_sq"].max()
    v_plain = [st["exp_avg_sq"].max() for p, st in plain.state.items()
               if isinstance(p, torch.Tensor) and p.shape == model.fc2.bias.shape and "exp_avg_sq" in st]
    assert v_guarded * 1e6 < max(v_plain)
    events = [e for e in guarded.events if e.stage == "spike"]
    assert [e.param for e in events] == ["fc2.bias"]
    assert all(torch.isfinite(t).all() for t in state_tensors(guarded).values() if t.is_floating_point())


def test_guard_state_survives_state_dict_and_clean_run_is_unchanged():
    models = [make_model() for _ in range(2)]
    opts = [no.AdamW(models[0].named_parameters(), spike_factor=50.0),
            no.AdamW(models[1].named_parameters())]
    for m, o in zip(models, opts):
        train_steps(m, o, 10)
    assert opts[0].metrics()["resolution/events_spike"] == 0.0
    for a, b in zip(*(m.parameters() for m in models)):
        assert torch.equal(a, b)
    clone = no.AdamW(make_model(seed=3).named_parameters(), spike_factor=50.0)
    clone.load_state_dict(copy.deepcopy(opts[0].state_dict()))
    assert torch.equal(clone._get_resolution().tensors["grad_norm_ema"],
                       opts[0]._get_resolution().tensors["grad_norm_ema"])
    assert (opts[0]._get_resolution().tensors["grad_norm_ema"] > 0).all()


def test_bad_spike_factor_is_named():
    with pytest.raises(ValueError, match="spike_factor"):
        no.AdamW(make_model().parameters(), spike_factor=0.5)


@pytest.mark.parametrize("cls,default", [(no.AdamW, None), (no.SFAdamW, None), (no.SFNorMuon, 10.0),
                                         (no.FullFusion, 10.0), (no.Muon, 10.0)])
def test_guard_default_by_path(cls, default):
    """On by default where the step computes the norm anyway (the spectral optimizers); opt-in on the
    AdamW family, where it is an extra read of every gradient (functional/spike.py, RESULTS "overhead")."""
    assert cls(make_model().named_parameters()).spike_factor == default


def test_default_adamw_is_torch_adamw_through_a_finite_spike():
    """The AdamW default is the drop-in: a finite spike goes through as torch.optim.AdamW takes it, while
    the opt-in guard (spike_factor=10) rescales it — the check that the default really is unguarded."""
    def spike(step, model):
        if step == 6:
            model.fc1.weight.grad.mul_(1e4)

    models = [make_model() for _ in range(3)]
    opts = [no.AdamW(models[0].parameters(), lr=1e-2, weight_decay=0.1),
            torch.optim.AdamW(models[1].parameters(), lr=1e-2, weight_decay=0.1),
            no.AdamW(models[2].parameters(), lr=1e-2, weight_decay=0.1, spike_factor=10.0)]
    for m, o in zip(models, opts):
        train_steps(m, o, 8, inject=spike)
    ours, ref, guarded = (m.fc1.weight for m in models)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(guarded, ref, rtol=1e-3, atol=1e-4)
    assert opts[0].metrics()["resolution/events_total"] == 0.0
    assert opts[2].metrics()["resolution/events_spike"] > 0


FLT_MAX = torch.finfo(torch.float32).max


@pytest.mark.parametrize("grad", [[1e29], [1e20, -1e20, 3.0], [3e38, -3e38]],
                         ids=["one-entry", "squares-overflow", "norm-above-fp32"])
def test_guard_sees_spikes_whose_squares_overflow_fp32(grad):
    """A finite gradient whose fp32 sum of squares overflows is the largest kind of finite spike, not a
    non-finite one: the guard triggers (scale cap/‖g‖, the EMA takes the cap). With an fp32 norm it saw
    "not finite", never triggered, and the raw gradient reached the moments."""
    g = torch.tensor(grad)
    exact = math.sqrt(sum(x * x for x in g.double().tolist()))
    out, new_ema, trig = spike_guard([g], torch.tensor([2.0]), 10.0)
    assert trig.tolist() == [True]
    assert torch.isfinite(out[0]).all()
    assert torch.linalg.vector_norm(out[0].double()).item() == pytest.approx(20.0, rel=1e-6)
    assert new_ema.item() == pytest.approx(0.9 * 2.0 + 0.1 * 20.0, rel=1e-6)
    _, seeded, trig = spike_guard([g], torch.zeros(1), 10.0)  # not seeded yet: the first norm seeds ...
    assert not trig.any()
    assert seeded.item() == (pytest.approx(exact, rel=1e-6) if exact <= FLT_MAX else 0.0)  # ... if fp32 holds it


GUARDED = [(no.AdamW, {"spike_factor": 10.0}), (no.SFAdamW, {"spike_factor": 10.0}), (no.SFNorMuon, {})]


@pytest.mark.parametrize("impl", ["loop", "foreach", "compiled", "fused"])
@pytest.mark.parametrize("cls, kw", GUARDED, ids=[c.__name__ for c, _ in GUARDED])
def test_every_impl_guards_a_spike_too_large_for_fp32_squares(cls, kw, impl):
    """The same spike scaled by 1e6 (fp32 squares fine) and by 1e22 (they overflow) is the same direction,
    so once the guard rescales it to its cap the two runs must agree — in every implementation (the native
    loops sum such a chunk again in double; Triton's stats and the torch paths take float64 norms)."""
    def run(mult):
        model = make_model(small=True)  # TinyNet's fc1 and fc2 in fewer tensors: the compiled case compiles less
        opt = cls(model.named_parameters(), lr=1e-2, impl=impl, **kw)

        def spike(step, m):
            if step == 4:
                m.fc2.bias.grad.mul_(mult)
                m.fc1.weight.grad.mul_(mult)  # a hidden matrix: the spectral path's guard for SFNorMuon

        train_steps(model, opt, 6, inject=spike)
        return model, opt

    (small, small_opt), (big, big_opt) = run(1e6), run(1e22)
    for name in ("fc1.weight", "fc2.bias"):
        assert [(e.step, e.stage) for e in big_opt.events if e.param == name] == [(5, "spike")], name
    assert [(e.step, e.param, e.stage) for e in big_opt.events] == [(e.step, e.param, e.stage)
                                                                    for e in small_opt.events]
    for a, b in zip(small.parameters(), big.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", ["loop", "foreach", "compiled", "fused"])
@pytest.mark.parametrize("cls, kw", GUARDED, ids=[c.__name__ for c, _ in GUARDED])
def test_every_impl_guards_a_spike_beside_a_nan(cls, kw, impl):
    """The fp16-overflow pattern: a NaN beside a huge finite entry in one gradient. The guard's norm used
    to be over every entry, so the NaN made it non-finite and the guard stood down: the 1e30 entry reached
    the moments (exp_avg 9e28, the weight 5e26 in the audit's repro). The norm is now of the finite
    entries: the spike is capped, the NaN is repaired as a missing observation, and the EMA (which only
    complete gradients update) is what it was. SmallNet: see the test above."""
    model = make_model(small=True)
    opt = cls(model.named_parameters(), lr=1e-2, impl=impl, **kw)

    def spike(step, m):
        if step == 4:
            for g in (m.fc2.bias.grad, m.fc1.weight.grad):
                g.view(-1)[0] = float("nan")
                g.view(-1)[1] = 1e30

    train_steps(model, opt, 4)
    ema = opt._global()["resolution"]["grad_norm_ema"].clone()
    before = [p.detach().clone() for p in model.parameters()]
    train_steps(model, opt, 1, seed=4, inject=lambda step, m: spike(4, m))
    stages = {(e.param, e.stage) for e in opt.events if e.step == 5}
    assert {("fc1.weight", "spike"), ("fc2.bias", "spike"), ("fc1.weight", "grad"), ("fc2.bias", "grad")} <= stages
    names = [n for n, _ in model.named_parameters()]
    for n in ("fc1.weight", "fc2.bias"):
        i = names.index(n)
        assert opt._global()["resolution"]["grad_norm_ema"][i] == ema[i], n
    for p, q in zip(before, model.parameters()):
        assert torch.isfinite(q).all() and (q - p).abs().max() < 0.1
    for p in model.parameters():
        for v in opt.state[p].values():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                assert v.abs().max() < 1e6


@pytest.mark.parametrize("impl", ["loop", "foreach", "compiled", "fused"])
@pytest.mark.parametrize("cls, kw", GUARDED, ids=[c.__name__ for c, _ in GUARDED])
def test_every_impl_ignores_all_zero_gradients_in_the_guard(cls, kw, impl):
    """An MoE expert or layer that gets all-zero gradients for a while (zero_grad(set_to_none=False)) and
    then ordinary ones again: no spike. The zeros used to enter the norm EMA, which decayed by 0.9 per step,
    so after 100 of them an ordinary gradient was a "spike" at factor 10 — 26 spikes and the step size
    escalated to 2^-9 in an audit's run (2026-11-26); None gradients over the same stretch gave none."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 6))
    opt = cls([w], lr=1e-2, impl=impl, **kw)
    gen = torch.Generator().manual_seed(1)
    for step in range(60):
        w.grad = torch.zeros(8, 6) if 10 <= step < 50 else torch.randn(8, 6, generator=gen)
        opt.step()
    assert opt.metrics()["resolution/events_total"] == 0.0
    assert opt._global()["resolution"]["grad_norm_ema"].item() > 1.0  # still the ordinary norm (~6.9)
