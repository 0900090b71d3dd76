"""``python -m experiments spikes`` — finite gradient spikes: the ``spike_factor`` guard measured (issue 3).

A finite spike passes the NaN/Inf gate and writes itself into the moments (Adam's v remembers g² for
~1/(1-β₂) steps; a Muon momentum points along the spike for ~1/(1-μ) steps). The library's guard
(:mod:`nonans_optim.functional.spike`) rescales a tensor whose gradient norm exceeds ``spike_factor`` × its
running-mean norm. This experiment measures it and picks the default.

Design. Tasks: the char-LM (a small one: d=32, context 32, batch 16) and the digits CNN of
:mod:`experiments.tasks`, :data:`DEFAULT_STEPS` steps, lr 3e-3. Arms: optimizer × ``spike_factor`` in
:data:`FACTORS` × condition in :data:`CONDITIONS` × seed. Conditions: ``clean``; ``grad1e2/1e4/1e6`` — on
~1.5 % of the steps (:func:`spike_steps`, drawn in the middle 60 % of the run) ONE matrix's gradient
(:data:`TARGET`) is replaced, after backward and before ``step()``, by a copy multiplied by 1e2/1e4/1e6;
``loss1e3`` — on the same steps the batch is replaced by an outlier batch (random tokens / random labels)
and its loss multiplied by 1e3 (every gradient spikes, in a wrong direction). The batches and the model
init depend on the seed only, so every run is paired with the same seed's clean unguarded run.

Measured per run: the final validation loss (and the digits error), the guard's trigger count
(``opt.metrics()["resolution/events_spike"]``) and at which steps it rose, the per-step training loss; for
clean guarded runs whether the final parameters are ``torch.equal`` to the unguarded run's. Recovery: the
mean training-loss excess over the :data:`RECOVERY_WINDOW` steps after each spike (same batches as the
paired clean run) and the final validation-loss gap.

Decision rule (fixed before the measurement; :func:`decide`):

1. A factor is *admissible* only if it never triggers on any clean run (every task, optimizer and seed) and
   those clean runs end bit-identical (``torch.equal`` on every parameter) to the unguarded clean runs.
2. A (task, optimizer, spike condition) cell is *recovered* by a factor when the mean over seeds of the
   paired final validation-loss gap (spiked run / same seed's clean unguarded run − 1) is at most
   :data:`TOLERANCE` (5 %) and no seed diverged.
3. If no admissible factor recovers more cells than running without the guard (``None``), the default
   stays ``None``. Otherwise the default is the LARGEST admissible factor that recovers as many cells as
   the best admissible factor: the most conservative setting (furthest from false positives on workloads we
   did not measure) that still gets the full measured benefit.
"""
from __future__ import annotations

import argparse
import math
import re
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from .questions_io import (RESULTS, ROOT, environment, fmt, md_table, new_figure, read_json, replace_section,
                           save_figure, wandb_run, write_json)
from nonans_optim.functional.spike import SPIKE_BETA

from .tasks import OPTIMIZERS, make_task, train

__all__ = ["main", "run", "run_one", "spike_steps", "summarise", "decide", "render", "plot", "FACTORS",
           "CONDITIONS", "TARGET", "TOLERANCE"]

FACTORS: tuple[float | None, ...] = (None, 3.0, 10.0, 30.0, 100.0)
#: condition → (kind, multiplier); kind "grad": one tensor's gradient × m; "loss": outlier batch, loss × m.
CONDITIONS: dict[str, tuple[str, float] | None] = {"clean": None, "grad1e2": ("grad", 1e2),
                                                   "grad1e4": ("grad", 1e4), "grad1e6": ("grad", 1e6),
                                                   "loss1e3": ("loss", 1e3)}
TASK_KWARGS: dict[str, dict[str, int]] = {"charlm": {"d": 32, "context": 32, "batch": 16}, "digits": {}}
#: the spiked tensor: a matrix that takes the spectral path in SF-NorMuon and the Adam path in AdamW.
TARGET = {"charlm": "blocks.0.fc1.weight", "digits": "fc.weight"}
DEFAULT_STEPS = 120
SPIKE_RATE = 0.015
TOLERANCE = 0.05
RECOVERY_WINDOW = 10
LR = 3e-3
JSON_PATH = RESULTS / "spikes.json"
COMMAND = "python -m experiments spikes"


