"""torch.optim's checkpoint conventions a user relies on without reading our docs: a state_dict loaded twice,
into a copy, from torch.optim.AdamW, from another model or another number of groups (refused before anything
changes), load hooks, copies and pickles, 16- and 64-bit models resumed exactly — each case a defect an audit
of the library found (2026-11-25 and after), and the behaviour now promised. The rest of the conventions:
tests/test_conventions.py and tests/test_precision_conventions.py."""
from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import nonans_optim as no
from optim_infos import IDS, INFOS, Wide, loss_fn, make_batch, make_model, same_tree, steps_on, train_steps

# the infos whose parameters the native loops take (impl="fused"), where a wrong size was memory-unsafe
FUSED = [i for i in INFOS if i.kwargs.get("impl") == "fused"]


@pytest.mark.parametrize("info", INFOS, ids=IDS)
def test_checkpoint_of_another_model_is_refused_before_anything_changes(info):
    """Same parameter count, other shapes: torch's load accepts it; the native loops then read and wrote
    past the state tensors (heap corruption). Refused now, naming the shape, with nothing replaced."""
    small, big = Wide(8), Wide(12)
    a, b = info.make(small.parameters()), info.make(big.parameters())
    steps_on(small, a, 2)
    steps_on(big, b, 2)
    before = copy.deepcopy(b.state_dict())
    with pytest.raises(ValueError, match="shape"):
        b.load_state_dict(a.state_dict())
    assert same_tree(b.state_dict(), before)
    steps_on(big, b, 1)  # and it still steps


@pytest.mark.parametrize("info", FUSED, ids=[i.name for i in FUSED])
def test_fused_kernels_refuse_state_of_another_size(info):
    """State edited by hand past load_state_dict: a clear error from the kernel launcher, never an
    out-of-bounds access."""
    model = Wide(8)
    opt = info.make(model.parameters())
    steps_on(model, opt, 1)
    st = opt.state[model.fc1.weight]
    key = "exp_avg_sq" if "exp_avg_sq" in st else "momentum_buffer"
    st[key] = torch.zeros(3)
    with pytest.raises(ValueError, match="entries"):
        steps_on(model, opt, 1)


@pytest.mark.parametrize("info", INFOS, ids=IDS)
def test_load_state_dict_twice_and_into_a_copy(info):
    """torch's load adds ``differentiable`` to the defaults; the fit check used to demand it of the
    checkpoint, so a second load (rolling back to the last good checkpoint) always failed."""
    model = make_model()
    opt = info.make(model.parameters())
    train_steps(model, opt, 2)
    saved = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(saved)
    opt.load_state_dict(saved)
    twin = copy.deepcopy(opt)
    twin.load_state_dict(saved)
    train_steps(model, opt, 1)


@pytest.mark.parametrize("info", INFOS, ids=IDS)
def test_deepcopy_and_pickle_make_a_working_optimizer(info):
    """torch's __getstate__ keeps defaults, state and param_groups only: a copy had no policy, impl or
    mode and failed at its first step. A copy (with its model) now takes the original's steps exactly."""
    model = make_model()
    opt = info.make(model.named_parameters(), resolution="skip")
    train_steps(model, opt, 2)
    m2, o2 = copy.deepcopy((model, opt))
    buf = io.BytesIO()
    pickle.dump((model, opt), buf)
    m3, o3 = pickle.loads(buf.getvalue())
    for m, o in ((model, opt), (m2, o2), (m3, o3)):
        train_steps(m, o, 2, seed=5)
    for m, o in ((m2, o2), (m3, o3)):
        assert o.resolution_policy == "skip" and o.impl == opt.impl
        for p, q in zip(model.parameters(), m.parameters()):
            assert torch.equal(p, q)
        assert o.metrics() == opt.metrics()


def test_torch_adamw_checkpoint_resumes_in_adamw():
    """A drop-in must take the checkpoint of the optimizer it replaces: the group keys torch lacks
    (warmup_steps) come from the new optimizer, the global step from the parameters' ``step``, and the
    resumed run follows torch's own."""
    models = [make_model() for _ in range(2)]
    ref = torch.optim.AdamW(models[0].parameters(), lr=1e-2, weight_decay=0.1)
    train_steps(models[0], ref, 3)
    models[1].load_state_dict(models[0].state_dict())
    ours = no.AdamW(models[1].parameters(), lr=1e-2, weight_decay=0.1)
    ours.load_state_dict(torch.load(_saved(ref.state_dict()), weights_only=True))
    assert ours.metrics()["optim/step"] == 3.0
    train_steps(models[0], ref, 3, seed=2)
    train_steps(models[1], ours, 3, seed=2)
    for p, q in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7)


