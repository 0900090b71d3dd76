"""``python -m experiments ns5-method`` — standard vs Gram Newton-Schulz on this machine (CPU, bf16).

What it decides: ``nonans_optim.ns5.GRAM_MIN_ASPECT``, the long/short side ratio from which
``ns5(method="auto")`` takes the Gram iteration (``nonans_optim.ns5_gram``). Gram trades s×l matmuls for
s×s ones, so FLOPs alone predict a crossover at l/s = 1.5; only wall time on the real matmul library says
where it actually wins, and only the fp64 oracle says what it costs in accuracy.

* Time: the iteration alone (``iterate_reference`` vs ``iterate_gram`` on the same normalised bf16
  batch), on the issue's shapes at batch 4 and 1 and on the GPT step-time model's NS5 buckets (same-shape
  hidden matrices stacked, as the optimizers do), plus the whole ``ns5()`` call over all GPT buckets.
  Arms run interleaved (``experiments.step_time.interleaved``); reported are each arm's median and the
  median of the same-round ratios gram/standard (the two calls of a round run back to back, so a busy
  neighbour spoils a pair rather than one arm). The machine is shared and noisy: only same-run ratios
  mean anything, and the crossover (``measured_min_aspect``) is taken from the same-round ratios.
* Accuracy: relative Frobenius error against the *fp64 standard* iteration with the same coefficients
  (Keller's NS5 does not converge to U Vᵀ, so that is the fair oracle), and σ_max of the output (NS5's
  band is [0.68, 1.2024]), on a Gaussian and an ill-conditioned (σ log-spread over 1e-4..1) input, for
  standard, Gram (restart every 2), Dao et al.'s single restart after step 2, and no restart.

Output: ``results/ns5_method.json`` and the table between ``<!-- ns5-method:begin/end -->`` in RESULTS.md.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
from pathlib import Path
from typing import Any

import torch

from experiments._models import build_gpt, hidden_matrices
from experiments.questions_io import fmt, publish
from experiments.step_time import interleaved, machine_info
from nonans_optim.ns5 import GRAM_MIN_ASPECT, KELLER_COEFFICIENTS, iterate_reference, normalise, ns5
from nonans_optim.ns5_gram import gram_flops, iterate_gram, standard_flops

ROOT = Path(__file__).resolve().parent.parent
COEFFS = [KELLER_COEFFICIENTS] * 5
ISSUE_SHAPES = [(256, 768), (256, 1024), (256, 256), (512, 1024), (256, 512), (256, 384)]
VARIANTS = {"gram": 2, "gram_dao": (2,), "gram_norestart": None}  # restart_after of each Gram variant


def gpt_buckets() -> list[tuple[int, int, int]]:
    """(batch, short, long) of every same-shape stack of the GPT model's hidden matrices."""
    hidden, _ = hidden_matrices(build_gpt())
    counts: dict[tuple[int, int], int] = {}
    for p in hidden:
        counts[tuple(p.shape)] = counts.get(tuple(p.shape), 0) + 1
    return [(n, min(m), max(m)) for m, n in counts.items()]


def time_iterations(cases: list[tuple[int, int, int]], args) -> list[dict[str, Any]]:
    rows = []
    for B, s, l in cases:
        X = normalise(torch.randn(B, s, l, generator=torch.Generator().manual_seed(s + l))).bfloat16()
        arms = {"standard": lambda X=X: iterate_reference(X, COEFFS),
                "gram": lambda X=X: iterate_gram(X, COEFFS, restart_after=2)}
        t = interleaved(arms, rounds=args.rounds, warmup=args.warmup, inner=args.inner,
                        device=torch.device("cpu"))
        med = {k: statistics.median(v) for k, v in t.items()}
        # Same-round ratio: the two arms run back to back, so a busy neighbour (a 2-thread OpenMP team
        # sharing 2 cores with another job stalls in ~100 ms steps) spoils a round's pair, not one arm.
        paired = statistics.median(g / st for g, st in zip(t["gram"], t["standard"]))
        rows.append({"batch": B, "s": s, "l": l, "aspect": l / s, "standard_ms": med["standard"] * 1e3,
                     "gram_ms": med["gram"] * 1e3, "ratio": med["gram"] / med["standard"],
                     "ratio_paired": paired,
                     "flop_ratio": gram_flops(s, l, 5, 2) / standard_flops(s, l, 5)})
        print(f"  time {B}x{s}x{l}: ratio {rows[-1]['ratio']:.3f}, paired {paired:.3f}", flush=True)
    return rows


def time_gpt_ns5(args) -> dict[str, Any]:
    """The whole ns5() call (normalise, cast, iterate) over every GPT bucket, per method."""
    hidden, _ = hidden_matrices(build_gpt())
    gen = torch.Generator().manual_seed(0)
    by_shape: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for p in hidden:
        by_shape.setdefault(tuple(p.shape), []).append(torch.randn(p.shape, generator=gen))
    stacks = [torch.stack(v) for v in by_shape.values()]
    arms = {m: (lambda m=m: [ns5(G, dtype="bf16", method=m) for G in stacks])
            for m in ("standard", "gram", "auto")}
    t = interleaved(arms, rounds=args.rounds, warmup=args.warmup, inner=1, device=torch.device("cpu"))
    med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
    return {"ms": med, "gram_ratio": med["gram"] / med["standard"],
            "auto_ratio": med["auto"] / med["standard"]}