def spike_steps(steps: int, seed: int, rate: float = SPIKE_RATE) -> list[int]:
    """Sorted 0-based step indices of the spikes: ``max(1, round(rate·steps))`` distinct steps drawn (fixed
    by the seed) from the middle 60 % of the run, so the EMA is warm and there are steps left to recover."""
    n = max(1, round(rate * steps))
    lo, hi = steps // 5, max(steps // 5 + n, (4 * steps) // 5)
    g = torch.Generator().manual_seed(777 + seed)
    return sorted((lo + torch.randperm(hi - lo, generator=g)[:n]).tolist())


def _outlier(task_name: str, batch: Any, g: torch.Generator) -> Any:
    """A same-shaped batch of noise: uniform random tokens (char-LM) or the same images with random labels."""
    if task_name == "charlm":
        return torch.randint(0, int(batch.max()) + 1, batch.shape, generator=g)
    x, y = batch
    return x, torch.randint(0, 10, y.shape, generator=g)


def run_one(task_name: str, opt_name: str, factor: float | None, condition: str, seed: int, steps: int,
            lr: float = LR, extra_pre_step=None) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """One training run; returns (JSON record, final parameters — for the bit-identity check).
    ``extra_pre_step(step, opt, loss)`` runs after the spike is injected, just before ``step()`` (another
    guard under test: ``experiments/spike_guards.py``)."""
    task = make_task(task_name, seed, **TASK_KWARGS.get(task_name, {}))
    kind, mult = CONDITIONS[condition] or (None, 1.0)
    at = set(spike_steps(steps, seed)) if kind else set()
    target = dict(task.model.named_parameters())[TARGET[task_name]]
    g_out = torch.Generator().manual_seed(99 + seed)
    counter = {"i": 0}
    losses: list[float] = []
    trig: dict[str, Any] = {"last": 0.0, "steps": [], "opt": None}

    def loss_fn(model, batch):
        i = counter["i"]
        counter["i"] += 1
        if kind == "loss" and i in at:
            return task.loss(model, _outlier(task_name, batch, g_out)) * mult
        return task.loss(model, batch)

    head = {"ema": None, "max": 0.0}

    def pre_step(step, opt, loss):
        if condition == "clean" and factor is None:  # headroom: the guard's ratio, on the unguarded run
            norms = torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in task.model.parameters()])
            if head["ema"] is not None:
                head["max"] = max(head["max"], float((norms / head["ema"].clamp_min(1e-30)).max()))
                head["ema"] = SPIKE_BETA * head["ema"] + (1 - SPIKE_BETA) * norms
            else:
                head["ema"] = norms
        if kind == "grad" and step in at:
            target.grad = target.grad * mult  # a new tensor: the spike is ours, the optimizer must not fix it
        if extra_pre_step is not None:
            extra_pre_step(step, opt, loss)

    def on_step(step, opt, loss):
        losses.append(float(loss.detach()))
        trig["opt"] = opt
        if factor is not None:
            n = opt.metrics()["resolution/events_spike"]
            if n > trig["last"]:
                trig["steps"].append(step - 1)
            trig["last"] = n

    kwargs = {"spike_factor": factor}  # explicit, so the "None" arm is unguarded whatever the default
    r = train(task, opt_name, seed=seed, lr=lr, steps=steps, evals=4, opt_kwargs=kwargs, loss_fn=loss_fn,
              pre_step=pre_step, on_step=on_step)
    rec = {"task": task_name, "optimizer": opt_name, "factor": factor, "condition": condition, "seed": seed,
           "steps": r["steps"], "final": r["final"], "diverged": r["diverged"], "train_time_s": r["train_time_s"],
           "triggers": int(trig["last"]), "trigger_steps": trig["steps"], "spike_steps": sorted(at),
           "losses": losses}
    if condition == "clean" and factor is None:
        rec["max_norm_ratio"] = head["max"]
    return rec, [p.detach().clone() for p in task.model.parameters()]