def _saved(sd) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return buf


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_resume_keeps_the_polyak_step_on_steps_without_set_loss(impl):
    """set_loss() turns the Polyak step on for the rest of the run; that flag lived only on the instance,
    so a resumed optimizer ran the steps without a set_loss() at multiplier 1 (an uninterrupted run: the
    saved clamp value) while metrics() still reported the saved one."""
    def run(resume: bool):
        model = make_model()
        opt = no.SFNorMuon(model.parameters(), lr=1e-2, impl=impl)
        for i in range(6):
            if resume and i == 3:
                buf = io.BytesIO()
                torch.save(opt.state_dict(), buf)
                buf.seek(0)
                opt = no.SFNorMuon(model.parameters(), lr=1e-2, impl=impl)
                opt.load_state_dict(torch.load(buf, weights_only=True))
            opt.zero_grad()
            loss = loss_fn(model, make_batch(i))
            loss.backward()
            if i % 4 == 0:
                opt.set_loss(loss)
            opt.step()
        return model
    for p, q in zip(run(False).parameters(), run(True).parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("name", ["AdamW", "FullFusion"])
def test_load_hooks_see_the_checkpoint_as_given_and_the_optimizer_fully_loaded(name):
    """A load pre-hook may adapt the checkpoint before anything checks it (torch's docs: remap a checkpoint
    whose parameters are in another order — here by name), and a post-hook sees the loaded optimizer,
    counters included. The checks used to run before the pre-hooks (refusing what the hook would fix)
    and the optimizer-level state was restored after the post-hooks."""
    def by_name(opt, sd):
        saved = sd["param_groups"][0]
        where = dict(zip(saved["param_names"], saved["params"]))
        names = opt.param_groups[0]["param_names"]
        state = {j: sd["state"][where[n]] for j, n in enumerate(names) if where[n] in sd["state"]}
        return {"state": state, "param_groups": [{**saved, "params": list(range(len(names))), "param_names": names}]}

    model = Wide(5)
    saved_opt = getattr(no, name)(list(model.named_parameters())[::-1], lr=1e-2)  # saved in reverse order
    for _ in range(3):
        model(torch.randn(4, 6)).square().mean().backward()
        with torch.no_grad():
            model.fc1.weight.grad.view(-1)[:2] = float("nan")
        saved_opt.step()
        saved_opt.zero_grad()
    assert saved_opt.metrics()["resolution/events_total"] == 3
    opt = getattr(no, name)(model.named_parameters(), lr=1e-2)
    opt.register_load_state_dict_pre_hook(by_name)
    seen = {}
    opt.register_load_state_dict_post_hook(lambda o: seen.update(o.metrics()))
    opt.load_state_dict(saved_opt.state_dict())
    assert seen == opt.metrics() == saved_opt.metrics()
    for p in model.parameters():
        assert same_tree(opt.state[p], saved_opt.state[p])


def test_load_hooks_run_once_per_load():
    """The hooks run here, around the whole load, and not a second time from inside torch's part of it."""
    model = Wide(5)
    opt = no.AdamW(model.parameters(), lr=1e-2)
    steps_on(model, opt, 1)
    calls = []
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("post"))
    opt.load_state_dict(opt.state_dict())
    assert calls == ["pre", "post"]


def test_saved_group_hyperparameters_win_and_decide_the_expected_state():
    """torch's contract: a checkpoint's group values replace the loading optimizer's (the lr a schedule had
    reached, a group's path); only keys it lacks come from the current groups. The fit check reads the saved
    group too: a matrix saved on the scalar path (Adam state) is accepted, not refused for lacking the
    spectral path's momentum."""
    model = Wide(5)
    rest = [model.fc1.bias, model.fc2.weight, model.fc2.bias]
    saved = no.Muon([{"params": [model.fc1.weight], "path": "scalar", "lr": 3e-3}, {"params": rest}], lr=1e-2)
    steps_on(model, saved, 2)
    opt = no.Muon([{"params": [model.fc1.weight]}, {"params": rest}], lr=1e-2)
    opt.load_state_dict(saved.state_dict())
    assert (opt.param_groups[0]["path"], opt.param_groups[0]["lr"]) == ("scalar", 3e-3)
    steps_on(model, opt, 1)
    assert {"exp_avg", "exp_avg_sq"} <= opt.state[model.fc1.weight].keys()
    assert "momentum_buffer" not in opt.state[model.fc1.weight]


