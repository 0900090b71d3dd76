"""``python -m experiments ablation`` — FusionOpt's case-study ablation, re-run on two offline tasks.

Arms: AdamW, SF-AdamW, Muon, Muon + MONA, SF-NorMuon, FullFusion (:data:`experiments.tasks.OPTIMIZERS`) on
the char-level LM and the digits CNN (:mod:`experiments.tasks`), each seed with

* the same *step* budget, and
* the same *wall-clock* budget: every optimizer trains for the seconds AdamW needed for the step budget
  (median over seeds, measured in the same run), and the steps it achieved are recorded.

One lr for every optimizer: spectral updates are RMS-matched to AdamW's (README.md, "One learning rate"),
so the comparison is "swap the optimizer, keep the lr". The Polyak step is left off (no ``set_loss``): its
clamp is measured separately (``questions polyak``). Results: ``results/ablation.json`` and
``results/ablation_<task>.png``; the RESULTS.md section between ``<!-- ablation:begin/end -->`` is rendered
from the JSON (``--render-only`` re-renders without training).

FusionOpt's published case-study table (Taikakim/fusion-optimiser docs/results.md, 5 M-param audio-control
heads, 30 epochs, same wall-clock) is quoted in :data:`FUSIONOPT_CASE_STUDY` for the side-by-side.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from nonans_optim.optimizers._fused import auto_choice

from .questions_io import (RESULTS, ROOT, at_commit, environment, fmt, md_table, mean_sd, new_figure, read_json,
                           replace_section, save_figure, wandb_run, write_json)
from .tasks import OPTIMIZERS, make_task, train

__all__ = ["main", "run", "render", "FUSIONOPT_CASE_STUDY"]

#: FusionOpt docs/results.md "Quality lift over AdamW": Δ val_MAE vs AdamW (%) and it/s vs AdamW. Quoted
#: from the source (their measurement, not ours); SF-AdamW is not in their table.
FUSIONOPT_CASE_STUDY = {"adamw": (0.0, 1.00), "muon": (-2.7, 0.92), "muon_mona": (-5.8, 0.84),
                        "sfnormuon": (-7.4, 1.00), "fullfusion": (-8.4, 0.51)}

DEFAULT_STEPS = {"charlm": 200, "digits": 200}
JSON_PATH = RESULTS / "ablation.json"
COMMAND = "python -m experiments ablation"


def _strip(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if k != "train_curve"}


def run(tasks: list[str], seeds: int, steps: dict[str, int], lr: float, optimizers: list[str],
        time_arm: bool = True, log=print) -> dict[str, Any]:
    out: dict[str, Any] = {"config": {"tasks": tasks, "seeds": seeds, "steps": steps, "lr": lr,
                                      "optimizers": optimizers, "time_arm": time_arm,
                                      "polyak": "off (no set_loss)", "threads": torch.get_num_threads(),
                                      # what the default, impl="auto", ran: the speed behind the wall-clock arm
                                      "impl": {"fused": "auto (fused: the native CPU loops)",
                                               "foreach": "auto (foreach)"}[auto_choice("cpu")]},
                           "env": environment(), "tasks": {}}
    for task in tasks:
        res: dict[str, Any] = {"step_arm": {o: [] for o in optimizers}, "time_arm": {o: [] for o in optimizers}}
        wb = wandb_run("nonans-ablation", task, out["config"])
        for seed in range(seeds):
            for o in optimizers:
                r = train(make_task(task, seed), o, seed=seed, lr=lr, steps=steps[task])
                res["step_arm"][o].append(_strip(r))
                wb.log({f"{task}/{o}/steps": r["final"][_metric(task)], "seed": seed})
                log(f"[ablation] {task} steps={steps[task]} seed={seed} {o:<11} "
                    f"{_metric(task)}={r['final'][_metric(task)]:.4f} it/s={r['it_s']:.1f}")
        if time_arm:
            base = [r["train_time_s"] for r in res["step_arm"].get("adamw", [])] or \
                   [r["train_time_s"] for rs in res["step_arm"].values() for r in rs]
            seconds = statistics.median(base)
            res["seconds"] = seconds
            for seed in range(seeds):
                for o in optimizers:
                    r = train(make_task(task, seed), o, seed=seed, lr=lr, seconds=seconds)
                    res["time_arm"][o].append(_strip(r))
                    wb.log({f"{task}/{o}/time": r["final"][_metric(task)], "seed": seed})
                    log(f"[ablation] {task} seconds={seconds:.1f} seed={seed} {o:<11} "
                        f"{_metric(task)}={r['final'][_metric(task)]:.4f} steps={r['steps']}")
        wb.finish()
        out["tasks"][task] = res
    return out


def _metric(task: str) -> str:
    return "val_loss" if task == "charlm" else "val_err"


def summarise(data: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """Per task and optimizer: metric mean/sd in both arms, Δ% vs AdamW, steps, it/s ratio vs AdamW."""
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for task, res in data["tasks"].items():
        m = _metric(task)
        rows: dict[str, dict[str, float]] = {}
        base = {arm: mean_sd(r["final"][m] for r in res[arm].get("adamw", []))[0] for arm in ("step_arm", "time_arm")}
        base_its = mean_sd(r["it_s"] for r in res["step_arm"].get("adamw", []))[0]
        for o, runs in res["step_arm"].items():
            s_mean, s_sd = mean_sd(r["final"][m] for r in runs)
            t_runs = res["time_arm"].get(o, [])
            t_mean, t_sd = mean_sd(r["final"][m] for r in t_runs)
            its = mean_sd(r["it_s"] for r in runs)[0]
            rows[o] = {"step_mean": s_mean, "step_sd": s_sd, "step_delta_pct": 100 * (s_mean / base["step_arm"] - 1),
                       "time_mean": t_mean, "time_sd": t_sd,
                       "time_delta_pct": 100 * (t_mean / base["time_arm"] - 1) if t_runs else float("nan"),
                       "time_steps": mean_sd(r["steps"] for r in t_runs)[0] if t_runs else float("nan"),
                       "it_s": its, "it_s_ratio": its / base_its,
                       "diverged": sum(r["diverged"] for r in runs + t_runs), "n": len(runs)}
        summary[task] = rows
    return summary


def _verdicts(summary: dict[str, dict[str, dict[str, float]]]) -> list[list[str]]:
    """FusionOpt's conclusions checked against each task's same-wall-clock arm (theirs was same wall-clock).

    A difference counts only when it exceeds the larger of the two seed standard deviations."""
    rows = []

    def better(task, a, b):  # is a's time-arm metric lower than b's, beyond the spread?
        ra, rb = summary[task][a], summary[task][b]
        d, spread = rb["time_mean"] - ra["time_mean"], max(ra["time_sd"], rb["time_sd"])
        return "holds" if d > spread else ("reversed" if -d > spread else "within spread")

    claims = [("every spectral variant beats AdamW (Muon, +MONA, SF-NorMuon, Full all < AdamW)",
               lambda t: ", ".join(f"{o}: {better(t, o, 'adamw')}"
                                   for o in ("muon", "muon_mona", "sfnormuon", "fullfusion"))),
              ("MONA adds to Muon (Muon+MONA < Muon)", lambda t: better(t, "muon_mona", "muon")),
              ("SF-NorMuon beats Muon+MONA", lambda t: better(t, "sfnormuon", "muon_mona")),
              ("Full Fusion beats SF-NorMuon at the same wall-clock", lambda t: better(t, "fullfusion", "sfnormuon")),
              ("Full Fusion runs at ~0.51x AdamW's it/s",
               lambda t: f"measured {fmt(summary[t]['fullfusion']['it_s_ratio'], 2)}x"),
              ("SF-NorMuon runs at ~1.00x AdamW's it/s (after compile)",
               lambda t: f"measured {fmt(summary[t]['sfnormuon']['it_s_ratio'], 2)}x (no torch.compile)")]
    for text, fn in claims:
        try:
            rows.append([text] + [fn(t) for t in summary])
        except KeyError:
            continue
    return rows


def render(data: dict[str, Any]) -> str:
    summary = summarise(data)
    cfg = data["config"]
    parts = [f"Command: `{COMMAND}` (JSON: `results/ablation.json`, plots: `results/ablation_<task>.png`). "
             f"lr {cfg['lr']} for every optimizer (library defaults otherwise, impl "
             f"{cfg.get('impl', 'foreach (the default before impl=auto)')}; Polyak off), {cfg['seeds']} seeds, "
             f"step budgets {cfg['steps']}, {cfg['threads']} CPU thread(s); measured {data['env']['date']}"
             f"{at_commit(data['env'])}. "
             "Metric: char-LM validation loss (nats/char), digits validation error (%); lower is better; "
             "mean ± sd over seeds. Wall-clock arm: every optimizer trains for the median seconds AdamW took "
             "for the step budget. it/s are CPU numbers from the same run, noisy (shared machine)."]
    for task, rows in summary.items():
        secs = data["tasks"][task].get("seconds")
        table = []
        for o, r in rows.items():
            fo = FUSIONOPT_CASE_STUDY.get(o)
            table.append([OPTIMIZERS.get(o, o), f"{fmt(r['step_mean'], 4)} ± {fmt(r['step_sd'], 2)}",
                          f"{r['step_delta_pct']:+.1f}%", f"{fmt(r['time_mean'], 4)} ± {fmt(r['time_sd'], 2)}",
                          f"{r['time_delta_pct']:+.1f}%", fmt(r["time_steps"], 4), f"{r['it_s_ratio']:.2f}x",
                          str(int(r["diverged"])),
                          f"{fo[0]:+.1f}% / {fo[1]:.2f}x" if fo else "—"])
        parts.append(f"**{task}** ({_metric(task)}; wall-clock budget {fmt(secs, 3)} s per run)\n\n" + md_table(
            ["optimizer", "same steps", "Δ vs AdamW", "same wall-clock", "Δ vs AdamW", "steps in budget",
             "it/s vs AdamW", "diverged runs", "FusionOpt case study (Δ val_MAE / it/s)"], table)
            + f"\n\n![{task}](results/ablation_{task}.png)")
    parts.append("**FusionOpt's conclusions, checked on the same-wall-clock arm** (a difference counts only when "
                 "it exceeds the larger seed sd)\n\n"
                 + md_table(["FusionOpt conclusion"] + list(summary), _verdicts(summary)))
    return "\n\n".join(parts)


def plot(data: dict[str, Any], outdir=RESULTS) -> None:
    for task, res in data["tasks"].items():
        m = _metric(task)
        fig, ax = new_figure(3, 1)
        for o, runs in res["step_arm"].items():
            steps = [p["step"] for p in runs[0]["curve"]]
            ys = [statistics.fmean(r["curve"][i][m] for r in runs if i < len(r["curve"])) for i in range(len(steps))]
            ax[0, 0].plot(steps, ys, label=OPTIMIZERS.get(o, o))
            t_runs = res["time_arm"].get(o) or []
            if t_runs:
                r = t_runs[0]
                ax[0, 1].plot([p["time"] for p in r["curve"]], [p[m] for p in r["curve"]], label=OPTIMIZERS.get(o, o))
        summ = summarise(data)[task]
        ax[0, 2].bar(range(len(summ)), [r["it_s_ratio"] for r in summ.values()])
        ax[0, 2].set_xticks(range(len(summ)), [OPTIMIZERS.get(o, o) for o in summ], rotation=45, ha="right")
        ax[0, 0].set(title=f"{task}: same steps (mean of seeds)", xlabel="step", ylabel=m)
        ax[0, 1].set(title="same wall-clock (seed 0)", xlabel="training seconds", ylabel=m)
        ax[0, 2].set(title="it/s vs AdamW", ylabel="ratio")
        ax[0, 0].legend(fontsize=7)
        save_figure(fig, outdir / f"ablation_{task}.png")


def write_markdown(data: dict[str, Any], results_md: Path | str = ROOT / "RESULTS.md") -> None:
    replace_section(Path(results_md), "ablation", render(data), title="Case-study ablation (issue 6)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments ablation", description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", nargs="+", default=["charlm", "digits"])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None, help="step budget for every task (default per task)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS))
    ap.add_argument("--no-time-arm", action="store_true")
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
        steps = {t: args.steps or DEFAULT_STEPS[t] for t in args.tasks}
        t0 = time.perf_counter()
        data = run(args.tasks, args.seeds, steps, args.lr, args.optimizers, time_arm=not args.no_time_arm)
        data["wall_s"] = time.perf_counter() - t0
        write_json(out, data)
        print(f"[ablation] wrote {out} in {data['wall_s']:.0f} s")
    plot(data, out.parent)
    if args.results_md and not args.no_markdown:
        write_markdown(data, args.results_md)
    print(render(data))
    return 0