def _excess(rec: dict[str, Any], ref: dict[str, Any]) -> float:
    """Mean relative training-loss excess over the window after each spike, paired with the clean run."""
    vals = []
    for s in rec["spike_steps"]:
        a, b = rec["losses"][s + 1:s + 1 + RECOVERY_WINDOW], ref["losses"][s + 1:s + 1 + RECOVERY_WINDOW]
        if a and b:
            vals.append(statistics.fmean(a) / statistics.fmean(b) - 1.0)
    return statistics.fmean(vals) if vals else float("nan")


def run(tasks: list[str], optimizers: list[str], factors: list[float | None], conditions: list[str],
        seeds: int, steps: int, lr: float = LR, log=print) -> dict[str, Any]:
    """Every arm; the clean unguarded run of each (task, optimizer, seed) goes first and is the pair."""
    from tqdm import tqdm
    if None not in factors or "clean" not in conditions:
        raise ValueError("the unguarded clean run is every comparison's reference: keep None and 'clean'")
    cfg = {"tasks": tasks, "optimizers": optimizers, "factors": factors, "conditions": conditions,
           "seeds": seeds, "steps": steps, "lr": lr, "task_kwargs": {t: TASK_KWARGS.get(t, {}) for t in tasks},
           "target": {t: TARGET[t] for t in tasks}, "spike_rate": SPIKE_RATE, "tolerance": TOLERANCE,
           "recovery_window": RECOVERY_WINDOW, "threads": torch.get_num_threads()}
    out: dict[str, Any] = {"config": cfg, "env": environment(), "runs": []}
    wb = wandb_run("nonans-spikes", "spikes", cfg)
    order = [None] + [f for f in factors if f is not None]
    conds = ["clean"] + [c for c in conditions if c != "clean"]
    bar = tqdm(total=len(tasks) * len(optimizers) * seeds * len(order) * len(conds), desc="spikes")
    for task in tasks:
        for o in optimizers:
            for seed in range(seeds):
                ref, ref_params = None, None
                for c in conds:
                    for f in order:
                        rec, params = run_one(task, o, f, c, seed, steps, lr)
                        if ref is None:
                            ref, ref_params = rec, params
                        rec["val_gap"] = rec["final"]["val_loss"] / ref["final"]["val_loss"] - 1.0
                        rec["recovery_excess"] = _excess(rec, ref) if c != "clean" else 0.0
                        if c == "clean" and f is not None:
                            rec["identical_to_unguarded"] = all(torch.equal(a, b) for a, b in zip(params, ref_params))
                        out["runs"].append(rec)
                        wb.log({f"{task}/{o}/{c}/k={f}/val_gap": rec["val_gap"], "triggers": rec["triggers"]})
                        bar.set_postfix_str(f"{task} {o} {c} k={f} gap={rec['val_gap']:+.3f} trig={rec['triggers']}")
                        bar.update()
    bar.close()
    wb.finish()
    return out


def _cells(data: dict[str, Any], arm: str) -> dict[tuple[str, str, str, Any], list[dict[str, Any]]]:
    cells: dict[tuple[str, str, str, Any], list[dict[str, Any]]] = {}
    for r in data["runs"]:
        cells.setdefault((r["task"], r["optimizer"], r["condition"], r[arm]), []).append(r)
    return cells


def summarise(data: dict[str, Any], arm: str = "factor") -> list[dict[str, Any]]:
    """One row per (task, optimizer, condition, arm): means over seeds of the paired measurements. ``arm``:
    the run field that names the guard setting (``spike_guards`` compares guards, not factors)."""
    rows = []
    for (task, o, c, f), runs in _cells(data, arm).items():
        finite = not any(r["diverged"] for r in runs)
        gap = statistics.fmean(r["val_gap"] for r in runs) if finite else float("inf")
        rows.append({"task": task, "optimizer": o, "condition": c, arm: f, "n": len(runs),
                     "val_loss": statistics.fmean(r["final"]["val_loss"] for r in runs),
                     "val_err": (statistics.fmean(r["final"]["val_err"] for r in runs)
                                 if "val_err" in runs[0]["final"] else None),
                     "val_gap": gap, "recovery_excess": statistics.fmean(r["recovery_excess"] for r in runs),
                     "triggers": statistics.fmean(r["triggers"] for r in runs), "diverged": not finite,
                     "identical": all(r.get("identical_to_unguarded", True) for r in runs),
                     "recovered": finite and gap <= data["config"]["tolerance"]})
    return rows


