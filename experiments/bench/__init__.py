"""``python -m experiments bench [baseline|nonans|compare] [--scale] [--workloads k1,k2] [--out DIR]``

The singularity benchmark (issue 5): eight workloads with a real cause of NaN/Inf, each trained by the
stock arms (``baseline``: clean reference, stock + guards, checkpoint-rollback; peers when installed) and by
our arms (``nonans``: resolution "repair", and the "off" control). ``compare`` derives the comparison from
the JSON of both, writes ``results/bench.json``, PNG plots and the RESULTS.md section. No argument runs all
three. CPU defaults use fixed seeds; ``--scale`` runs the larger sizes (meant for a GPU).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

from experiments.questions_io import checkout_commit, cpu_model

from .arms import OURS_ARMS, STOCK_ARMS, peer_arms, peer_status
from .harness import run_arm
from .overhead import step_overhead
from .report import compare, plot, render_markdown, write_results_section
from .workloads import WORKLOADS

__all__ = ["main", "run_group", "machine"]


def machine() -> dict:
    return dict(cpu=cpu_model(), platform=platform.platform(), python=platform.python_version(),
                torch=torch.__version__, cpu_count=os.cpu_count(), threads=torch.get_num_threads(),
                cuda=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                date=datetime.datetime.now().isoformat(timespec="seconds"), commit=checkout_commit())


def _progress(total: int, desc: str):
    try:
        from tqdm import tqdm
        return tqdm(total=total, desc=desc, leave=False, file=sys.stderr, dynamic_ncols=True)
    except ImportError:  # tqdm is optional at runtime
        return None


def _wandb_log(group: str, records: dict) -> None:
    """Offline wandb logging whenever wandb is installed (NONANS_WANDB=0 turns it off)."""
    if os.environ.get("NONANS_WANDB", "1") == "0":
        return
    try:
        import wandb
    except ImportError:
        return
    for key, arms in records.items():
        for arm, rec in arms.items():
            run = wandb.init(project="nonans-bench", name=f"{key}/{arm}", mode="offline", reinit=True,
                             config=dict(workload=key, arm=arm, group=group, size=rec["size"]))
            for step, loss in enumerate(rec["losses"]):
                if loss is not None:
                    wandb.log({"loss": loss}, step=step)
            run.summary.update({k: rec[k] for k in ("completed", "final_metric", "events_total", "steps_lost")})
            run.finish()


def run_group(arms, keys, *, size: str, seed: int) -> dict[str, dict[str, dict]]:
    """Run ``arms`` on the workloads ``keys``; returns {workload: {arm: record}}."""
    out: dict[str, dict[str, dict]] = {}
    for key in keys:
        wl = WORKLOADS[key]
        out[key] = {}
        kind = wl.build(size=size, seed=seed, clean=True).optim.kind
        for arm in list(arms) + (peer_arms(kind) if "baseline" in arms else []):
            bar = _progress(wl.build(size=size, seed=seed, clean=True).steps, f"{key}:{arm}")
            try:
                out[key][arm] = run_arm(wl, arm, size=size, seed=seed, progress=bar)
            except Exception as exc:  # a peer that cannot run here is reported, not fatal
                if not arm.startswith("peer_"):
                    raise
                out[key][arm] = dict(workload=key, arm=arm, error=f"{type(exc).__name__}: {exc}"[:300],
                                     completed=False, losses=[], first_nonfinite_step=None,
                                     final_metric=None, events_total=0, steps_lost=None, metric="")
            if bar is not None:
                bar.close()
            rec = out[key][arm]
            print(f"  {key:<22} {arm:<10} completed={rec['completed']!s:<5} "
                  f"first_nonfinite={rec['first_nonfinite_step']} final={rec['final_metric']} "
                  f"events={rec['events_total']} lost={rec['steps_lost']}", file=sys.stderr)
    return out


def _save(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments bench", description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", default="all", choices=("all", "baseline", "nonans", "compare"))
    ap.add_argument("--scale", action="store_true", help="larger sizes (GPU)")
    ap.add_argument("--size", choices=("tiny", "default", "scale"), default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated workload keys")
    ap.add_argument("--out", default="results")
    ap.add_argument("--results-md", default="RESULTS.md", help="'' to skip rendering (as every experiment takes it)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: these models are too small to gain from more)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    size = args.size or ("scale" if args.scale else "default")
    keys = [k for k in args.workloads.split(",") if k]
    unknown = [k for k in keys if k not in WORKLOADS]
    if unknown:
        ap.error(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}")
    t0 = time.perf_counter()
    paths = {g: os.path.join(args.out, f"bench_{g}.json") for g in ("baseline", "nonans")}
    if args.mode in ("all", "baseline"):
        print(f"bench baseline ({size}): arms {STOCK_ARMS}; peers {peer_status()}", file=sys.stderr)
        t_group = time.perf_counter()
        recs = run_group(STOCK_ARMS, keys, size=size, seed=args.seed)
        _wandb_log("baseline", recs)
        _save(paths["baseline"], dict(size=size, seed=args.seed, records=recs,
                                      wall_s=time.perf_counter() - t_group))
    if args.mode in ("all", "nonans"):
        print(f"bench nonans ({size}): arms {OURS_ARMS}", file=sys.stderr)
        t_group = time.perf_counter()
        recs = run_group(OURS_ARMS, keys, size=size, seed=args.seed)
        overhead = {k: step_overhead(WORKLOADS[k], size=size, seed=args.seed) for k in keys}
        _wandb_log("nonans", recs)
        _save(paths["nonans"], dict(size=size, seed=args.seed, records=recs, overhead=overhead,
                                    wall_s=time.perf_counter() - t_group))
    if args.mode in ("all", "compare"):
        missing = [p for p in paths.values() if not os.path.exists(p)]
        if missing:
            print(f"compare needs {missing}: run `bench baseline` and `bench nonans` first", file=sys.stderr)
            return 1
        base, ours = (json.load(open(paths[g], encoding="utf-8")) for g in ("baseline", "nonans"))
        records = {k: {**base["records"].get(k, {}), **ours["records"].get(k, {})}
                   for k in keys if k in base["records"] or k in ours["records"]}
        results = dict(machine=machine(), size=base["size"], seed=base["seed"], peers=peer_status(),
                       # the runs' own time: a `bench compare` on its own must not report ~0 s
                       wall_s=base.get("wall_s", 0.0) + ours.get("wall_s", 0.0) if args.mode == "compare"
                       else time.perf_counter() - t0,
                       workloads={k: dict(title=WORKLOADS[k].title, cause=WORKLOADS[k].cause,
                                          notes=WORKLOADS[k].notes, guards=WORKLOADS[k].guards,
                                          metric=next(iter(records[k].values()))["metric"]) for k in records},
                       compare=compare(records, ours.get("overhead", {})), overhead=ours.get("overhead", {}),
                       records=records)
        _save(os.path.join(args.out, "bench.json"), results)
        for k, arms in records.items():
            plot(k, WORKLOADS[k].title, arms, os.path.join(args.out, f"bench_{k}.png"))
        md = render_markdown(results)
        if args.results_md:
            write_results_section(md, args.results_md)
        print(md)
    print(f"bench {args.mode}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0
