"""torch.optim conventions a user relies on without reading our docs: checkpoints (of another model, loaded
twice, from torch.optim.AdamW), copies, closures, LR-scheduler-driven betas, groups added later — each
case a defect an audit of the library found (2026-11-25), and the behaviour now promised."""
from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import nonans_optim as no
from optim_infos import IDS, INFOS, loss_fn, make_batch, make_model, same_tree, train_steps

# the infos whose parameters the native loops take (impl="fused"), where a wrong size was memory-unsafe
FUSED = [i for i in INFOS if i.kwargs.get("impl") == "fused"]


class Wide(nn.Module):
    """Two Linear layers whose width changes every shape but not the number of parameter tensors."""

    def __init__(self, width: int):
        super().__init__()
        torch.manual_seed(width)
        self.fc1, self.fc2 = nn.Linear(6, width), nn.Linear(width, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _steps(model, opt, n: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(16, 6, generator=g).to(dtype)).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("info", INFOS, ids=IDS)
def test_checkpoint_of_another_model_is_refused_before_anything_changes(info):
    """Same parameter count, other shapes: torch's load accepts it; the native loops then read and wrote
    past the state tensors (heap corruption). Refused now, naming the shape, with nothing replaced."""
    small, big = Wide(8), Wide(12)
    a, b = info.make(small.parameters()), info.make(big.parameters())
    _steps(small, a, 2)
    _steps(big, b, 2)
    before = copy.deepcopy(b.state_dict())
    with pytest.raises(ValueError, match="shape"):
        b.load_state_dict(a.state_dict())
    assert same_tree(b.state_dict(), before)
    _steps(big, b, 1)  # and it still steps


@pytest.mark.parametrize("info", FUSED, ids=[i.name for i in FUSED])
def test_fused_kernels_refuse_state_of_another_size(info):
    """State edited by hand past load_state_dict: a clear error from the kernel launcher, never an
    out-of-bounds access."""
    model = Wide(8)
    opt = info.make(model.parameters())
    _steps(model, opt, 1)
    st = opt.state[model.fc1.weight]
    key = "exp_avg_sq" if "exp_avg_sq" in st else "momentum_buffer"
    st[key] = torch.zeros(3)
    with pytest.raises(ValueError, match="entries"):
        _steps(model, opt, 1)


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


@pytest.mark.parametrize("flag", ["amsgrad", "maximize"])
def test_torch_features_we_lack_are_refused(flag):
    model = make_model()
    ref = torch.optim.AdamW(model.parameters(), **{flag: True})
    train_steps(model, ref, 1)
    ours = no.AdamW(model.parameters())
    with pytest.raises(ValueError, match=flag):
        ours.load_state_dict(ref.state_dict())


@pytest.mark.parametrize("cls", [no.SFNorMuon, no.FullFusion], ids=["SFNorMuon", "FullFusion"])
def test_closure_takes_the_same_step_as_calling_it_first(cls):
    """step(closure) used to feed the closure's loss to set_loss, which switches the Polyak multiplier
    on (a 10x step on the tasks of OPEN_QUESTIONS.md Q5) — for every trainer that passes a closure."""
    models = [make_model() for _ in range(2)]
    opts = [cls(m.parameters(), lr=1e-2) for m in models]
    for i in range(3):
        batch = make_batch(i)

        def closure(m=models[0], o=opts[0]):
            o.zero_grad()
            loss = loss_fn(m, batch)
            loss.backward()
            return loss

        got = opts[0].step(closure)
        opts[1].zero_grad()
        want = loss_fn(models[1], batch)
        want.backward()
        opts[1].step()
        assert torch.equal(got, want)
    for p, q in zip(*(m.parameters() for m in models)):
        assert torch.equal(p, q)
    assert opts[0].metrics()["fusion/gamma_mult"] == 1.0


@pytest.mark.parametrize("make", [
    lambda ps: no.SFAdamW(ps, lr=1e-2, betas=(0.7, 0.999)),
    lambda ps: no.SFNorMuon(ps, lr=1e-2, betas=(0.7, 0.999), sf_beta=0.9, spike_factor=None),
    lambda ps: no.SFNorMuon(ps, lr=1e-2, betas=(0.9, 0.999), sf_beta=0.6, spike_factor=None, impl="fused"),
], ids=["SFAdamW", "SFNorMuon", "SFNorMuon-fused"])
def test_schedule_free_eval_is_the_average_of_z(make):
    """With a constant lr the schedule-free average is x_T = mean(z_1..z_T) (c_t = 1/t), whatever β is, so
    eval() must return it. The scalar path stepped with sf_beta but rebuilt x with betas[0]: wrong x on
    biases and norms whenever the two differed (and under OneCycleLR, which cycles betas[0])."""
    model = make_model()
    opt = make(model.parameters())
    zs = []
    for i in range(4):
        train_steps(model, opt, 1, seed=i)
        zs.append([opt.state[p]["z"].clone() for p in model.parameters()])
    opt.eval()
    for k, p in enumerate(model.parameters()):
        torch.testing.assert_close(p.detach(), torch.stack([z[k] for z in zs]).mean(0), rtol=1e-4, atol=1e-6)


def test_sfadamw_reads_betas_at_every_step():
    """SFAdamW takes β from betas[0] at every step, as schedule_free's AdamW does, so a scheduler that
    cycles it (OneCycleLR's cycle_momentum) reaches the step; a copy made at construction used to ignore
    it. Setting betas before the first step must equal constructing with them."""
    models = [make_model() for _ in range(2)]
    a = no.SFAdamW(models[0].parameters(), lr=1e-2)
    b = no.SFAdamW(models[1].parameters(), lr=1e-2, betas=(0.7, 0.999))
    a.param_groups[0]["betas"] = (0.7, 0.999)
    for m, o in zip(models, (a, b)):
        train_steps(m, o, 3)
        o.eval()
    for p, q in zip(*(m.parameters() for m in models)):
        assert torch.equal(p, q)


@pytest.mark.parametrize("bad, match", [
    (dict(lr=-1.0), "lr"), (dict(weight_decay=-1.0), "weight_decay"), (dict(betas=(2.0, 0.9)), "betas"),
    (dict(eps=-1.0), "eps"), (dict(warmup_steps=1.5), "warmup_steps"), (dict(path="bogus"), "path"),
    (dict(nesterov="yes"), "nesterov"), (dict(momentum=1.5), "momentum"), (dict(ns_steps=0), "ns_steps"),
])
def test_add_param_group_checks_like_the_constructor(bad, match):
    """A bad value in a group added later used to pass and fail halfway through a step, earlier groups
    already updated. Refused where given, and the group is not added."""
    model = make_model()
    opt = no.SFNorMuon([model.fc1.weight])
    with pytest.raises(ValueError, match=match):
        opt.add_param_group({"params": [model.fc2.weight], **bad})
    assert len(opt.param_groups) == 1
    train_steps(model, opt, 1)


@pytest.mark.parametrize("name, value", [
    ("weight_decay", 0.01), ("eps", 1e-8), ("momentum", 0.9), ("betas", (0.9, 0.99)), ("normuon_eps", 1e-8),
])
def test_hyperparameters_on_a_device_are_refused_but_cpu_tensors_step(name, value):
    """step() reads every hyperparameter but lr on the host; a device tensor there would be a sync at every
    step. Refused where given (the meta device stands in for a GPU), naming it; a CPU tensor steps as the
    float does (to rounding: a tensor's arithmetic is fp32, the float's double)."""
    cls = no.AdamW if name in ("eps", "betas") else no.SFNorMuon
    dev = (tuple(torch.tensor(b, device="meta") for b in value) if name == "betas"
           else torch.tensor(value, device="meta"))
    with pytest.raises(ValueError, match=f"{name}.*meta tensor"):
        cls([nn.Parameter(torch.randn(4, 4))], **{name: dev})
    opt = cls([nn.Parameter(torch.randn(4, 4))])
    with pytest.raises(ValueError, match=f"{name}.*meta tensor"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(4, 4))], name: dev})
    assert len(opt.param_groups) == 1
    host = tuple(torch.tensor(b) for b in value) if name == "betas" else torch.tensor(value)
    models = [make_model(), make_model()]
    opts = [cls(models[0].parameters(), **{name: value}), cls(models[1].parameters(), **{name: host})]
    for m, o in zip(models, opts):
        train_steps(m, o, 3)
    for p, q in zip(*(m.parameters() for m in models)):  # betas 1.5e-8 apart; (0.9, 0.999) would be 5e-6
        torch.testing.assert_close(p, q, rtol=0.0, atol=1e-7)


