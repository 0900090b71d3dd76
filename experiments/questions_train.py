"""Open questions 3 (negative losses) and 7 (Muon on conv kernels), trained on the digits CNN.

Q3 — FusionOpt saw, on one workload (audio control heads with a diversity penalty against a frozen
reference): AdamW → NaN within ~1k steps; SF-NorMuon → incoherent; Full Fusion warm-started → usable
(docs/results.md "Diversity training"). Here the second architecture is the digits CNN with the loss
``CE(f(x), y) − λ·mean‖h(x) − h_ref(x)‖²`` (h = penultimate features, h_ref from a frozen AdamW-trained
reference): unbounded below, like theirs. Arms: AdamW, SF-NorMuon, +MONA, +Shampoo, Full (Polyak on, as
FusionOpt runs it), plus SF-NorMuon and Full with Polyak off — the control for the Polyak floor (a
negative loss EMA pins γ at 0.1·lr). Warm start (from the reference) and fresh start, 3 seeds. Every arm
runs with ``resolution="off"`` so that a NaN is the optimizer's, not hidden by the repair step.

Q7 — the reshape-and-route pattern: conv kernels (out, in, kh, kw) → (out, in·kh·kw) on the spectral path
(our routing) versus conv kernels on the scalar path (FusionOpt's routing: conv is never reshaped), against
AdamW and SF-AdamW, each with the same lr grid (equal tuning budget) and then 3 seeds at the chosen lr.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from .questions_io import fmt, md_table, mean_sd
from .tasks import digits_data, make_task, train

__all__ = ["run_q3", "render_q3", "run_q7", "render_q7", "Q3_ARMS"]

Q3_ARMS = {"AdamW": ("adamw", {}),
           "SF-NorMuon": ("sfnormuon", {}),
           "SF-NorMuon+MONA": ("fusion:ns5+normuon+sf+mona", {"weight_decay": 0.05, "momentum": 0.8}),
           "SF-NorMuon+Shampoo": ("fusion:ns5+normuon+sf+shampoo", {"weight_decay": 0.05, "momentum": 0.8}),
           "Full": ("fullfusion", {}),
           "SF-NorMuon, Polyak off": ("sfnormuon", {"polyak": False}),
           "Full, Polyak off": ("fullfusion", {"polyak": False})}


def _reference(width: int, steps: int, lr: float) -> torch.nn.Module:
    task = make_task("digits", 999, width=width)
    train(task, "adamw", seed=999, lr=lr, steps=steps, evals=1)
    ref = task.model.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def run_q3(seeds: int = 3, steps: int = 150, lam: float = 1.0, lr: float = 3e-3, width: int = 8,
           ref_steps: int = 200, arms: dict | None = None) -> dict[str, Any]:
    arms = arms or Q3_ARMS
    ref = _reference(width, ref_steps, lr)
    data = digits_data()
    with torch.no_grad():
        ref_pred = ref(data["Xva"]).argmax(-1)
        ref_feat = ref.features(data["Xva"])
    out: dict[str, Any] = {"config": {"seeds": seeds, "steps": steps, "lambda": lam, "lr": lr, "width": width,
                                      "ref_steps": ref_steps},
                           "reference_val_err": 100 * float((ref_pred != data["yva"]).float().mean()), "runs": []}

    def loss_fn(m, xy):
        x, y = xy
        h = m.features(x)
        with torch.no_grad():
            h_ref = ref.features(x)
        return F.cross_entropy(m.head(h), y) - lam * (h - h_ref).pow(2).sum(-1).mean()

    for arm, (opt_name, kw) in arms.items():
        for init in ("warm", "fresh"):
            for seed in range(seeds):
                task = make_task("digits", seed, width=width)
                if init == "warm":
                    task.model.load_state_dict(ref.state_dict())
                polyak = kw.get("polyak", True) and opt_name != "adamw"
                r = train(task, opt_name, seed=seed, lr=lr, steps=steps, evals=2, loss_fn=loss_fn,
                          set_loss=polyak, opt_kwargs={"resolution": "off", **kw})
                with torch.no_grad():
                    m = task.model
                    pred = m(data["Xva"]).argmax(-1)
                    dist = float((m.features(data["Xva"]) - ref_feat).pow(2).sum(-1).mean())
                last_loss = r["train_curve"][-1][1] if r["train_curve"] else float("nan")
                out["runs"].append({"arm": arm, "init": init, "seed": seed, "diverged": r["diverged"],
                                    "steps": r["steps"], "val_err": r["final"]["val_err"],
                                    "agree_ref": 100 * float((pred == ref_pred).float().mean()),
                                    "feat_dist": dist, "last_train_loss": last_loss})
    return out


def render_q3(data: dict[str, Any]) -> str:
    rows = []
    arms = list(dict.fromkeys(r["arm"] for r in data["runs"]))
    for arm in arms:
        for init in ("warm", "fresh"):
            rs = [r for r in data["runs"] if r["arm"] == arm and r["init"] == init]
            ok = [r for r in rs if not r["diverged"] and math.isfinite(r["val_err"])]
            err, err_sd = mean_sd(r["val_err"] for r in ok)
            agree, _ = mean_sd(r["agree_ref"] for r in ok)
            dist, _ = mean_sd(r["feat_dist"] for r in ok)
            rows.append([arm, init, f"{sum(r['diverged'] for r in rs)}/{len(rs)}",
                         f"{fmt(err, 3)} ± {fmt(err_sd, 2)}", fmt(agree, 3), fmt(dist, 3),
                         fmt(mean_sd(r["last_train_loss"] for r in ok)[0], 3)])
    c = data["config"]
    return (f"Reference (AdamW, {c['ref_steps']} steps) val error {fmt(data['reference_val_err'], 3)}%; "
            f"λ = {c['lambda']}, {c['steps']} steps, lr {c['lr']}, CNN width {c['width']}.\n\n"
            + md_table(["arm", "init", "NaN/Inf runs", "val err % (finite runs)", "agreement with reference %",
                        "feature distance ‖h−h_ref‖²", "final train loss"], rows))


def _conv_scalar_groups(model: torch.nn.Module) -> list[dict]:
    """FusionOpt's routing for this model: conv kernels go to the scalar path (never reshaped)."""
    import nonans_optim as no
    groups = no.param_groups(model)
    out = []
    for g in groups:
        if g["path"] != "spectral":
            out.append(g)
            continue
        keep = [(p, n) for p, n in zip(g["params"], g["param_names"]) if p.ndim == 2]
        move = [(p, n) for p, n in zip(g["params"], g["param_names"]) if p.ndim != 2]
        if keep:
            out.append({**g, "params": [p for p, _ in keep], "param_names": [n for _, n in keep]})
        if move:
            out.append({**g, "params": [p for p, _ in move], "param_names": [n for _, n in move], "path": "scalar"})
    return out


