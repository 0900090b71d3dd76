"""Telemetry the resolution contract promises, beyond the counts themselves (test_resolution.py): whose
event a bad loss is, what survives add_param_group and a checkpoint of another policy, what set_loss
accepts, wandb's event cursor, and watch() under inference mode — each case a defect an audit of the
library found (2026-11-25)."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from torch import nn

import nonans_optim as no
from optim_infos import make_model, train_steps


def _nan_at(step_no: int):
    def inject(step, model):
        if step == step_no:
            model.fc1.weight.grad[0, 0] = float("nan")
    return inject


@pytest.mark.parametrize("impl", ["loop", "fused"])
def test_a_bad_loss_is_nobodys_event_and_backs_nothing_off(impl):
    """A non-finite set_loss() value is recorded in row 0 of the count block; it used to count as an event
    of parameter 0, so repeated bad losses halved that one parameter's step size (1/32 after 6 steps)."""
    model = make_model()
    opt = no.SFNorMuon(model.named_parameters(), impl=impl)
    for _ in range(8):
        opt.zero_grad()
        model(*_batch()[:2]).square().mean().backward()
        opt.set_loss(float("nan"))
        opt.step()
    m = opt.metrics()
    assert m["resolution/events_loss"] == 8.0 and m["resolution/min_scale"] == 1.0
    assert m["resolution/escalations"] == 0.0
    evs = opt.events
    assert len(evs) == 8 and all(e.param is None and e.stage == "loss" and e.numel == 1 for e in evs)
    assert float(opt._global()["resolution"]["scale"].min()) == 1.0


def _batch():
    from optim_infos import make_batch
    return make_batch(0)


def test_add_param_group_keeps_counters_and_escalation():
    """Adding a group used to restart every counter: a parameter that had backed off was back at full
    step size and its history gone."""
    model = make_model()
    opt = no.AdamW(model.fc1.parameters(), impl="loop")
    train_steps(model, opt, 6, inject=lambda step, m: m.fc1.weight.grad.fill_(float("nan")) if step >= 1 else None)
    before = opt.metrics()
    assert before["resolution/min_scale"] < 1.0
    opt.add_param_group({"params": list(model.fc2.parameters())})
    after = opt.metrics()
    for key in ("resolution/events_total", "resolution/min_scale", "resolution/escalations"):
        assert after[key] == before[key], key
    assert [e.step for e in opt.events] == list(range(2, 7))
    train_steps(model, opt, 1)  # and the grown counters step
    assert opt._global()["resolution"]["scale"].shape[0] == 4


def test_a_checkpoint_saved_under_skip_resumes_labelled_repair():
    """The loaded policy history ended in "skip" and the new optimizer's "repair" was never added, so the
    next (repaired) event was labelled "skipped"."""
    model = make_model()
    a = no.AdamW(model.named_parameters(), resolution="skip")
    train_steps(model, a, 2, inject=_nan_at(1))
    b = no.AdamW(model.named_parameters())
    b.load_state_dict(a.state_dict())
    assert [e.action for e in b.events] == ["skipped"]
    train_steps(model, b, 2, inject=_nan_at(1))
    assert [e.action for e in b.events] == ["skipped", "repaired"]


@pytest.mark.parametrize("value", [np.float32(2.0), np.array(2.0), np.array([2.0]), torch.tensor(2), 2, 2.0])
def test_set_loss_takes_any_real_scalar(value):
    p = nn.Parameter(torch.randn(4, 4))
    opt = no.SFNorMuon([p])
    opt.set_loss(value)
    p.grad = torch.ones(4, 4)
    opt.step()
    assert opt.metrics()["fusion/loss_ema"] == 2.0


@pytest.mark.parametrize("value", [True, np.bool_(True), torch.tensor(True), torch.tensor(1 + 2j), "1.0",
                                   torch.ones(2)])
def test_set_loss_refuses_what_is_not_a_real_scalar(value):
    """A bool tensor was accepted and failed inside the next step(), after the step count had advanced."""
    opt = no.SFNorMuon([nn.Parameter(torch.randn(4, 4))])
    with pytest.raises(ValueError, match="real scalar"):
        opt.set_loss(value)


def test_wandb_sends_every_event_past_the_ring_size(monkeypatch):
    """The cursor was len(optimizer.events); the list keeps 64 event steps, so once it was full nothing
    new was ever sent. A checkpoint loaded from earlier makes its later steps new again."""
    pytest.importorskip("wandb")
    from nonans_optim.integrations import wandb as integ
    monkeypatch.setattr(integ, "_SENT", integ.weakref.WeakKeyDictionary())
    logged = []
    run = types.SimpleNamespace(log=lambda payload, step=None: logged.append(payload))
    monkeypatch.setattr("wandb.Table", lambda columns, data: data)
    model = make_model()
    opt = no.AdamW(model.parameters())

    def every_step(step, m):
        m.fc1.weight.grad[0, 0] = float("nan")
    sent = 0
    saved = None
    for block in range(20):
        train_steps(model, opt, 10, seed=block, inject=every_step)
        if block == 10:
            saved = opt.state_dict()
        sent += len(integ.log_optimizer(opt, run=run).get("resolution/events", []))
    assert sent == 200 == opt.metrics()["resolution/events_total"]
    opt.load_state_dict(saved)  # back to step 110
    train_steps(model, opt, 5, inject=every_step)
    assert len(integ.log_optimizer(opt, run=run)["resolution/events"]) == 5


