import pytest

import nonans_optim as no
from optim_infos import make_model, train_steps


def test_log_optimizer_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from nonans_optim.integrations.wandb import log_optimizer
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    model = make_model()
    opt = no.SFNorMuon(model.named_parameters())

    def inject(step, m):
        if step == 1:
            m.fc1.weight.grad[0, 0] = float("nan")
    train_steps(model, opt, 3, inject=inject)
    run = wandb.init(project="nonans-test", dir=str(tmp_path), mode="offline")
    try:
        logged = log_optimizer(opt, step=3, run=run)
    finally:
        run.finish()
    assert logged["resolution/events_total"] == 1.0
    assert "fusion/gamma_curr" in logged
    assert isinstance(logged["resolution/events"], wandb.Table)


class _Run:
    """A stand-in for a wandb run: records what log() was given."""

    def __init__(self):
        self.logged = []

    def log(self, payload, step=None):
        self.logged.append((dict(payload), step))


def test_two_optimizers_in_one_run_log_under_their_prefixes():
    """Two optimizers logged to one run wrote the same keys (optim/step, resolution/*): the last call of a
    step overwrote the other's values (an audit, 2026-11-26). A prefix keeps them apart."""
    pytest.importorskip("wandb")
    from nonans_optim.integrations.wandb import log_optimizer
    run = _Run()
    models = [make_model(), make_model()]
    opts = [no.AdamW(models[0].parameters()), no.SFNorMuon(models[1].named_parameters())]
    for m, o in zip(models, opts):
        train_steps(m, o, 2)
    log_optimizer(opts[0], run=run, prefix="critic", step=2)
    log_optimizer(opts[1], run=run, prefix="actor/", step=2)
    (a, _), (b, _) = run.logged
    assert set(a) == {f"critic/{k}" for k in opts[0].metrics()}
    assert set(b) == {f"actor/{k}" for k in opts[1].metrics()} and not set(a) & set(b)
    with pytest.raises(TypeError, match="prefix must be a str"):
        log_optimizer(opts[0], run=run, prefix=3)


def test_resumed_job_sends_no_event_twice():
    """The cursor of sent events is in the optimizer's state: a job resumed from a checkpoint sent every
    event its history still held once more (it was kept per optimizer object in the process). Now the
    resumed job sends the events after the checkpoint's last call only — including one of a step the
    crashed job had already run but not logged."""
    pytest.importorskip("wandb")
    import copy

    from nonans_optim.integrations.wandb import log_optimizer

    def inject(step, m):
        if step in (1, 4):  # (train_steps counts from 0: events at optimizer steps 2 and 5)
            m.fc1.weight.grad[0, 0] = float("nan")

    def rows(payload):
        table = payload.get("resolution/events")
        return [] if table is None else [r[0] for r in table.data]  # the step column comes first

    run = _Run()
    model = make_model()
    opt = no.AdamW(model.parameters())
    train_steps(model, opt, 3, inject=inject)
    assert rows(log_optimizer(opt, run=run, step=3)) == [2]
    ckpt = copy.deepcopy((model.state_dict(), opt.state_dict()))
    twin = copy.deepcopy(opt)
    assert rows(log_optimizer(twin, run=run, step=3)) == []  # a copy keeps the cursor too

    resumed_model = make_model()
    resumed_model.load_state_dict(ckpt[0])
    resumed = no.AdamW(resumed_model.parameters())
    resumed.load_state_dict(ckpt[1])
    train_steps(resumed_model, resumed, 2, inject=lambda step, m: inject(step + 3, m))
    assert [e.step for e in resumed.events] == [2, 5]  # the history holds both
    assert rows(log_optimizer(resumed, run=run, step=5)) == [5]
    assert rows(log_optimizer(resumed, run=run, step=5)) == []

    old = copy.deepcopy(ckpt[1])  # a checkpoint saved before the cursor was kept: its history once more
    for st in old["state"].values():
        st.get("nonans", {}).pop("events_sent_step", None)
    again = no.AdamW(make_model().parameters())
    again.load_state_dict(old)
    assert rows(log_optimizer(again, run=run, step=3)) == [2]
    assert rows(log_optimizer(again, run=run, step=3)) == []