Q7_ARMS = {"AdamW": ("adamw", False), "SF-AdamW": ("sfadamw", False),
           "Muon, conv reshaped → spectral": ("muon", False), "Muon, conv → scalar (FusionOpt)": ("muon", True)}


def run_q7(seeds: int = 3, steps: int = 300, tune_steps: int = 150, lrs=(1e-3, 3e-3, 1e-2),
           width: int = 16) -> dict[str, Any]:
    out: dict[str, Any] = {"config": {"seeds": seeds, "steps": steps, "tune_steps": tune_steps, "lrs": list(lrs),
                                      "width": width}, "tuning": {}, "runs": {}}
    for arm, (opt_name, conv_scalar) in Q7_ARMS.items():
        def run(seed, lr, n):
            task = make_task("digits", seed, width=width)
            kw = {"groups": _conv_scalar_groups(task.model)} if conv_scalar else {}
            return train(task, opt_name, seed=seed, lr=lr, steps=n, evals=2, opt_kwargs=kw)
        tune = {str(lr): run(100, lr, tune_steps)["final"]["val_loss"] for lr in lrs}  # tuning seed ≠ test seeds
        best = min(lrs, key=lambda lr: tune[str(lr)] if math.isfinite(tune[str(lr)]) else math.inf)
        out["tuning"][arm] = {"val_loss": tune, "best_lr": best}
        out["runs"][arm] = [{k: r[k] for k in ("final", "diverged", "it_s")}
                            for r in (run(s, best, steps) for s in range(seeds))]
    return out


def render_q7(data: dict[str, Any]) -> str:
    rows = []
    base = mean_sd(r["final"]["val_err"] for r in data["runs"]["AdamW"])[0]
    for arm, runs in data["runs"].items():
        err, sd = mean_sd(r["final"]["val_err"] for r in runs)
        loss, lsd = mean_sd(r["final"]["val_loss"] for r in runs)
        rows.append([arm, fmt(data["tuning"][arm]["best_lr"]), f"{fmt(err, 3)} ± {fmt(sd, 2)}",
                     f"{err - base:+.2f}", f"{fmt(loss, 3)} ± {fmt(lsd, 2)}"])
    c = data["config"]
    return (f"lr grid {c['lrs']} tuned on a separate seed for {c['tune_steps']} steps (by val loss), then "
            f"{c['seeds']} seeds × {c['steps']} steps at the chosen lr; CNN width {c['width']}.\n\n"
            + md_table(["arm", "chosen lr", "val err %", "Δ vs AdamW (points)", "val loss"], rows))