@pytest.mark.parametrize("info", INFOS[:2], ids=IDS[:2])
def test_add_param_group_refuses_complex_and_vector_on_spectral(info):
    opt = info.make([nn.Parameter(torch.randn(4, 4))])
    with pytest.raises(ValueError, match="complex"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(4, dtype=torch.complex64))]})
    fusion = no.SFNorMuon([nn.Parameter(torch.randn(4, 4))])
    with pytest.raises(ValueError, match="spectral"):
        fusion.add_param_group({"params": [nn.Parameter(torch.randn(4))], "path": "spectral"})
    assert len(opt.param_groups) == len(fusion.param_groups) == 1


@pytest.mark.parametrize("info", INFOS, ids=IDS)
def test_parameters_on_two_devices_are_refused(info):
    """One optimizer keeps its counters and step sizes on its first parameter's device: parameters on another
    device are refused at construction and in add_param_group (the group is not added, the optimizer still
    steps). The meta device stands in for a second device here; a GPU copy runs cuda + cpu."""
    cpu, other = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.empty(4, 4, device="meta"))
    with pytest.raises(ValueError, match=r"more than one device \(cpu, meta\)"):
        info.make([cpu, other])
    opt = info.make([cpu])
    with pytest.raises(ValueError, match="one optimizer per device"):
        opt.add_param_group({"params": [other]})
    assert len(opt.param_groups) == 1
    cpu.grad = torch.randn(4, 4)
    opt.step()
    assert torch.isfinite(cpu).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_parameters_on_cuda_and_cpu_are_refused():
    with pytest.raises(ValueError, match="more than one device"):
        no.AdamW([nn.Parameter(torch.randn(3, device="cuda")), nn.Parameter(torch.randn(3))])


