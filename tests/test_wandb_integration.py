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
