"""impl="fused" on the scalar path (the native C loop of nonans_optim/native) against impl="loop", the
ground truth; tests/test_fused_spectral.py does the spectral path.

Each case injects NaN, ±Inf, a g² overflow, a first moment overflowing in its lerp, a whole-tensor loss that
repeats (the hold rule) and a finite spike (the spike guard), on tensors large enough that both threads of
the C loop get a share, and compares parameters, every state buffer and the event counts. The native
record_step is compared with the torch one on random count sequences. The generic suites
(tests/test_optimizers.py, tests/test_resolution.py) run "AdamW-fused", "SFAdamW-fused", "Muon-fused" and
"SFNorMuon-fused" too: resume, clean "repair" == "off", fault injection, and the rest.
"""
from __future__ import annotations

import copy
import ctypes
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import nonans_optim as no
from nonans_optim import native
from nonans_optim.optimizers import _fused
from nonans_optim.resolution import STAGES, Resolution
from optim_infos import assert_params_and_state_close, assert_resolution_matches, event_tuples

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native kernel unavailable: {native.failure()}")

SHAPES = [(300, 70), (5,), (4, 3)]  # 21000 entries = 2 chunks: one per thread; a vector; a tiny matrix
STEPS = 7


def _grads(step: int, gen, shapes=SHAPES):
    """The fault sequence's gradients on ``shapes`` (the first a matrix of at least 11 x 6)."""
    gs = [torch.randn(s, generator=gen) for s in shapes]
    rows, cols = shapes[0]
    if step == 1:
        gs[0][0, 0], gs[0][rows // 2, 2], gs[0][rows - 1, cols - 1] = float("nan"), float("inf"), float("-inf")
    if step in (2, 3):
        gs[1][:] = float("nan") if step == 2 else float("-inf")  # whole tensor, twice: hold on step 3
        # finite, but -3.3e38 then +3.3e38: g - m inside m's lerp overflows on step 3 (the "moment" stage)
        gs[0][10, 5] = -3.3e38 if step == 2 else 3.3e38
    if step == 4:
        gs[2][2, 1] = 3e38  # finite, but its square overflows fp32: the "moment" stage
    if step == 5:
        gs[0] *= 1e4  # a finite spike: the guard rescales it
    if step == 6:
        gs[0][0, 0] = float("nan")  # bad first entry on a parameter with a recent event: the pre-pass path
    return gs


def _run(cls, impl: str, policy: str, threads: int = 2, device: str = "cpu", clean: bool = False, shapes=SHAPES,
         dtype=torch.float32, **kw):
    """STEPS steps of the fault sequence (``clean``: the same random gradients without the faults) on
    parameters of ``shapes`` and ``dtype`` on ``device`` (tests/test_kernels_scalar_one.py runs the Triton path
    through it, on smaller shapes under the interpreter; tests/test_native_simd.py in bf16 too)."""
    torch.manual_seed(0)
    params = [torch.randn(s, device=device).to(dtype).requires_grad_() for s in shapes]
    # the spike guard is opt-in on AdamW/SFAdamW: on here unless a case says otherwise, so the fault
    # sequence's finite spike (step 5) exercises the pre-pass
    opt = cls(params, resolution=policy, impl=impl, **{"lr": 1e-2, "weight_decay": 0.1, "spike_factor": 10.0, **kw})
    gen = torch.Generator().manual_seed(1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for t in range(STEPS):
            grads = [torch.randn(s, generator=gen) for s in shapes] if clean else _grads(t, gen, shapes)
            for p, g in zip(params, grads):
                p.grad = g.to(device, dtype)
            opt.step()
    finally:
        torch.set_num_threads(before)
    return params, opt


@pytest.mark.parametrize("factor", [10.0, None], ids=["guard", "default"])
@pytest.mark.parametrize("policy", ["repair", "skip", "off"])
@pytest.mark.parametrize("cls", [no.AdamW, no.SFAdamW], ids=["AdamW", "SFAdamW"])
def test_fused_matches_loop(cls, policy, factor):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a silent fallback would fail here
        ref, ref_opt = _run(cls, "loop", policy, spike_factor=factor)
        got, got_opt = _run(cls, "fused", policy, spike_factor=factor)
    assert_params_and_state_close(ref, ref_opt, got, got_opt, equal_nan=True)
    if policy == "off":
        assert not all(torch.isfinite(p).all() for p in got)  # stock arithmetic: the faults got through
        return
    assert all(torch.isfinite(p).all() for p in got)
    assert_resolution_matches(ref_opt, got_opt)
    stages = {e[2] for e in event_tuples(got_opt)}
    # every injected kind was seen; under the guard the finite giants of steps 2-4 are spikes too (their
    # float64 norm is far above the cap), rescaled before they can overflow a moment
    assert ({"grad", "moment"} if factor is None else {"grad", "spike"}) <= stages, stages
    assert ("spike" in stages) == (factor is not None), stages
    if policy == "repair":  # the repeated whole-tensor loss held the vector on step 3 (4 with 1-based steps)
        assert got_opt._global()["resolution"]["escalations"].sum() > 0


@pytest.mark.parametrize("cls", [no.AdamW, no.SFAdamW], ids=["AdamW", "SFAdamW"])
def test_thread_count_does_not_change_results(cls):
    """The loop is element-wise, each count an exact integer, and the spike guard's norm is summed per
    fixed-size chunk in chunk order: 1 and 2 threads agree bit for bit, the guard firing included."""
    runs = [_run(cls, "fused", "repair", threads=t) for t in (1, 2)]
    for p, q in zip(runs[0][0], runs[1][0]):
        assert torch.equal(p, q)
    assert event_tuples(runs[0][1]) == event_tuples(runs[1][1])
    assert "spike" in {e[2] for e in event_tuples(runs[1][1])}


@pytest.mark.parametrize("cls", [no.AdamW, no.SFAdamW], ids=["AdamW", "SFAdamW"])
def test_tensors_at_different_steps_in_one_call(cls):
    """The middle parameter has no gradient on the first two steps, so one native call takes tensors whose
    step counts differ (t, t-2, t): each its own bias corrections, which the loop computes once per run of
    equal steps."""
    runs = []
    for impl in ("loop", "fused"):
        torch.manual_seed(0)
        params = [torch.randn(s, requires_grad=True) for s in SHAPES]
        opt = cls(params, impl=impl, lr=1e-2, weight_decay=0.1)
        gen = torch.Generator().manual_seed(1)
        for t in range(5):
            for i, (q, g) in enumerate(zip(params, [torch.randn(s, generator=gen) for s in SHAPES])):
                q.grad = None if (i == 1 and t < 2) else g
            opt.step()
        runs.append((params, opt))
    (ref, ref_opt), (got, got_opt) = runs
    assert [float(got_opt.state[q]["step"]) for q in got] == [5.0, 3.0, 5.0]
    assert_params_and_state_close(ref, ref_opt, got, got_opt)


def test_unsupported_tensors_run_compiled(monkeypatch):
    """fp64 parameters and a non-contiguous gradient are not what the C loop indexes (it takes fp32 and bf16):
    those groups run impl="compiled" (silently, with the same results), never a pointer into the wrong
    layout."""
    calls = []
    real = _fused.compiled_scalar_update
    monkeypatch.setattr(_fused, "compiled_scalar_update", lambda *a, **k: calls.append(1) or real(*a, **k))
    contiguous, transposed = (lambda p: torch.randn(p.shape)), (lambda p: torch.randn(p.shape[::-1]).t())
    for make, dtype in ((contiguous, torch.float64), (transposed, torch.float32)):
        torch.manual_seed(0)
        params = [torch.randn(6, 4, dtype=dtype, requires_grad=True) for _ in range(2)]
        twins = [p.detach().clone().requires_grad_() for p in params]
        opts = [no.AdamW(ps, lr=1e-2, impl=impl) for ps, impl in ((params, "fused"), (twins, "compiled"))]
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            for _ in range(2):
                for p, q in zip(params, twins):
                    p.grad = make(p).to(dtype)
                    q.grad = p.grad.clone()
                for o in opts:
                    o.step()
        for p, q in zip(params, twins):
            assert p.dtype == dtype and torch.equal(p, q)
    assert len(calls) == 4  # every fused step went to the compiled path


def _read_int64(address: int, n: int) -> list[int]:
    return list((ctypes.c_int64 * n).from_address(address))


@pytest.mark.parametrize("bad", range(3))
def test_pointer_table_layout_and_refusals(bad):
    """:func:`_fused.pointer_table` (the native step's one argument array): each list's data pointers in
    its own block, the tail after them, each block's address returned — and None when any tensor of any
    list is strided or of another dtype than its list's, wherever it sits: a pointer into the wrong layout
    must never reach the C loop (a wrapper's null pointer: tests/test_distributed_checkpoint.py)."""
    f32 = [torch.randn(3, 2), torch.randn(5)]
    b16 = [torch.randn(4).bfloat16(), torch.empty(0, dtype=torch.bfloat16)]  # an empty tensor's null pointer passes
    steps = [torch.zeros(()) for _ in range(2)]
    lists = ((f32, torch.float32), (b16, torch.bfloat16), (steps, torch.float32))
    table, addresses = _fused.pointer_table(lists, [7, -1])
    assert [b - a for a, b in zip(addresses, addresses[1:])] == [16, 16, 16]
    for (tensors, _), at in zip(lists, addresses):
        assert _read_int64(at, len(tensors)) == [t.data_ptr() for t in tensors]
    assert _read_int64(addresses[-1], 2) == [7, -1]
    assert _read_int64(_fused.pointers(b16, torch.bfloat16)._as_parameter_.value, 2) == [t.data_ptr() for t in b16]
    spoiled = [list(tensors) for tensors, _ in lists]
    spoiled[bad][-1] = (torch.randn(2, 3).t(), torch.randn(1), torch.zeros((), dtype=torch.float64))[bad]
    assert _fused.pointer_table(tuple(zip(spoiled, (torch.float32, torch.bfloat16, torch.float32)))) is None
    assert _fused.pointers(spoiled[bad], lists[bad][1]) is None


def test_unavailable_kernel_warns_once_and_runs_compiled(monkeypatch):
    monkeypatch.setattr(native, "library", lambda: None)
    monkeypatch.setattr(native, "_FAILURE", ["simulated: no C compiler"])
    monkeypatch.setattr(_fused, "_WARNED", [])
    with pytest.warns(RuntimeWarning, match="simulated"):
        got, _ = _run(no.AdamW, "fused", "repair")
    ref, _ = _run(no.AdamW, "compiled", "repair")
    for p, q in zip(ref, got):
        assert torch.equal(p, q)


def test_builds_into_a_fresh_cache_and_reports_a_broken_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("NONANS_CACHE_DIR", str(tmp_path / "ok"))
    lib = native.library.__wrapped__()
    assert lib is not None and hasattr(lib, "nonans_scalar_step")
    assert len(list((tmp_path / "ok").glob("nonans_native-*.so"))) == 1
    blocker = tmp_path / "a-file"  # a cache "folder" that cannot be created: the temporary folder serves
    blocker.write_text("")
    monkeypatch.setenv("NONANS_CACHE_DIR", str(blocker / "cache"))
    assert native.library.__wrapped__() is not None
    monkeypatch.setenv("NONANS_CACHE_DIR", str(tmp_path / "broken"))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    monkeypatch.setattr(native, "_compiler", lambda: "false")
    monkeypatch.setattr(native, "_FAILURE", [])
    assert native.library.__wrapped__() is None
    assert "compiler failed" in native.failure()


counts_seq = st.lists(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(0, 4)),
                               max_size=4), min_size=1, max_size=40)