def test_polyak_l1_norm_of_fp16_gradients_does_not_overflow():
    """Σ|g| of an fp16 gradient passes 65504 at 300x300 ones: taken in fp16 it was Inf, and the finite
    gradient dropped out of Ḡ as if it were non-finite (γ stayed 1)."""
    p = nn.Parameter(torch.zeros(300, 300, dtype=torch.float16))
    opt = no.SFNorMuon([p])
    for _ in range(3):
        p.grad = torch.ones_like(p)
        opt.set_loss(2.0)
        opt.step()
    m = opt.metrics()
    assert m["fusion/gnorm_ema"] == 1.0 and m["fusion/gamma_mult"] == 2.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(dtype=torch.int32), "floating"), (dict(steps=2.5), "steps"), (dict(steps=-1), "steps"),
])
def test_ns5_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        no.ns5(torch.randn(4, 4), **kwargs)


def test_ns5_refuses_a_tensor_that_requires_grad():
    G = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(ValueError, match="differentiable"):
        no.ns5(G)
    with torch.no_grad():
        assert torch.equal(no.ns5(G), no.ns5(G.detach()))


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


def test_fp16_parameters_on_the_adam_path_warn():
    """In fp16 the Adam moments of an ordinary gradient underflow (v and eps round to 0): the eager paths
    divided 0 by 0 every step, repaired it and never moved the parameter, the fused one took ~8x the step.
    A warning names it where the parameters are given; bf16 and spectral-routed fp16 matrices are fine."""
    half = nn.Linear(4, 4).half()
    with pytest.warns(UserWarning, match="float16"):
        no.AdamW(half.parameters())
    with pytest.warns(UserWarning, match=r"1 float16 parameter\(s\) \(shapes \[\(4,\)\]\)"):
        no.SFNorMuon(half.parameters())  # the bias only: the weight takes NS5
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        no.AdamW(nn.Linear(4, 4).bfloat16().parameters())
        no.SFNorMuon([nn.Parameter(torch.randn(4, 4, dtype=torch.float16))])


