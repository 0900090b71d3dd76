"""FusionOpt's claim "KL-Shampoo standalone diverges to NaN" (docs/results.md, finding 2), measured.

Arms, each with ``resolution="off"`` so a NaN is the optimizer's own: our KL-Shampoo alone
(``Fusion(components={"shampoo"})`` — the coupled KL update, whose direction the spectral path RMS-matches to
0.2, like every spectral stage), KL-Shampoo + NS5, and AdamW, at lr 3e-3 and a stress lr 3e-2, on the
char-LM and the digits CNN. FusionOpt's standalone "KL-Shampoo" is plain Shampoo without grafting
(``Taikakim/fusion-optimiser`` fusion_optimiser/optimizer.py ``_spectral_group_step``); that exact update is
not re-implemented here, so the verdict is about KL-Shampoo as the paper defines it. The other two claims
(fp16 NS5, AdamW + diversity penalty) are rendered from the q2 and q3 measurements.
"""
from __future__ import annotations

import math
from typing import Any

from .questions_io import fmt, md_table, mean_sd
from .tasks import make_task, train

__all__ = ["run_shampoo_alone", "render_shampoo_alone"]

ARMS = {"KL-Shampoo alone": "fusion:shampoo", "KL-Shampoo + NS5": "fusion:shampoo+ns5", "AdamW": "adamw"}
WORKLOADS = {"charlm": {"d": 32, "batch": 16}, "digits": {"width": 16}}


def run_shampoo_alone(steps: int = 150, seeds: int = 2, lrs=(3e-3, 3e-2)) -> dict[str, Any]:
    runs = []
    for wl, kw in WORKLOADS.items():
        for lr in lrs:
            for arm, name in ARMS.items():
                for seed in range(seeds):
                    extra = {"resolution": "off"}
                    if name.startswith("fusion"):
                        extra["polyak"] = False
                    r = train(make_task(wl, seed, **kw), name, seed=seed, lr=lr, steps=steps, evals=2,
                              opt_kwargs=extra)
                    m = "val_loss" if wl == "charlm" else "val_err"
                    runs.append({"workload": wl, "lr": lr, "arm": arm, "seed": seed, "metric": m,
                                 "value": r["final"][m], "diverged": r["diverged"], "steps": r["steps"]})
    return {"config": {"steps": steps, "seeds": seeds, "lrs": list(lrs)}, "runs": runs}


def render_shampoo_alone(data: dict[str, Any]) -> str:
    rows = []
    for wl in WORKLOADS:
        for lr in data["config"]["lrs"]:
            for arm in ARMS:
                rs = [r for r in data["runs"] if r["workload"] == wl and r["lr"] == lr and r["arm"] == arm]
                if not rs:
                    continue
                fin = [r["value"] for r in rs if not r["diverged"] and math.isfinite(r["value"])]
                m, s = mean_sd(fin)
                rows.append([wl, fmt(lr), arm, rs[0]["metric"], f"{sum(r['diverged'] for r in rs)}/{len(rs)}",
                             f"{fmt(m, 4)} ± {fmt(s, 2)}" if fin else "—"])
    return (f"{data['config']['steps']} steps, {data['config']['seeds']} seeds, resolution off.\n\n"
            + md_table(["workload", "lr", "arm", "metric", "NaN/Inf runs", "final metric (finite runs)"], rows))
