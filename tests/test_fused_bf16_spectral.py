"""impl="fused" on bf16 matrices in the native spectral loops (spectral_pre.c with MONA's buffers,
spectral_post.c), against the same oracle as tests/test_fused_bf16.py: an fp32 twin of the bf16 optimizer,
fed the widened gradient, whose results the bf16 step must write rounded once, bit for bit, with the same
events; where bf16 and fp32 part ways (a value finite in fp32, Inf once stored in bf16) impl="loop" in bf16
is the ground truth. Split from tests/test_fused_bf16.py, whose twin step and spectral helpers it imports.
"""
from __future__ import annotations

import pytest
import torch

import nonans_optim as no
from optim_infos import assert_resolution_matches, event_tuples
from test_fused_bf16 import BF16_MAX, SPECTRAL_SHAPES, _column_window_run, _spectral_grads, _step_against_twin
from test_fused_bf16 import pytestmark  # noqa: F401  (its skip: the native kernel unavailable)


def _mona_fusion(params, **kw):
    """FullFusion without KL-Shampoo: MONA, NorMuon and schedule-free around NS5."""
    return no.Fusion(params, components=("ns5", "mona", "normuon", "sf"), **kw)


@pytest.mark.parametrize("policy", ["repair", "skip", "off"])
@pytest.mark.parametrize("cls", [no.SFNorMuon, no.Muon, _mona_fusion], ids=["SFNorMuon", "Muon", "MONA"])
def test_bf16_spectral_step_is_the_fp32_step_rounded(cls, policy):
    """The spectral loops on bf16 matrices (SF-NorMuon, Muon, and MONA without KL-Shampoo, which reads the
    gradient in torch): each step writes what an fp32 twin's step on the widened values writes, rounded to
    bf16, bit for bit — the momentum buffer (bf16 in both: the hot dtype's), NorMuon's fp32 row moment, z,
    MONA's buffers (bf16: the parameter's dtype) — with the same events."""
    torch.manual_seed(0)
    params = [(0.1 * torch.randn(s)).bfloat16().requires_grad_() for s in SPECTRAL_SHAPES]
    kw = {"lr": 1e-2, "weight_decay": 0.1, "resolution": policy, "impl": "fused"}
    def make(ps):
        return cls([{"params": ps, "path": "spectral"}], **kw)

    opt = make(params)
    gen = torch.Generator().manual_seed(1)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for t in range(6):
            _step_against_twin(make, opt, params, _spectral_grads(t, gen), counters=policy != "off")
    finally:
        torch.set_num_threads(before)
    if policy != "off":
        assert all(torch.isfinite(p).all() for p in params)
        assert {"grad", "spike"} <= {e[2] for e in event_tuples(opt)}


@pytest.mark.parametrize("policy", ["repair", "skip"])
def test_bf16_fullfusion_follows_the_loop(policy):
    """FullFusion on bf16 matrices in the native loops, KL-Shampoo included (the loop's torch functions, fed
    the bf16 gradient as impl="loop" feeds them; so no fp32 twin is bit-exact here): through the spectral
    fault sequence, the same events as impl="loop" in bf16, finite parameters and state, and parameters
    within 2% of the loop's (the loop rounds every op to bf16; they differed by about 0.5% on 2026-11-27)."""
    runs = []
    for impl in ("loop", "fused"):
        torch.manual_seed(0)
        params = [(0.1 * torch.randn(s)).bfloat16().requires_grad_() for s in SPECTRAL_SHAPES]
        opt = no.FullFusion([{"params": params, "path": "spectral"}], lr=1e-2, weight_decay=0.1,
                            resolution=policy, impl=impl)
        gen = torch.Generator().manual_seed(1)
        for t in range(6):
            for p, g in zip(params, _spectral_grads(t, gen)):
                p.grad = g
            opt.step()
        runs.append((params, opt))
    (ref, ref_opt), (got, got_opt) = runs
    assert event_tuples(got_opt) == event_tuples(ref_opt) and {"grad", "spike"} <= {e[2] for e in
                                                                                     event_tuples(got_opt)}
    for p, q in zip(got, ref):
        assert all(torch.isfinite(v).all() for v in [p, *got_opt.state[p].values()] if torch.is_tensor(v))
        assert (p.float() - q.float()).norm() <= 2e-2 * q.float().norm()
        assert got_opt.state[p]["mona_diff_avg"].dtype == torch.bfloat16


@pytest.mark.parametrize("cls, p00", [(no.Muon, BF16_MAX), (no.SFNorMuon, 0.0)], ids=["Muon-y", "SFNorMuon-z"])
def test_one_value_in_the_bf16_window_fails_the_row_test(cls, p00):
    """The bf16 row test of spectral_post.c on one value alone: Muon's y, moved 1e36 outwards from bf16's
    largest value (into 3.3962e38 … 3.4028e38: finite in fp32, Inf in bf16, past 2^127 so its doubling
    overflows), and SF-NorMuon's z alone, with y = lerp(0, z, 0.5) + … staying just under 2^127. The entry is
    kept and counted as impl="loop" keeps and counts it."""
    def moved(sign: float, lr: float) -> float:
        q, opt = _column_window_run(cls, "fused", torch.float32, sign, lr, p00)
        return float(opt.state[q].get("z", q)[0, 0].detach()) - sign * BF16_MAX

    slope = moved(1.0, 1e35) / 1e35
    sign, lr = (1.0 if slope > 0 else -1.0), 1e36 / abs(slope)
    _, wide_opt = _column_window_run(cls, "fused", torch.float32, sign, lr, p00)
    assert not wide_opt.events
    ref, ref_opt = _column_window_run(cls, "loop", torch.bfloat16, sign, lr, p00)
    got, got_opt = _column_window_run(cls, "fused", torch.bfloat16, sign, lr, p00)
    assert [(e.stage, e.inf_count) for e in ref_opt.events] == [("update", 1)]
    assert_resolution_matches(ref_opt, got_opt)
    assert torch.isfinite(got).all() and all(torch.isfinite(v).all() for v in got_opt.state[got].values()
                                             if torch.is_tensor(v))
    assert float(got_opt.state[got].get("z", got)[0, 0]) == sign * BF16_MAX  # the value kept