@pytest.mark.parametrize("name", ["SFNorMuon", "SFAdamW"])
def test_a_compiled_training_step_matches_eager_and_compiles_once(name):
    """torch.compile of the README's training step — forward, backward, set_loss, step, zero_grad, and an
    eval()/train() round trip — takes the eager steps exactly, and compiles one graph for all of them.
    Traced, set_loss and eval() lost their writes to the optimizer (the Polyak step never turned on:
    0.2 off eager after 4 steps; eval() swapped the parameters but left the mode "train"), and step()'s
    host bookkeeping recompiled at every step until dynamo's limit (an audit, 2026-11-25)."""
    from torch._dynamo.utils import counters

    def train_step(model, opt, x):
        loss = model(x).square().mean()
        loss.backward()
        opt.set_loss(loss)
        opt.step()
        opt.zero_grad()
        opt.eval()
        opt.train()
        return loss

    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    (eager, opt_e), (comp, opt_c) = [(m, getattr(no, name)(m.parameters(), lr=1e-2)) for m in (Wide(5), Wide(5))]
    torch._dynamo.reset()
    counters.clear()
    step_c = torch.compile(train_step, backend="eager")
    for _ in range(4):
        train_step(eager, opt_e, x)
        step_c(comp, opt_c, x)
    for p, q in zip(eager.parameters(), comp.parameters()):
        assert torch.equal(p, q)
    assert opt_c.metrics() == opt_e.metrics()
    assert counters["stats"]["unique_graphs"] == 1
    step_c_eval = torch.compile(lambda o: o.eval(), backend="eager")
    step_c_eval(opt_c)
    with pytest.raises(RuntimeError, match="eval mode"):
        opt_c.step()  # the mode was recorded: no training step on the averaged x


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
    _steps(model, opt, 1)
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
    _steps(model, saved, 2)
    opt = no.Muon([{"params": [model.fc1.weight]}, {"params": rest}], lr=1e-2)
    opt.load_state_dict(saved.state_dict())
    assert (opt.param_groups[0]["path"], opt.param_groups[0]["lr"]) == ("scalar", 3e-3)
    _steps(model, opt, 1)
    assert {"exp_avg", "exp_avg_sq"} <= opt.state[model.fc1.weight].keys()
    assert "momentum_buffer" not in opt.state[model.fc1.weight]


def test_a_checkpoint_with_another_number_of_groups_is_refused():
    """Two saved groups into one: torch's own error, not the first group loaded and the second dropped."""
    model = Wide(5)
    saved = no.AdamW([{"params": [model.fc1.weight]}, {"params": [model.fc2.weight]}], lr=1e-2)
    _steps(model, saved, 1)
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
    _steps(model, ref, 3)
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