def _rule_text() -> str:
    """The docstring's decision rule as one markdown paragraph (the rule is stated once, in the docstring)."""
    text = " ".join(__doc__.split("Decision rule")[1].split("):", 1)[1].split())
    return re.sub(r":\w+:`(\w+)`", r"`\1`", text.replace("``", "`"))


def decide(data: dict[str, Any]) -> dict[str, Any]:
    """Apply the module docstring's rule to the measurement (it reads nothing else)."""
    rows = summarise(data)
    per: dict[str, dict[str, Any]] = {}
    for f in data["config"]["factors"]:
        mine = [r for r in rows if r["factor"] == f]
        clean = [r for r in mine if r["condition"] == "clean"]
        spiked = [r for r in mine if r["condition"] != "clean"]
        fp = sum(x["triggers"] for x in data["runs"] if x["factor"] == f and x["condition"] == "clean")
        per[str(f)] = {"factor": f, "false_positives": int(fp), "identical": all(r["identical"] for r in clean),
                       "admissible": f is None or (fp == 0 and all(r["identical"] for r in clean)),
                       "recovered": sum(r["recovered"] for r in spiked), "cells": len(spiked),
                       "not_recovered": [f"{r['task']}/{r['optimizer']}/{r['condition']}" for r in spiked
                                         if not r["recovered"]]}
    heads = [(r["max_norm_ratio"], f"{r['task']}/{r['optimizer']}/seed {r['seed']}") for r in data["runs"]
             if "max_norm_ratio" in r]
    base = per["None"]["recovered"]
    admissible = [p for p in per.values() if p["admissible"] and p["factor"] is not None]
    best = max((p["recovered"] for p in admissible), default=base)
    if best <= base:
        default, why = None, (f"no admissible factor recovers more cells than no guard ({base}/{per['None']['cells']})")
    else:
        default = max(p["factor"] for p in admissible if p["recovered"] == best)
        why = (f"largest admissible factor (0 clean-run triggers, bit-identical clean runs) recovering {best}/"
               f"{per['None']['cells']} spiked cells within {100 * data['config']['tolerance']:.0f}% "
               f"(no guard: {base})")
    return {"rule": _rule_text(), "per_factor": per,
            "default": default, "why": why, "clean_max_norm_ratio": max(heads, default=(float("nan"), ""))}


_NAMES = {"clean": "clean", "grad1e2": "1 tensor ×1e2", "grad1e4": "1 tensor ×1e4", "grad1e6": "1 tensor ×1e6",
          "loss1e3": "outlier batch, loss ×1e3"}