def test_a_checkpoint_with_another_number_of_groups_is_refused():
    """Two saved groups into one: torch's own error, not the first group loaded and the second dropped."""
    model = Wide(5)
    saved = no.AdamW([{"params": [model.fc1.weight]}, {"params": [model.fc2.weight]}], lr=1e-2)
    steps_on(model, saved, 1)
    opt = no.AdamW([model.fc1.weight], lr=1e-2)
    with pytest.raises(ValueError, match="number of parameter groups"):
        opt.load_state_dict(saved.state_dict())
    assert opt.state_dict()["state"] == {}


def test_torch_checkpoint_resumes_at_the_largest_parameter_step():
    """A torch.optim.AdamW checkpoint has no global step, only one per parameter, and a parameter that had
    no gradient at some step counts fewer: the run resumes at the largest — already when a load post-hook
    looks (the step is set before the post-hooks run, not after)."""
    model = Wide(5)
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps_on(model, ref, 3)
    model.fc2.weight.grad = None
    ref.step()  # fc2.weight stays at step 3, the others reach 4
    ours = no.AdamW(model.parameters(), lr=1e-2)
    seen = []
    ours.register_load_state_dict_post_hook(lambda o: seen.append(o.metrics()["optim/step"]))
    ours.load_state_dict(ref.state_dict())
    assert seen == [4.0] and ours.metrics()["optim/step"] == 4.0


def test_a_checkpoint_refused_for_name_routing_says_so():
    """Fusion routes by parameter name (a "head" matrix takes the scalar path): an unnamed checkpoint
    loaded into a named optimizer is refused, and the error names that cause, not another optimizer."""
    head = nn.Linear(6, 4)
    unnamed = no.SFNorMuon(head.parameters(), lr=1e-2)
    head(torch.randn(3, 6)).square().mean().backward()
    unnamed.step()
    named = no.SFNorMuon([("head.weight", head.weight), ("head.bias", head.bias)], lr=1e-2)
    with pytest.raises(ValueError, match="given parameter names and the other was not"):
        named.load_state_dict(unnamed.state_dict())


@pytest.mark.parametrize("saved_dtype", [torch.bfloat16, torch.float64])
def test_momentum_dtype_param_follows_the_loading_parameters(saved_dtype):
    """momentum_dtype="param": the buffer is kept in the parameter's dtype. torch casts every floating state
    tensor to the loading parameter's dtype; the buffer used to be put back in its *saved* dtype, so a bf16
    (or fp64) model's checkpoint resumed on an fp32 copy kept bf16 (fp64) momentum for good — lower
    precision, or a group the fp32 native loops no longer took. It now follows the parameter, with the
    saved values (exactly, for bf16 → fp32)."""
    src = Wide(5).to(saved_dtype)
    opt = no.SFNorMuon(src.parameters(), momentum_dtype="param", ns5_dtype="fp32")
    steps_on(src, opt, 2)
    saved = copy.deepcopy(opt.state_dict())
    dst = Wide(5)
    dst.load_state_dict({k: v.float() for k, v in src.state_dict().items()})
    opt2 = no.SFNorMuon(dst.parameters(), momentum_dtype="param", ns5_dtype="fp32")
    opt2.load_state_dict(saved)
    matrices = [p for p in dst.parameters() if p.ndim == 2]
    for i, q in enumerate(dst.parameters()):
        if q.ndim == 2:
            buf, was = opt2.state[q]["momentum_buffer"], saved["state"][i]["momentum_buffer"]
            assert buf.dtype == torch.float32 and was.dtype == saved_dtype
            if saved_dtype is torch.bfloat16:
                assert torch.equal(buf, was.float())
    assert matrices
    steps_on(dst, opt2, 1)
    assert all(opt2.state[q]["momentum_buffer"].dtype == torch.float32 for q in matrices)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("cls", [no.SFNorMuon, no.FullFusion], ids=["SFNorMuon", "FullFusion"])