@pytest.mark.parametrize("impl", ["loop", "foreach", "compiled", "auto"])
def test_fp64_adamw_is_torchs_adamw(impl):
    """fp64 parameters get γ, the hyperparameters and the bias corrections in fp64: the steps equal
    torch.optim.AdamW's (compiled: inductor's own operation order, within 1e-8), and a decay factor
    1 - lr·wd = 1 - 1e-8 is applied, not rounded to 1 (in fp32 it was: 7.7e-7 off torch after 20 steps)."""
    p0 = torch.randn(7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ref, got = nn.Parameter(p0.clone()), nn.Parameter(p0.clone())
    ref_opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=1e-5)
    got_opt = no.AdamW([got], lr=1e-3, weight_decay=1e-5, impl=impl)
    for t in range(20):
        ref.grad = torch.randn(7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(t))
        got.grad = ref.grad.clone()
        ref_opt.step()
        got_opt.step()
    torch.testing.assert_close(got, ref, rtol=1e-8 if impl == "compiled" else 0, atol=0)
    w = nn.Parameter(torch.ones(3, dtype=torch.float64))
    w.grad = torch.zeros(3, dtype=torch.float64)
    no.AdamW([w], lr=1.0, weight_decay=1e-8, impl=impl).step()
    assert torch.equal(w, torch.full((3,), 1 - 1e-8, dtype=torch.float64))


@pytest.mark.parametrize("impl", ["loop", "foreach", "compiled", "auto"])
@pytest.mark.parametrize("name", ["FullFusion", "SFNorMuon"])
def test_fp64_fusion_with_set_loss_steps(name, impl):
    """The Polyak L1 norm of fp64 gradients is taken in fp64 (a norm may only widen its input: asking
    for fp32 raised, so every fp64 Fusion step after set_loss() failed — a regression of the fp32-sum fix)."""
    model = Wide(5).double()
    opt = getattr(no, name)(model.parameters(), lr=1e-2, impl=impl)
    for _ in range(2):
        loss = model(torch.randn(4, 6, dtype=torch.float64)).square().mean()
        loss.backward()
        opt.set_loss(loss)
        opt.step()
        opt.zero_grad()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert opt.metrics()["fusion/gamma_mult"] != 1.0  # the Polyak step ran


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_set_loss_is_consumed_by_one_step_and_the_polyak_step_stays_on(impl):
    """set_loss() gives the loss of *one* step: a later step without it folds no loss into L̄ (a stale loss
    re-fed every step would pull L̄ towards an old value), yet the Polyak step stays on — Ḡ keeps tracking
    the gradients and γ keeps the multiplier L̄/Ḡ — for the rest of the run, as the module promises."""
    model = make_model()
    opt = no.SFNorMuon(model.parameters(), lr=1e-2, impl=impl)
    snaps = []
    for i, given in enumerate((3.0, 5.0, None)):
        opt.zero_grad()
        loss_fn(model, make_batch(i)).backward()
        if given is not None:
            opt.set_loss(given)
        opt.step()
        snaps.append({k: opt._global()["polyak"][k].clone() for k in ("loss_ema", "gnorm_ema", "gamma_mult")})
    assert snaps[1]["loss_ema"].item() == pytest.approx(0.98 * 3.0 + 0.02 * 5.0)
    assert torch.equal(snaps[2]["loss_ema"], snaps[1]["loss_ema"])  # step 3 had no loss: L̄ unchanged
    assert not torch.equal(snaps[2]["gnorm_ema"], snaps[1]["gnorm_ema"])  # but Ḡ followed step 3's gradients
    want = (snaps[2]["loss_ema"] / snaps[2]["gnorm_ema"]).clamp(0.1, 10.0)
    torch.testing.assert_close(snaps[2]["gamma_mult"], want, rtol=0, atol=0)
    assert opt.metrics()["fusion/gamma_mult"] == pytest.approx(want.item())


