"""Open question 5 / Polyak instrumentation — does FusionOpt's clamp(L̄/Ḡ, 0.1, 10) saturate?

FusionOpt's rule (``_update_polyak``; ``nonans_optim/functional/polyak.py``): γ = lr·clamp(L̄/Ḡ, 0.1, 10) with
L̄, Ḡ EMAs (β 0.98) of the loss and of the mean |g|. The ratio has units (loss per unit gradient, i.e. a
length in parameter space), so its typical value is set by the workload, not by the clamp's designer: a
loss of ~1 and a mean |g| of ~1e-3 give ~1e3, pinned at the upper clamp. Multiplying the loss by k multiplies
both EMAs by k, so the ratio — and the saturation — does not change with the loss scale.

Instrumentation: SF-NorMuon with the Polyak step on two workloads (char-LM, digits CNN) at loss scales
×0.01, ×1, ×100, logging ``fusion/gnorm_ema``, ``fusion/loss_ema``, ``fusion/gamma_curr`` every step for the
first 1,000 steps; the fraction of steps at each clamp is reported.

Scale-free alternative (evaluated when the clamp saturates): the *relative* Polyak ratio
ρ_t = (L̄_t/Ḡ_t)/(L̄_1/Ḡ_1), γ = lr·clamp(ρ_t, 0.1, 10). ρ is dimensionless (invariant to loss scale and to the
parametrisation's units), equals 1 at the start — so the user's lr means what it says — and shrinks as the
loss falls faster than the gradient (for f* = 0 and a quadratic, L/‖g‖ ∝ distance to the optimum, so ρ is
the fraction of the initial distance left). It is applied host-side here by setting ``group["lr"]`` before
each step (the optimizer's own Polyak switched off), so schedule-free weights see the same lr_t².
"""
from __future__ import annotations

from typing import Any

import torch
from nonans_optim.functional.polyak import CLAMP

from .questions_io import fmt, md_table, mean_sd, wandb_run
from .tasks import make_task, train

__all__ = ["run_polyak", "render_polyak", "RelativePolyak", "clamp_fractions"]

WORKLOADS = {"charlm": {"d": 32, "batch": 16}, "digits": {"width": 8}}
LO, HI = CLAMP


class RelativePolyak:
    """Host-side scale-free Polyak multiplier (see the module docstring); call before every step."""

    def __init__(self, base_lr: float, beta: float = 0.98, clamp: tuple[float, float] = (LO, HI)):
        self.base, self.beta, self.clamp = base_lr, beta, clamp
        self.loss = self.gnorm = self.r0 = None
        self.mults: list[float] = []

    def __call__(self, step: int, opt, loss: torch.Tensor) -> None:
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        gm = float(sum(g.abs().sum() for g in grads) / sum(g.numel() for g in grads))
        lv = float(loss.detach())
        b = self.beta
        self.loss = lv if self.loss is None else b * self.loss + (1 - b) * lv
        self.gnorm = gm if self.gnorm is None else b * self.gnorm + (1 - b) * gm
        r = self.loss / self.gnorm
        self.r0 = r if self.r0 is None else self.r0
        mult = min(max(r / self.r0, self.clamp[0]), self.clamp[1])
        self.mults.append(mult)
        for group in opt.param_groups:
            group["lr"] = self.base * mult


def clamp_fractions(mults: list[float]) -> dict[str, float]:
    n = max(1, len(mults))
    lo = sum(m <= LO * (1 + 1e-6) for m in mults) / n
    hi = sum(m >= HI * (1 - 1e-6) for m in mults) / n
    return {"at_low": lo, "at_high": hi, "free": 1 - lo - hi}


