"""The training loop every arm shares, and what it measures.

Per run: the loss at every step, the first step at which anything (loss, gradient or parameter) was
non-finite, how many steps had a non-finite *loss* (the forward pass itself overflowed — distinct from a
GradScaler calibration skip, where only the scaled backward overflows), whether the run completed (reached
its last step with finite parameters and a finite final metric), steps lost, GradScaler skips, rollbacks, and for
our optimizer the resolved events and the moment-buffer norm just before and just after every step that had one
(continuity).

The harness syncs freely (``float(loss)``, finiteness checks): it is user code *around* ``step()``, and
its cost is the same for every arm. Step overhead is measured separately (:mod:`.overhead`).
"""
from __future__ import annotations

import copy
import math
import time

import torch

from nonans_optim._base import NonansOptimizer

from .arms import OURS_ARMS, make_optimizer
from .spec import Workload

__all__ = ["run_arm", "moment_norm", "ROLLBACK_EVERY"]

ROLLBACK_EVERY = {"tiny": 10, "default": 20, "scale": 100}  # K: checkpoint period of the rollback arm
MOMENT_KEYS = ("exp_avg", "momentum_buffer")


def moment_norm(opt) -> float:
    """‖(all exp_avg / momentum_buffer entries)‖₂ — read outside ``step()``."""
    sq = 0.0
    for st in opt.state.values():
        if isinstance(st, dict):
            for k in MOMENT_KEYS:
                if k in st:
                    sq += float(st[k].double().pow(2).sum())
    return math.sqrt(sq)


def _finite_fraction(tensors) -> float:
    total = sum(t.numel() for t in tensors)
    ok = sum(int(torch.isfinite(t).sum()) for t in tensors)
    return ok / total if total else 1.0


def _all_finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _safe(x: float) -> float | None:
    return x if math.isfinite(x) else None


def run_arm(workload: Workload, arm: str, *, size: str = "default", seed: int = 0,
            rollback_every: int | None = None, progress=None, ours_kwargs: dict | None = None) -> dict:
    """Train ``workload`` with ``arm`` and return the JSON-ready record of the run (``ours_kwargs``: see
    :func:`.arms.make_optimizer`)."""
    rollback_every = rollback_every or ROLLBACK_EVERY[size]
    torch.manual_seed(seed)
    task = workload.build(size=size, seed=seed, clean=(arm == "clean"))
    model, steps = task.model, task.steps
    opt = make_optimizer(arm, task, **(ours_kwargs or {}))
    ours = arm in OURS_ARMS
    scaler = torch.amp.GradScaler("cpu") if (task.amp and not ours) else None
    clip = task.clip  # the same guard for every arm (GradScaler only for the stock ones)
    params = [p for p in model.parameters() if p.requires_grad]
    if hasattr(opt, "train"):  # schedule-free optimizers (ours and peers) step in train mode
        opt.train()
    tracked_events = ours and arm == "nonans"

    losses: list[float | None] = []
    rec = dict(workload=workload.key, arm=arm, size=size, seed=seed, steps=steps, completed=False,
               first_nonfinite_step=None, first_nonfinite_loss_step=None, nonfinite_loss_steps=0,
               scaler_skips=0, rollbacks=0, steps_lost=0, no_info_steps=0, continuity=[], event_steps=[],
               events_total=0)
    ckpt = (0, copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())) if arm == "rollback" else None
    budget = 2 * steps if arm == "rollback" else steps  # the rollback arm may spend up to 2x the compute
    step, data_index, events_seen = 0, 0, 0.0
    t0 = time.perf_counter()
    while step < steps and data_index < budget:
        loss = task.loss_fn(model, data_index)
        opt.zero_grad(set_to_none=True)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if task.fault is not None:
            task.fault(model, data_index)
        data_index += 1
        loss_f = float(loss.detach())
        grads = [p.grad for p in params if p.grad is not None]
        frac = _finite_fraction(grads)
        if (not math.isfinite(loss_f) or frac < 1.0) and rec["first_nonfinite_step"] is None:
            rec["first_nonfinite_step"] = step
        if not math.isfinite(loss_f):
            rec["nonfinite_loss_steps"] += 1
            if rec["first_nonfinite_loss_step"] is None:
                rec["first_nonfinite_loss_step"] = step
        before = moment_norm(opt) if tracked_events else None
        if isinstance(opt, NonansOptimizer):
            opt.set_loss(loss.detach())
        if scaler is not None:
            scaler.unscale_(opt)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(params, clip)
            scale = scaler.get_scale()
            rec["no_info_steps"] += int(_finite_fraction(grads) == 0.0)
            scaler.step(opt)
            scaler.update()
            rec["scaler_skips"] += int(scaler.get_scale() < scale)
        else:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(params, clip)
            rec["no_info_steps"] += int(_finite_fraction(grads) == 0.0)  # after clipping: what step() sees
            opt.step()
        params_ok = _all_finite([p.detach() for p in params])
        if not params_ok and rec["first_nonfinite_step"] is None:
            rec["first_nonfinite_step"] = step
        if tracked_events:
            total = opt.metrics().get("resolution/events_total", 0.0)
            if total > events_seen:
                rec["event_steps"].append(step)
                rec["continuity"].append(dict(step=step, before=before, after=moment_norm(opt)))
            events_seen = total
        if arm == "rollback" and (not math.isfinite(loss_f) or not params_ok):
            ckpt_step, model_sd, opt_sd = ckpt
            model.load_state_dict(model_sd)
            opt.load_state_dict(copy.deepcopy(opt_sd))
            rec["rollbacks"] += 1
            rec["steps_lost"] += step - ckpt_step + 1  # the steps since the checkpoint, and this one
            del losses[ckpt_step:]
            step = ckpt_step
            continue
        losses.append(_safe(loss_f))
        step += 1
        if progress is not None:
            progress.update(1)
        if not params_ok:  # the run is dead: every later step would be wasted compute
            break
        if arm == "rollback" and step % rollback_every == 0:
            ckpt = (step, copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    rec["wall_s"] = time.perf_counter() - t0
    params_ok = _all_finite([p.detach() for p in params])
    if hasattr(opt, "eval"):  # schedule-free: evaluate at the averaged x
        opt.eval()
    if isinstance(opt, NonansOptimizer):
        rec["events_total"] = int(opt.metrics().get("resolution/events_total", 0.0))
        rec["events"] = [dict(step=e.step, param=str(e.param), stage=e.stage, nan=e.nan_count,
                              inf=e.inf_count, numel=e.numel, action=e.action) for e in opt.events][:200]
    with torch.no_grad():
        final = task.evaluate(model) if params_ok else float("nan")
    rec["final_metric"] = _safe(final)
    rec["metric"] = task.metric
    rec["completed"] = bool(step >= steps and params_ok and math.isfinite(final))
    if not rec["completed"] and arm != "rollback":
        rec["steps_lost"] = steps - (rec["first_nonfinite_step"] or 0)
    elif not rec["completed"]:
        rec["steps_lost"] += steps - step
    elif arm == "baseline":
        rec["steps_lost"] = rec["scaler_skips"]
    elif ours:
        rec["steps_lost"] = rec["no_info_steps"]
    rec["losses"] = losses
    return rec