@pytest.mark.parametrize("cls", [no.SFAdamW, no.SFNorMuon], ids=["SFAdamW", "SFNorMuon"])
def test_a_refused_step_is_not_counted(cls):
    """A step() refused in eval mode, or for a sparse gradient, changes nothing — the global step included
    (it drives warmup, the schedule-free weights, bias correction and the events' step labels): the next
    real step is numbered as if the refused call had never been made."""
    model = make_model()
    opt = cls(model.parameters(), lr=1e-2)
    train_steps(model, opt, 2)
    opt.eval()
    with pytest.raises(RuntimeError, match="eval mode"):
        opt.step()
    calls = []  # refused before the closure runs (as schedulefree does): no forward/backward on x
    with pytest.raises(RuntimeError, match="eval mode"):
        opt.step(lambda: calls.append(1))
    assert calls == []
    opt.train()
    assert opt.metrics()["optim/step"] == 2.0
    model.embed.weight.grad = torch.sparse_coo_tensor([[0]], [[1.0] * 8], (11, 8), check_invariants=True)
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert opt.metrics()["optim/step"] == 2.0
    train_steps(model, opt, 1)
    assert opt.metrics()["optim/step"] == 3.0


@pytest.mark.parametrize("saved_dtype", [torch.bfloat16, torch.float64])
def test_momentum_dtype_param_follows_the_loading_parameters(saved_dtype):
    """momentum_dtype="param": the buffer is kept in the parameter's dtype. torch casts every floating state
    tensor to the loading parameter's dtype; the buffer used to be put back in its *saved* dtype, so a bf16
    (or fp64) model's checkpoint resumed on an fp32 copy kept bf16 (fp64) momentum for good — lower
    precision, or a group the fp32 native loops no longer took. It now follows the parameter, with the
    saved values (exactly, for bf16 → fp32)."""
    src = Wide(5).to(saved_dtype)
    opt = no.SFNorMuon(src.parameters(), momentum_dtype="param", ns5_dtype="fp32")
    _steps(src, opt, 2)
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
    _steps(dst, opt2, 1)
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
        _steps(model, opt, 2)
        if resume:
            saved = copy.deepcopy(opt.state_dict())
            kept = copy.deepcopy(saved)
            opt = type(opt)(model.parameters(), **({"shampoo_refresh_every": 2} if cls is no.FullFusion else {}))
            opt.load_state_dict(saved)
            for pid, st in opt.state_dict()["state"].items():
                for key, val in st.items():
                    if isinstance(val, torch.Tensor):
                        assert val.dtype == kept["state"][pid][key].dtype, key
        _steps(model, opt, 2, seed=1)
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
    _steps(model, opt, 2)
    saved = copy.deepcopy(opt.state_dict())
    opt2 = no.SFNorMuon(model.parameters(), momentum_dtype="bf16", ns5_dtype="fp32")
    opt2.load_state_dict(saved)
    for i, p in enumerate(model.parameters()):
        if p.ndim == 2:
            buf = opt2.state[p]["momentum_buffer"]
            assert buf.dtype == torch.bfloat16 and torch.equal(buf, saved["state"][i]["momentum_buffer"])


