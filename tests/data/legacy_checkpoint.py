"""Checkpoints in the layout before the optimizer-level state moved into a parameter's state, written by the
code of that layout, and the run that continues them: ``tests/test_distributed_checkpoint.py`` loads them
into the current code and checks the continuation against what the old code computed.

``legacy_checkpoint.pt`` was written by commit fa21cf5 (the last commit of that layout)::

    git worktree add /tmp/old fa21cf5 && ln -s ../kernels /tmp/old/nonans_optim/kernels
    PYTHONPATH=/tmp/old python tests/data/legacy_checkpoint.py tests/data/legacy_checkpoint.pt

(the link stands in for the editable install's mapping of ``kernels/`` to ``nonans_optim.kernels``).
Both sides run :func:`run` below, so a difference is the checkpoint's, not the driver's.
"""
from __future__ import annotations

import pickle
import sys

import torch
from torch import nn

import nonans_optim as no

CASES = {"AdamW": {}, "FullFusion": {"eval_at_save": True}}
KW = {"lr": 1e-2, "impl": "foreach"}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def set_grads(model: nn.Module, step: int) -> None:
    """Seeded gradients; NaN entries at steps 2 and 5, a whole +Inf tensor at step 3 (events to count, an
    escalation to keep) — the same on every machine."""
    gen = torch.Generator().manual_seed(step)
    for i, p in enumerate(model.parameters()):
        g = torch.randn(p.shape, generator=gen)
        if step in (2, 5) and i == 0:
            g.view(-1)[:3] = float("nan")
        if step == 3 and i == 2:
            g.fill_(float("inf"))
        p.grad = g.to(p.dtype)


def run(model: nn.Module, opt, steps: range) -> None:
    for step in steps:
        set_grads(model, step)
        opt.set_loss(torch.tensor(2.0 - 0.1 * step))
        opt.step()
        if step == 2:
            opt.resolution_policy = "repair"  # the events of steps 1-2 stay labelled "skipped"


def summary(model: nn.Module, opt) -> dict:
    return {"params": [p.detach().clone() for p in model.parameters()],
            "events": [(e.step, e.param, e.stage, e.nan_count, e.inf_count, e.action, e.escalated)
                       for e in opt.events],
            "metrics": opt.metrics()}


def main(path: str) -> None:
    out = {}
    for name, case in CASES.items():
        model = make_model()
        opt = getattr(no, name)(model.parameters(), resolution="skip", **KW)
        run(model, opt, range(1, 4))
        if case.get("eval_at_save"):
            opt.eval()
        saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                 "optim": torch.load(_bytes(opt.state_dict()), weights_only=False),
                 "pickled": pickle.dumps(opt), "at_save": summary(model, opt)}
        if case.get("eval_at_save"):
            opt.train()
        run(model, opt, range(4, 7))
        out[name] = {**saved, "final": summary(model, opt)}
    torch.save(out, path)


def _bytes(obj):
    import io
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


if __name__ == "__main__":
    main(sys.argv[1])
