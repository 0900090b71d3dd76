"""The resolution contract (``resolution.py``) under faults injected into the gradients: invariant, preserved
moments, policies, the hold rule, no host sync in the step on the GPU.

Non-finite values that arise inside the step from finite gradients (overflowing moments and directions, a
non-finite loss or step size): tests/test_resolution_inside.py. The bookkeeping behind the counts (escalation,
the recent-event window, the event ring, summary counters, count helpers): tests/test_resolution_accounting.py.
"""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nonans_optim as no
from optim_infos import (IDS, INFOS, all_finite, assert_params_and_state_close, assert_skip_holds_as_the_loop_does,
                         impl_cases, impl_ids, loss_fn, make_batch, make_model, no_host_sync, state_tensors,
                         train_steps)

BAD = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}


injection = st.fixed_dictionaries({
    "value": st.sampled_from(sorted(BAD)),
    "pattern": st.sampled_from(["element", "tensor", "all"]),
    "steps": st.sets(st.integers(0, 5), min_size=1, max_size=3),
    "param": st.integers(0, 11),
    "seed": st.integers(0, 2**16),
})


def make_injector(spec, model):
    params = list(model.parameters())
    target = params[spec["param"] % len(params)]
    gen = torch.Generator().manual_seed(spec["seed"])
    log = []

    def inject(step, _model):
        if step not in spec["steps"]:
            return
        value = BAD[spec["value"]]
        if spec["pattern"] == "element":
            flat = target.grad.view(-1)
            i = int(torch.randint(0, flat.numel(), (1,), generator=gen))
            flat[i] = value
            log.append((step, target, [i]))
        elif spec["pattern"] == "tensor":
            target.grad.fill_(value)
            log.append((step, target, None))
        else:
            for p in params:
                if p.grad is not None:
                    p.grad.fill_(value)
            log.append((step, None, None))
    return inject, log


EAGER_CASES = impl_cases(("loop", "foreach"))


@pytest.mark.parametrize("policy", ["repair", "skip"])
@pytest.mark.parametrize("info, impl", EAGER_CASES, ids=impl_ids(EAGER_CASES))
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=injection)
def test_invariant_under_random_injection(info, policy, impl, spec):
    model = make_model()
    opt = info.make(model.named_parameters(), resolution=policy, impl=impl)
    inject, log = make_injector(spec, model)
    train_steps(model, opt, 6, inject=inject)
    assert all_finite(model, opt)
    m = opt.metrics()
    assert m["resolution/events_grad"] >= len(log)
    assert m["resolution/events_total"] == len({(e.step, e.param, e.stage) for e in opt.events})
    # counters survive a state_dict round trip
    clone = info.make(make_model(seed=9).named_parameters(), resolution=policy, impl=impl)
    clone.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert clone.metrics() == m
    assert clone.events == opt.events


@pytest.mark.parametrize("value", sorted(BAD))
@pytest.mark.parametrize("info", INFOS, ids=IDS)
def test_moments_unchanged_at_injected_entries(info, value):
    model = make_model()
    opt = info.make(model.named_parameters())
    train_steps(model, opt, 3)
    target = model.fc1.weight  # a hidden matrix: spectral for Fusion, scalar for AdamW
    batch = make_batch(99)
    opt.zero_grad()
    loss_fn(model, batch).backward()
    target.grad[2, 3] = BAD[value]
    target.grad[5, 1] = BAD[value]
    before = {k: v.clone() for k, v in opt.state[target].items() if k in info.moment_keys}
    assert before, "no moment buffer to check"
    opt.step()
    after = opt.state[target]
    for k, old in before.items():
        new = after[k]
        if new.shape == target.shape:
            assert new[2, 3] == old[2, 3] and new[5, 1] == old[5, 1], k
            mask = torch.ones_like(new, dtype=torch.bool)
            mask[2, 3] = mask[5, 1] = False
            assert not torch.equal(new[mask], old[mask]), f"{k}: finite entries must still update"
    if "normuon_row_sq" in after:  # rows 2 and 5 keep their second moment
        assert torch.isfinite(after["normuon_row_sq"]).all()
    ev = [e for e in opt.events if e.stage == "grad"]
    assert len(ev) == 1 and ev[0].param == "fc1.weight" and ev[0].numel == target.numel()
    assert (ev[0].nan_count, ev[0].inf_count) == ((2, 0) if value == "nan" else (0, 2))
    assert ev[0].action == "repaired" and ev[0].step == 4
    assert all_finite(model, opt)


