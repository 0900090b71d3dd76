"""impl="fused" on the spectral path (optimizers/_fused_spectral.py): what the generic comparison with
impl="loop" in tests/test_compiled_spectral.py does not pin down — that the native loops really ran, that
the result does not depend on the thread count, the spike guard and the bf16 momentum buffer inside
them, and the NS5 input's scale invariance over fp32's whole range."""
from __future__ import annotations

import copy
import shutil

import pytest
import torch

import nonans_optim as no
from nonans_optim import native
from nonans_optim.optimizers import _fused_spectral, _kl_stacks, _spectral
from fused_spectral_checks import (OVERFLOW_DIRECTIONS, OVERFLOW_IDS, SHAPES, check_direction_whose_squares_overflow,
                                   check_skip_keeps_kl_damping, check_tensors_on_different_first_steps,
                                   count_kl_stacks, unbounded_loop)
from optim_infos import assert_params_and_state_close, assert_params_and_state_near, event_tuples, same_tree

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native kernel unavailable: {native.failure()}")



def _run(impl="fused", *, threads=2, scale=1.0, steps=6, inject=True, cls=no.SFNorMuon, **kw):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(0.1 * torch.randn(s)) for s in SHAPES]
    opt = cls([{"params": ps, "path": "spectral"}], lr=1e-2, weight_decay=0.1, impl=impl, **kw)
    gen = torch.Generator().manual_seed(1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for t in range(steps):
            for i, p in enumerate(ps):
                p.grad = scale * torch.randn(p.shape, generator=gen)
                if inject and t == 1 and i == 0:
                    p.grad[0, 3], p.grad[5, 5] = float("nan"), float("inf")
                if inject and t in (2, 3) and i == 3:
                    p.grad.fill_(float("nan"))  # twice in a row: the hold rule on the second
                if inject and t in (2, 3) and i == 1:  # finite; the momentum (and MONA's) lerp overflows
                    p.grad[3, 7] = -3.3e38 if t == 2 else 3.3e38
                if inject and t == 4 and i == 2:
                    p.grad *= 1e4  # a finite spike: the guard fires
            opt.step()
    finally:
        torch.set_num_threads(before)
    return ps, opt


def test_native_loops_run_for_sfnormuon_muon_and_fullfusion(monkeypatch):
    ran = []
    real = _fused_spectral.fused_spectral_update
    monkeypatch.setattr(_spectral, "fused_spectral_update", lambda *a, **k: ran.append(real(*a, **k)) or ran[-1])
    for cls in (no.SFNorMuon, no.Muon, no.FullFusion):
        _run(cls=cls, steps=2)
    _run(cls=no.FullFusion, steps=2, resolution="skip")
    assert len(ran) == 8 and all(ran)


@pytest.mark.parametrize("cls", [no.SFNorMuon, no.Muon, no.FullFusion], ids=["SFNorMuon", "Muon", "FullFusion"])
def test_fp16_ns5_runs_the_native_loops_and_follows_the_loop(cls, monkeypatch):
    """ns5_dtype="fp16": the loops write X in fp32 and NS5 iterates on it cast to fp16 (ns5's own order:
    normalise in fp32, then cast), its output widened for post. The events and escalations are the loop's;
    the values agree to fp16's rounding, not fp32's: pre's norm rounds differently from normalise() at fp32's
    last bit, which moves a few entries of X by one fp16 ulp, and five fp16 iterations spread that (measured
    here: NorMuon's row moment up to 2.2e-3 of its scale, parameters 1.3e-4), so the bound is a share of each
    tensor's scale. The loops really ran (until 2026-11-27 an fp16 group ran eagerly: 1.42x "off" under
    "repair" on the bench's fp16 workload)."""
    ran, hot = [], set()
    real, iterate = _fused_spectral.fused_spectral_update, _fused_spectral.iterate
    monkeypatch.setattr(_spectral, "fused_spectral_update", lambda *a, **k: ran.append(real(*a, **k)) or ran[-1])
    monkeypatch.setattr(_fused_spectral, "iterate", lambda X, *a, **k: hot.add(X.dtype) or iterate(X, *a, **k))
    kw = dict(ns5_dtype="fp16", cls=cls)
    (ref, ref_opt), (got, got_opt) = _run("loop", **kw), _run("fused", **kw)
    assert ran and all(ran) and hot == {torch.float16}
    assert_params_and_state_near(ref, ref_opt, got, got_opt, rel=1e-2)
    assert event_tuples(got_opt) == event_tuples(ref_opt)
    r, g = ref_opt._global()["resolution"], got_opt._global()["resolution"]
    assert torch.equal(r["escalations"], g["escalations"]) and g["escalations"].sum() > 0


def test_thread_count_does_not_change_results():
    """Row sums are added in row order after a barrier, so 1 and 2 threads agree bit for bit — with the
    spike guard firing and the hold rule engaged."""
    (a, oa), (b, ob) = _run(threads=1), _run(threads=2)
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        assert same_tree(oa.state[p], ob.state[q])  # the optimizer-level state (counters) included
    assert event_tuples(oa) == event_tuples(ob)
    assert {"grad", "spike"} <= {e[2] for e in event_tuples(ob)}


def test_a_group_keeps_one_workspace_set_when_its_gradient_set_changes():
    """MoE routing: a different subset of a group's experts has a gradient each step. The kept NS5 buffers
    are one set per group, not one per parameter that happened to come first (16 sets, 3.8x the experts'
    parameters, after 200 top-2 steps over 16 experts in the memory audit)."""
    torch.manual_seed(0)
    experts = [torch.nn.Parameter(torch.randn(24, 16)) for _ in range(6)]
    opt = no.SFNorMuon([{"params": experts, "path": "spectral"}], lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for step in range(12):
        for p in experts:
            p.grad = None
        for e in ((step, step + 1), (step + 3,), (0, 5))[step % 3]:
            experts[e % 6].grad = torch.randn(24, 16, generator=gen)
        opt.step()
    assert len(opt._workspaces) == 1
    (group, cache), = opt._workspaces.values()
    assert group is opt.param_groups[0] and len(cache) == 1
    opt.load_state_dict(opt.state_dict())  # torch's load makes new group dicts: the old group's set goes
    experts[0].grad = torch.randn(24, 16, generator=gen)
    opt.step()
    (group, cache), = opt._workspaces.values()
    assert group is opt.param_groups[0]


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_a_build_without_openmp_sums_rows_in_the_same_order(tmp_path, monkeypatch):
    """A compiler without OpenMP gets ``-fopenmp-simd``, so the row sums' ``omp simd reduction`` keeps the
    order the OpenMP build uses: without it the single-threaded build summed sequentially and SF-NorMuon /
    Muon drifted 1e-4 from the default build in 30 steps (the determinism audit, 2026-11-26)."""
    wrapper = tmp_path / "cc-without-openmp"
    wrapper.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = "-fopenmp" ] && exit 1; done\nexec gcc "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("NONANS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_compiler", lambda: str(wrapper))
    monkeypatch.setattr(native, "_FAILURE", [])
    single = native.library.__wrapped__()
    assert single is not None
    results = {}
    for name, lib in (("default", native.library()), ("no OpenMP", single)):
        monkeypatch.setattr(native, "library", lambda lib=lib: lib)
        for cls in (no.SFNorMuon, no.Muon):
            results[name, cls.__name__] = _run(cls=cls, threads=1, steps=12, inject=False)[0]
    for cls in ("SFNorMuon", "Muon"):
        assert all(torch.equal(p, q) for p, q in zip(results["default", cls], results["no OpenMP", cls])), cls


@pytest.mark.parametrize("cls", [no.SFNorMuon, no.FullFusion], ids=["SFNorMuon", "FullFusion"])
@pytest.mark.parametrize("momentum_dtype", ["auto", "param"])
def test_faults_spike_and_hold_match_loop(momentum_dtype, cls):
    """Counts and escalation equal, values within fp32 tolerance (NS5 in fp32; the bf16 buffer, where
    chosen, is rounded the same way by both). FullFusion: MONA in the pre loop, and KL-Shampoo between
    the loops fed the gradient as the spike guard rescaled it."""
    kw = dict(ns5_dtype="fp32", momentum_dtype=momentum_dtype, cls=cls)
    (ref, ref_opt), (got, got_opt) = _run("loop", **kw), _run("fused", **kw)
    assert_params_and_state_close(ref, ref_opt, got, got_opt)
    assert event_tuples(got_opt) == event_tuples(ref_opt)
    r, g = ref_opt._global()["resolution"], got_opt._global()["resolution"]
    assert torch.equal(r["escalations"], g["escalations"]) and g["escalations"].sum() > 0


@pytest.fixture
def kl_batched(monkeypatch):
    """KL-Shampoo's batched form (what the fused step runs on CUDA) on these CPU tests, and its stack count."""
    monkeypatch.setattr(_kl_stacks, "_batch_on", lambda device: True)
    return count_kl_stacks(monkeypatch)


@pytest.mark.parametrize("chunk_bytes", [None, 1], ids=["one-stack", "chunks-of-one"])
def test_kl_batched_matches_loop(kl_batched, chunk_bytes, monkeypatch):
    """FullFusion's fault sequence (a bad entry and a guard-scaled overflow inside the bucket of two, a
    whole-tensor NaN held) with KL-Shampoo run as stacks: the loop's values within fp32 tolerance (batched
    against single matrix products), its events exactly; a bucket cut into chunks agrees too."""
    if chunk_bytes:
        monkeypatch.setattr(_kl_stacks, "_BATCH_BYTES", chunk_bytes)
    kw = dict(ns5_dtype="fp32", cls=no.FullFusion)
    (ref, ref_opt), (got, got_opt) = _run("loop", **kw), _run("fused", **kw)
    assert kl_batched and set(kl_batched) == ({1} if chunk_bytes else {2})  # the (64, 200) pair: stacked
    assert_params_and_state_close(ref, ref_opt, got, got_opt)
    assert event_tuples(got_opt) == event_tuples(ref_opt)


def test_kl_batched_skip_keeps_damping_and_mixed_first_steps(kl_batched):
    """The damping of a "skip" tensor put back inside a stack (here the bypassing tensor shares its stack
    with a clean one), and buckets whose tensors are at different steps (one by one), both as the loop."""
    check_skip_keeps_kl_damping("cpu", shapes=[(16, 24), (16, 24), (30, 8)])
    assert 2 in kl_batched
    kl_batched.clear()
    check_tensors_on_different_first_steps("cpu")
    assert not kl_batched  # its tensors are never at one step together: every bucket went one by one


@pytest.mark.parametrize("scale", [1e-30, 1e30])
def test_update_is_invariant_to_the_gradient_scale(scale):
    """The NS5 input is M/‖M‖: gradients 1e±30 times larger give the same steps (fp32 squares overflow or
    underflow there, so the loops fall back to double for those rows). No spike guard: its EMA would see
    the scale only at the first step anyway."""
    kw = dict(ns5_dtype="fp32", momentum_dtype="param", spike_factor=None, inject=False)
    (ref, _), (got, _) = _run(**kw), _run(scale=scale, **kw)
    for p, q in zip(ref, got):
        assert torch.isfinite(q).all()
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6)