def render(data: dict[str, Any]) -> str:
    cfg, dec = data["config"], data["decision"]
    rows = summarise(data)
    fs = cfg["factors"]
    parts = [f"Command: `{COMMAND}` (JSON: `results/spikes.json`, plot: `results/spikes.png`); measured "
             f"{data['env']['date']}, {cfg['threads']} CPU thread, wall {fmt(data.get('wall_s'), 3)} s. Tasks "
             f"{cfg['tasks']} (char-LM d=32 ctx 32 batch 16), {cfg['steps']} steps, lr {cfg['lr']}, "
             f"{cfg['seeds']} seeds. Spikes on {fmt(100 * cfg['spike_rate'], 2)}% of the steps (middle 60% of the "
             f"run): one matrix's gradient ({', '.join(f'{t}: `{n}`' for t, n in cfg['target'].items())}) × "
             "1e2/1e4/1e6 after backward, or an outlier batch (random tokens / labels) with the loss × 1e3. "
             "Cell value: mean over seeds of the paired final validation-loss gap vs the same seed's clean "
             "unguarded run (lower is better; ✓ = recovered, within "
             f"{100 * cfg['tolerance']:.0f}%), then the guard's trigger count per run. Recovery: mean "
             f"training-loss excess over the {cfg['recovery_window']} steps after each spike (same batches)."]
    for task in cfg["tasks"]:
        for o in cfg["optimizers"]:
            table = []
            for c in cfg["conditions"]:
                cell = {r["factor"]: r for r in rows if (r["task"], r["optimizer"], r["condition"]) == (task, o, c)}
                table.append([_NAMES.get(c, c)] + [
                    f"{100 * cell[f]['val_gap']:+.1f}%{' ✓' if cell[f]['recovered'] else ''} · "
                    f"{fmt(cell[f]['triggers'], 3)} · {100 * cell[f]['recovery_excess']:+.0f}%" for f in fs])
            parts.append(f"**{task} / {OPTIMIZERS.get(o, o)}** (gap · triggers · post-spike excess; clean "
                         f"unguarded val_loss {fmt(_clean(rows, task, o), 4)})"
                         "\n\n" + md_table(["condition"] + [f"k={fmt(f)}" if f else "no guard" for f in fs], table))
    per, head = dec["per_factor"], dec.get("clean_max_norm_ratio") or (float("nan"), "not measured")
    parts.append("**Decision** (rule fixed in advance, `experiments/spikes.py`): " + dec["rule"] + "\n\n" + md_table(
        ["spike_factor", "clean-run triggers (false positives)", "clean runs bit-identical", "admissible",
         "spiked cells recovered", "not recovered"],
        [[fmt(p["factor"]) if p["factor"] else "None", p["false_positives"], p["identical"], p["admissible"],
          f"{p['recovered']}/{p['cells']}", ", ".join(p["not_recovered"]) or "—"] for p in per.values()])
        + f"\n\n**Chosen default: `spike_factor={dec['default']}`** — {dec['why']}. Headroom: the largest "
        f"‖g‖ / running-mean ‖g‖ (the guard's ratio, β={SPIKE_BETA}) of any tensor on any clean unguarded run "
        f"was {fmt(head[0], 3)} ({head[1]}). {_where_default()}\n\n![spikes](results/spikes.png)")
    return "\n\n".join(parts)


def _where_default() -> str:
    """Which optimizers the library constructs with the guard on, read from the library when rendering."""
    import nonans_optim as no
    on, off = [], []
    for name in ("SFNorMuon", "FullFusion", "Muon", "AdamW", "SFAdamW"):
        factor = getattr(no, name)([torch.nn.Parameter(torch.zeros(3, 3))]).spike_factor
        (on if factor is not None else off).append(f"{name} ({'None' if factor is None else fmt(factor)})")
    return (f"The library's defaults: the guard is on for {', '.join(on) or 'none'} — their step computes the "
            f"gradient norm anyway — and opt-in for {', '.join(off) or 'none'}, whose one-read Adam step would pay "
            "an extra read of every gradient for it (RESULTS.md, \"overhead\": the `spike_factor=10` rows).")


def _clean(rows: list[dict[str, Any]], task: str, o: str) -> float:
    return next(r["val_loss"] for r in rows if (r["task"], r["optimizer"], r["condition"], r["factor"]) ==
                (task, o, "clean", None))


def ref_spikes(data: dict[str, Any], task: str, o: str, cond: str) -> list[int]:
    """The spike steps of seed 0's runs of ``cond`` (the same for every factor)."""
    return next(r["spike_steps"] for r in data["runs"] if (r["task"], r["optimizer"], r["seed"], r["condition"])
                == (task, o, 0, cond))