def test_watch_runs_under_inference_mode():
    """Reading an inference tensor's version counter raises: a watched model failed under
    torch.inference_mode(), which its docstring promises never to do."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with no.watch(model) as w:
        with torch.inference_mode():
            out = model(torch.randn(3, 4))
            model[0].weight.data[0, 0] = float("nan")  # the layer that makes it
            out2 = model(torch.randn(3, 4))
        first = w.first_nonfinite()
    assert out.shape == (3, 2) and torch.isnan(out2).any()
    assert first is not None and first["module"] == "0"


def test_loss_events_are_never_marked_escalated():
    """A loss event sits in row 0 of the count block and used to copy parameter 0's escalation flag."""
    model = make_model()
    opt = no.SFNorMuon(model.named_parameters(), impl="loop")
    for step in range(3):
        opt.zero_grad()
        model(*_batch()[:2]).square().mean().backward()
        next(model.parameters()).grad.fill_(float("nan"))  # parameter 0 escalates on steps 2 and 3
        opt.set_loss(float("nan"))
        opt.step()
    evs = opt.events
    assert any(e.escalated for e in evs if e.stage == "grad")
    assert not any(e.escalated for e in evs if e.stage == "loss")


def test_metrics_keep_one_key_set_and_off_still_reports_the_past():
    """A logger sees the same keys before and after the first step; switching to "off" used to hide the
    counters already recorded (they reappeared when switched back)."""
    model = make_model()
    opt = no.AdamW(model.parameters())
    keys = set(opt.metrics())
    train_steps(model, opt, 2, inject=_nan_at(1))
    assert set(opt.metrics()) == keys
    opt.resolution_policy = "off"
    assert opt.metrics()["resolution/events_total"] == 1.0 and len(opt.events) == 1
    train_steps(model, opt, 1, inject=_nan_at(0))  # not recorded under "off"
    assert opt.metrics()["resolution/events_total"] == 1.0


@pytest.mark.parametrize("impl", ["loop", "foreach", "compiled", "fused"])
@pytest.mark.parametrize("name", ["AdamW", "SFNorMuon"])
def test_a_held_parameter_is_labelled_held(name, impl):
    """A second gradient without a finite entry within the repeat window holds the parameter (it keeps its
    value and state): its event says "held", not "repaired" (both audits of 2026-11-25 found the label
    wrong); the first such gradient took its continuation step and is "repaired". Every implementation
    (torch and C records) labels alike; under "skip" both are "skipped"."""
    for policy, want in (("repair", ["repaired", "held"]), ("skip", ["skipped", "skipped"])):
        p = torch.nn.Parameter(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)))
        opt = getattr(no, name)([{"params": [p], **({"path": "spectral"} if name == "SFNorMuon" else {})}],
                                lr=1e-2, impl=impl, resolution=policy)
        p.grad = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
        opt.step()
        for _ in range(2):
            before = p.detach().clone()
            p.grad = torch.full((6, 4), float("nan"))
            opt.step()
        assert torch.equal(p, before)  # held (or skipped): the second one did not move it
        assert [(e.step, e.stage, e.action) for e in opt.events if e.stage == "grad"] == \
            [(2, "grad", want[0]), (3, "grad", want[1])]


def test_add_param_group_keeps_each_parameters_own_counters():
    """The saved counters are the rows of the parameters already there; the added ones start fresh after
    them (the sums metrics() reports cannot tell which row is whose: the scale and the events' params can)."""
    model = make_model()
    opt = no.AdamW(model.fc1.parameters(), impl="loop")
    train_steps(model, opt, 3, inject=lambda step, m: m.fc1.weight.grad.fill_(float("nan")) if step >= 1 else None)
    opt.add_param_group({"params": list(model.fc2.parameters())})
    assert [(e.step, e.param, e.stage) for e in opt.events] == [(2, 0, "grad"), (3, 0, "grad")]
    assert opt._global()["resolution"]["scale"].tolist() == [0.5, 1.0, 1.0, 1.0]  # step 3 repeated step 2


@pytest.mark.parametrize("impl", ["loop", "fused"])
def test_a_bad_loss_is_counted_in_its_own_column(impl):
    """A NaN loss is a NaN count, an Inf loss an Inf count (the two columns of the loss stage)."""
    model = make_model()
    opt = no.SFNorMuon(model.named_parameters(), impl=impl)
    for loss in (float("nan"), float("-inf"), float("nan")):
        opt.zero_grad()
        model(*_batch()[:2]).square().mean().backward()
        opt.set_loss(loss)
        opt.step()
    m = opt.metrics()
    assert (m["resolution/nan_loss"], m["resolution/inf_loss"]) == (2.0, 1.0)
    assert [(e.step, e.stage, e.nan_count, e.inf_count) for e in opt.events] == [
        (1, "loss", 1, 0), (2, "loss", 0, 1), (3, "loss", 1, 0)]


@pytest.mark.parametrize("impl", ["loop", "foreach", "fused"])
def test_a_schedule_free_update_counts_y_and_z_each(impl):
    """The "update" stage counts the entries of each tensor it writes: y and z for a schedule-free parameter
    (SingularityEvent's docs), so an overflow of both on every entry reads 2·numel — the same in every
    implementation, and both kept finite."""
    p = nn.Parameter(torch.full((4,), 3.0e38))
    opt = no.SFAdamW([p], lr=1e38, impl=impl)
    p.grad = torch.full((4,), -1.0)
    opt.step()
    (ev,) = [e for e in opt.events if e.stage == "update"]
    assert (ev.nan_count, ev.inf_count, ev.numel) == (0, 8, 4)
    assert torch.isfinite(p).all() and torch.isfinite(opt.state[p]["z"]).all()