def test_resume_of_a_16_or_64_bit_model_continues_exactly(cls, dtype):
    """State a step keeps in fp32 whatever the parameter's dtype — NorMuon's row moment, KL-Shampoo's
    factors — is put back in fp32 after torch's load cast it to the parameter's dtype: the first step after
    a resume raised on a bf16, fp16 or fp64 model (mixed dtypes; an audit, 2026-11-26). Now the resumed
    run is the uninterrupted one, bit for bit."""
    def run(resume: bool):
        model = Wide(5).to(dtype)
        opt = cls(model.parameters(), shampoo_refresh_every=2) if cls is no.FullFusion else cls(model.parameters())
        steps_on(model, opt, 2)
        if resume:
            saved = copy.deepcopy(opt.state_dict())
            kept = copy.deepcopy(saved)
            opt = type(opt)(model.parameters(), **({"shampoo_refresh_every": 2} if cls is no.FullFusion else {}))
            opt.load_state_dict(saved)
            for pid, st in opt.state_dict()["state"].items():
                for key, val in st.items():
                    if isinstance(val, torch.Tensor):
                        assert val.dtype == kept["state"][pid][key].dtype, key
        steps_on(model, opt, 2, seed=1)
        return model, opt
    (a, oa), (b, ob) = run(False), run(True)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert all(torch.equal(oa.state[p][k], ob.state[q][k]) for p, q in zip(a.parameters(), b.parameters())
               for k in oa.state[p] if isinstance(oa.state[p][k], torch.Tensor))


def test_momentum_dtype_bf16_survives_a_load_exactly():
    """momentum_dtype="bf16" on fp32 parameters: torch's cast to fp32 on load is undone, bit for bit."""
    model = Wide(5)
    opt = no.SFNorMuon(model.parameters(), momentum_dtype="bf16", ns5_dtype="fp32")
    steps_on(model, opt, 2)
    saved = copy.deepcopy(opt.state_dict())
    opt2 = no.SFNorMuon(model.parameters(), momentum_dtype="bf16", ns5_dtype="fp32")
    opt2.load_state_dict(saved)
    for i, p in enumerate(model.parameters()):
        if p.ndim == 2:
            buf = opt2.state[p]["momentum_buffer"]
            assert buf.dtype == torch.bfloat16 and torch.equal(buf, saved["state"][i]["momentum_buffer"])


def test_a_checkpoint_holding_several_optimizers_state_loads_without_misplaced_counters():
    """ZeroRedundancyOptimizer's consolidated state_dict holds each rank's optimizer-level dict, whose
    counters index that rank's shard. Loaded into one optimizer, the first rank's counters were given to
    the first parameters of the whole model (an event of 4.weight reported on 0.bias). Now they start afresh,
    with a warning; the step and the moments load as saved."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    params = list(model.parameters())
    shards = [no.SFNorMuon(params[:2]), no.SFNorMuon(params[2:])]  # rank 0's and rank 1's local optimizers
    for step in range(3):
        model(torch.randn(8, 4)).square().mean().backward()
        if step == 1:
            params[2].grad[0, 0] = float("nan")  # an event of rank 1's first parameter
        for opt in shards:
            opt.step()
        model.zero_grad()
    assert [e.param for e in shards[1].events] == [0]  # shard-local index
    a, b = (opt.state_dict() for opt in shards)
    merged = {"state": {**a["state"], **{k + 2: v for k, v in b["state"].items()}},
              "param_groups": [{**a["param_groups"][0], "params": [0, 1, 2, 3]}]}
    whole = no.SFNorMuon(params)
    with pytest.warns(RuntimeWarning, match="optimizer-level state of 2 optimizers"):
        whole.load_state_dict(merged)
    assert whole.events == [] and whole.metrics()["optim/step"] == 3.0
    assert torch.equal(whole.state[params[2]]["momentum_buffer"], shards[1].state[params[2]]["momentum_buffer"])
    model(torch.randn(8, 4)).square().mean().backward()
    whole.step()
    assert whole.metrics()["optim/step"] == 4.0 and all(torch.isfinite(p).all() for p in params)