def ill_conditioned(B: int, s: int, l: int, lo: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(B, s, s, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(B, l, s, generator=g, dtype=torch.float64))
    sv = torch.logspace(math.log10(lo), 0.0, s, dtype=torch.float64)
    return (U * sv) @ V.mT


def accuracy(cases: list[tuple[int, int]], args) -> list[dict[str, Any]]:
    rows = []
    for s, l in cases:
        g = torch.Generator().manual_seed(7 * s + l)
        inputs = {"gauss": torch.randn(2, s, l, generator=g, dtype=torch.float64),
                  "ill_1e-4": ill_conditioned(2, s, l, 1e-4, s + l)}
        for kind, G in inputs.items():
            X = normalise(G)
            ref = iterate_reference(X.double(), COEFFS)
            for dt_name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
                Xh = X.to(dt)
                outs = {"standard": iterate_reference(Xh, COEFFS)}
                outs.update({k: iterate_gram(Xh, COEFFS, restart_after=r) for k, r in VARIANTS.items()})
                row: dict[str, Any] = {"s": s, "l": l, "input": kind, "dtype": dt_name}
                for k, O in outs.items():
                    O = O.double()
                    row[f"{k}_err"] = float((O - ref).norm() / ref.norm())
                    row[f"{k}_smax"] = float(torch.linalg.svdvals(O).max())
                row["gram_err_ratio"] = row["gram_err"] / row["standard_err"]
                rows.append(row)
        print(f"  accuracy {s}x{l} done", flush=True)
    return rows


def crossover(rows: list[dict[str, Any]]) -> float | None:
    """Smallest measured aspect ratio from which Gram was faster on every measured shape (by the
    same-round ratio, the one a busy neighbour disturbs least), or None."""
    aspects = sorted({r["aspect"] for r in rows})
    for a in aspects:
        if all(r["ratio_paired"] < 1.0 for r in rows if r["aspect"] >= a):
            return a
    return None


def run(args) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    info = machine_info()
    shapes = ISSUE_SHAPES[:2] if args.quick else ISSUE_SHAPES
    cases = [(B, s, l) for s, l in shapes for B in (4, 1)]
    gpt = gpt_buckets()
    timing = time_iterations(cases, args)
    timing_gpt = time_iterations(gpt, args)
    gpt_total = time_gpt_ns5(args)
    acc = accuracy([(64, 256)] if args.quick else [(64, 256), (256, 256), (256, 1024)], args)
    return {"command": "python -m experiments ns5-method" + (" --quick" if args.quick else ""),
            "machine": {**info, "note": "shared 2-core machine; other jobs ran concurrently"},
            "settings": {"threads": args.threads, "rounds": args.rounds, "warmup": args.warmup,
                         "inner": args.inner, "hot_dtype": "bf16", "steps": 5, "restart_after": 2},
            "timing": timing, "timing_gpt_buckets": timing_gpt, "gpt_ns5_total": gpt_total,
            "accuracy": acc, "measured_min_aspect": crossover(timing + timing_gpt),
            "loadavg_end": list(os.getloadavg()),
            "GRAM_MIN_ASPECT": GRAM_MIN_ASPECT}


def render(data: dict[str, Any]) -> str:
    lines = [f"Command: `{data['command']}` (JSON: `results/ns5_method.json`), {data['machine']['date']}, "
             f"{data['machine']['cpu']}, {data['settings']['threads']} threads, bf16; shared machine.", "",
             "| shapes | batch × s × l | l/s | standard ms | gram ms | ratio of medians | same-round ratio "
             "| FLOP ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for src, rows in (("issue", data["timing"]), ("GPT bucket", data["timing_gpt_buckets"])):
        for r in rows:
            lines.append(f"| {src} | {r['batch']}×{r['s']}×{r['l']} | {fmt(r['aspect'])} "
                         f"| {fmt(r['standard_ms'])} | {fmt(r['gram_ms'])} | {fmt(r['ratio'])} "
                         f"| {fmt(r['ratio_paired'])} | {fmt(r['flop_ratio'])} |")
    t = data["gpt_ns5_total"]
    lines += ["", f"GPT model, ns5() over all hidden buckets: standard {fmt(t['ms']['standard'])} ms, "
              f"gram {fmt(t['ms']['gram'])} ms ({fmt(t['gram_ratio'])}x), auto {fmt(t['ms']['auto'])} ms "
              f"({fmt(t['auto_ratio'])}x). Measured crossover aspect: {fmt(data['measured_min_aspect'])} "
              f"(GRAM_MIN_ASPECT = {fmt(data['GRAM_MIN_ASPECT'])}).", "",
              "| s × l | input | dtype | err standard | err gram | gram/std | err Dao [2,3] | err no restart "
              "| σmax std | σmax gram | σmax Dao | σmax no restart |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["accuracy"]:
        lines.append(f"| {r['s']}×{r['l']} | {r['input']} | {r['dtype']} | {fmt(r['standard_err'])} | "
                     f"{fmt(r['gram_err'])} | {fmt(r['gram_err_ratio'])} | {fmt(r['gram_dao_err'])} | "
                     f"{fmt(r['gram_norestart_err'])} | {fmt(r['standard_smax'])} | {fmt(r['gram_smax'])} | "
                     f"{fmt(r['gram_dao_smax'])} | {fmt(r['gram_norestart_smax'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments ns5-method", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="two shapes, 2 rounds (for smoke tests)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--inner", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "results" / "ns5_method.json"))
    ap.add_argument("--results-md", default=str(ROOT / "RESULTS.md"), help="'' to skip rendering")
    args = ap.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 31)
    args.warmup = args.warmup or (1 if args.quick else 2)
    data = run(args)
    publish(data, Path(args.out), render(data), args.results_md, "ns5-method",
            "Newton-Schulz: standard vs Gram iteration on CPU (issue 2)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