def test_skip_keeps_kl_damping_of_a_skipped_tensor():
    check_skip_keeps_kl_damping("cpu")


def test_tensors_on_different_first_steps():
    check_tensors_on_different_first_steps("cpu")


@pytest.mark.parametrize("impl", ["loop", "compiled", "fused"])
def test_bf16_buffer_entry_that_rounds_to_inf_is_kept(impl):
    """momentum=0 makes the new buffer g itself: 3.40e38 is finite in fp32 but rounds to Inf in a bf16
    buffer (above (2 - 2^-8)·2^127). The buffer keeps its value there in every implementation, the moment
    stage counts it, and 3.39e38 (which rounds to bf16's maximum) is stored normally."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(0.1 * torch.randn(64, 200))
    opt = no.SFNorMuon([{"params": [p], "path": "spectral"}], lr=1e-2, momentum=0.0, momentum_dtype="bf16",
                       impl=impl, spike_factor=None)
    g = torch.randn(64, 200) * 1e-3
    g[3, 7], g[5, 9] = 3.40e38, 3.39e38
    p.grad = g
    opt.step()
    buf = opt.state[p]["momentum_buffer"]
    assert buf.dtype == torch.bfloat16 and torch.isfinite(buf).all() and torch.isfinite(p).all()
    assert buf[3, 7] == 0 and buf[5, 9] == torch.tensor(3.39e38).to(torch.bfloat16)
    assert opt.metrics()["resolution/inf_moment"] == 1



def _kl_overflow_run(impl, comps, momentum_dtype, momentum):
    """KL-Shampoo's path through the pre loop (its input is M itself, no norm of M taken first) with finite
    gradients that overflow the momentum side, the spike guard off: MONA's A (G - G_prev overflows on the
    second step) and the buffer's lerp, or a bf16 buffer entry that rounds to Inf (3.40e38; 3.39e38 rounds
    to bf16's maximum and is stored)."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(0.1 * torch.randn(s)) for s in [(64, 200), (33, 17)]]
    opt = no.Fusion([{"params": ps, "path": "spectral"}], components=comps, impl=impl, lr=1e-2,
                    spike_factor=None, ns5_dtype="fp32", momentum=momentum, momentum_dtype=momentum_dtype)
    gen = torch.Generator().manual_seed(1)
    for t in range(3):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        ps[0].grad[3, 7], ps[0].grad[5, 9] = (3.40e38, 3.39e38) if t == 0 else (-3.3e38, 1e-3)
        opt.step()
    return ps, opt


