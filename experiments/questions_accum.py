"""Open question 8 — schedule-free under gradient accumulation (1/4/16/64 micro-batches per step).

Same samples per optimizer step (a global batch of 64 digits split into k micro-batches of 64/k), same
seed, so the only difference between the curves is float summation order. Three checks per optimizer
(SF-AdamW and SF-NorMuon with the Polyak step on):

1. the validation curves overlap (max |Δ val loss| against k = 1 over the run);
2. the parameters (which hold y) are bit-identical between micro-steps — nothing but ``step()`` moves them;
3. ``set_loss`` gets the accumulated loss (mean over micro-batches): the optimizer's ``fusion/loss_ema``
   equals an EMA (β = 0.98, seeded with the first value) of the accumulated losses recomputed here, and
   differs from what passing only the last micro-batch's loss would give.

The model has no normalisation layers, so accumulation is exactly a large batch (up to rounding). Rounding
differences are amplified by bf16 NS5 and by the Polyak step (whose saturated clamp is a 10x lr), so a
control arm (fp32 NS5, Polyak off) separates "accumulation changes the algorithm" from "rounding".
"""
from __future__ import annotations

from typing import Any

import torch

from .questions_io import fmt, md_table
from .tasks import make_optimizer, make_task

__all__ = ["run_q8", "render_q8"]


def _ema(xs: list[float], beta: float = 0.98) -> float:
    e = xs[0]
    for x in xs[1:]:
        e = beta * e + (1 - beta) * x
    return e


def _one(opt_name: str, k: int, steps: int, lr: float, global_batch: int, seed: int,
         kwargs: dict | None = None) -> dict[str, Any]:
    task = make_task("digits", seed, batch=global_batch)
    opt = make_optimizer(opt_name, task.model, lr, **(kwargs or {}))
    g = torch.Generator().manual_seed(10_000 + seed)
    curve, acc_losses, last_losses, moved = [], [], [], 0
    params = list(task.model.parameters())
    for step in range(steps + 1):
        if step % max(1, steps // 10) == 0 or step == steps:
            opt.eval()
            curve.append(task.evaluate(task.model)["val_loss"])
            opt.train()
        if step == steps:
            break
        x, y = task.sample(g)
        before = [p.detach().clone() for p in params]
        total = torch.zeros(())
        for xm, ym in zip(x.chunk(k), y.chunk(k)):
            loss = task.loss(task.model, (xm, ym)) / k
            loss.backward()
            total = total + loss.detach()
            moved += sum(int(not torch.equal(b, p)) for b, p in zip(before, params))
        opt.set_loss(total)
        acc_losses.append(float(total))
        last_losses.append(float(loss.detach()) * k)
        opt.step()
        opt.zero_grad(set_to_none=True)
    m = opt.metrics()
    return {"curve": curve, "moved_between_micro_steps": moved, "loss_ema": m.get("fusion/loss_ema"),
            "loss_ema_recomputed": _ema(acc_losses), "loss_ema_if_last_micro": _ema(last_losses)}


#: label -> (optimizer, kwargs). The last arm is the exactness control: fp32 NS5 and no Polyak step, so
#: nothing amplifies the rounding differences of a differently-ordered gradient sum.
Q8_OPTIMIZERS = {"sfadamw": ("sfadamw", {}), "sfnormuon": ("sfnormuon", {}),
                 "sfnormuon (fp32 NS5, Polyak off)": ("sfnormuon", {"ns5_dtype": "fp32", "polyak": False})}


def run_q8(micro=(1, 4, 16, 64), steps: int = 100, lr: float = 3e-3, global_batch: int = 64, seed: int = 0,
           optimizers=tuple(Q8_OPTIMIZERS)) -> dict[str, Any]:
    out: dict[str, Any] = {"config": {"micro": list(micro), "steps": steps, "lr": lr, "global_batch": global_batch},
                           "runs": {}}
    for o in optimizers:
        name, kw = Q8_OPTIMIZERS[o]
        out["runs"][o] = {str(k): _one(name, k, steps, lr, global_batch, seed, kw) for k in micro}
    return out


def render_q8(data: dict[str, Any]) -> str:
    rows = []
    for o, runs in data["runs"].items():
        base = runs[str(data["config"]["micro"][0])]["curve"]
        for k, r in runs.items():
            dev = max(abs(a - b) for a, b in zip(r["curve"], base))
            rows.append([o, k, fmt(r["curve"][-1], 4), f"{dev:.1e}", r["moved_between_micro_steps"],
                         fmt(r["loss_ema"], 5) if r["loss_ema"] is not None else "— (no Polyak)",
                         fmt(r["loss_ema_recomputed"], 5), fmt(r["loss_ema_if_last_micro"], 5)])
    c = data["config"]
    return (f"Global batch {c['global_batch']}, {c['steps']} steps, lr {c['lr']}, digits CNN.\n\n"
            + md_table(["optimizer", "micro-batches", "final val loss", "max |Δ val loss| vs 1 micro-batch",
                        "param changes between micro-steps", "optimizer loss_ema",
                        "EMA of accumulated losses", "EMA if only last micro loss"], rows))
