"""impl="compiled" (torch.compile'd scalar path) against impl="loop", the ground truth.

Each case runs a few steps with NaN, ±Inf and a g² overflow injected into chosen tensors and compares
parameters, every state buffer and the device-side event counts. Compile time dominates the runtime, so
the model is two tensors and each (optimizer, policy) compiles once.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import nonans_optim as no
from nonans_optim.optimizers import _compiled
from optim_infos import assert_params_and_state_close, assert_resolution_matches

pytestmark = pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile unavailable")

STEPS = 5


def _grads(step: int, shapes, gen):
    gs = [torch.randn(s, generator=gen) for s in shapes]
    if step == 1:
        gs[0][0, 0], gs[0][1, 2] = float("nan"), float("inf")  # a partial fault
    if step == 2:
        gs[1][:] = float("-inf")  # a whole tensor
    if step in (2, 3):  # finite; m's lerp overflows on step 3 (g - m): the "moment" stage
        gs[0][3, 2] = -3.3e38 if step == 2 else 3.3e38
    if step == 3:
        gs[0][2, 1] = 3e38  # finite gradient whose square overflows fp32: the "moment" stage
    return gs


def _run(cls, impl: str, policy: str, **kw):
    torch.manual_seed(0)
    params = [torch.randn(4, 3, requires_grad=True), torch.randn(5, requires_grad=True)]
    opt = cls(params, lr=1e-2, weight_decay=0.1, resolution=policy, impl=impl, **kw)
    gen = torch.Generator().manual_seed(1)
    for t in range(STEPS):
        for p, g in zip(params, _grads(t, [p.shape for p in params], gen)):
            p.grad = g
        opt.step()
    return params, opt


@pytest.mark.parametrize("policy", ["repair", "skip", "off"])
@pytest.mark.parametrize("cls", [no.AdamW, no.SFAdamW], ids=["AdamW", "SFAdamW"])
def test_compiled_matches_loop(cls, policy):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a silent fallback to foreach would fail here
        ref, ref_opt = _run(cls, "loop", policy)
        got, got_opt = _run(cls, "compiled", policy)
    assert _compiled.compile_available()
    assert_params_and_state_close(ref, ref_opt, got, got_opt, equal_nan=True)
    if policy == "off":
        assert not any(torch.isfinite(p).all() for p in got)  # stock arithmetic: the faults got through
        return
    assert all(torch.isfinite(p).all() for p in got)
    assert_resolution_matches(ref_opt, got_opt)
    assert got_opt._global()["resolution"]["counts"].sum() > 0


def test_lr_change_and_clean_repair_equals_off():
    """A new lr (a schedule) must not recompile, and a clean "repair" step equals "off"."""
    torch._dynamo.utils.counters.clear()
    runs = []
    for policy in ("repair", "off"):
        torch.manual_seed(0)
        p = torch.randn(6, 4, requires_grad=True)
        opt = no.AdamW([p], lr=1e-2, resolution=policy, impl="compiled")
        for t in range(3):
            opt.param_groups[0]["lr"] = 1e-2 / (t + 1)
            p.grad = torch.full_like(p, 0.1 * (t + 1))
            opt.step()
        runs.append(p.detach().clone())
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-6, atol=1e-7)
    assert _compiled.compile_available()
    assert 1 <= torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2  # one per policy, none per lr


def test_fallback_to_foreach_when_compile_fails(monkeypatch):
    """No C++ compiler (simulated): warn once and take the foreach path, with identical results."""
    def broken(*a, **k):
        raise RuntimeError("simulated: no C++ compiler")

    monkeypatch.setattr(_compiled, "_compiled_kernel", lambda sf, policy, factor, dtype: broken)
    monkeypatch.setattr(_compiled, "_BROKEN", [])
    with pytest.warns(RuntimeWarning, match="simulated"):
        got, got_opt = _run(no.AdamW, "compiled", "repair")
    ref, ref_opt = _run(no.AdamW, "foreach", "repair")
    for p, q in zip(ref, got):
        assert torch.equal(p, q)
        assert torch.equal(got_opt.state[q]["step"], ref_opt.state[p]["step"])


def test_host_steps_advance_like_torch_add():
    """The step counters the compiled and Triton paths advance through their addresses: the same values as
    torch's in-place add (counts where fp32 rounds, 2^24 and past it, included), the tensors themselves
    updated and their version counters bumped; a float64 counter takes torch's foreach add."""
    from nonans_optim.optimizers._compiled import host_steps

    starts = [0.0, 7.0, 2.0 ** 24 - 1, 2.0 ** 24, 2.0 ** 24 + 2, 3.0e7, 1.0e9]
    for dtype in (torch.float32, torch.float64):
        states = [{"step": torch.tensor(s, dtype=dtype)} for s in starts]
        want = [torch.tensor(s, dtype=dtype).add_(1.0) for s in starts]
        versions = [st["step"]._version for st in states]
        got = host_steps(states)
        assert got == [float(w) for w in want]
        assert all(torch.equal(st["step"], w) for st, w in zip(states, want))
        assert all(st["step"]._version > v for st, v in zip(states, versions))
