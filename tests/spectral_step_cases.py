"""The cases of ``test_kernels_spectral_step.py`` — the multi-tensor Triton spectral step against
``impl="loop"`` — and their helpers (``_force_triton``, ``_run_wide``), moved out of that file so that it keeps
the two-faced wiring (the interpreter suite on the CPU, the ``gpu``-marked copies) and this one what each case
checks; the other spectral kernel tests import the helpers from here. Each ``case_*`` takes the device it
runs on."""
from __future__ import annotations

import pytest
import torch

import nonans_optim as no
from optim_infos import (assert_params_and_state_close, assert_params_and_state_near, assert_resolution_matches,
                         event_tuples)
from test_compiled_spectral import _run  # (its model and fault sequence)

CASES = [(no.SFNorMuon, {}), (no.Muon, {}), (no.Fusion, {"components": ("ns5", "normuon"), "nesterov": False}),
         (no.Fusion, {"components": ("ns5", "sf")}), (no.Fusion, {"components": ("ns5", "mona", "normuon", "sf")}),
         (no.FullFusion, {})]
IDS = ["SFNorMuon", "Muon", "Fusion-ns5-normuon", "Fusion-ns5-sf", "Fusion-mona", "FullFusion"]
SHAPES = [(12, 300), (12, 300), (90, 20), (33, 17)]  # several blocks; a bucket of two; tall; ragged
SQUARE = [(24, 24), (24, 24), (20, 20), (24, 24)]  # a bucket of three (0, 1, 3): KL-Shampoo's stacks
# on CUDA, how far the stacks may sit from the loop, as a share of each tensor's scale: batched QR and products
# round differently there, and the basis refresh amplifies it (tests/test_kl_conditioning.py)
KL_ROUNDING = 1e-2


def _force_triton(monkeypatch, kl_batched: bool = False):
    """impl="fused" on the Triton kernels, failing instead of falling back to impl="compiled"; KL-Shampoo one
    matrix at a time unless ``kl_batched`` (its CUDA default stacks a bucket: batched and single matrix
    products round differently, and a rank-deficient factor's QR basis is then free to differ in its null
    space — so a comparison with the loop stacks only where the factors have full rank)."""
    from nonans_optim.optimizers import _kl_stacks, _spectral

    monkeypatch.setattr(_kl_stacks, "_batch_on", lambda device: kl_batched)

    def no_fallback(*args, **kwargs):
        raise AssertionError("the Triton spectral path fell back to impl='compiled'")

    monkeypatch.setenv("NONANS_FUSED_BACKEND", "triton")
    monkeypatch.setattr(_spectral, "compiled_spectral_update", no_fallback)


