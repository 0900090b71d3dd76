"""Checks of the fused spectral step that run on any device and any implementation of it:
tests/test_fused_spectral.py runs them on the native loops (CPU), tests/spectral_step_cases.py on the Triton
kernels (the interpreter on the CPU, and CUDA). Moved out of tests/test_fused_spectral.py, which the Triton
cases imported them from, so that no test file imports another's helpers for them."""
from __future__ import annotations

import torch

import nonans_optim as no
from nonans_optim.optimizers import _kl_stacks, _spectral
from optim_infos import assert_params_and_state_close, event_tuples

SHAPES = [(64, 200), (64, 200), (300, 40), (33, 17)]  # a wide bucket of two, a tall matrix, a small one


def count_kl_stacks(monkeypatch) -> list[int]:
    """The size of every stack KL-Shampoo's batched form runs from here on (also used by
    tests/test_kernels_spectral_step.py), so a test can tell it was not the one-by-one fallback."""
    stacks: list[int] = []
    real = _kl_stacks._step_stack
    monkeypatch.setattr(_kl_stacks, "_step_stack", lambda *a, **k: stacks.append(len(a[1])) or real(*a, **k))
    return stacks



def check_skip_keeps_kl_damping(device, shapes=SHAPES[:3]) -> None:
    """Under "skip" the loop restores all of a bad-gradient tensor's state, KL-Shampoo's damping included —
    which the preconditioner grows when it bypasses (here: an infinite eigenvalue makes its inverse root
    zero). The fused path must put the damping back the same way, and leave it to grow on clean steps.
    (Also run on the Triton kernels: tests/test_kernels_spectral_step.py.)"""
    runs = []
    for impl in ("loop", "fused"):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(0.1 * torch.randn(s).to(device)) for s in shapes]
        opt = no.FullFusion([{"params": ps, "path": "spectral"}], lr=1e-2, impl=impl, resolution="skip",
                            ns5_dtype="fp32")
        gen = torch.Generator().manual_seed(1)
        damping = []
        for t in range(4):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen).to(device)
            if t == 1:
                opt.state[ps[0]]["kl_eigvals_left"][0] = float("inf")  # the next preconditioning bypasses
                ps[0].grad[2, 2] = float("nan")  # ... on a step that "skip" discards for this tensor
            opt.step()
            damping.append(float(opt.state[ps[0]]["kl_damping"]))
        assert damping[1] == damping[0] < damping[3], (impl, damping)  # put back, then grown on clean steps
        runs.append((ps, opt, damping))
    (ref, ref_opt, ref_d), (got, got_opt, got_d) = runs
    assert ref_d == got_d
    assert_params_and_state_close(ref, ref_opt, got, got_opt)
    assert event_tuples(got_opt) == event_tuples(ref_opt)  # the bypass is a "direction" event, counted alike
    assert (2, 0, "direction") in {e[:3] for e in event_tuples(got_opt)}



def check_tensors_on_different_first_steps(device) -> None:
    """MONA's G_prev starts as a tensor's own first gradient, so in one group a parameter whose gradient
    first arrives later is on its first step while the others are not (a head unfrozen after warm-up, say):
    the fused step must decide "first" per tensor, as the loop does — with a bad entry on that first step.
    (Also run on the Triton kernels: tests/test_kernels_spectral_step.py.)"""
    runs = []
    for impl in ("loop", "fused"):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(16, 12).to(device)) for _ in range(3)]
        opt = no.FullFusion([{"params": ps, "path": "spectral"}], lr=1e-2, impl=impl, ns5_dtype="fp32")
        gen = torch.Generator().manual_seed(1)
        for t in range(4):
            for i, p in enumerate(ps):  # parameter i first has a gradient at step i
                p.grad = torch.randn(p.shape, generator=gen).to(device) if i <= t else None
            if t == 2:
                ps[2].grad[1, 1] = float("nan")
            opt.step()
        assert [int(opt.state[p]["step"]) for p in ps] == [4, 3, 2]
        runs.append((ps, opt))
    (ref, ref_opt), (got, got_opt) = runs
    assert_params_and_state_close(ref, ref_opt, got, got_opt)



def unbounded_loop(monkeypatch, big: float):
    """The loop's NS5 output scaled by ``big``, and its NorMuon / RMS matching told that the direction is
    unbounded (which only a composition without NS5 is, and which the fused paths do not cover): with the
    fused path's iterate scaled alike, the same direction reaches both, with squares past fp32's maximum."""
    from nonans_optim.functional import normuon as nm
    real_ns5 = _spectral.ns5
    monkeypatch.setattr(_spectral, "ns5", lambda *a, **k: real_ns5(*a, **k) * big)
    monkeypatch.setattr(_spectral, "normuon", lambda *a, bounded, **k: nm.normuon(*a, bounded=False, **k))
    monkeypatch.setattr(_spectral, "rms_match", lambda O, bounded: nm.rms_match(O, bounded=False))



OVERFLOW_DIRECTIONS = [(("ns5",), "off"), (("ns5",), "repair"), (("ns5", "normuon"), "off"),
                       (("ns5", "normuon"), "repair"), (("ns5", "normuon"), "skip"),
                       (("ns5", "normuon", "sf"), "repair")]

OVERFLOW_IDS = ["-".join(c) + "-" + p for c, p in OVERFLOW_DIRECTIONS]



def check_direction_whose_squares_overflow(device, comps, policy):
    """The direction side's overflow handling, reached by scaling NS5's output by 2^70 (entries ~1e20: every
    row's fp32 Σ O² overflows; the caller patches the loop with :func:`unbounded_loop` and the fused path's
    iterate alike). ‖Ô‖_F comes from a wider sum (it was +Inf: a zero update), and under the gate a NorMuon
    row whose moment overflowed keeps v, divides by it and counts one Inf at the "moment" stage —
    parameters, state and counts as the loop computes them. "off" keeps the stock NorMuon (an overflowed v
    is +Inf, then lerp(Inf, x) = NaN)."""
    runs = []
    for impl in ("loop", "fused"):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s).to(device)) for s in [(8, 24), (8, 24), (20, 12)]]
        opt = no.Fusion([{"params": ps, "path": "spectral"}], components=comps, impl=impl, lr=0.02,
                        weight_decay=0.0, resolution=policy, spike_factor=None, ns5_dtype="fp32")
        gen = torch.Generator().manual_seed(1)
        for t in range(3):
            before = [p.detach().clone() for p in ps]
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen).to(device)
            opt.step()
            if t == 0:
                first = [p.detach() - b for p, b in zip(ps, before)]
        runs.append((ps, opt))
    (ref, ref_opt), (got, got_opt) = runs
    stock = policy == "off" and "normuon" in comps
    assert stock or all(torch.isfinite(p).all() for p in got)
    assert_params_and_state_close(ref, ref_opt, got, got_opt, rtol=1e-4, equal_nan=stock)
    if policy != "off":
        assert event_tuples(got_opt) == event_tuples(ref_opt)
        rows = 8 + 8 + 20 if "normuon" in comps else 0
        assert got_opt.metrics()["resolution/inf_moment"] == 3 * rows
        assert got_opt.metrics()["resolution/events_update"] == got_opt.metrics()["resolution/events_direction"] == 0
    if "sf" not in comps and not stock:  # the first update: RMS 0.2·lr, not 0
        for d in first:
            torch.testing.assert_close(d.square().mean().sqrt().cpu(), torch.tensor(0.2 * 0.02), rtol=1e-3, atol=0)