@settings(max_examples=25, deadline=None)
@given(seq=counts_seq)
def test_native_record_step_matches_torch(seq):
    """Event ring, escalation (backoff, floor, growth) and counters: the C loop equals the torch ops. Every
    third step of ``got`` takes the torch path, which replaces some counter tensors: the C loop's cached
    pointers must follow (a stale pointer would write into a tensor the optimizer no longer holds)."""
    P = 4  # sizes that n + n // 2 gradient counts reach: whole-tensor events, so held steps, occur
    kw = dict(ring_size=5, growth_interval=3, repeat_window=4, min_scale=2.0 ** -3, numels=[3, 4, 6, 1])
    ref, got = Resolution("repair", P, torch.device("cpu"), **kw), Resolution("repair", P, torch.device("cpu"), **kw)
    for step, events in enumerate(seq, 1):
        c = torch.zeros(P, len(STAGES), 2, dtype=torch.int64)
        for p, s, n in events:
            c[p, s] += torch.tensor([n, n // 2])
        ref.record_step(step, c)
        got.record_step(step, c, native=step % 3 != 0)
    for k in ref.tensors:
        assert torch.equal(ref.tensors[k], got.tensors[k]), k


@pytest.mark.parametrize("make", [lambda ps: no.AdamW(ps, impl="fused"),
                                  lambda ps: no.SFNorMuon([{"params": ps, "path": "spectral"}], impl="fused")],
                         ids=["AdamW", "SFNorMuon"])
def test_writes_are_visible_to_autograd(make):
    """The C loops write through data pointers, so they bump the version counters themselves: a graph
    that saved a parameter before step() must refuse to backprop through the updated values, as it
    does after torch's own in-place optimizers."""
    p = torch.nn.Parameter(torch.randn(6, 4))
    opt = make([p])
    loss = (p * p).sum()  # saves p for backward
    p.grad = torch.ones_like(p)
    before = p._version
    opt.step()
    assert p._version > before
    assert all(t._version > 0 for t in opt.state[p].values() if isinstance(t, torch.Tensor))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("impl", ["fused", "compiled"])
@pytest.mark.parametrize("cls", [no.AdamW, no.SFAdamW], ids=["AdamW", "SFAdamW"])
def test_second_moment_overflow_counts_as_the_loop_does(cls, impl):
    """The moment stage counts entries whose new v is not finite although g was — also where g² is finite
    and only β₂·v + (1-β₂)·g² overflows (the loop's definition, functional/adam.py::_observed),
    which a count of non-finite g² alone would miss."""
    runs = []
    for which in ("loop", impl):
        torch.manual_seed(0)
        params = [torch.randn(40, requires_grad=True)]
        opt = cls(params, lr=1e-2, impl=which, spike_factor=None)
        params[0].grad = torch.randn(40)
        opt.step()
        opt.state[params[0]]["exp_avg_sq"][:3] = 3.3e38
        params[0].grad = torch.randn(40)
        params[0].grad[:2] = 3.2e20  # (1-β₂)·g² = 1e38: finite; the sum with β₂·3.3e38 is not
        opt.step()
        runs.append((params, opt))
    (ref, ref_opt), (got, got_opt) = runs
    assert ("moment", 0, 2) in {(e.stage, e.nan_count, e.inf_count) for e in got_opt.events}
    assert_resolution_matches(ref_opt, got_opt)
    assert_params_and_state_close(ref, ref_opt, got, got_opt)


@pytest.mark.parametrize("cls", [no.AdamW, no.SFAdamW], ids=["AdamW", "SFAdamW"])
def test_cached_pointers_follow_replaced_counters(cls):
    """The native step's counter pointers are cached (``Resolution.native_args``); every way the counters
    get replaced — a checkpoint load, the torch record_step of another impl — must send the next fused step's
    counts into the live tensors, not into the old ones the cache still holds."""
    p = torch.zeros(100, requires_grad=True)
    opt = cls([p], impl="fused")

    def nan_step(impl: str = "fused") -> None:
        opt.impl = impl
        p.grad = torch.ones(100)
        p.grad[7] = float("nan")
        opt.step()

    p.grad = torch.ones(100)
    opt.step()  # clean: fills the cache
    saved = copy.deepcopy(opt.state_dict())  # state_dict() holds the live tensors, as torch's does
    nan_step()
    assert opt.metrics()["resolution/nan_grad"] == 1
    opt.load_state_dict(saved)  # the checkpoint's counters (no events) replace the live ones
    nan_step()
    assert opt.metrics()["resolution/nan_grad"] == 1
    nan_step("foreach")  # the torch record_step replaces scale and clean_streak
    nan_step()
    m = opt.metrics()
    assert (m["resolution/nan_grad"], m["resolution/events_total"]) == (3, 3)
    # the second and third events repeat within the window: each halves the live scale
    assert (m["resolution/escalations"], m["resolution/min_scale"]) == (2, 0.25)


@pytest.mark.parametrize("cls,shape", [(no.AdamW, (40,)), (no.SFNorMuon, (8, 5))], ids=["AdamW", "SFNorMuon"])
def test_guard_norm_of_a_tiny_gradient_matches_the_float64_norm(cls, shape):
    """The native guard summed the squares in fp32: a gradient of |g| = 1e-24 (squares below fp32's
    subnormals) had norm 0, never seeded the EMA, and the next, 1000x larger gradient was no spike — where
    spike.py's float64 norm (loop, foreach, compiled) seeds it and caps the jump (the fuzz audit). An
    all-zero gradient still gives 0 and leaves the EMA alone."""
    def run(impl):
        p = torch.nn.Parameter(torch.ones(shape))
        opt = cls([p], lr=1e-3, spike_factor=10.0, impl=impl)
        for scale in (0.0, 1e-24, 3e-24, 1e-21):
            p.grad = torch.full(shape, scale)
            opt.step()
        return opt._global()["resolution"]["grad_norm_ema"], event_tuples(opt)
    (ema_loop, ev_loop), (ema_fused, ev_fused) = run("loop"), run("fused")
    assert ema_loop.item() > 0 and ev_loop and ev_loop[-1][2] == "spike"
    torch.testing.assert_close(ema_fused, ema_loop, rtol=1e-6, atol=0)
    assert ev_fused == ev_loop
