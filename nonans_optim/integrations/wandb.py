"""Log an optimizer's metrics and singularity events to Weights & Biases.

``metrics()`` is the only synchronising call, so log every N steps, not every step::

    from nonans_optim.integrations.wandb import log_optimizer
    if step % 50 == 0:
        log_optimizer(optimizer, step=step)

Events are sent as a ``wandb.Table`` only when new ones appeared since the last call. ``optimizer.events``
keeps the last 63 steps that had events, so log at least that often to see every one; the counts in
``metrics()`` are complete either way. The step up to which events were sent is kept in the optimizer's
own state (``events_sent_step``, which ``state_dict()`` and every checkpoint carry), so a job resumed from a
checkpoint sends what came after the last call before that checkpoint — no event twice, none lost — and so
does a ``copy.deepcopy``. (Until 2026-11-26 it was kept per optimizer object in this process: a resumed job
sent every event its history still held once more. A checkpoint saved before then has no such entry and
does the same once.)

Several optimizers in one run (a GAN's two, an encoder's and a decoder's) log the same keys: give each a
``prefix`` (``log_optimizer(opt_g, prefix="generator")`` logs ``generator/resolution/events_total``...), or
the last call of a step overwrites the others. ``step`` follows wandb's rule: a step below the run's current
one is dropped by wandb with a warning, so pass the step your other ``wandb.log`` calls use, or none.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any

__all__ = ["log_optimizer"]

# The cursor is the optimizer step up to which events were sent. A step, not a count of events: the event
# list is a ring of the last 64 event steps, so its length stops growing and a count-based cursor stopped
# sending anything once the ring was full. It lives in a nonans_optim optimizer's optimizer-level state;
# here only for an optimizer that has none yet (no step taken: no events either) or any other object with
# metrics() and events. Weak keys: an id() could be reused by a new optimizer.
_SENT: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
_KEY = "events_sent_step"


def _state(optimizer) -> dict | None:
    """The optimizer-level state dict that keeps the cursor, or None (never created here)."""
    get = getattr(optimizer, "_global_state", None)
    return get() if callable(get) else None


def log_optimizer(optimizer, *, step: int | None = None, run: Any = None, events: bool = True,
                  prefix: str = "") -> dict:
    """Log ``optimizer.metrics()`` (and new SingularityEvents) to ``run`` (default: ``wandb.run``), each key
    under ``prefix + "/"`` when a prefix is given (module docstring: several optimizers in one run).

    Returns the dict that was logged. Raises ImportError with the install hint when wandb is missing."""
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
    try:
        import wandb
    except ImportError as exc:  # pragma: no cover - exercised only without wandb
        raise ImportError("log_optimizer needs wandb: pip install 'nonans-optim[wandb]'") from exc
    run = run if run is not None else wandb.run
    if run is None:
        raise RuntimeError("no active wandb run: call wandb.init(...) first or pass run=")
    payload: dict[str, Any] = dict(optimizer.metrics())
    if events:
        now = int(payload.get("optim/step", 0))
        # min(): the optimizer went back to an earlier step since (its state replaced without the cursor)
        st = _state(optimizer)
        sent = min(st.get(_KEY, -1) if st is not None else _SENT.get(optimizer, -1), now)
        new = [e for e in optimizer.events if e.step > sent]
        if st is not None:
            st[_KEY] = now
        else:
            _SENT[optimizer] = now
        if new:
            cols = [f.name for f in dataclasses.fields(new[0])]
            payload["resolution/events"] = wandb.Table(
                columns=cols, data=[[getattr(e, c) for c in cols] for e in new])
    head = prefix.rstrip("/")
    if head:
        payload = {f"{head}/{key}": value for key, value in payload.items()}
    run.log(payload, step=step)
    return payload
