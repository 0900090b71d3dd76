"""impl="compiled" (optimizers/_compiled_spectral.py) and impl="fused" (optimizers/_fused_spectral.py, the
native loops, with KL-Shampoo between them) on the spectral path against impl="loop", under every policy.
KL-Shampoo groups are not compiled: under impl="compiled" they run foreach, which is compared with the loop
here too. "skip" runs the "repair" graphs between a snapshot and a whole-tensor restore.

NS5 runs in fp32 here: in bf16 a last-bit difference of the normalised input (the compiled graph divides by
max|M|, ns5() by the nearest power of two) can flip a bf16 rounding and the two paths then differ at bf16
resolution (~1e-3), which would hide a real bug behind a loose tolerance. Faults are injected on steps 1-3
(partial NaN/Inf, a whole tensor NaN, a whole tensor -Inf on a parameter with a recent event: the hold rule).
"""
from __future__ import annotations

import warnings

import pytest
import torch

import nonans_optim as no
from nonans_optim.optimizers import _compiled
from optim_infos import assert_params_and_state_close, assert_resolution_matches

pytestmark = pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile unavailable")


def _model():
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 12),
                               torch.nn.Linear(12, 4), torch.nn.Conv2d(4, 3, 2))


def _run(impl, cls, policy, *, inject=True, steps=5, device="cpu", **kw):
    torch.manual_seed(0)
    model = _model().to(device)
    opt = cls(no.param_groups(model), lr=1e-2, resolution=policy, impl=impl, ns5_dtype="fp32", **kw)
    gen = torch.Generator().manual_seed(1)
    ps = list(model.parameters())
    for t in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen).to(device)
        if inject and t == 1:
            ps[0].grad[0, 0], ps[2].grad[1, 2] = float("nan"), float("inf")
        if inject and t == 2:
            ps[4].grad[:] = float("nan")
        if inject and t in (2, 3) and "ns5" in kw.get("components", ("ns5",)):
            # finite; the momentum (and MONA's) lerp overflows on step 3. Without NS5 the direction would
            # carry the finite 3e38 entry itself, where the loop's and the graph's norms (fp32 vs fp64
            # sums of squares) differ by a few percent: contained either way, just not comparable.
            ps[2].grad[0, 1] = -3.3e38 if t == 2 else 3.3e38
        if inject and t == 3:
            ps[0].grad[:] = float("-inf")
        opt.param_groups[0]["lr"] = 1e-2 / (t + 1)  # a schedule: must not recompile
        opt.set_loss(torch.tensor(1.0 + t, device=device))
        opt.step()
    return ps, opt


CASES = [(no.SFNorMuon, {}), (no.Muon, {}),
         (no.Fusion, {"components": ("ns5", "mona", "normuon", "sf")}),
         (no.Fusion, {"components": ("mona", "normuon")}),
         (no.FullFusion, {}), (no.Fusion, {"components": ("ns5", "shampoo")})]
IDS = ["SFNorMuon", "Muon", "Fusion-mona", "Fusion-no-ns5", "FullFusion", "Fusion-shampoo"]


@pytest.mark.parametrize("impl", ["compiled", "fused"])
@pytest.mark.parametrize("policy", ["repair", "skip", "off"])
@pytest.mark.parametrize("cls,kw", CASES, ids=IDS)
def test_compiled_spectral_matches_loop(cls, kw, policy, impl):
    inject = policy != "off"  # under "off" a fault makes both NaN, which would compare nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a silent fallback would fail here
        ref, ref_opt = _run("loop", cls, policy, inject=inject, **kw)
        got, got_opt = _run(impl, cls, policy, inject=inject, **kw)
    assert _compiled.compile_available()
    assert all(torch.isfinite(q).all() for q in got)
    assert_params_and_state_close(ref, ref_opt, got, got_opt)
    if policy == "off":
        return
    assert_resolution_matches(ref_opt, got_opt, ema_rtol=1e-6)
    assert got_opt._global()["resolution"]["counts"].sum() > 0


@pytest.mark.parametrize("impl", ["compiled", "fused"])
def test_compiled_spectral_bf16_close_to_loop(impl):
    """At the default hot dtype the paths agree to bf16 resolution."""
    ref, _ = _run("loop", no.SFNorMuon, "repair", inject=False)
    got, _ = _run(impl, no.SFNorMuon, "repair", inject=False)
    for p, q in zip(ref, got):
        torch.testing.assert_close(q, p, rtol=2e-2, atol=1e-3)


def test_shampoo_groups_run_foreach():
    """KL-Shampoo is not compiled on the spectral path: the result is foreach's (the scalar path of the
    same optimizer still runs compiled, so compare within float tolerance)."""
    ref, ref_opt = _run("foreach", no.FullFusion, "repair")
    got, got_opt = _run("compiled", no.FullFusion, "repair")
    for p, q in zip(ref, got):
        assert torch.isfinite(q).all()
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    assert torch.equal(got_opt._global()["resolution"]["counts"],
                       ref_opt._global()["resolution"]["counts"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_clean_skip_steps_equal_repair_and_off_to_rounding(dtype):
    """On clean steps "skip" leaves exactly what "repair" leaves (the same graphs; its restore selects
    nothing), at the default bf16 NS5 and on bf16 parameters. "skip" ran foreach until 2026-11-26, whose NS5
    normalisation differs from the graphs' in the last bit: 0.016 from "off" on a bf16 parameter in three
    steps. Against "off" the compiled path is equal to rounding only, not bit for bit: inductor may
    vectorise a norm's reduction in one graph and not in the other (a 4096x3 matrix: the "off" graph sums
    the NorMuon-weighted norm in one scalar loop, the gated one in 16 lanes), so the sums differ in the
    last bit (README, impl="compiled")."""
    runs = {}
    for policy in ("off", "skip", "repair"):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in [(8, 6), (6, 6), (8, 6), (300, 3)]]
        opt = no.SFNorMuon([{"params": ps, "path": "spectral"}], lr=2e-2, impl="compiled", resolution=policy)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen).to(dtype)
            opt.step()
        runs[policy] = (ps, opt)
    keys = ("momentum_buffer", "z", "normuon_row_sq")
    (ps_r, opt_r), (ps_s, opt_s), (ps_o, _) = runs["repair"], runs["skip"], runs["off"]
    for p, q in zip(ps_s, ps_r):
        assert torch.equal(p, q)
        assert all(torch.equal(opt_s.state[p][k], opt_r.state[q][k]) for k in keys)
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype is torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    for p, q in zip(ps_o, ps_r):
        torch.testing.assert_close(q, p, **tol)
    assert opt_s.metrics()["resolution/events_total"] == opt_r.metrics()["resolution/events_total"] == 0.0


def test_steps_and_lr_schedule_do_not_recompile():
    """Every per-step number (lr, schedule-free c, MONA's first-step flag) is a tensor input: eight steps
    with a changing lr add no graphs beyond the pre, post and scalar ones (fewer when an earlier test in
    this process already compiled them)."""
    torch._dynamo.utils.counters.clear()
    _run("compiled", no.Fusion, "repair", steps=8, components=("ns5", "mona", "normuon", "sf"))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 3
