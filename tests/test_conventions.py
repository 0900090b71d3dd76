"""torch.optim conventions a user relies on without reading our docs: closures, LR-scheduler-driven betas,
groups added later, devices, torch.compile, torch's own arguments — each case a defect an audit of the
library found (2026-11-25), and the behaviour now promised. Checkpoints and copies:
tests/test_checkpoint_conventions.py; fp64, fp16 and bf16 parameters: tests/test_precision_conventions.py."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import nonans_optim as no
from optim_infos import IDS, INFOS, Wide, loss_fn, make_batch, make_model, train_steps


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