def _mona_window_run(impl: str, comps: tuple[str, ...]):
    """MONA's average A driven into bf16's window by one entry, with nothing else there out of range: A and
    G_prev at ±bf16's largest value, β = 0 (the new A is G - G_prev = 1e36 + 3.3895e38, finite in fp32 and
    Inf in bf16), α = 0 and an old momentum buffer of -g with μ = 0.5, so that the entry's M is exactly 0:
    no square overflows, which is what else sends a row to the gated arithmetic (spectral_rows.h's row_msq_).
    With KL-Shampoo, pass 3 speculates the row and tests it (row_check_)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter((0.1 * torch.randn(16, 24)).bfloat16())
    opt = no.Fusion([{"params": [p], "path": "spectral"}], components=comps, momentum=0.5, nesterov=False,
                    impl=impl, mona_alpha=0.0, mona_beta=0.0, spike_factor=None)
    p.grad = torch.randn(16, 24).bfloat16()
    opt.step()
    g = torch.randn(16, 24).bfloat16()
    g[0, 0] = 1e36
    st = opt.state[p]
    with torch.no_grad():
        st["mona_diff_avg"][0, 0], st["mona_prev_grad"][0, 0] = BF16_MAX, -BF16_MAX
        st["momentum_buffer"][0, 0] = -g[0, 0]
    p.grad = g
    opt.step()
    return p, opt


@pytest.mark.parametrize("comps", [("ns5", "mona"), ("ns5", "mona", "shampoo")], ids=["MONA", "MONA+KL"])
def test_a_mona_average_that_is_inf_in_bf16_is_kept(comps):
    """A new MONA average finite in fp32 and Inf as stored in bf16 is a missing observation, as in the loop
    (which computes it in bf16): A keeps its value and the moment stage counts the entry (KL-Shampoo's
    factor, fed g = 1e36, also records a direction event: the same in both)."""
    runs = [_mona_window_run(impl, comps) for impl in ("loop", "fused")]
    for p, opt in runs:
        st = opt.state[p]
        assert st["mona_diff_avg"][0, 0] == BF16_MAX
        assert all(torch.isfinite(v).all() for v in st.values() if torch.is_tensor(v))
        assert ("moment", 0, 1) in [(e.stage, e.param, e.inf_count) for e in opt.events]
    assert event_tuples(runs[0][1]) == event_tuples(runs[1][1])


def _spectral_window_run(cls, impl: str, dtype, sign: float, lr: float):
    """One ordinary step (lr 1e-2), then entry [0, 0] (and z's) set to ``sign`` · bf16's largest value and
    one step of size ``lr``: the entry (z's, schedule-free) then moves by lr·d, d fixed by the first step."""
    torch.manual_seed(0)
    p = torch.nn.Parameter((0.1 * torch.randn(16, 24)).to(dtype))
    opt = cls([{"params": [p], "path": "spectral"}], lr=1e-2, weight_decay=0.0, impl=impl)
    p.grad = torch.randn(16, 24).to(dtype)
    opt.step()
    with torch.no_grad():
        p[0, 0] = sign * BF16_MAX
        if "z" in opt.state[p]:
            opt.state[p]["z"][0, 0] = p[0, 0]
    opt.param_groups[0]["lr"] = lr
    p.grad = torch.randn(16, 24).to(dtype)
    opt.step()
    return p, opt


@pytest.mark.parametrize("cls", [no.SFNorMuon, no.Muon], ids=["SFNorMuon", "Muon"])
def test_bf16_spectral_update_that_is_inf_in_bf16_follows_the_loop(cls):
    """Entry [0, 0] (and, schedule-free, z's) at bf16's largest magnitude, and a step size that moves it by
    1e36 outwards (measured on an fp32 run with lr = 1e35: the move is lr·d): it lands in the middle of
    the window between bf16's rounding limit (3.3962e38) and fp32's maximum (3.4028e38) — finite in fp32,
    Inf once stored. The fused bf16 step keeps the value and counts it as impl="loop" does (whose rounding
    of every op moves the value by far less than the window's half-width)."""
    def moved(sign: float, lr: float) -> float:
        q, opt = _spectral_window_run(cls, "fused", torch.float32, sign, lr)
        return float(opt.state[q].get("z", q)[0, 0].detach()) - sign * BF16_MAX

    slope = moved(1.0, 1e35) / 1e35
    sign, lr = (1.0 if slope > 0 else -1.0), 1e36 / abs(slope)
    wide, wide_opt = _spectral_window_run(cls, "fused", torch.float32, sign, lr)
    assert not wide_opt.events  # finite in fp32: nothing to resolve there
    ref, ref_opt = _spectral_window_run(cls, "loop", torch.bfloat16, sign, lr)
    got, got_opt = _spectral_window_run(cls, "fused", torch.bfloat16, sign, lr)
    assert {e.stage for e in ref_opt.events} == {"update"}
    assert_resolution_matches(ref_opt, got_opt)
    assert torch.isfinite(got).all() and all(torch.isfinite(v).all() for v in got_opt.state[got].values()
                                             if torch.is_tensor(v))
