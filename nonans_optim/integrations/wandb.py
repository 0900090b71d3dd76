"""Log an optimizer's metrics and singularity events to Weights & Biases.

``metrics()`` is the only synchronising call, so log every N steps, not every step::

    from nonans_optim.integrations.wandb import log_optimizer
    if step % 50 == 0:
        log_optimizer(optimizer, step=step)

Events are sent as a ``wandb.Table`` only when new ones appeared since the last call.
"""
from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["log_optimizer"]

_SEEN: dict[int, int] = {}


def log_optimizer(optimizer, *, step: int | None = None, run: Any = None, events: bool = True) -> dict:
    """Log ``optimizer.metrics()`` (and new SingularityEvents) to ``run`` (default: ``wandb.run``).

    Returns the dict that was logged. Raises ImportError with the install hint when wandb is missing."""
    try:
        import wandb
    except ImportError as exc:  # pragma: no cover - exercised only without wandb
        raise ImportError("log_optimizer needs wandb: pip install 'nonans-optim[wandb]'") from exc
    run = run if run is not None else wandb.run
    if run is None:
        raise RuntimeError("no active wandb run: call wandb.init(...) first or pass run=")
    payload: dict[str, Any] = dict(optimizer.metrics())
    if events:
        evs = optimizer.events
        new = evs[_SEEN.get(id(optimizer), 0):]
        _SEEN[id(optimizer)] = len(evs)
        if new:
            cols = [f.name for f in dataclasses.fields(new[0])]
            payload["resolution/events"] = wandb.Table(
                columns=cols, data=[[getattr(e, c) for c in cols] for e in new])
    run.log(payload, step=step)
    return payload
