"""impl="auto", every optimizer's default: the native loops of impl="fused" where they cover a group, and
impl="foreach" everywhere else — without the compile step or the warning that impl="fused" falls back
with, since a default must not bring either.

Each case trains TinyNet (every routing case) on a fault sequence — a NaN, an Inf, a finite gradient
spike that triggers the guard — and requires *identical* parameters, state and resolution counters to
the implementation that auto claims to be: "fused" with the native library, "foreach" without it
(``NONANS_NATIVE=0``, no C compiler) or for tensors the native loops do not take (fp64 on CPU).
"""
from __future__ import annotations

import warnings

import pytest
import torch

import nonans_optim as no
from nonans_optim import kernels, native
from nonans_optim.optimizers._fused import auto_choice
from optim_infos import INFOS, make_model, state_tensors, train_steps

BASE = [i for i in INFOS if "impl" not in i.kwargs]  # the optimizers as a user constructs them
STEPS = 6


def _inject(step: int, model) -> None:
    g = model.fc1.weight.grad
    if step == 2:
        g[0, 0], g[3, 5] = float("nan"), float("inf")
    if step == 4:
        g.mul_(1e4)  # a finite spike: the spike guard (factor 10, set in _run) triggers on it
    if step == 5:
        model.head.bias.grad[1] = float("-inf")


def _run(info, impl: str | None, *, dtype=torch.float32):
    model = make_model(dtype=dtype)
    # The guard is on by default on the spectral optimizers and opt-in on AdamW/SFAdamW: set it everywhere,
    # so that every optimizer's native loop runs its pre-pass and the case below exercises it.
    kw = {"impl": "auto" if impl is None else impl, "spike_factor": 10.0}
    opt = info.make(no.param_groups(model) if info.cls not in (no.AdamW, no.SFAdamW) else model.parameters(),
                    **kw)
    with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        warnings.simplefilter("error")  # auto must fall back silently; "fused" may not warn either here
        train_steps(model, opt, STEPS, inject=_inject, dtype=torch.float32 if dtype == torch.bfloat16 else dtype)
    return model, opt


def _assert_identical(ref, got) -> None:
    (ref_model, ref_opt), (got_model, got_opt) = ref, got
    for (name, p), q in zip(ref_model.named_parameters(), got_model.parameters()):
        assert torch.equal(p, q), name
    ref_state, got_state = state_tensors(ref_opt), state_tensors(got_opt)
    assert ref_state.keys() == got_state.keys()
    for key, val in ref_state.items():
        assert torch.equal(val, got_state[key]), key
    ref_res, got_res = ref_opt._global()["resolution"], got_opt._global()["resolution"]
    for key, val in ref_res.items():
        assert torch.equal(val, got_res[key]), key
    assert int(got_res["events"][:, 5].sum()) > 0  # the guard fired (stage "spike"): the case is real


@pytest.mark.parametrize("info", BASE, ids=[i.name for i in BASE])
def test_auto_is_the_default(info):
    assert info.cls([torch.nn.Parameter(torch.zeros(3, 3))], **info.kwargs).impl == "auto"


@pytest.mark.skipif(native.library() is None, reason=f"native kernel unavailable: {native.failure()}")
@pytest.mark.parametrize("info", BASE, ids=[i.name for i in BASE])
def test_auto_is_fused_where_the_native_loops_cover(info):
    assert auto_choice("cpu") == "fused"  # what reports state
    # CUDA: the Triton kernels for both families (measured on an H200, 2026-11-26: _fused.auto_choice)
    assert auto_choice("cuda") == ("fused" if kernels.available() else "foreach")
    _assert_identical(_run(info, "fused"), _run(info, None))


@pytest.mark.parametrize("info", BASE, ids=[i.name for i in BASE])
def test_auto_is_foreach_without_the_native_library(info, monkeypatch):
    """The spike guard, which the native loops apply inside, is then applied once, eagerly."""
    monkeypatch.setattr(native, "library", lambda: None)
    assert auto_choice("cpu") == "foreach"
    _assert_identical(_run(info, "foreach"), _run(info, None))


