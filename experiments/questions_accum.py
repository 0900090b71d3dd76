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

Which of the two amplifies (the published run of 2026-11-25 changed both at once, on one seed): SF-NorMuon
in a 2x2 of NS5 dtype (bf16, the default, or fp32) and Polyak (on, the default, or off), plus Polyak off
with a 10x lr — the step a saturated clamp takes without the Polyak rule — in bf16 and fp32 NS5, each on
``seeds``. The rule, fixed before the run (:func:`attribution`): an arm that changes one thing from the
default "removes" the default's drift when its mean drift over the seeds is at most a tenth of the
default's, "leaves" it when at least half, and "reduces" it in between.
"""
from __future__ import annotations

import statistics
from typing import Any

import torch

from .questions_io import fmt, mean_sd, md_table
from .questions_polyak import clamp_fractions
from .tasks import make_optimizer, make_task

__all__ = ["run_q8", "render_q8", "drifts", "attribution", "Q8_OPTIMIZERS"]


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
    curve, acc_losses, last_losses, moved, mults = [], [], [], 0, []
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
        mult = opt.metrics().get("fusion/gamma_mult")
        if mult is not None:
            mults.append(mult)
    m = opt.metrics()
    return {"curve": curve, "moved_between_micro_steps": moved, "loss_ema": m.get("fusion/loss_ema"),
            "loss_ema_recomputed": _ema(acc_losses), "loss_ema_if_last_micro": _ema(last_losses),
            "at_upper_clamp": clamp_fractions(mults)["at_high"] if mults else None}


#: label -> (optimizer, kwargs, lr multiplier). "sfnormuon" is the default (bf16 NS5, Polyak on); each
#: other SF-NorMuon arm changes what its label says. The last is the exactness control: fp32 NS5 and no
#: Polyak step, so nothing amplifies the rounding differences of a differently-ordered gradient sum.
Q8_OPTIMIZERS = {"sfadamw": ("sfadamw", {}, 1.0), "sfnormuon": ("sfnormuon", {}, 1.0),
                 "sfnormuon (fp32 NS5)": ("sfnormuon", {"ns5_dtype": "fp32"}, 1.0),
                 "sfnormuon (Polyak off)": ("sfnormuon", {"polyak": False}, 1.0),
                 "sfnormuon (Polyak off, lr ×10)": ("sfnormuon", {"polyak": False}, 10.0),
                 "sfnormuon (fp32 NS5, Polyak off, lr ×10)": ("sfnormuon", {"ns5_dtype": "fp32", "polyak": False},
                                                             10.0),
                 "sfnormuon (fp32 NS5, Polyak off)": ("sfnormuon", {"ns5_dtype": "fp32", "polyak": False}, 1.0)}
DEFAULT_ARM, CONTROL_ARM = "sfnormuon", "sfnormuon (fp32 NS5, Polyak off)"


def run_q8(micro=(1, 4, 16, 64), steps: int = 100, lr: float = 3e-3, global_batch: int = 64,
           seeds=(0, 1, 2, 3, 4), optimizers=tuple(Q8_OPTIMIZERS)) -> dict[str, Any]:
    """``runs[arm][str(k)]``: one result per seed, in ``config["seeds"]`` order."""
    out: dict[str, Any] = {"config": {"micro": list(micro), "steps": steps, "lr": lr, "global_batch": global_batch,
                                      "seeds": list(seeds)},
                           "runs": {}}
    for o in optimizers:
        name, kw, scale = Q8_OPTIMIZERS[o]
        out["runs"][o] = {str(k): [_one(name, k, steps, lr * scale, global_batch, seed, kw) for seed in seeds]
                          for k in micro}
    return out


def drifts(data: dict[str, Any]) -> dict[str, list[float]]:
    """Per arm, per seed: the largest |Δ val loss| between any micro-batch count's curve and the 1-micro-batch
    curve of the same seed, over the run."""
    out = {}
    for o, runs in data["runs"].items():
        base = runs[str(data["config"]["micro"][0])]
        out[o] = [max(max(abs(a - b) for a, b in zip(r[i]["curve"], base[i]["curve"])) for r in runs.values())
                  for i in range(len(base))]
    return out


def attribution(data: dict[str, Any]) -> dict[str, tuple[float, str]]:
    """Per SF-NorMuon arm other than the default: (its mean drift / the default's, "removes" ≤ 0.1 <
    "reduces" < 0.5 ≤ "leaves"), the rule of the module docstring; empty without the default arm."""
    d = drifts(data)
    if DEFAULT_ARM not in d:
        return {}
    ref = statistics.fmean(d[DEFAULT_ARM])
    out = {}
    for o, xs in d.items():
        if o == DEFAULT_ARM or not o.startswith("sfnormuon"):
            continue
        ratio = statistics.fmean(xs) / ref if ref > 0 else float("inf")
        out[o] = (ratio, "removes" if ratio <= 0.1 else "leaves" if ratio >= 0.5 else "reduces")
    return out


def render_q8(data: dict[str, Any]) -> str:
    rows, d = [], drifts(data)
    for o, runs in data["runs"].items():
        base = runs[str(data["config"]["micro"][0])]
        for k, rs in runs.items():
            devs = [max(abs(a - b) for a, b in zip(r["curve"], b0["curve"])) for r, b0 in zip(rs, base)]
            m, sd = mean_sd(devs)
            clamp = [r["at_upper_clamp"] for r in rs if r.get("at_upper_clamp") is not None]
            r0 = rs[0]
            rows.append([o, k, fmt(statistics.fmean(r["curve"][-1] for r in rs), 4), f"{m:.1e} ± {sd:.1e}",
                         sum(r["moved_between_micro_steps"] for r in rs),
                         f"{statistics.fmean(clamp):.0%}" if clamp else "— (no Polyak)",
                         fmt(r0["loss_ema"], 5) if r0["loss_ema"] is not None else "— (no Polyak)",
                         fmt(r0["loss_ema_recomputed"], 5), fmt(r0["loss_ema_if_last_micro"], 5)])
    c = data["config"]
    att = attribution(data)
    summary = []
    for o, xs in d.items():
        ratio, verdict = att.get(o, (None, "— (the default)" if o == DEFAULT_ARM else "—"))
        summary.append([o, f"{statistics.fmean(xs):.1e}", f"{min(xs):.1e} – {max(xs):.1e}",
                        "—" if ratio is None else f"{ratio:.2f}", verdict])
    return (f"Global batch {c['global_batch']}, {c['steps']} steps, lr {c['lr']}, digits CNN, seeds {c['seeds']} "
            "(each micro-batch count against the 1-micro-batch run of the same seed; loss EMA columns: seed "
            f"{c['seeds'][0]}).\n\n"
            + md_table(["optimizer", "micro-batches", "final val loss (mean)", "max |Δ val loss| vs 1 micro-batch",
                        "param changes between micro-steps", "steps at the upper Polyak clamp",
                        "optimizer loss_ema", "EMA of accumulated losses", "EMA if only last micro loss"], rows)
            + "\n\nDrift per arm (the largest |Δ val loss| over every micro-batch count, per seed):\n\n"
            + md_table(["arm", "mean drift", "seed range", "mean / default's", "the default's drift (rule)"],
                       summary))