@pytest.mark.parametrize("info", INFOS, ids=IDS)
def test_skip_leaves_affected_tensor_untouched(info):
    model = make_model()
    opt = info.make(model.named_parameters(), resolution="skip")
    train_steps(model, opt, 3)
    target = model.fc1.weight
    opt.zero_grad()
    loss_fn(model, make_batch(50)).backward()
    target.grad[0, 0] = float("nan")
    p_before = target.detach().clone()
    st_before = {k: v.clone() for k, v in opt.state[target].items() if k != "step"}
    other_before = model.fc2.weight.detach().clone()
    opt.step()
    assert torch.equal(target, p_before)
    for k, v in st_before.items():
        assert torch.equal(opt.state[target][k], v), k
    assert not torch.equal(model.fc2.weight, other_before)
    assert opt.events[0].action == "skipped"


@pytest.mark.parametrize("info", INFOS, ids=IDS)
def test_policy_changed_between_steps_applies(info):
    """``resolution_policy`` is read at every step: a run that starts under "repair" and switches to "skip"
    skips (the affected tensor untouched, the event labelled so), and a bad value is refused on assignment,
    before any step can trip over it."""
    model = make_model()
    opt = info.make(model.named_parameters())
    train_steps(model, opt, 3)  # under "repair": the counters exist from here on
    opt.resolution_policy = "skip"
    target = model.fc1.weight
    opt.zero_grad()
    loss_fn(model, make_batch(50)).backward()
    target.grad[0, 0] = float("nan")
    p_before = target.detach().clone()
    opt.step()
    assert torch.equal(target, p_before)
    assert [e.action for e in opt.events] == ["skipped"]
    # back to "repair": the next event is repaired, and each keeps the label of its own step's policy,
    # across a checkpoint too
    opt.resolution_policy = "repair"
    assert [e.action for e in opt.events] == ["skipped"]  # read before any step ran under the new policy
    opt.zero_grad()
    loss_fn(model, make_batch(51)).backward()
    target.grad[0, 1] = float("inf")
    opt.step()
    assert not torch.equal(target, p_before)
    fresh = info.make(make_model().named_parameters())
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    for o in (opt, fresh):
        assert [(e.step, e.action) for e in o.events] == [(4, "skipped"), (5, "repaired")]
    settings = (opt.resolution_policy, opt.impl, opt.spike_factor)
    with pytest.raises(ValueError, match="resolution must be one of"):
        opt.resolution_policy = "ignore"
    with pytest.raises(ValueError, match="impl must be one of"):
        opt.impl = "cuda"
    with pytest.raises(ValueError, match="spike_factor"):
        opt.spike_factor = 0.5
    assert settings[0] == "repair" and (opt.resolution_policy, opt.impl, opt.spike_factor) == settings  # unchanged


@pytest.mark.parametrize("info, impl", EAGER_CASES, ids=impl_ids(EAGER_CASES))
def test_clean_steps_identical_to_off(info, impl):
    """Both policies: "skip" is its own path in several implementations (a snapshot and a restore)."""
    policies = ("off", "repair", "skip")
    models = [make_model() for _ in policies]
    opts = [info.make(m.named_parameters(), resolution=r, impl=impl) for m, r in zip(models, policies)]
    for m, o in zip(models, opts):
        train_steps(m, o, 15)
    ref = state_tensors(opts[0])
    for model, opt in zip(models[1:], opts[1:]):
        for a, b in zip(model.parameters(), models[0].parameters()):
            assert torch.equal(a, b), opt.resolution_policy
        got = state_tensors(opt)
        assert all(torch.equal(got[k], ref[k]) for k in ref), opt.resolution_policy
        assert opt.metrics()["resolution/events_total"] == 0.0