@pytest.mark.parametrize("info", [i for i in BASE if i.name in ("AdamW", "SFNorMuon")], ids=["AdamW", "SFNorMuon"])
def test_auto_follows_nonans_fused_backend(info, monkeypatch):
    """NONANS_FUSED_BACKEND names auto's fused backend on both paths: "triton" on a CPU without the
    interpreter leaves foreach (the (SF-)AdamW path ran the native loop regardless until 2026-11-26), and a
    bad value is refused on both (the (SF-)AdamW path took any)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("NONANS_FUSED_BACKEND", "triton")
    _assert_identical(_run(info, "foreach"), _run(info, None))
    monkeypatch.setenv("NONANS_FUSED_BACKEND", "bogus")
    with pytest.raises(ValueError, match="NONANS_FUSED_BACKEND must be one of"):
        _run(info, None)


@pytest.mark.parametrize("info", [i for i in BASE if i.name in ("AdamW", "SFNorMuon")], ids=["AdamW", "SFNorMuon"])
def test_auto_is_foreach_for_groups_the_native_loops_do_not_cover(info):
    """fp64 parameters on CPU: impl="fused" would compile (inductor); auto runs foreach, silently."""
    _assert_identical(_run(info, "foreach", dtype=torch.float64), _run(info, None, dtype=torch.float64))


@pytest.mark.skipif(native.library() is None, reason=f"native kernel unavailable: {native.failure()}")
@pytest.mark.parametrize("info", [i for i in BASE if i.name in ("AdamW", "SFAdamW")], ids=["AdamW", "SFAdamW"])
def test_auto_runs_a_bf16_model_in_the_native_loop(info):
    """A whole-bf16 model on CPU ran the eager foreach step, 17x torch's fused AdamW on the default GPT (an
    audit, 2026-11-26): the (SF-)AdamW loop now takes bf16 groups, and auto is "fused" there."""
    _assert_identical(_run(info, "fused", dtype=torch.bfloat16), _run(info, None, dtype=torch.bfloat16))


@pytest.mark.skipif(native.library() is None, reason=f"native kernel unavailable: {native.failure()}")
@pytest.mark.parametrize("info", [i for i in BASE if i.name in ("AdamW", "SFNorMuon")], ids=["AdamW", "SFNorMuon"])
def test_auto_inside_torch_compile(info):
    """A user who compiles ``optimizer.step`` (or a training step around it): the native calls run eagerly
    (``torch.compiler.disable``), the results are the eager ones, and dynamo has nothing to say about our
    code (it used to trace into the native library's build cache and warn)."""
    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        model = make_model()
        opt = info.make(no.param_groups(model) if info.cls is not no.AdamW else model.parameters(), impl="auto")
        step = torch.compile(opt.step) if compiled else opt.step
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train_steps(model, opt, 3, inject=lambda i, m: _inject(2, m) if i == 1 else None)
            for _ in range(2):  # and through the compiled step itself
                for p in model.parameters():
                    p.grad = torch.ones_like(p)
                step()
        ours = [str(w.message)[:200] for w in caught if "nonans_optim" in str(w.message) + str(w.filename)]
        assert not ours, ours
        runs.append((model, opt))
    (ref_model, ref_opt), (got_model, got_opt) = runs
    for p, q in zip(ref_model.parameters(), got_model.parameters()):
        assert torch.equal(p, q)
    assert [(e.step, e.stage) for e in got_opt.events] == [(e.step, e.stage) for e in ref_opt.events] != []


def test_auto_says_why_it_runs_foreach(monkeypatch, caplog):
    """No warning (a default must not nag), but one INFO record naming the reason."""
    monkeypatch.setenv("NONANS_NATIVE", "0")
    monkeypatch.setattr(native, "_FAILURE", [])
    with caplog.at_level("INFO", logger="nonans_optim.native"):
        assert native.library.__wrapped__() is None
    assert any("NONANS_NATIVE=0" in r.getMessage() and r.levelname == "INFO" for r in caplog.records)


def _spy(monkeypatch, module, name: str) -> list:
    """Wrap ``module.name`` (a native step taking the parameter list first): the returned list gets
    (number of parameters, whether it ran) per call."""
    calls, real = [], getattr(module, name)

    def spy(params, *args, **kw):
        done = real(params, *args, **kw)
        calls.append((len(params), done))
        return done

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.skipif(native.library() is None, reason=f"native kernel unavailable: {native.failure()}")
@pytest.mark.parametrize("cls", [no.AdamW, no.SFAdamW], ids=["AdamW", "SFAdamW"])
def test_auto_runs_the_covered_tensors_of_a_mixed_group_natively(cls, monkeypatch):
    """One tensor the native loop cannot take (channels_last; until the loop took bf16, a bf16 one too)
    sent the whole group to foreach — 14-21x torch's fused AdamW on a GPT-sized model (an audit,
    2026-11-26). The covered tensors now run in the loop, one call per dtype, and the rest foreach: the
    same values, events and counters as with the odd tensors in a group of their own, faults in every part
    recorded."""
    from nonans_optim.optimizers import _scalar

    calls = _spy(monkeypatch, _scalar, "native_scalar_update")

    def run(split: bool):
        torch.manual_seed(0)
        fp32 = [torch.nn.Parameter(torch.randn(s)) for s in [(16, 8), (8,), (5, 3)]]
        odd = [torch.nn.Parameter(torch.randn(6, 4).bfloat16()),
               torch.nn.Parameter(torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last))]
        groups = [{"params": fp32}, {"params": odd}] if split else [{"params": fp32[:2] + odd + fp32[2:]}]
        opt = cls(groups, lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        for t in range(4):
            for p in fp32 + odd:
                p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
                if p.grad.dim() == 4:
                    p.grad = p.grad.contiguous(memory_format=torch.channels_last)
            if t == 2:
                fp32[0].grad[0, 0], odd[0].grad[1, 1] = float("nan"), float("inf")
            opt.step()
        return fp32 + odd, opt

    (a, oa), (b, ob) = run(False), run(True)
    assert calls[:3] == [(5, False), (3, True), (1, True)]  # the whole group refused, then fp32 and bf16 parts
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    assert [(e.step, e.stage, e.nan_count, e.inf_count) for e in oa.events] == \
        [(e.step, e.stage, e.nan_count, e.inf_count) for e in ob.events] == [(3, "grad", 1, 0), (3, "grad", 0, 1)]
    perm = [0, 1, 3, 4, 2]  # the split run's parameter order (fp32 group first), by the mixed run's position
    for key in ("counts", "events", "scale", "clean_streak", "escalations"):
        assert torch.equal(oa._global()["resolution"][key], ob._global()["resolution"][key][perm]), key


@pytest.mark.skipif(native.library() is None, reason=f"native kernel unavailable: {native.failure()}")
@pytest.mark.parametrize("cls", [no.SFNorMuon, no.FullFusion], ids=["SFNorMuon", "FullFusion"])
def test_auto_runs_the_covered_matrices_of_a_mixed_spectral_group_natively(cls, monkeypatch):
    """The spectral path's twin of the test above: a channels_last conv kernel among fp32 matrices sent
    the whole group to foreach (SF-NorMuon 2.1-2.5x slower on a GPT-sized model; an audit, 2026-11-26).
    The covered matrices now run in the native loops and the kernel foreach: what the same tensors give
    with the kernel in a group of its own, faults included."""
    from nonans_optim.optimizers import _fused_spectral

    calls = _spy(monkeypatch, _fused_spectral, "fused_spectral_update")

    def run(split: bool):
        torch.manual_seed(0)
        mats = [torch.nn.Parameter(torch.randn(s)) for s in [(8, 6), (8, 6), (6, 5)]]
        conv = torch.nn.Parameter(torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last))
        groups = ([{"params": mats, "path": "spectral"}, {"params": [conv], "path": "spectral"}] if split
                  else [{"params": mats[:1] + [conv] + mats[1:], "path": "spectral"}])
        opt = cls(groups, lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        for t in range(4):
            for p in mats + [conv]:
                p.grad = torch.randn(p.shape, generator=gen).contiguous(
                    memory_format=torch.channels_last if p.dim() == 4 else torch.contiguous_format)
            if t == 2:
                mats[0].grad[0, 0], conv.grad[1, 1, 0, 0] = float("nan"), float("inf")
            opt.step()
        return mats + [conv], opt

    (a, oa), (b, ob) = run(False), run(True)
    assert (3, True) in calls[:3]  # the mixed group's fp32 matrices went to the loops
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    assert sorted((e.step, e.stage, e.nan_count, e.inf_count) for e in oa.events) == \
        sorted((e.step, e.stage, e.nan_count, e.inf_count) for e in ob.events)
    assert oa.metrics()["resolution/events_total"] == 2.0
