"""``python -m experiments momentum-dtype`` — the spectral momentum buffer in bf16 vs fp32 (issue 2).

Why it is a question: issue 2 asks for SF-NorMuon's optimizer state to be no larger than AdamW's (8 bytes
per parameter). SF-NorMuon keeps z (fp32) and the momentum (fp32) per spectral entry plus a NorMuon row
moment, so it sits just above 8. Storing the momentum in bf16 brings it to about 6. The momentum only feeds
NS5, which rounds its input to bf16 anyway; the open part is whether rounding the *buffer* every step
(an EMA with μ = 0.8: each step's increment is 20% of the buffer, far above bf16's 2⁻⁸ resolution) costs
training quality. This measures it on the two offline tasks of the ablation (``experiments/tasks.py``),
same seeds, same lr, same steps, for SF-NorMuon and for FullFusion (where the momentum also feeds
KL-Shampoo before NS5, with μ = 0.8), and the state bytes on the step-time GPT.

Output: ``results/momentum_dtype.json`` and the table between ``<!-- momentum-dtype:begin/end -->`` in
RESULTS.md.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch

import nonans_optim as no
from experiments._models import build_gpt, synthetic_grads
from experiments.questions_io import md_table, publish
from experiments.step_time import ROOT, machine_info, state_bytes
from experiments.tasks import make_task, train

DTYPES = ("param", "bf16")
OPTIMIZERS = ("sfnormuon", "fullfusion")  # FullFusion: the momentum also feeds KL-Shampoo before NS5
BENCH_W5 = "w5_kl_shampoo"  # bench's Fusion(shampoo, ns5) workload: its one-seed metric moved with bf16
DEFAULT_STEPS = {"charlm": 200, "digits": 200}
METRIC = {"charlm": "val_loss", "digits": "val_err", "bench-w5": "held-out CE"}


def bytes_per_param(momentum_dtype: str) -> float:
    model = build_gpt()
    opt = no.SFNorMuon(no.param_groups(model), lr=1e-3, momentum_dtype=momentum_dtype)
    for p, g in zip(model.parameters(), synthetic_grads(model)):
        p.grad = g
    opt.step()
    per, _ = state_bytes([opt], {id(p) for p in model.parameters()})
    return per / sum(p.numel() for p in model.parameters())


def run(tasks: list[str], seeds: int, steps: dict[str, int], lr: float, optimizers: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"tasks": {}, "bytes_per_param": {d: bytes_per_param(d) for d in DTYPES}}
    for task in tasks:
        for opt in optimizers:
            res: dict[str, list[float]] = {d: [] for d in DTYPES}
            for seed in range(seeds):
                for d in DTYPES:
                    r = train(make_task(task, seed), opt, seed=seed, lr=lr, steps=steps[task],
                              opt_kwargs={"momentum_dtype": d})
                    res[d].append(r["final"][METRIC[task]])
                    print(f"[momentum-dtype] {task} {opt} seed={seed} {d:<5} {METRIC[task]}={res[d][-1]:.4f}",
                          flush=True)
            out["tasks"][f"{task}/{opt}"] = res
    out["tasks"]["bench-w5/fusion-shampoo-ns5"] = bench_w5(max(seeds, 5))
    return out


def bench_w5(seeds: int) -> dict[str, list[float]]:
    """bench workload 5 (KL-Shampoo + NS5, μ 0.95, lr 0.02) under the "nonans" arm, fp32 vs bf16 momentum:
    a workload whose held-out CE spreads widely over seeds, so it gets at least five."""
    from experiments.bench.harness import run_arm
    from experiments.bench.workloads import WORKLOADS
    res: dict[str, list[float]] = {d: [] for d in DTYPES}
    for seed in range(seeds):
        for d in DTYPES:
            r = run_arm(WORKLOADS[BENCH_W5], "nonans", seed=seed, ours_kwargs={"momentum_dtype": d})
            res[d].append(r["final_metric"])
            print(f"[momentum-dtype] bench W5 seed={seed} {d:<5} held-out CE={res[d][-1]:.4f}", flush=True)
    return res


def render(data: dict[str, Any]) -> str:
    c = data["config"]
    lines = [f"Command: `{data['command']}` (JSON: `results/momentum_dtype.json`), {data['machine']['date']}; "
             f"lr {c['lr']}, {c['seeds']} seeds, steps {c['steps']}, every other setting the default; the bench row is "
             "`python -m experiments bench`'s workload 5 under its own settings (\"nonans\" arm), seeds 0-4.",
             ""]
    rows = []
    for key, res in data["tasks"].items():
        task, opt = key.split("/")
        f32, b16 = res["param"], res["bf16"]
        sd = statistics.stdev(f32) if len(f32) > 1 else float("nan")
        diff = [b - a for a, b in zip(f32, b16)]
        rows.append([task, opt, METRIC[task], f"{statistics.mean(f32):.4f} ± {sd:.4f}",
                     f"{statistics.mean(b16):.4f} ± {statistics.stdev(b16) if len(b16) > 1 else float('nan'):.4f}",
                     f"{statistics.mean(diff):+.4f}", f"{max(abs(x) for x in diff):.4f}",
                     f"{sum(x < 0 for x in diff)} / {sum(x > 0 for x in diff)} of {len(diff)}"])
    lines.append(md_table(["task", "optimizer", "metric", "fp32 momentum (mean ± sd)", "bf16 momentum (mean ± sd)",
                           "paired Δ (bf16 − fp32)", "largest |paired Δ|", "seeds bf16 lower / higher"], rows))
    b = data["bytes_per_param"]
    lines.append(f"\nState bytes per parameter on the step-time GPT (3.44M parameters): fp32 momentum "
                 f"{b['param']:.2f}, bf16 momentum {b['bf16']:.2f} (AdamW: 8.00).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments momentum-dtype", description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", nargs="+", default=["charlm", "digits"])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "results" / "momentum_dtype.json"))
    ap.add_argument("--results-md", default=str(ROOT / "RESULTS.md"), help="'' to skip rendering")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps = {t: args.steps or DEFAULT_STEPS[t] for t in args.tasks}
    data = run(args.tasks, args.seeds, steps, args.lr, args.optimizers)
    data["config"] = {"tasks": args.tasks, "seeds": args.seeds, "steps": steps, "lr": args.lr,
                      "optimizers": args.optimizers}
    data["machine"] = machine_info()
    cmd = "python -m experiments momentum-dtype"
    data["command"] = cmd + "".join(f" {a}" for a in (argv or []))
    publish(data, Path(args.out), render(data), args.results_md, "momentum-dtype",
            "bf16 momentum buffer for SF-NorMuon (issue 2)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