@pytest.mark.parametrize("info", INFOS, ids=IDS)
def test_off_policy_really_fails(info):
    """The control: without resolution a single NaN element poisons the run."""
    model = make_model()
    opt = info.make(model.named_parameters(), resolution="off")

    def inject(step, m):
        if step == 2:
            m.fc1.weight.grad[0, 0] = float("nan")
    train_steps(model, opt, 4, inject=inject)
    assert not all_finite(model, opt)


def test_one_percent_faulty_steps_end_near_the_clean_run():
    """1% of steps carry a NaN/Inf gradient element: repair ends within 2% of the clean loss; off ends NaN."""
    torch.manual_seed(0)
    X = torch.randn(512, 16)
    w_true = torch.randn(16, 1)
    Y = torch.tanh(X @ w_true) + 0.05 * torch.randn(512, 1)

    def run(resolution, faulty):
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        opt = no.AdamW(model.parameters(), lr=3e-3, resolution=resolution)
        gen = torch.Generator().manual_seed(2)
        for step in range(400):
            idx = torch.randint(0, 512, (64,), generator=gen)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(X[idx]), Y[idx])
            loss.backward()
            if faulty and step % 100 == 37:
                model[0].weight.grad[step % 32, 3] = float("nan") if step % 200 else float("inf")
            opt.step()
        with torch.no_grad():
            return torch.nn.functional.mse_loss(model(X), Y).item()

    clean = run("repair", False)
    repaired = run("repair", True)
    off = run("off", True)
    assert abs(repaired - clean) <= 0.02 * clean
    assert off != off  # NaN


GPU_CASES = impl_cases(("auto", "foreach", "compiled"))  # auto: the default users get


def _gpu_steps_without_sync(info, *, first_may_sync: bool = False, **kw):
    """Three CUDA steps of ``info``'s optimizer on the test model, the last with a NaN gradient entry, each
    under ``no_host_sync`` (the first one too, unless ``first_may_sync``): returns the optimizer."""
    model = make_model().cuda()
    opt = info.make(model.named_parameters(), **kw)
    tokens, img, y = (t.cuda() for t in make_batch(0))
    for i in range(3):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(tokens, img), y)
        loss.backward()
        if i == 2:
            model.fc1.weight.grad[0, 0] = float("nan")
        opt.set_loss(loss)
        if i == 0 and first_may_sync:
            opt.step()
            continue
        with no_host_sync():
            opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    return opt


@pytest.mark.gpu
@pytest.mark.parametrize("info, impl", GPU_CASES, ids=impl_ids(GPU_CASES))
def test_no_host_sync_in_step_on_gpu(info, impl):
    # The first step allocates state, and must not sync either — except where it runs torch.compile
    # (impl="compiled"), whose compile syncs (inductor's, not ours: 129 to 236 syncs at the first step, 0
    # after, in the first H100 run of `python -m experiments sync-audit`, 2026-11-25, commit 319bdff; that
    # run was not published).
    _gpu_steps_without_sync(info, first_may_sync=impl == "compiled", impl=impl)