def _run_wide(impl, policy, *, device, steps=5, clean=False, cls=no.SFNorMuon, shapes=SHAPES, **kw):
    """SF-NorMuon (or ``cls``) on SHAPES (several kernel blocks per matrix, rows wider than a row chunk):
    partial NaN/Inf, a finite momentum overflow, a whole tensor NaN twice (the hold rule) and a finite spike
    (the guard)."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(0.1 * torch.randn(s).to(device)) for s in shapes]
    opt = cls([{"params": ps, "path": "spectral"}], lr=1e-2, weight_decay=0.1, impl=impl, resolution=policy, **kw)
    gen = torch.Generator().manual_seed(1)
    for t in range(steps):
        for i, p in enumerate(ps):
            g = torch.randn(p.shape, generator=gen)
            if not clean and t == 1 and i == 0:
                g[0, 3], g[5, -10] = float("nan"), float("inf")
            if not clean and t in (2, 3) and i == 3:
                g.fill_(float("nan"))
            if not clean and t in (2, 3) and i == 1:  # finite; the buffer's lerp overflows on step 3
                g[3, 7] = -3.3e38 if t == 2 else 3.3e38
            if not clean and t == 3 and i == 2:
                g *= 1e4
            p.grad = g.to(device)
        opt.step()
    return ps, opt


def case_optimizer_matches_loop(device, cls, kw, policy, monkeypatch):
    _force_triton(monkeypatch)
    inject = policy != "off"  # under "off" a fault makes both NaN, which would compare nothing
    ref, ref_opt = _run("loop", cls, policy, inject=inject, device=device, **kw)
    got, got_opt = _run("fused", cls, policy, inject=inject, device=device, **kw)
    assert all(torch.isfinite(q).all() for q in got)
    assert_params_and_state_close(ref, ref_opt, got, got_opt)
    if policy != "off":
        assert_resolution_matches(ref_opt, got_opt, ema_rtol=1e-6)
        assert "grad" in {e[2] for e in event_tuples(got_opt)}


def case_wide_matrices_match_loop(device, policy, factor, cls, monkeypatch):
    """With the guard (the default) the giant finite entry is a spike, rescaled before it reaches the
    buffer (and, FullFusion, before KL-Shampoo's factors see it: the device-side scale); without it the
    buffer's lerp overflows (the moment stage): both, so every stage is exercised."""
    _force_triton(monkeypatch)
    ref, ref_opt = _run_wide("loop", policy, device=device, ns5_dtype="fp32", spike_factor=factor, cls=cls)
    got, got_opt = _run_wide("fused", policy, device=device, ns5_dtype="fp32", spike_factor=factor, cls=cls)
    assert_params_and_state_close(ref, ref_opt, got, got_opt)
    assert_resolution_matches(ref_opt, got_opt, ema_rtol=1e-6)
    assert {"grad", "spike" if factor else "moment"} <= {e[2] for e in event_tuples(got_opt)}


def case_kl_batched_matches_loop(device, policy, factor, monkeypatch):
    """FullFusion's KL-Shampoo as stacks (its default on CUDA) on these kernels, over _run_wide's faults on
    square matrices (full-rank factors from the first step, so the loop's QR bases are unique): a stack of
    three takes the guard's device-side scales as one product (the overflow at step 3 is a spike there) and
    holds a whole-NaN tensor, and still matches the loop; the stacks really ran."""
    from fused_spectral_checks import count_kl_stacks

    _force_triton(monkeypatch, kl_batched=True)
    stacks = count_kl_stacks(monkeypatch)
    kw = dict(device=device, ns5_dtype="fp32", spike_factor=factor, cls=no.FullFusion, shapes=SQUARE)
    ref, ref_opt = _run_wide("loop", policy, **kw)
    got, got_opt = _run_wide("fused", policy, **kw)
    if torch.device(device).type == "cpu":  # one LAPACK/BLAS call per matrix, stacked or not
        assert_params_and_state_close(ref, ref_opt, got, got_opt)
    else:
        assert_params_and_state_near(ref, ref_opt, got, got_opt, rel=KL_ROUNDING)
    assert_resolution_matches(ref_opt, got_opt, ema_rtol=1e-6)
    assert 3 in stacks


def case_update_overflow_counts(device, cls, monkeypatch):
    """The update stage's counts (the apply kernel's one packed sum: NaN in the low 16 bits, non-finite above)
    against the loop: entries at ±fp32's maximum, which every step of lr 1e37 pushes past it on one side —
    decisively, by about 1e36 where the two arithmetics can differ by an ulp (2e31) — while the other entries
    stay below 2e38; and none counted on the steps where the second tensor is held (its gradient all NaN
    after an event). The fault sequences of the other cases never overflow an update."""
    _force_triton(monkeypatch)
    big = torch.finfo(torch.float32).max
    runs = []
    for impl in ("loop", "fused"):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(0.1 * torch.randn(16, 24)) for _ in range(2)]
        with torch.no_grad():
            for q in ps:
                q.view(-1)[::7], q.view(-1)[3::7] = big, -big
        ps = [torch.nn.Parameter(q.detach().to(device)) for q in ps]
        opt = cls([{"params": ps, "path": "spectral"}], lr=1e37, weight_decay=0.0, ns5_dtype="fp32", impl=impl)
        gen = torch.Generator().manual_seed(1)
        for t in range(4):
            for i, q in enumerate(ps):
                g = torch.randn(q.shape, generator=gen)
                if i == 1 and t >= 2:
                    g.fill_(float("nan"))
                q.grad = g.to(device)
            opt.step()
            assert all(torch.isfinite(q).all() for q in ps)
        runs.append(opt)
    updates = [[e for e in event_tuples(o) if e[2] == "update"] for o in runs]
    assert updates[1] == updates[0]
    assert {e[1] for e in updates[0] if e[0] == 1} == {0, 1} and all(e[4] > 0 for e in updates[0]), updates[0]
    assert not [e for e in updates[0] if e[1] == 1 and e[0] >= 3], updates[0]  # held: nothing counted


