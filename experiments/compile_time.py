"""The first step of ``impl="compiled"``: how long torch.compile takes, on a cold and on a warm cache.

``impl="compiled"`` runs a group's elementwise update and its resolution bookkeeping as one shape-static
graph over the whole list of the group's tensors (optimizers/_compiled.py), so inductor emits and the C++
compiler builds code for every tensor of the group: its compile time grows with the number of tensors,
and a new list of shapes, ``resolution`` policy or ``spike_factor`` value compiles again. This measures
what a user pays for it, in fresh processes (the only honest way to see a first compile):

* **cold**: a new, empty ``TORCHINDUCTOR_CACHE_DIR`` — a new machine or container, including inductor's
  one-time precompiled header;
* **warm**: a second process on that same directory — inductor's FX graph cache hit, dynamo's trace left.

Each cell is one process's first ``step()`` in seconds; "later steps" is the median of the next steps in
the warm process, for scale. The default ``impl="auto"`` never compiles (the native loops on CPU, Triton on
CUDA): this is the price of choosing ``"compiled"``.

    python -m experiments compile-time [--models quick,default] [--optimizers AdamW,SFNorMuon] [--quick]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "compile_time.json"
OPTIMIZERS = ("AdamW", "SFAdamW", "SFNorMuon", "FullFusion")
CHILD_TIMEOUT_S = 3600  # generous (a cold compile adds about a second per tensor); a hung child must not hang the run
SECTION, TITLE = "compile-time", "First step of impl=\"compiled\": torch.compile time, cold and warm cache"


def child(model: str, optimizer: str, later: int, threads: int) -> dict[str, Any]:
    """In this (fresh) process: the named model's synthetic gradients, one ``impl="compiled"`` optimizer,
    its first step timed, then ``later`` steps. Refuses a run whose compile failed (the optimizer warns and
    runs foreach then: that would time the wrong thing)."""
    import torch

    import nonans_optim as no
    from experiments._models import MODELS, QUICK, build_gpt, synthetic_grads

    torch.set_num_threads(threads)
    if model == "toy":  # --quick: one Linear layer (a matrix and a bias), a smoke test's few seconds
        torch.manual_seed(0)
        model_ = torch.nn.Linear(8, 4)
    else:
        model_ = build_gpt(QUICK if model == "quick" else MODELS[model])
    params = list(model_.parameters())
    for p, g in zip(params, synthetic_grads(model_)):
        p.grad = g
    cls = getattr(no, optimizer)
    opt = cls(no.param_groups(model_) if cls.__name__ in ("SFNorMuon", "FullFusion") else params, impl="compiled")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "torch.compile failed ...; using impl='foreach'"
        t0 = time.perf_counter()
        opt.step()
        first = time.perf_counter() - t0
    times = []
    for _ in range(later):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return {"tensors": len(params), "first_s": first, "later_ms": 1e3 * statistics.median(times)}


def _run_child(model: str, optimizer: str, cache: str, later: int, threads: int) -> dict[str, Any]:
    from experiments.step_time import run_child

    return run_child("experiments.compile_time", ["--child", model, optimizer, "--later", str(later),
                                                  "--threads", str(threads)],
                     env={"TORCHINDUCTOR_CACHE_DIR": cache}, timeout=CHILD_TIMEOUT_S)


def run(models: list[str], optimizers: list[str], later: int, threads: int) -> list[dict[str, Any]]:
    rows = []
    for model in models:
        for optimizer in optimizers:
            with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
                cold = _run_child(model, optimizer, cache, later, threads)
                warm = _run_child(model, optimizer, cache, later, threads)
            rows.append({"model": model, "optimizer": optimizer, "tensors": cold["tensors"],
                         "cold_first_s": cold["first_s"], "warm_first_s": warm["first_s"],
                         "later_ms": warm["later_ms"]})
            print(f"{model:<8} {optimizer:<11} {cold['tensors']:>4} tensors: first step {cold['first_s']:.1f} s "
                  f"cold, {warm['first_s']:.1f} s warm; later {warm['later_ms']:.2f} ms", flush=True)
    return rows


def render(result: dict[str, Any]) -> str:
    from experiments.questions_io import at_commit, md_table

    m = result["machine"]
    lines = [f"Command: `{result['command']}` (JSON: `results/compile_time.json`), measured {m['date']}{at_commit(m)} "
             f"on {m['processor']}, {m['cpu_count']} cores, {m['torch_threads']} torch thread(s), torch "
             f"{m['torch']}. Each cell is one fresh process's first `step()` with `impl=\"compiled\"` (resolution "
             "\"repair\", the default), synthetic gradients: **cold**, a new empty `TORCHINDUCTOR_CACHE_DIR` (a new "
             "machine; it includes inductor's one-time precompiled header); **warm**, a second process on the "
             "same directory (inductor's FX graph cache hits; dynamo still traces). Later steps: the median of "
             f"the next {result['settings']['later']} steps in the warm process. The default `impl=\"auto\"` never "
             "compiles; a new list of shapes, policy or `spike_factor` compiles again.", ""]
    rows = [[r["model"], r["tensors"], r["optimizer"], f"{r['cold_first_s']:.1f}", f"{r['warm_first_s']:.1f}",
             f"{r['later_ms']:.2f}"] for r in result["rows"]]
    table = md_table(["model", "tensors", "optimizer", "first step, cold cache (s)", "first step, warm cache (s)",
                      "later steps (ms)"], rows)
    return "\n".join(lines) + "\n" + table + _slopes(result["rows"])


def _slopes(rows: list[dict[str, Any]]) -> str:
    """The cold first step's growth per tensor, for each optimizer measured on two models: (cold on the larger
    - cold on the smaller) / (difference in tensors) — the part that scales with the group, without the
    process's fixed costs (imports, the precompiled header) that a ratio to one row would fold in."""
    parts = []
    for opt in dict.fromkeys(r["optimizer"] for r in rows):
        mine = sorted((r for r in rows if r["optimizer"] == opt), key=lambda r: r["tensors"])
        lo, hi = mine[0], mine[-1]
        if hi["tensors"] > lo["tensors"]:
            slope = (hi["cold_first_s"] - lo["cold_first_s"]) / (hi["tensors"] - lo["tensors"])
            parts.append(f"{opt} {slope:.2f} s ({lo['model']} → {hi['model']})")
    if not parts:
        return ""
    return "\n\nCold first step, added per tensor of the model: " + "; ".join(parts) + "."


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments compile-time", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="quick,default", help="comma-separated: quick, default, gpt2-small")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    ap.add_argument("--later", type=int, default=5, help="steps timed after the first (warm process)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads in each process")
    ap.add_argument("--quick", action="store_true", help="a one-layer toy model and AdamW only (for tests)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--results-md", default="RESULTS.md", help="section to update ('' to skip; `python -m "
                    "experiments render` re-renders it from the JSON)")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "OPTIMIZER"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, args.later, args.threads)))
        return 0
    models = ["toy"] if args.quick else [m for m in args.models.split(",") if m]
    optimizers = ["AdamW"] if args.quick else [o for o in args.optimizers.split(",") if o]
    if args.later < 1:
        ap.error(f"--later must be at least 1 (the steps timed after the first), got {args.later}")
    unknown = sorted(set(optimizers) - set(OPTIMIZERS))
    if unknown:
        ap.error(f"unknown optimizer(s) {unknown}; choose from {', '.join(OPTIMIZERS)}")
    from experiments._models import MODELS
    bad = sorted(set(models) - set(MODELS) - {"quick", "toy"})
    if bad:
        ap.error(f"unknown model(s) {bad}; choose from quick, {', '.join(MODELS)}")
    from experiments.questions_io import publish
    from experiments.watch_overhead import machine

    rows = run(models, optimizers, args.later, args.threads)
    info = dict(machine(), torch_threads=args.threads)  # (machine() names the torch version too)
    cmd = " ".join(["python -m experiments compile-time", *(argv if argv is not None else sys.argv[1:])]).strip()
    result = {"experiment": "compile_time", "command": cmd, "machine": info,
              "settings": {"models": models, "optimizers": optimizers, "later": args.later}, "rows": rows}
    publish(result, args.out, render(result), args.results_md, SECTION, TITLE)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