def run_polyak(steps: int = 1000, scales=(0.01, 1.0, 100.0), lr: float = 3e-3, ab_steps: int = 300,
               ab_seeds: int = 2, optimizer: str = "sfnormuon") -> dict[str, Any]:
    out: dict[str, Any] = {"config": {"steps": steps, "scales": list(scales), "lr": lr, "ab_steps": ab_steps,
                                      "ab_seeds": ab_seeds, "optimizer": optimizer, "workloads": WORKLOADS},
                           "trace": {}, "ab": []}
    for wl, kw in WORKLOADS.items():
        for scale in scales:
            log: dict[str, list[float]] = {"gamma_mult": [], "loss_ema": [], "gnorm_ema": [], "gamma_curr": []}
            wb = wandb_run("nonans-polyak", f"{wl}-x{scale}", {"workload": wl, "scale": scale})

            def on_step(step, opt, loss, log=log, wb=wb):
                m = opt.metrics()
                for k in log:
                    log[k].append(m[f"fusion/{k}"])
                wb.log({f"fusion/{k}": m[f"fusion/{k}"] for k in log})

            r = train(make_task(wl, 0, **kw), optimizer, seed=0, lr=lr, steps=steps, evals=4, set_loss=True,
                      loss_scale=scale, on_step=on_step)
            wb.finish()
            every = max(1, steps // 200)
            out["trace"][f"{wl}@{scale}"] = {
                "workload": wl, "scale": scale, "fractions": clamp_fractions(log["gamma_mult"]),
                "final": r["final"], "diverged": r["diverged"], "steps": r["steps"],
                "median_ratio_proxy": sorted(a / b for a, b in zip(log["loss_ema"], log["gnorm_ema"])
                                             if b > 0)[len(log["loss_ema"]) // 2] if log["loss_ema"] else float("nan"),
                **{k: v[::every] for k, v in log.items()}}
    for wl, kw in WORKLOADS.items():
        for seed in range(ab_seeds):
            for rule in ("none", "fusionopt", "relative"):
                rel = RelativePolyak(lr) if rule == "relative" else None
                r = train(make_task(wl, seed, **kw), optimizer, seed=seed, lr=lr, steps=ab_steps, evals=2,
                          set_loss=rule == "fusionopt", opt_kwargs={"polyak": rule == "fusionopt"}, pre_step=rel)
                metric = "val_loss" if wl == "charlm" else "val_err"
                out["ab"].append({"workload": wl, "seed": seed, "rule": rule, "metric": metric,
                                  "value": r["final"][metric], "diverged": r["diverged"],
                                  "fractions": clamp_fractions(rel.mults) if rel else None,
                                  "final_mult": rel.mults[-1] if rel else None})
    return out


def render_polyak(data: dict[str, Any]) -> str:
    c = data["config"]
    rows = []
    for key, t in data["trace"].items():
        f = t["fractions"]
        rows.append([t["workload"], f"×{t['scale']:g}", fmt(t["loss_ema"][-1], 3), fmt(t["gnorm_ema"][-1], 3),
                     fmt(t["median_ratio_proxy"], 3), fmt(t["gamma_curr"][-1], 3),
                     f"{100 * f['at_low']:.1f}%", f"{100 * f['at_high']:.1f}%", f"{100 * f['free']:.1f}%",
                     "yes" if t["diverged"] else "no"])
    part1 = (f"{c['optimizer']} with the Polyak step (`set_loss` every step), lr {c['lr']}, first {c['steps']} "
             "steps; last logged EMAs, median L̄/Ḡ over the run, and the share of steps at each clamp.\n\n"
             + md_table(["workload", "loss scale", "loss_ema (end)", "gnorm_ema (end)", "median L̄/Ḡ",
                         "gamma_curr (end)", "at 0.1 clamp", "at 10 clamp", "between", "diverged"], rows))
    rows2 = []
    for wl in c["workloads"]:
        for rule in ("none", "fusionopt", "relative"):
            rs = [r for r in data["ab"] if r["workload"] == wl and r["rule"] == rule]
            if not rs:
                continue
            m, s = mean_sd(r["value"] for r in rs)
            extra = "—"
            if rule == "relative":
                fr = [r["fractions"] for r in rs]
                extra = (f"free {100 * mean_sd(f['free'] for f in fr)[0]:.0f}% of steps, final multiplier "
                         f"{fmt(mean_sd(r['final_mult'] for r in rs)[0], 3)}")
            rows2.append([wl, rs[0]["metric"], rule, f"{fmt(m, 4)} ± {fmt(s, 2)}",
                          sum(r["diverged"] for r in rs), extra])
    part2 = (f"A/B at loss scale ×1, {c['ab_steps']} steps, {c['ab_seeds']} seeds: no Polyak (γ = lr), FusionOpt's "
             "clamp, and the scale-free relative rule.\n\n"
             + md_table(["workload", "metric", "rule", "value", "diverged", "relative-rule clamp use"], rows2))
    return part1 + "\n\n" + part2


def plot_polyak(data: dict[str, Any], path) -> None:
    from .questions_io import new_figure, save_figure
    fig, ax = new_figure(3, 1)
    for key, t in data["trace"].items():
        xs = [i * max(1, data["config"]["steps"] // 200) for i in range(len(t["gamma_mult"]))]
        ax[0, 0].plot(xs, t["gamma_mult"], label=key)
        ax[0, 1].semilogy(xs, [abs(v) + 1e-30 for v in t["loss_ema"]], label=key)
        ax[0, 2].semilogy(xs, [v + 1e-30 for v in t["gnorm_ema"]], label=key)
    ax[0, 0].set(title="γ multiplier (clamp 0.1..10)", xlabel="step")
    ax[0, 1].set(title="|loss_ema|", xlabel="step")
    ax[0, 2].set(title="gnorm_ema (mean |g|)", xlabel="step")
    ax[0, 0].legend(fontsize=6)
    save_figure(fig, path)