def case_bf16_buffer_overflow_as_stored(device, monkeypatch):
    """A bf16 momentum buffer at bf16's largest value and a gradient of 3.4e38 — finite in fp32, where the
    kernels compute — make, at momentum 0.2, a new buffer entry (3.3979e38) that is finite in fp32 and +Inf
    once stored in bf16 (above 3.3962e38 it rounds up): the write kernel's speculative test must see it as
    stored (the gated path keeps the old value and counts a moment overflow), never write the Inf. Against
    the loop, which updates in fp32 and rounds on the write too."""
    _force_triton(monkeypatch)
    runs = []
    for impl in ("loop", "fused"):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(0.1 * torch.randn(16, 24).to(device))]
        opt = no.Muon([{"params": ps, "path": "spectral"}], lr=1e-2, momentum=0.2, ns5_dtype="fp32",
                      momentum_dtype="bf16", spike_factor=None, impl=impl)
        gen = torch.Generator().manual_seed(1)
        for t in range(3):
            g = torch.randn(16, 24, generator=gen)
            if t == 1:
                opt.state[ps[0]]["momentum_buffer"][3, 7] = torch.finfo(torch.bfloat16).max
                g[3, 7] = 3.4e38
            ps[0].grad = g.to(device)
            opt.step()
            assert all(torch.isfinite(x).all() for x in state_tensors_of(opt, ps))
            if t == 1:  # kept
                assert opt.state[ps[0]]["momentum_buffer"][3, 7].item() == torch.finfo(torch.bfloat16).max
        runs.append((ps, opt))
    (ref, ref_opt), (got, got_opt) = runs
    assert event_tuples(got_opt) == event_tuples(ref_opt)
    assert [e[2] for e in event_tuples(got_opt)] == ["moment"], event_tuples(got_opt)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=2e-3)


def state_tensors_of(opt, params):
    """Every floating tensor of the parameters and their state."""
    return [*params, *(v for q in params for v in opt.state[q].values()
                       if isinstance(v, torch.Tensor) and v.is_floating_point())]


def case_bf16_buffer_and_ns5_input(device, cls, monkeypatch):
    """A bf16 momentum buffer (rounded once per write, its overflow tested as stored) and a bf16 NS5 input:
    the loop does the same in bf16 tensors, so the two agree to bf16's resolution, not bit for bit."""
    _force_triton(monkeypatch)
    kw = dict(ns5_dtype="bf16", momentum_dtype="bf16", cls=cls)
    ref, ref_opt = _run_wide("loop", "repair", device=device, **kw)
    got, got_opt = _run_wide("fused", "repair", device=device, **kw)
    for p, q, st_p, st_q in zip(ref, got, ref_opt.state.values(), got_opt.state.values()):
        assert torch.isfinite(q).all()
        torch.testing.assert_close(q, p, rtol=0, atol=2e-3)  # 5 steps of lr 1e-2 at RMS 0.2, bf16 NS5
        assert st_q["momentum_buffer"].dtype == torch.bfloat16
        torch.testing.assert_close(st_q["momentum_buffer"].float(), st_p["momentum_buffer"].float(),
                                   rtol=1e-2, atol=1e-2)
    assert event_tuples(got_opt) == event_tuples(ref_opt)


def case_skip_keeps_kl_damping(device, monkeypatch):
    """KL-Shampoo's damping of a "skip" tensor with a bad entry is put back by a device-side select (the
    native loops decide it on the host), and grows on clean steps."""
    from fused_spectral_checks import check_skip_keeps_kl_damping

    _force_triton(monkeypatch)
    check_skip_keeps_kl_damping(device, shapes=[(16, 24), (16, 24), (30, 8)])  # small: the interpreter is slow