@pytest.mark.parametrize("comps, momentum_dtype, momentum", [
    (("mona", "shampoo", "ns5"), "param", 0.95), (("shampoo", "ns5"), "bf16", 0.0)], ids=["mona-fp32", "bf16"])
def test_kl_input_whose_momentum_overflows_matches_loop(comps, momentum_dtype, momentum):
    """The pre loop speculates the ungated arithmetic on an entirely finite row of KL-Shampoo's input and
    checks the new buffer and MONA's A (row_update_'s check); these rows fail that check and are computed
    again gated: state as the loop leaves it, finite, and the moment stage's count."""
    (ref, ref_opt), (got, got_opt) = (_kl_overflow_run(impl, comps, momentum_dtype, momentum)
                                      for impl in ("loop", "fused"))
    assert all(torch.isfinite(t).all() for t in got + [v for st in got_opt.state.values() for v in st.values()
                                                        if isinstance(v, torch.Tensor) and v.is_floating_point()])
    assert_params_and_state_close(ref, ref_opt, got, got_opt)
    assert event_tuples(got_opt) == event_tuples(ref_opt)
    assert got_opt.metrics()["resolution/inf_moment"] > 0


@pytest.mark.parametrize("comps, policy", OVERFLOW_DIRECTIONS, ids=OVERFLOW_IDS)
def test_direction_whose_squares_overflow_matches_loop(monkeypatch, comps, policy):
    """:func:`check_direction_whose_squares_overflow` on the native post loop (‖Ô‖_F rescanned in double when
    the fp32 sums overflow), which really ran."""
    ran = []
    real = _fused_spectral.fused_spectral_update
    monkeypatch.setattr(_spectral, "fused_spectral_update", lambda *a, **k: ran.append(real(*a, **k)) or ran[-1])
    real_iterate = _fused_spectral.iterate
    monkeypatch.setattr(_fused_spectral, "iterate", lambda *a, **k: real_iterate(*a, **k) * 2.0 ** 70)
    unbounded_loop(monkeypatch, 2.0 ** 70)
    check_direction_whose_squares_overflow("cpu", comps, policy)
    assert len(ran) == 3 and all(ran)