class LogitScale(nn.Module):
    """A Linear and a 0-d parameter (CLIP's ``logit_scale``): a 0-d tensor takes part in type promotion
    differently from one with dimensions, which three paths got wrong (below)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.lin = nn.Linear(6, 4)
        self.logit_scale = nn.Parameter(torch.tensor(2.6))

    def forward(self, x):
        return self.lin(x) * self.logit_scale.exp()


@pytest.mark.parametrize("name", ["AdamW", "SFAdamW", "Muon", "SFNorMuon"])
@pytest.mark.parametrize("impl,dtype", [("loop", torch.bfloat16), ("foreach", torch.float16)])
def test_a_half_precision_0d_parameter_steps_and_repair_equals_off(dtype, name, impl):
    """The 0-d parameter's update came out in fp32 (0-d times the 0-d fp32 step size promotes), and the
    guarded write into the bf16/fp16 parameter raised under "repair" and "skip": AdamW and Muon crashed at
    their first step on such a model, which torch.optim.AdamW steps."""
    runs = {}  # (the eager paths: the compiled kernel, which impl="fused" runs for 16-bit groups, had no crash)
    for policy in ("repair", "skip", "off"):
        model = LogitScale().to(dtype)
        opt = getattr(no, name)(model.named_parameters(), lr=1e-2, impl=impl, resolution=policy)
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 6, generator=g).to(dtype)).float().square().mean().backward()
            opt.step()
        runs[policy] = [p.detach().clone() for p in model.parameters()]
        assert model.logit_scale.dtype == dtype and model.logit_scale.dim() == 0
    assert not torch.equal(runs["off"][0], LogitScale().to(dtype).logit_scale)  # it moved
    for policy in ("repair", "skip"):
        assert all(torch.equal(a, b) for a, b in zip(runs[policy], runs["off"])), policy


@pytest.mark.parametrize("impl", ["foreach", "compiled", "fused"])
def test_fp64_parameters_of_any_shape_match_torch_adamw(impl):
    """fp64 groups run the compiled kernel under impl="compiled" and "fused" (the native loops are fp32).
    There a 0-d tensor's in-place writes were lost (its moments never moved: 1e-2 off torch's AdamW after
    five steps), and under "repair" the per-parameter step sizes were rounded to fp32 (a 1-D fp32 scale
    times the 0-d fp64 γ promotes to fp32: 1e-9 off). Both now match torch to fp64 rounding."""
    shapes = [(), (1,), (3,), (4, 5)]
    gen = torch.Generator().manual_seed(0)
    ref = [nn.Parameter(torch.randn(s, dtype=torch.float64, generator=gen)) for s in shapes]
    ours = [nn.Parameter(p.detach().clone()) for p in ref]
    t_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    o_opt = no.AdamW(ours, lr=1e-2, weight_decay=0.1, impl=impl)
    for _ in range(5):
        for p, q in zip(ref, ours):
            p.grad = torch.randn(p.shape, dtype=torch.float64, generator=gen)
            q.grad = p.grad.clone()
        t_opt.step()
        o_opt.step()
    for p, q in zip(ref, ours):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-15)
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(o_opt.state[q][k], t_opt.state[p][k], rtol=0, atol=1e-15)


def test_param_names_of_another_length_than_params_are_dropped_with_a_warning():
    """ZeroRedundancyOptimizer gives each rank's shard of a group the group's whole param_names list (torch
    accepts it): names were then matched by position to other tensors — an embedding routed by a hidden
    layer's name to the spectral path, events labelled with other parameters' names. They are dropped."""
    model = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 8, bias=False))
    names, params = zip(*model.named_parameters())
    with pytest.warns(RuntimeWarning, match="2 param_names for 1 params"):
        opt = no.SFNorMuon([{"params": [params[1]], "param_names": list(names)}])
    assert opt.param_groups[0]["param_names"] == [None]
    assert opt._param_names() == [0]
    ok = no.SFNorMuon([{"params": list(params), "param_names": list(names)}])  # matching lengths: kept
    assert ok._param_names() == list(names)


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


def test_torch_adamw_arguments_are_taken_as_torch_takes_them():
    """Code and configs written for torch.optim.AdamW (its amsgrad, maximize, foreach, capturable,
    differentiable, fused) raised "unexpected keyword argument"; taken now at torch's defaults."""
    p = [torch.nn.Parameter(torch.randn(3, 2))]
    assert no.AdamW(p, 1e-3, (0.9, 0.999), 1e-8, 1e-2, False).impl == "auto"  # torch's positional amsgrad
    assert no.AdamW(p, amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False,
                    fused=None).impl == "auto"
    assert no.AdamW(p, fused=True).impl == "fused" and no.AdamW(p, foreach=True).impl == "foreach"
    assert no.AdamW(p, foreach=False, fused=False).impl == "auto"  # which implementation, never the result
    for kw in ("amsgrad", "maximize", "capturable", "differentiable"):
        with pytest.raises(ValueError, match=f"does not implement {kw}=True"):
            no.AdamW(p, **{kw: True})
    with pytest.raises(ValueError, match="cannot be given together"):
        no.AdamW(p, foreach=True, fused=True)
    with pytest.raises(ValueError, match="impl='loop' and fused=True"):
        no.AdamW(p, impl="loop", fused=True)