def plot(data: dict[str, Any], path: Path) -> None:
    """Per (task, optimizer): gap heat map (condition × factor); then clean triggers per factor; then the
    paired training-loss ratio around the spikes for the first task/optimizer's loss spike, seed 0."""
    cfg, rows = data["config"], summarise(data)
    pairs = [(t, o) for t in cfg["tasks"] for o in cfg["optimizers"]]
    ncols = max(len(pairs), 2)
    fig, ax = new_figure(ncols, 2, size=(4.6, 3.4))
    for extra in range(2, ncols):
        ax[1, extra].axis("off")
    for extra in range(len(pairs), ncols):
        ax[0, extra].axis("off")
    fs, cs = cfg["factors"], [c for c in cfg["conditions"] if c != "clean"]
    labels = ["none" if f is None else fmt(f) for f in fs]
    for k, (t, o) in enumerate(pairs):
        grid = [[next(100 * r["val_gap"] for r in rows if (r["task"], r["optimizer"], r["condition"], r["factor"])
                      == (t, o, c, f)) for f in fs] for c in cs]
        shown = [[min(v, 100.0) for v in row] for row in grid]
        im = ax[0, k].imshow(shown, cmap="RdYlGn_r", vmin=-10, vmax=50, aspect="auto")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax[0, k].text(j, i, f"{v:+.0f}" if math.isfinite(v) else "div", ha="center", va="center", fontsize=7)
        ax[0, k].set_xticks(range(len(fs)), labels)
        ax[0, k].set_yticks(range(len(cs)), [_NAMES.get(c, c) for c in cs], fontsize=7)
        ax[0, k].set(title=f"{t} / {OPTIMIZERS.get(o, o)}: val-loss gap %", xlabel="spike_factor")
    fig.colorbar(im, ax=ax[0, len(pairs) - 1])
    fp = [decide(data)["per_factor"][str(f)]["false_positives"] for f in fs]
    ax[1, 0].bar(labels, fp)
    ax[1, 0].set(title="clean-run triggers (all runs)", xlabel="spike_factor", ylabel="count")
    t, o = pairs[0]
    cond = "loss1e3" if "loss1e3" in cs else cs[0]
    ref = next(r for r in data["runs"] if (r["task"], r["optimizer"], r["seed"], r["condition"], r["factor"])
               == (t, o, 0, "clean", None))
    for f in fs:
        r = next(x for x in data["runs"] if (x["task"], x["optimizer"], x["seed"], x["condition"], x["factor"])
                 == (t, o, 0, cond, f))
        ratio = [a / b for a, b in zip(r["losses"], ref["losses"])]
        ax[1, 1].plot(range(1, len(ratio) + 1), ratio, label="none" if f is None else f"k={fmt(f)}", lw=1)
    for s in ref_spikes(data, t, o, cond):
        ax[1, 1].axvline(s + 1, color="k", ls=":", lw=0.8)
    ax[1, 1].set(title=f"{t}/{o} {cond}, seed 0", xlabel="step", ylabel="train loss / clean", ylim=(0.8, 2.0))
    ax[1, 1].legend(fontsize=7)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", nargs="+", default=["charlm", "digits"])
    ap.add_argument("--optimizers", nargs="+", default=["adamw", "sfnormuon"])
    ap.add_argument("--factors", nargs="+", default=["none", "3", "10", "30", "100"])
    ap.add_argument("--conditions", nargs="+", default=list(CONDITIONS))
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    ap.add_argument("--lr", type=float, default=LR)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(JSON_PATH))
    ap.add_argument("--render-only", action="store_true")
    ap.add_argument("--results-md", default=str(ROOT / "RESULTS.md"), help="'' to skip rendering")
    ap.add_argument("--no-markdown", action="store_true", help="the same as --results-md ''")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.render_only:
        data = read_json(out)
        if data is None:
            print(f"no {out}; run without --render-only first")
            return 1
    else:
        torch.set_num_threads(args.threads)
        factors = [None if f.lower() == "none" else float(f) for f in args.factors]
        t0 = time.perf_counter()
        data = run(args.tasks, args.optimizers, factors, args.conditions, args.seeds, args.steps, args.lr)
        data["wall_s"] = time.perf_counter() - t0
        data["decision"] = decide(data)
        write_json(out, data)
        print(f"[spikes] wrote {out} in {data['wall_s']:.0f} s")
    plot(data, out.with_suffix(".png"))
    if args.results_md and not args.no_markdown:
        replace_section(Path(args.results_md), "spikes", render(data),
                        title="Finite gradient spikes: the spike_factor guard (issue 3)")
    print(render(data))
    print(f"[spikes] default spike_factor = {data['decision']['default']} ({data['decision']['why']})")
    return 0