@pytest.mark.gpu
@pytest.mark.parametrize("info", INFOS, ids=IDS)
def test_no_host_sync_under_deterministic_algorithms_on_gpu(info, monkeypatch):
    """``torch.use_deterministic_algorithms(True)`` swaps in other CUDA kernels for some ops — among them
    the ``index_add_`` that assembles the eager path's event counts (``_common.assemble_counts``; int64, so
    its result never depended on the order anyway) — and a swapped kernel may synchronise where the default
    one does not. The default step, with an event, under both modes at once."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (read at each call)
    torch.use_deterministic_algorithms(True)
    try:
        opt = _gpu_steps_without_sync(info)
    finally:
        torch.use_deterministic_algorithms(False)
    assert opt.metrics()["resolution/events_total"] >= 1


@pytest.mark.parametrize("info", INFOS, ids=IDS)
def test_persistent_whole_tensor_loss_holds_after_one_continuation_step(info):
    """An isolated all-NaN gradient takes a continuation step from momentum; a repeated one (within the
    repeat window) holds the parameter instead of drifting along a stale direction."""
    model = make_model()
    opt = info.make(model.named_parameters())
    train_steps(model, opt, 3)
    snapshots = []

    def inject(step, m):
        m.fc1.weight.grad.fill_(float("nan"))
        snapshots.append(m.fc1.weight.detach().clone())
    train_steps(model, opt, 3, seed=4, inject=inject)
    after = model.fc1.weight.detach()
    assert not torch.equal(snapshots[0], snapshots[1]), "first whole-tensor event: continuation step"
    assert torch.equal(snapshots[1], snapshots[2]) and torch.equal(snapshots[2], after), "repeats hold"
    assert all_finite(model, opt)


@pytest.mark.parametrize("impl", ["foreach", "compiled", "fused"])
@pytest.mark.parametrize("cls", [no.AdamW, no.SFAdamW], ids=["AdamW", "SFAdamW"])
def test_skip_holds_a_persistent_loss_as_the_loop_does(cls, impl):
    """"skip" applies the hold rule as "repair" does (the loop's ``_common.keep_flags``): a tensor whose
    gradient is entirely non-finite again within the repeat window writes nothing and counts no update —
    even where the update from its stale state would not be finite. The compiled, native and Triton scalar
    paths held only under "repair", so they counted that update, and the extra event fed the escalation
    (found by a differential soak of impl="fused" against impl="loop"; the Triton path runs this in
    tests/test_kernels_scalar_one.py)."""
    assert_skip_holds_as_the_loop_does(cls, impl)


@pytest.mark.parametrize("name", ["AdamW", "SFAdamW"])
@pytest.mark.parametrize("impl", ["loop", "foreach", "compiled", "fused"])
def test_a_finite_gradient_that_overflows_a_moment_is_a_missing_observation(name, impl):
    """g = 3e38 is finite, but (1-β₂)·g² overflows v. Only v used to be kept there: AdamW wrote m =
    0.9·m + 0.1·g (finite), schedule-free divided g itself by the old v, and m̂/√v̂ moved the parameter
    to ~1e35 (a third audit, 2026-11-26; torch's AdamW leaves v at +Inf and the entry at rest). Now the
    entry is missing for both moments: they keep their values, it moves nothing, and it counts once at the
    "moment" stage — in every implementation alike."""
    def run(impl):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(8))
        opt = getattr(no, name)([p], lr=1e-3, impl=impl)
        gen = torch.Generator().manual_seed(1)
        for t in range(8):
            g = torch.randn(8, generator=gen)
            if t == 3:
                g[2] = 3e38
                before = {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
            p.grad = g
            opt.step()
            if t == 3:
                after = opt.state[p]
                keys = ("exp_avg", "exp_avg_sq") if name == "AdamW" else ("exp_avg_sq",)
                assert all(after[k][2] == before[k][2] for k in keys)
                assert abs(float(p[2])) < 5
            assert float(p.detach().abs().max()) < 5
        return [p], opt

    ps, opt = run(impl)
    evs = [(e.step, e.stage, e.nan_count, e.inf_count) for e in opt.events]
    assert evs == [(4, "moment", 0, 1)]
    if impl != "loop":
        ref_ps, ref_opt = run("loop")
        assert_params_and_state_close(ref_ps, ref_opt, ps, opt)