def test_workspace_buffers_go_with_the_optimizer():
    """The native spectral path keeps its NS5 stacks between steps; they belong to the optimizer now. Kept
    in a module-level dict keyed by the group's first parameter, they outlived a deleted optimizer for as
    long as the model did (an audit, 2026-11-26: 8 bytes per parameter of a 2048² matrix)."""
    import gc
    import weakref

    if native.library() is None:
        pytest.skip(f"native kernel unavailable: {native.failure()}")
    w = torch.nn.Parameter(torch.randn(64, 32))
    opt = no.SFNorMuon([w], impl="fused")
    for _ in range(2):
        w.grad = torch.randn(64, 32)
        opt.step()
    (anchor, cache), = opt._workspaces.values()
    assert anchor is opt.param_groups[0]
    (inputs, *_), = cache.values()
    buf = weakref.ref(inputs[0])
    w.grad = torch.randn(64, 32)
    opt.step()
    assert next(iter(next(iter(opt._workspaces.values()))[1].values()))[0][0] is buf()  # reused, not rebuilt
    twin = copy.deepcopy(opt)
    assert twin._workspaces == {}  # a copy builds its own
    del opt, twin, cache, inputs
    gc.collect()
    assert buf() is None and w.grad is not None  # the model lives on; the optimizer's buffers do not
