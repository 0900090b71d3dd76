"""Precision boundaries of step(): the caller's autocast region, groups mixing fp64 with fp32, gradients of
another dtype than their parameter (an audit of mixed precision on CPU, 2026-11-26)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import nonans_optim as no
from nonans_optim import native
from optim_infos import INFOS, IDS, event_tuples, state_tensors

needs_native = pytest.mark.skipif(native.library() is None, reason=f"native kernel unavailable: {native.failure()}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("info", INFOS, ids=IDS)
def test_step_inside_autocast_is_the_step_outside(info, dtype):
    """``step()`` called inside ``torch.autocast`` steps as outside it, bit for bit. FullFusion's KL-Shampoo
    matmuls ran in the autocast dtype: in fp16, G·Gᵀ of a finite |g| ≈ 300 overflowed, a "direction" event
    every step, the factor stuck at 0 and the step size halved to 2⁻¹⁰; in bf16 the parameters drifted."""
    def run(amp: bool):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(32, 16))
        b = torch.nn.Parameter(torch.randn(16))
        opt = info.make([w, b], impl="auto")
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            w.grad = torch.randn(32, 16, generator=gen) * 300.0
            b.grad = torch.randn(16, generator=gen)
            with torch.autocast("cpu", dtype=dtype, enabled=amp):
                opt.step()
            assert not torch.is_autocast_enabled("cpu")  # the caller's region is not left switched off
        return opt

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref, got = run(False), run(True)
    assert event_tuples(got) == event_tuples(ref) == []
    a, b = state_tensors(ref), state_tensors(got)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ref_p = [p for g in ref.param_groups for p in g["params"]]
    got_p = [p for g in got.param_groups for p in g["params"]]
    assert all(torch.equal(x, y) for x, y in zip(ref_p, got_p))


def test_autocast_region_is_restored_when_step_raises():
    p = torch.nn.Parameter(torch.randn(4))
    p.grad = torch.randn(4)
    opt = no.AdamW([p], lr=1e-3)
    opt._run_step = lambda: (_ for _ in ()).throw(RuntimeError("boom"))  # a step that fails halfway
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="boom"):
            opt.step()
        assert torch.is_autocast_enabled("cpu")


def _spy_foreach(monkeypatch, module, name) -> list:
    seen: list = []
    original = getattr(module, name)

    def spy(grads, *a, **k):
        seen.append([g.dtype for g in grads])
        return original(grads, *a, **k)
    monkeypatch.setattr(module, name, spy)
    return seen


@needs_native
def test_one_fp64_tensor_keeps_the_fp32_tensors_of_its_group_native(monkeypatch):
    """A group holding one fp64 tensor steps in fp64 γ, which the native loop refuses; impl="auto" then sent
    every fp32 tensor of the group to foreach with it (33x slower in the audit's run). The fp32 tensors run
    native now, with γ in fp32, and the group ends as impl="loop" ends it, to rounding."""
    from nonans_optim.optimizers import _scalar

    def build():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(64, 32)) for _ in range(3)]
        ps.append(torch.nn.Parameter(torch.zeros((), dtype=torch.float64)))
        return ps

    def run(impl):
        ps = build()
        opt = no.AdamW(ps, lr=1e-2, weight_decay=0.1, impl=impl)
        gen = torch.Generator().manual_seed(1)
        for step in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
            if step == 1:
                ps[0].grad[0, 0] = float("nan")
            opt.step()
        return ps, opt

    seen = _spy_foreach(monkeypatch, _scalar, "adam_moments_foreach")
    got, got_opt = run("auto")
    assert seen and all(dts == [torch.float64] for dts in seen), seen  # only the fp64 scalar ran foreach
    ref, ref_opt = run("loop")
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert event_tuples(got_opt) == event_tuples(ref_opt) != []


@needs_native
def test_one_fp64_matrix_keeps_the_fp32_matrices_of_a_spectral_group_native():
    from nonans_optim.optimizers import _fused_spectral

    calls: list = []
    original = _fused_spectral.fused_spectral_update

    def spy(params, *a, **k):
        calls.append([p.dtype for p in params])
        return original(params, *a, **k)

    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(32, 16)) for _ in range(2)]
    ps.append(torch.nn.Parameter(torch.randn(32, 16, dtype=torch.float64)))
    opt = no.SFNorMuon([{"params": ps, "path": "spectral"}], lr=1e-2)
    for p in ps:
        p.grad = torch.randn_like(p)
    mp = pytest.MonkeyPatch()
    mp.setattr(_fused_spectral, "fused_spectral_update", spy)
    try:
        opt.step()
    finally:
        mp.undo()
    assert [torch.float32, torch.float32] in calls, calls  # the fp32 part ran in the native loops
    assert all(torch.isfinite(p).all() for p in ps)


@pytest.mark.parametrize("info", INFOS, ids=IDS)
@pytest.mark.parametrize("policy", ["repair", "off"])
def test_gradient_of_another_dtype_is_refused_by_name(info, policy):
    """torch's ``p.grad`` setter refuses a gradient of another dtype, but ``p.grad.data = ...`` gets one
    through; whether step() then raised depended on the policy and optimizer (AdamW "repair" accepted a bf16
    gradient, "off" raised torch.lerp's error). Refused now, before anything changes, naming both dtypes."""
    p = torch.nn.Parameter(torch.randn(8, 4))
    q = torch.nn.Parameter(torch.randn(4))
    opt = info.make([p, q], resolution=policy)
    p.grad, q.grad = torch.randn(8, 4), torch.randn(4)
    opt.step()
    before = (p.detach().clone(), copy.deepcopy(opt.state_dict()))
    p.grad = torch.randn(8, 4)
    q.grad = torch.randn(4)
    q.grad.data = q.grad.data.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"gradient of dtype torch.bfloat16, shape \(4,\) on cpu for a parameter "
                                           r"of dtype torch.float32"):
        opt.step()
    assert torch.equal(p, before[0]) and opt.state_dict()["state"][0]["step"] == before[1]["state"][0]["step"]
