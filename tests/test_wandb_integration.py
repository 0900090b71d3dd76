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
