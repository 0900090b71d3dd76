"""The loop ground truth pinned to independent facts. The fast paths (foreach, compiled, native, Triton) are
tested against impl="loop"; these tests pin the loop's own arithmetic (nonans_optim/functional) to
hand-derived values and the published recurrences, and the presets to their documented components and
defaults, so a slip there cannot be copied into every fast path's oracle unnoticed."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import nonans_optim as no
from optim_infos import make_model, train_steps


def test_sfadamw_loop_follows_the_schedule_free_recurrence():
    """SFAdamW (impl="loop") against the explicit three-sequence form of Schedule-Free AdamW, in fp64
    (functional/schedule_free.py's docstring): z ← z - γ d with d = g/(sqrt(v/(1-β₂ᵗ)) + ε) + λ z (decay at z,
    no first moment, no bias correction of g), x ← (1-c) x + c z with c_t = 1/t at a constant lr, and the
    parameter holding y = (1-β) z + β x; eval() gives x. The reference keeps x explicitly, so it pins the
    memory-efficient y update lerp(y, z, c) + γ(β(1-c) - 1) d that the implementation derives from it."""
    lr, (b1, b2), eps, wd = 0.05, (0.8, 0.99), 1e-3, 0.3
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(6, dtype=torch.float64, generator=gen)
    p = nn.Parameter(p0.clone())
    opt = no.SFAdamW([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, impl="loop")
    x, z, v = p0.clone(), p0.clone(), torch.zeros_like(p0)
    for t in range(1, 6):
        g = p.detach() - 1.0 + torch.randn(6, dtype=torch.float64, generator=gen)  # taken at y
        p.grad = g.clone()
        opt.step()
        v = b2 * v + (1 - b2) * g * g
        d = g / ((v / (1 - b2 ** t)).sqrt() + eps) + wd * z
        z = z - lr * d
        x = (1 - 1 / t) * x + (1 / t) * z
        torch.testing.assert_close(opt.state[p]["z"], z, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(p.detach(), (1 - b1) * z + b1 * x, rtol=1e-12, atol=1e-12)
    opt.eval()
    torch.testing.assert_close(p.detach(), x, rtol=1e-12, atol=1e-12)


def test_spectral_momentum_is_muons_nesterov_lerp():
    """functional.momentum_ against KellerJordan/Muon's muon_update by hand: B ← μB + (1-μ)G, and with
    Nesterov M = (1-μ)G + μB (B = 1, G = 3, μ = 0.9: B = 1.2, M = 0.3 + 1.08 = 1.38); without it M = B.
    The same with the resolution gate on (every entry finite: the stock arithmetic)."""
    from nonans_optim.functional.momentum import momentum_
    for ok in (None, torch.tensor([True, True])):
        for nesterov, want in ((True, 1.38), (False, 1.2)):
            buf = torch.tensor([1.0, -2.0], dtype=torch.float64)
            M, _ = momentum_(torch.tensor([3.0, 4.0], dtype=torch.float64), buf, ok, mu=0.9, nesterov=nesterov)
            torch.testing.assert_close(buf, torch.tensor([1.2, -1.4], dtype=torch.float64))
            want2 = 0.1 * 4.0 + 0.9 * -1.4 if nesterov else -1.4
            torch.testing.assert_close(M, torch.tensor([want, want2], dtype=torch.float64))
    # A finite G that overflows the buffer's lerp (G - B = 3.6e38 > fp32 max) is a missing observation for
    # B: B keeps -3e37, the entry is marked, and the Nesterov input there is the old B (lerp(B, B, μ) = B),
    # so M stays finite; the clean entry is the stock arithmetic.
    buf = torch.tensor([-3e37, 1.0])
    M, overflow = momentum_(torch.tensor([3.3e38, 3.0]), buf, torch.tensor([True, True]), mu=0.9, nesterov=True)
    assert overflow.tolist() == [True, False]
    torch.testing.assert_close(buf, torch.tensor([-3e37, 1.2]), rtol=0, atol=1e-6)  # -3e37 exactly
    torch.testing.assert_close(M, torch.tensor([-3e37, 1.38]), rtol=0, atol=1e-6)


def test_mona_starts_without_a_kick_and_averages_the_gradient_difference():
    """functional.mona_ by hand (functional/momentum.py's docstring): G_prev starts as the first gradient, so
    step 1 returns G₁ exactly (FusionOpt's zero start would add α(1-β)G₁); then D = G - G_prev,
    A ← βA + (1-β)D and G̃ = G + αA. α = 0.5, β = 0.75: G₂ - G₁ = 4 gives A = 1, G̃₂ = 11 + 0.5 = 11.5;
    G₃ - G₂ = -8 gives A = 0.75 - 2 = -1.25, G̃₃ = 3 - 0.625 = 2.375."""
    from nonans_optim.functional.momentum import mona_
    for ok in (None, torch.tensor([True])):
        prev, avg = torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
        got = []
        for t, g in enumerate((7.0, 11.0, 3.0)):
            G, overflow = mona_(torch.tensor([g], dtype=torch.float64), prev, avg, ok, alpha=0.5, beta=0.75,
                                first=t == 0)
            got.append((G.item(), avg.item(), prev.item()))
            assert overflow is None if ok is None else not overflow.any()
        assert got == [(7.0, 0.0, 7.0), (11.5, 1.0, 11.0), (2.375, -1.25, 3.0)]
    # A finite G whose difference overflows (3e38 - (-3e38)): A keeps its value and the entry is marked, but
    # G was observed, so G_prev takes it (only a non-finite G is a missing observation for G_prev).
    prev, avg = torch.tensor([-3e38, 1.0]), torch.tensor([0.5, 0.5])
    G, overflow = mona_(torch.tensor([3e38, 2.0]), prev, avg, torch.tensor([True, True]), alpha=0.5, beta=0.75,
                        first=False)
    assert overflow.tolist() == [True, False]
    assert torch.equal(avg, torch.tensor([0.5, 0.625]))  # 0.75·0.5 + 0.25·(2 - 1)
    assert torch.equal(prev, torch.tensor([3e38, 2.0]))


def test_normuon_is_the_papers_row_normalisation_then_rms_0_2():
    """functional.normuon against NorMuon (arXiv 2510.05491, Alg. 1) written out in fp64: v ← β₂v +
    (1-β₂)·mean over columns of O² (one entry per row, i.e. output neuron), Ô = O / (sqrt(v) + ε) with v
    broadcast along each row, update = 0.2·sqrt(mn)·Ô/‖Ô‖_F. A square O (rows and columns alike in shape)
    so that a column-wise slip cannot hide behind a shape error, a large ε so that its place shows, and
    rows of very different scale so that the row normalisation does."""
    from nonans_optim.functional.normuon import normuon
    O = torch.tensor([[3.0, 4.0, 0.0], [0.1, -0.2, 0.3], [-6.0, 1.0, 2.0]])
    v = torch.tensor([0.5, 0.01, 2.0])
    beta2, eps = 0.9, 0.05
    U, v_new, _ = normuon(O, v, None, beta2=beta2, eps=eps)
    O64, v64 = O.double(), v.double()
    want_v = beta2 * v64 + (1 - beta2) * (O64 ** 2).mean(dim=1)
    O_hat = O64 / (want_v.sqrt()[:, None] + eps)
    want_U = 0.2 * 3.0 * O_hat / O_hat.norm()
    torch.testing.assert_close(v_new.double(), want_v, rtol=1e-6, atol=0)
    torch.testing.assert_close(U.double(), want_U, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(U.double().square().mean().sqrt(), torch.tensor(0.2, dtype=torch.float64))
    # the resolution gate: a row that saw a non-finite gradient keeps its moment, the others update
    U2, v_gated, _ = normuon(O, v, torch.tensor([True, False, True]), beta2=beta2, eps=eps)
    torch.testing.assert_close(v_gated.double(), torch.where(torch.tensor([True, False, True]), want_v, v64),
                               rtol=1e-6, atol=0)


def test_rms_match_never_overflows_for_a_finite_direction():
    """RMS matching is scale invariant (U = 0.2·sqrt(mn)·Ô/‖Ô‖_F): a finite Ô of entries ~1e30 (squares past
    fp32's maximum; the fp32 norm used to come out +Inf and the update 0) gives RMS 0.2 and the same U as
    the same matrix scaled by 1e-30 (squares below fp32's smallest subnormal), and as the float64 formula."""
    from nonans_optim.functional.normuon import rms_match
    torch.manual_seed(0)
    A = torch.randn(2, 5, 7)  # a batch: each matrix matched on its own
    A[1] *= 1e3
    big, small = rms_match(A * 1e30), rms_match(A * 1e-30)
    want = (0.2 * 35 ** 0.5 * A.double() / torch.linalg.matrix_norm(A.double(), keepdim=True)).float()
    assert torch.isfinite(big).all()
    torch.testing.assert_close(big.square().mean((-2, -1)).sqrt(), torch.full((2,), 0.2))
    torch.testing.assert_close(big, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(small, big, rtol=1e-6, atol=0)
    assert torch.equal(rms_match(torch.zeros(3, 4)), torch.zeros(3, 4))  # zero stays zero


def test_normuon_row_whose_moment_overflows_keeps_it_and_divides_by_it():
    """Without NS5 (``bounded=False``) a finite row of O ~1e20 overflows mean_cols(O²). Under the gate that
    row keeps its previous v (missing observation), is reported, and Ô divides by the kept v — the +Inf made
    the row's direction 0 (1/(√Inf + ε)); a row that saw a bad gradient keeps v but is not an overflow. Off
    the gate ("off"): the stock arithmetic."""
    from nonans_optim.functional.normuon import normuon
    O = torch.tensor([[1e20, -2e20, 3e20], [0.1, -0.2, 0.3], [-6.0, 1.0, 2.0]])
    v = torch.tensor([4.0, 0.01, 2.0])
    beta2, eps = 0.9, 1e-8
    U, v_new, over = normuon(O, v, torch.tensor([True, True, False]), beta2=beta2, eps=eps, bounded=False)
    assert over.tolist() == [True, False, False]
    want_v = torch.tensor([4.0, 0.9 * 0.01 + 0.1 * (0.14 / 3), 2.0])
    torch.testing.assert_close(v_new, want_v)
    O_hat = O.double() / (want_v.double().sqrt()[:, None] + eps)
    torch.testing.assert_close(U.double(), 0.2 * 3.0 * O_hat / O_hat.norm(), rtol=1e-5, atol=1e-12)
    assert U[0].abs().min() > 0.1  # the overflowing row carries the direction
    U_off, v_off, none = normuon(O, v, None, beta2=beta2, eps=eps, bounded=False)  # "off": stock
    assert none is None and v_off[0] == float("inf") and torch.equal(U_off[0], torch.zeros(3))


def test_polyak_multiplier_by_hand():
    """functional.polyak.update_polyak against FusionOpt's rule by hand: L̄, Ḡ are EMAs (β = 0.98) seeded
    with the first value, the multiplier is clamp(L̄/Ḡ, 0.1, 10), a non-finite loss leaves L̄ alone (and is
    reported), 0/0 falls back to 1."""
    from nonans_optim.functional.polyak import init_polyak, update_polyak
    f = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    st = init_polyak(torch.device("cpu"))
    mult, bad = update_polyak(st, f(3.0), f(8.0), f(4.0))  # seeds: L̄ = 3, Ḡ = 8/4 = 2
    assert (mult.item(), bad.item(), st["loss_ema"].item(), st["gnorm_ema"].item()) == (1.5, False, 3.0, 2.0)
    mult, _ = update_polyak(st, f(53.0), f(52.0), f(1.0))  # L̄ = 0.98·3 + 0.02·53 = 4, Ḡ = 1.96 + 1.04 = 3
    torch.testing.assert_close(st["loss_ema"], f(4.0))
    torch.testing.assert_close(st["gnorm_ema"], f(3.0))
    torch.testing.assert_close(mult, f(4.0 / 3.0))
    mult, bad = update_polyak(st, f(float("nan")), f(3.0), f(1.0))  # L̄ kept, Ḡ = 3
    assert bad.item() and st["loss_ema"].item() == 4.0
    torch.testing.assert_close(mult, f(4.0 / 3.0))
    for loss, gsum, want in ((1e3, 1.0, 10.0), (1e-3, 1.0, 0.1), (0.0, 0.0, 1.0)):  # the clamp; 0/0 → 1
        st = init_polyak(torch.device("cpu"))
        mult, _ = update_polyak(st, f(loss), f(gsum), f(1.0))
        assert mult.item() == pytest.approx(want)
    st = init_polyak(torch.device("cpu"))
    mult, _ = update_polyak(st, None, f(1.0), f(1.0))  # no loss yet: multiplier 1
    assert mult.item() == 1.0


@pytest.mark.parametrize("impl", ["loop", "fused"])
def test_warmup_scales_step_t_by_t_over_warmup_steps(impl):
    """warmup_steps=W multiplies the lr of step t (counted from 1) by min(1, t/W): the first step already
    moves (by lr/W), step W is the first at the full lr. Pinned against torch's AdamW given that lr by
    hand, and the γ metrics() reports follows the same ramp (an off-by-one, 0 on step 1 or full lr a step
    early, would pass every test that runs without warmup)."""
    models = [make_model() for _ in range(2)]
    ours = no.AdamW(models[0].parameters(), lr=1e-2, weight_decay=0.1, warmup_steps=4, impl=impl)
    ref = torch.optim.AdamW(models[1].parameters(), lr=1e-2, weight_decay=0.1)
    for t in range(1, 7):
        ref.param_groups[0]["lr"] = 1e-2 * min(1.0, t / 4)
        for m, o in zip(models, (ours, ref)):
            train_steps(m, o, 1, seed=t)
        for a, b in zip(*(m.parameters() for m in models)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    model = make_model()
    fusion = no.FullFusion(model.parameters(), lr=1e-2, warmup_steps=4, impl="foreach")
    assert fusion.metrics()["fusion/gamma_curr"] == 0.0  # no step yet: warmup's factor at t = 0 (was: the full lr)
    plain = no.FullFusion(make_model().parameters(), lr=1e-2)
    assert plain.metrics()["fusion/gamma_curr"] == pytest.approx(1e-2, rel=1e-7)  # (γ is rounded to fp32)
    for t in range(1, 6):
        train_steps(model, fusion, 1, seed=t)
        m = fusion.metrics()  # γ = Polyak multiplier · lr · warmup (an fp32 product on the device)
        assert m["fusion/gamma_curr"] == pytest.approx(m["fusion/gamma_mult"] * 1e-2 * min(1.0, t / 4), rel=1e-6)


def test_gamma_curr_is_the_last_steps_under_a_scheduler():
    """With a scheduler stepped after step() (torch's order) the group's lr is already the next step's:
    gamma_curr reported that lr times the last multiplier (half the step actually taken under StepLR(0.5), an
    audit, 2026-11-26); it is the γ the last step took. After a load, before a step: the current lr again."""
    model = make_model()
    opt = no.SFNorMuon(model.parameters(), lr=1e-2, impl="foreach")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for t in range(1, 4):
        used = opt.param_groups[0]["lr"]
        train_steps(model, opt, 1, seed=t)  # (set_loss: the multiplier is not 1)
        sched.step()
        m = opt.metrics()
        assert m["fusion/gamma_mult"] != 1.0
        assert m["fusion/gamma_curr"] == pytest.approx(used * m["fusion/gamma_mult"], rel=1e-6)
    opt.load_state_dict(opt.state_dict())
    m = opt.metrics()
    assert m["fusion/gamma_curr"] == pytest.approx(opt.param_groups[0]["lr"] * m["fusion/gamma_mult"], rel=1e-6)


@pytest.mark.parametrize("cls,components,defaults,polyak", [
    (no.SFNorMuon, {"ns5", "normuon", "sf"}, dict(lr=1e-3, weight_decay=0.05, momentum=0.8), True),
    (no.FullFusion, {"ns5", "normuon", "sf", "mona", "shampoo"}, dict(lr=1e-3, weight_decay=0.05, momentum=0.8),
     True),
    (no.Muon, {"ns5"}, dict(lr=1e-3, weight_decay=0.01, momentum=0.95), False),
], ids=["SFNorMuon", "FullFusion", "Muon"])
def test_presets_are_the_documented_component_sets_and_defaults(cls, components, defaults, polyak):
    """Each preset is a named algorithm: a component dropped (FullFusion without KL-Shampoo, SFNorMuon
    without NorMuon) or a default changed still trains the generic suite's tiny model, so nothing else
    notices. Pins the components, the preset defaults (their docstrings give sources), the shared Fusion
    defaults, Polyak on/off and the schedule-free flag."""
    opt = cls(make_model().parameters())
    assert opt.components == frozenset(components)
    assert opt._schedule_free == ("sf" in components)
    assert opt._uses_polyak is polyak
    assert opt.spike_factor == 10.0
    shared = dict(nesterov=True, betas=(0.9, 0.999), eps=1e-8, sf_beta=0.9, normuon_beta2=0.95, normuon_eps=1e-8,
                  mona_alpha=0.1, mona_beta=0.9, shampoo_beta=0.95, shampoo_refresh_every=10, ns_steps=5,
                  ns5_dtype="auto", warmup_steps=0, momentum_dtype="auto", path=None)
    for key, want in {**shared, **defaults}.items():
        assert opt.defaults[key] == want, key
        assert opt.param_groups[0][key] == want, key
    assert ("sf_weight_sum" in opt.defaults) == ("sf" in components)
    assert no.Muon(make_model().parameters(), polyak=True)._uses_polyak  # the Muon default only


def test_fusion_defaults():
    """Fusion(components=...) itself: Muon's momentum 0.95 with Nesterov, weight decay 0.01, Polyak on."""
    opt = no.Fusion(make_model().parameters(), components=("ns5", "mona"))
    assert opt.components == frozenset({"ns5", "mona"}) and not opt._schedule_free and opt._uses_polyak
    assert (opt.defaults["momentum"], opt.defaults["nesterov"], opt.defaults["weight_decay"],
            opt.defaults["lr"], opt.spike_factor) == (0.95, True, 0.01, 1e-3, 10.0)


@pytest.mark.parametrize("impl", ["loop", "auto"])
@pytest.mark.parametrize("cls", [no.SFAdamW, no.SFNorMuon], ids=["SFAdamW", "SFNorMuon"])
def test_schedule_free_average_does_not_depend_on_the_grouping(cls, impl):
    """A parameter without gradients for a few steps, in a group of its own or sharing one: the same
    average x. A group's schedule-free weight sum advanced only on steps where one of its parameters had
    a gradient, so in its own group the weights of its later steps were larger — 0.083 apart from both the
    shared-group run and schedulefree's reference in an audit's run (2026-11-26); the reference adds every
    step's weight to a group's sum."""
    def run(shared: bool):
        torch.manual_seed(0)
        a, b = torch.nn.Parameter(torch.randn(4, 6)), torch.nn.Parameter(torch.randn(4, 6))
        groups = [{"params": [a, b]}] if shared else [{"params": [a]}, {"params": [b]}]
        opt = cls(groups, lr=1e-1, impl=impl)
        gen = torch.Generator().manual_seed(1)
        for t in range(12):
            a.grad = torch.randn(4, 6, generator=gen)
            b.grad = torch.randn(4, 6, generator=gen) if (t < 3 or t >= 8) else None
            opt.step()
        opt.eval()
        return b.detach().clone()
    torch.testing.assert_close(run(False), run(True), rtol=0, atol=1e-6)
