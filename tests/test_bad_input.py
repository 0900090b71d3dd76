"""Bad input gets a clear error naming the problem, before anything changes (an audit of 2026-11-26 found
each case below accepted, crashing, or leaving the optimizer broken)."""
import copy

import numpy as np
import pytest
import torch

import nonans_optim as no
from optim_infos import make_model, train_steps


def _snapshot(opt, model):
    return copy.deepcopy(([p.detach().clone() for p in model.parameters()], opt.state_dict()))


@pytest.mark.parametrize("cls, impl", [(no.AdamW, "auto"), (no.Muon, "auto"), (no.SFNorMuon, "foreach")],
                         ids=["AdamW-auto", "Muon-auto", "SFNorMuon-foreach"])
@pytest.mark.parametrize("bad", ["fewer", "transposed"])
def test_gradient_of_another_shape_is_refused_before_anything_changes(cls, impl, bad):
    """The native loops trust the sizes: 10 gradient entries for a parameter of 1000 moved entries past
    the 10 from whatever memory followed (a 20M parameter crashed the process)."""
    model = make_model()
    opt = cls(model.named_parameters(), lr=1e-2, impl=impl)
    train_steps(model, opt, 2)
    before = _snapshot(opt, model)
    w = model.fc1.weight
    w.grad.data = torch.ones(10) if bad == "fewer" else torch.ones(w.shape[::-1])
    with pytest.raises(RuntimeError, match=r"shape \(.*\) on cpu for a parameter of dtype torch.float32, shape"):
        opt.step()
    params, sd = before
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert opt.state_dict()["state"][0]["nonans"]["step"] == sd["state"][0]["nonans"]["step"] == 2


@pytest.mark.parametrize("cls", [no.AdamW, no.SFAdamW, no.SFNorMuon, no.FullFusion],
                         ids=lambda c: c.__name__)
def test_group_flags_this_library_lacks_are_refused_where_given(cls):
    """maximize=True in a group was accepted and ignored: the run descended (torch's AdamW ascends)."""
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="does not implement maximize=True"):
        cls([{"params": [p], "maximize": True}])
    opt = cls([p])
    with pytest.raises(ValueError, match="does not implement amsgrad=True"):
        opt.add_param_group({"params": [q], "amsgrad": True})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [q], "maximize": False})  # torch's defaults are fine


def _corrupt_group(key, value):
    def f(sd):
        sd["param_groups"][0][key] = value
    return f


def _corrupt_global(fn):
    def f(sd):
        fn(sd["state"][0]["nonans"])
    return f


CORRUPTIONS = {
    "eps nan": (_corrupt_group("eps", float("nan")), "param group 0: Invalid eps"),
    "negative lr": (_corrupt_group("lr", -1.0), "param group 0: Invalid lr"),
    "beta 1.5": (_corrupt_group("betas", (1.5, 0.9)), r"param group 0: Invalid betas\[0\]"),
    "lr string": (_corrupt_group("lr", "x"), "param group 0: Invalid lr"),
    "maximize": (_corrupt_group("maximize", True), "param group 0: AdamW does not implement maximize"),
    "no step": (_corrupt_global(lambda g: g.pop("step")), "has step None"),
    "float step": (_corrupt_global(lambda g: g.__setitem__("step", torch.tensor(2.0))), "has step tensor"),
    "no polyak": (_corrupt_global(lambda g: g.pop("polyak")), "has no Polyak state"),
    "polyak lacks a key": (_corrupt_global(lambda g: g["polyak"].pop("loss_seen")), r"\['loss_seen'\]"),
    "counters lack scale": (_corrupt_global(lambda g: g["resolution"].pop("scale")), "'scale'"),
    "counters lack events": (_corrupt_global(lambda g: g["resolution"].pop("events")), r"missing \['events'\]"),
    "state not a dict": (lambda sd: sd["state"].__setitem__(1, None), "parameter 1 of group 0 .* is a NoneType"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_a_refused_load_changes_nothing(case):
    """Each of these loaded (a failed load swapped the state in first) and broke every later step(), or
    trained wrong (eps=nan: an update event every step)."""
    corrupt, message = CORRUPTIONS[case]
    model = make_model()
    opt = no.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, opt, 2)
    twin_model, twin = copy.deepcopy((model, opt))
    sd = opt.state_dict()
    bad = copy.deepcopy(sd)
    corrupt(bad)
    given = copy.deepcopy(bad)
    with pytest.raises(ValueError, match=f"this state_dict does not fit AdamW: .*{message}"):
        opt.load_state_dict(bad)
    assert str(bad) == str(given)  # the caller's checkpoint untouched
    train_steps(model, opt, 2, seed=3)
    train_steps(twin_model, twin, 2, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters()))


def test_an_integer_step_tensor_loads_as_the_host_step():
    model = make_model()
    opt = no.AdamW(model.parameters())
    train_steps(model, opt, 2)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["nonans"]["step"] = torch.tensor(2)
    opt.load_state_dict(sd)
    assert type(opt._global()["step"]) is int and opt._global()["step"] == 2
    train_steps(model, opt, 1)
    assert opt.metrics()["optim/step"] == 3.0


def test_set_loss_refuses_what_has_no_float_value():
    opt = no.SFNorMuon(make_model().named_parameters())
    with pytest.raises(ValueError, match="real scalar loss"):
        opt.set_loss(torch.tensor(1.0, device="meta"))
    with pytest.raises(ValueError, match="no float can hold"):
        opt.set_loss(10 ** 400)


def test_meta_parameters_step_as_torch_steps_them():
    """(the autocast check raised for the meta device)"""
    p = torch.nn.Parameter(torch.ones(3, device="meta"))
    opt = no.AdamW([p], impl="foreach")
    p.grad = torch.ones(3, device="meta")
    opt.step()
    assert opt.state[p]["exp_avg"].is_meta


def test_numpy_scalars_are_numbers():
    p = torch.nn.Parameter(torch.ones(3))
    opt = no.AdamW([p], lr=np.float32(1e-2), betas=(np.float32(0.9), 0.999), eps=np.float64(1e-8))
    p.grad = torch.ones(3)
    opt.step()
    assert torch.isfinite(p).all() and not torch.equal(p, torch.ones(3))
    with pytest.raises(ValueError, match="Invalid lr"):
        no.AdamW([p], lr=np.bool_(True))