def case_held_keeps_kl_damping(device, monkeypatch):
    """A held matrix's KL damping is put back with the rest of its state (the decide kernel's hold bit, one
    select for the group), as in the loop (tests/test_kl_shampoo.py)."""
    from test_kl_shampoo import check_held_keeps_kl_damping

    _force_triton(monkeypatch)
    check_held_keeps_kl_damping(device, "fused", shape=(16, 24))


def case_direction_whose_squares_overflow(device, comps, policy, monkeypatch):
    """fused_spectral_checks.check_direction_whose_squares_overflow on these kernels: NS5's output scaled by
    2^70 here and in the loop, and the direction side launched with ``bounded=False`` (the row kernel's WIDE:
    its float64 rare path for ‖Ô‖_F and the NorMuon moment-overflow gate, which only a direction that is not
    NS5's output needs) — parameters, state and counts those of the loop."""
    from nonans_optim.kernels import spectral_step as k
    from nonans_optim.optimizers import _fused_triton
    from fused_spectral_checks import check_direction_whose_squares_overflow, unbounded_loop

    _force_triton(monkeypatch)
    real_iterate, real_post = _fused_triton.iterate, k.spectral_post_
    monkeypatch.setattr(_fused_triton, "iterate", lambda *a, **kw: real_iterate(*a, **kw) * 2.0 ** 70)
    monkeypatch.setattr(k, "spectral_post_", lambda *a, **kw: real_post(*a, **dict(kw, bounded=False)))
    unbounded_loop(monkeypatch, 2.0 ** 70)
    check_direction_whose_squares_overflow(device, comps, policy)


def case_tensors_on_different_first_steps(device, monkeypatch):
    """MONA's "first step" is a per-tensor flag the host copies with the hyperparameters."""
    from fused_spectral_checks import check_tensors_on_different_first_steps

    _force_triton(monkeypatch)
    check_tensors_on_different_first_steps(device)


def case_clean_repair_is_off(device, monkeypatch):
    _force_triton(monkeypatch)
    runs = [_run_wide("fused", policy, device=device, clean=True, steps=3)[0] for policy in ("repair", "off")]
    for p, q in zip(*runs):
        assert torch.equal(p, q)


def case_auto_runs_the_triton_kernels(device, cls, monkeypatch):
    """impl="auto" takes these kernels wherever impl="fused" does (the default on CUDA since the GPU run of
    2026-11-26): bit for bit the same parameters and events, every group through the Triton path, never
    torch.compile (``_force_triton`` fails on it)."""
    from nonans_optim.optimizers import _fused_spectral

    taken = []
    real = _fused_spectral.triton_spectral_update

    def counted(*args, **kwargs):
        taken.append(real(*args, **kwargs))
        return taken[-1]

    _force_triton(monkeypatch)
    monkeypatch.setattr(_fused_spectral, "triton_spectral_update", counted)
    got, got_opt = _run("auto", cls, "repair", device=device)
    assert taken and all(taken)  # every spectral group of every step ran the kernels
    want, want_opt = _run("fused", cls, "repair", device=device)
    for p, q in zip(got, want):
        assert torch.equal(p, q)
    assert event_tuples(got_opt) == event_tuples(want_opt)


def case_launch_failure_falls_back(device, kernel, cls, monkeypatch):
    """The buffer write is the first persistent write: a kernel that fails to compile there, or in the
    direction side after it (compiled ahead, before the write), leaves nothing half-done — one warning,
    the step counts put back — and the step and every later one run impl="compiled" (FullFusion, which
    it does not cover: "foreach"), matching impl="loop"."""
    from nonans_optim.kernels import spectral_step as k
    from nonans_optim.optimizers import _fused_triton
    from triton_launches import break_kernel

    monkeypatch.setattr(_fused_triton, "_COMPILED", set())
    break_kernel(monkeypatch, k, kernel)
    ref, ref_opt = _run("loop", cls, "repair", device=device)
    with pytest.warns(RuntimeWarning, match="simulated compile failure") as record:
        got, got_opt = _run("fused", cls, "repair", device=device)
    assert sum("Triton kernels failed" in str(w.message) for w in record) == 1
    assert_params_and_state_close(ref, ref_opt, got, got_opt)
    assert_resolution_matches(ref_opt, got_opt, ema_rtol=1e-6)
