"""``python -m experiments kernels`` — Triton NS5 and fused elementwise kernels against torch, on one GPU.

What is measured, all in one run so every ratio shares the same machine state:

* the bf16 matmul rate (a large ``torch.matmul``) and the copy bandwidth (a large ``copy_``): the anchors;
* NS5 (5 Keller iterations, bf16) per shape: eager torch (``iterate_reference``), the same function under
  ``torch.compile`` and ``nonans_optim.kernels.ns5_iterate``. Reported: ms, useful TFLOP/s at the dense
  count 4m²n + 2m³ per iteration, speedups, and the *symmetric limit* — the time the one-triangle FLOP count
  3m²n + m³ would take at the measured matmul rate (``kernels/ns5_gram.py``);
* the crossover: the smallest single-matrix size from which Triton is never slower than eager, which is
  what ``ns5(backend="auto")`` should use;
* the fused AdamW / momentum kernels: achieved bandwidth (bytes each step must move / time) against the copy
  bandwidth, next to the torch reference and ``torch.optim.AdamW(fused=True)``;
* the optimizer-level fused step, ``AdamW(impl="fused")`` on the multi-tensor kernels, "repair" and "off",
  against ``torch.optim.AdamW(fused=True)`` on the same tensors, with each arm's GPU time by kernel, and
  the same step at a few launch shapes, and the spectral fused step (SF-NorMuon, FullFusion) by kernel
  (``experiments/kernels_step.py``).

Without CUDA it prints why and exits 0 without writing. ``--dry-run`` runs the same code on CPU under the
Triton interpreter with tiny shapes (so CI tests the script); its timings mean nothing and it writes JSON
only where ``--out`` points.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from experiments.kernels_step import (_ms, bench_block_sweep, bench_fused_step, bench_one_launch_ablation,
                                      bench_spectral_step, device_time_per_step, gbps, render_ablation,
                                      render_fused_step, render_spectral_step, render_sweep)
from experiments.questions_io import at_commit, checkout_commit

ROOT = Path(__file__).resolve().parents[1]
JSON_PATH = ROOT / "results" / "kernels.json"
ITERATIONS = 5

GPU_SHAPES = [(1, 256, 256), (1, 512, 512), (1, 1024, 1024), (1, 2048, 2048), (1, 4096, 4096),
              (1, 8192, 8192), (1, 4096, 11008), (32, 1024, 1024), (8, 2048, 2048), (128, 512, 512)]
DRY_SHAPES = [(1, 16, 16), (2, 16, 24)]
# FusionOpt's open question 2b — does fusing the fp16 rescale-restore into the matmul epilogues change the
# picture on NVIDIA? — on a few shapes (the arms are in bench_fp16_safe)
FP16_GPU_SHAPES = [(1, 1024, 1024), (1, 4096, 4096), (8, 2048, 2048)]
FP16_DRY_SHAPES = [(1, 16, 24)]
TARGETS = {"speedup_vs_eager_4096": 1.4, "limit_ratio_8192": 1.15, "min_speedup_vs_eager": 0.95}


def dense_flops(b: int, m: int, n: int) -> float:
    """FLOPs of one NS iteration computed densely: X·Xᵀ (2m²n) + A² (2m³) + B·X (2m²n)."""
    return b * (4.0 * m * m * n + 2.0 * m**3)


def symmetric_flops(b: int, m: int, n: int) -> float:
    """FLOPs when X·Xᵀ and A² compute one triangle: m²n + m³ + 2m²n."""
    return b * (3.0 * m * m * n + 1.0 * m**3)


def make_timer(dry_run: bool) -> Callable[[Callable[[], Any]], float]:
    """Median milliseconds of ``fn``: ``triton.testing.do_bench`` on CUDA, wall-clock on the CPU dry run."""
    if dry_run:
        def timer(fn):
            fn()
            samples = []
            for _ in range(2):
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(samples)
        return timer
    from triton.testing import do_bench

    def timer(fn):
        fn()  # compile / autotune outside the measurement
        torch.cuda.synchronize()
        return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))
    return timer


def matmul_rate(timer, device, size: int) -> float:
    """bf16 FLOP/s of one large square ``torch.matmul`` (the ceiling any NS5 implementation shares)."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    return 2.0 * size**3 / (timer(lambda: torch.matmul(a, b)) * 1e-3)


def copy_bandwidth(timer, device, numel: int) -> float:
    """Bytes/s of ``dst.copy_(src)`` on fp32 (one read + one write per element)."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    return 2.0 * 4 * numel / (timer(lambda: dst.copy_(src)) * 1e-3)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


def bench_ns5(timer, device, shapes, rate: float, compile_backend: str | None, log) -> list[dict]:
    from nonans_optim.kernels import ns5_iterate
    from nonans_optim.ns5 import KELLER_COEFFICIENTS, iterate_reference, normalise

    coefficients = [KELLER_COEFFICIENTS] * ITERATIONS
    rows = []
    for b, m, n in shapes:
        torch.manual_seed(0)
        X32 = normalise(torch.randn(b, m, n, device=device)).contiguous()
        X = X32.to(torch.bfloat16)
        row: dict[str, Any] = {"batch": b, "m": m, "n": n, "dtype": "bf16", "iterations": ITERATIONS}
        row["eager_ms"] = timer(lambda: iterate_reference(X, coefficients))
        row["triton_ms"] = timer(lambda: ns5_iterate(X, coefficients))
        if compile_backend is not None:
            torch._dynamo.reset()  # one compiled graph per shape, never the recompile-limit fallback
            compiled = torch.compile(iterate_reference, dynamic=False, backend=compile_backend)
            row["compiled_ms"] = timer(lambda: compiled(X, coefficients))
        dense = dense_flops(b, m, n) * ITERATIONS
        row["triton_tflops"] = dense / (row["triton_ms"] * 1e-3) / 1e12
        row["eager_tflops"] = dense / (row["eager_ms"] * 1e-3) / 1e12
        row["symmetric_limit_ms"] = symmetric_flops(b, m, n) * ITERATIONS / rate * 1e3
        row["dense_limit_ms"] = dense / rate * 1e3
        row["speedup_vs_eager"] = row["eager_ms"] / row["triton_ms"]
        if "compiled_ms" in row:
            row["speedup_vs_compiled"] = row["compiled_ms"] / row["triton_ms"]
        row["ratio_to_symmetric_limit"] = row["triton_ms"] / row["symmetric_limit_ms"]
        ref = iterate_reference(X.float(), coefficients)  # fp32 on the same bf16 input: accuracy anchor
        row["rel_err_triton"] = _rel(ns5_iterate(X, coefficients), ref)
        row["rel_err_eager"] = _rel(iterate_reference(X, coefficients), ref)
        rows.append(row)
        log(f"  {b:>4}x{m}x{n:<6} eager {row['eager_ms']:9.3f} ms  triton {row['triton_ms']:9.3f} ms "
            f"({row['speedup_vs_eager']:.2f}x, {row['triton_tflops']:.0f} TFLOP/s dense-equivalent)  "
            f"compiled {row.get('compiled_ms', float('nan')):9.3f} ms  limit {row['symmetric_limit_ms']:8.3f} ms "
            f"err {row['rel_err_triton']:.2e} vs eager {row['rel_err_eager']:.2e}")
    return rows


def bench_fp16_safe(timer, device, shapes, log) -> list[dict]:
    """The fp16 rescale-restore NS5 (``ns5_iterate_fp16_safe``: the ×s on the first loads and the ÷s in the
    last epilogue, fused) against the same sequence unfused in torch (scale, cast, fp16 iteration, unscale:
    ``ns5_iterate_fp16_safe_reference``), plain fp16 and bf16 Triton without any rescale, from an fp32 input;
    errors against the fp32 iteration of the same input. Answers whether fusing makes the fp16-safe variant
    cost what plain fp16 costs (FusionOpt open question 2b)."""
    from nonans_optim.kernels import ns5_iterate, ns5_iterate_fp16_safe, ns5_iterate_fp16_safe_reference
    from nonans_optim.ns5 import KELLER_COEFFICIENTS, iterate_reference, normalise

    coefficients = [KELLER_COEFFICIENTS] * ITERATIONS
    rows = []
    for b, m, n in shapes:
        torch.manual_seed(0)
        X = normalise(torch.randn(b, m, n, device=device)).contiguous()
        ref = iterate_reference(X, coefficients)
        arms = {"fused": lambda: ns5_iterate_fp16_safe(X, coefficients),
                "unfused_torch": lambda: ns5_iterate_fp16_safe_reference(X, coefficients),
                "plain_fp16": lambda: ns5_iterate(X.half(), coefficients),
                "plain_bf16": lambda: ns5_iterate(X.bfloat16(), coefficients)}
        row: dict[str, Any] = {"batch": b, "m": m, "n": n, "iterations": ITERATIONS}
        for name, fn in arms.items():
            row[f"{name}_ms"] = timer(fn)
            row[f"rel_err_{name}"] = _rel(fn(), ref)
        row["fused_vs_unfused"] = row["unfused_torch_ms"] / row["fused_ms"]
        row["fused_vs_plain_fp16"] = row["fused_ms"] / row["plain_fp16_ms"]
        rows.append(row)
        log(f"  fp16-safe {b}x{m}x{n}: fused {row['fused_ms']:.3f} ms, unfused torch {row['unfused_torch_ms']:.3f} "
            f"ms, plain fp16 {row['plain_fp16_ms']:.3f} ms, bf16 {row['plain_bf16_ms']:.3f} ms")
    return rows


def crossover(rows: list[dict]) -> dict[str, Any]:
    """Smallest single square size from which Triton is never slower than eager (None if never)."""
    singles = sorted((r for r in rows if r["batch"] == 1 and r["m"] == r["n"]), key=lambda r: r["m"])
    threshold = None
    for i, r in enumerate(singles):
        if all(s["triton_ms"] <= s["eager_ms"] for s in singles[i:]):
            threshold = r["m"]
            break
    batched = {f"{r['batch']}x{r['m']}x{r['n']}": r["speedup_vs_eager"] for r in rows if r["batch"] > 1}
    return {"single_square_min_dim": threshold, "batched_speedups": batched,
            "note": "ns5(backend='auto') should pick triton for min(m, n) >= single_square_min_dim"}


def bench_elementwise(timer, device, numel: int, log) -> dict[str, Any]:
    from nonans_optim.kernels import (fused_adamw_, fused_adamw_reference_, momentum_update_,
                                      momentum_update_reference_)

    torch.manual_seed(0)
    p, g = torch.randn(numel, device=device), torch.randn(numel, device=device)
    m, v = torch.randn(numel, device=device), torch.rand(numel, device=device)
    counters = torch.zeros(2, dtype=torch.int64, device=device)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, bias_correction1=0.1,
                 bias_correction2=0.001)
    out: dict[str, Any] = {"numel": numel, "dtype": "fp32", "adamw_bytes_per_element": 28,
                           "momentum_bytes_per_element": 12}
    for policy in ("repair", "skip", "off"):
        ms = timer(lambda: fused_adamw_(p, g, m, v, counters, policy=policy, **hyper))
        out[f"adamw_{policy}_ms"] = ms
        out[f"adamw_{policy}_gbps"] = gbps(28.0, numel, ms)
    out["adamw_reference_ms"] = timer(lambda: fused_adamw_reference_(p, g, m, v, counters, policy="repair",
                                                                     **hyper))
    q = p.clone().requires_grad_(True)
    q.grad = g.clone()
    opt = torch.optim.AdamW([q], lr=1e-3, weight_decay=0.01, fused=device.type == "cuda")
    out["torch_adamw_fused_ms" if device.type == "cuda" else "torch_adamw_ms"] = timer(opt.step)
    ms = timer(lambda: momentum_update_(m, g, counters, beta=0.95, policy="repair"))
    out["momentum_repair_ms"], out["momentum_repair_gbps"] = ms, gbps(12.0, numel, ms)
    out["momentum_reference_ms"] = timer(lambda: momentum_update_reference_(m, g, counters, beta=0.95))
    log(f"  AdamW repair {out['adamw_repair_ms']:.3f} ms = {out['adamw_repair_gbps']:.0f} GB/s; skip (two-pass) "
        f"{out['adamw_skip_ms']:.3f} ms; off {out['adamw_off_ms']:.3f} ms; torch reference "
        f"{out['adamw_reference_ms']:.3f} ms; momentum {out['momentum_repair_gbps']:.0f} GB/s")
    return out


def check_targets(rows: list[dict]) -> dict[str, Any]:
    """The H100 targets of the kernels brief, evaluated on whatever shapes were run (None = not run)."""
    by = {(r["batch"], r["m"], r["n"]): r for r in rows}
    r4, r8 = by.get((1, 4096, 4096)), by.get((1, 8192, 8192))
    res: dict[str, Any] = {"targets": TARGETS}
    res["speedup_vs_eager_4096"] = r4["speedup_vs_eager"] if r4 else None
    res["limit_ratio_8192"] = r8["ratio_to_symmetric_limit"] if r8 else None
    res["min_speedup_vs_eager"] = min(r["speedup_vs_eager"] for r in rows) if rows else None
    res["met"] = {
        "speedup_vs_eager_4096": None if r4 is None else r4["speedup_vs_eager"] >= TARGETS["speedup_vs_eager_4096"],
        "limit_ratio_8192": None if r8 is None else r8["ratio_to_symmetric_limit"] <= TARGETS["limit_ratio_8192"],
        "min_speedup_vs_eager": None if not rows else res["min_speedup_vs_eager"] >= TARGETS["min_speedup_vs_eager"],
    }
    return res


def run(dry_run: bool, compile_ref: bool, shapes=None, log=print) -> dict[str, Any]:
    import triton

    device = torch.device("cpu" if dry_run else "cuda")
    timer = make_timer(dry_run)
    name = "cpu (Triton interpreter dry run)" if dry_run else torch.cuda.get_device_name(device)
    log(f"device: {name}")
    rate = matmul_rate(timer, device, 64 if dry_run else 8192)
    bandwidth = copy_bandwidth(timer, device, 1 << (12 if dry_run else 28))
    log(f"  bf16 matmul {rate / 1e12:.1f} TFLOP/s, copy {bandwidth / 1e9:.0f} GB/s")
    compile_backend = None if not compile_ref else ("eager" if dry_run else "inductor")
    rows = bench_ns5(timer, device, shapes or (DRY_SHAPES if dry_run else GPU_SHAPES), rate, compile_backend, log)
    fp16_safe = bench_fp16_safe(timer, device, FP16_DRY_SHAPES if dry_run else FP16_GPU_SHAPES, log)
    elementwise = bench_elementwise(timer, device, 4096 if dry_run else 1 << 26, log)
    elementwise["adamw_repair_fraction_of_copy"] = elementwise["adamw_repair_gbps"] * 1e9 / bandwidth
    elementwise["momentum_fraction_of_copy"] = elementwise["momentum_repair_gbps"] * 1e9 / bandwidth
    fused_step = bench_fused_step(timer, device, 4096 if dry_run else 1 << 26, log)
    for arm in ("repair", "off", "torch_fused"):
        fused_step[f"{arm}_fraction_of_copy"] = fused_step[f"{arm}_gbps"] * 1e9 / bandwidth
    sweep = bench_block_sweep(timer, device, 4096 if dry_run else 1 << 26, log,
                              None if dry_run else device_time_per_step)
    ablation = bench_one_launch_ablation(timer, device, 4096 if dry_run else 1 << 26, log,
                                         None if dry_run else device_time_per_step)
    spectral = bench_spectral_step(timer, device, log, None if dry_run else device_time_per_step,
                                   **(dict(shape=(16, 24), matrices=2) if dry_run else {}))
    return {"device": name, "dry_run": dry_run, "torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": checkout_commit(),
            "command": "python -m experiments kernels" + (" --dry-run" if dry_run else ""),
            "compile_backend": compile_backend, "matmul_bf16_tflops": rate / 1e12,
            "copy_gbps": bandwidth / 1e9, "ns5": rows, "crossover": crossover(rows), "fp16_safe": fp16_safe,
            "elementwise": elementwise, "fused_step": fused_step, "block_sweep": sweep, "one_launch_ablation": ablation,
            "spectral_step": spectral,
            "targets": check_targets(rows)}


def render(data: dict[str, Any]) -> str:
    """The RESULTS.md section of one run (tables from the JSON; nothing typed by hand)."""
    t, c, e, f = data["targets"], data["crossover"], data["elementwise"], data.get("fused_step")
    when = f", measured {data['date']}{at_commit(data)}" if "date" in data else ""  # (recorded since 2026-11-25)
    lines = [f"Command: `{data['command']}` (JSON: `results/kernels.json`) on {data['device']}, torch "
             f"{data['torch']}, triton {data['triton']}{when}. Anchors: bf16 matmul {data['matmul_bf16_tflops']:.0f} "
             f"TFLOP/s, copy {data['copy_gbps']:.0f} GB/s (read + write). NS5: {ITERATIONS} bf16 iterations; "
             "TFLOP/s count the dense 4m²n + 2m³ per iteration; the symmetric limit is the one-triangle count "
             "at the measured matmul rate.", "",
             "| batch × m × n | eager ms | compiled ms | Triton ms | vs eager | vs compiled | Triton TFLOP/s | "
             "Triton / symmetric limit | rel. error Triton / eager |", "|---|---|---|---|---|---|---|---|---|"]
    for r in data["ns5"]:
        vs_compiled = f"{r['speedup_vs_compiled']:.2f}x" if "speedup_vs_compiled" in r else "—"
        lines.append(f"| {r['batch']}×{r['m']}×{r['n']} | {_ms(r['eager_ms'])} | {_ms(r.get('compiled_ms'))} | "
                     f"{_ms(r['triton_ms'])} | {r['speedup_vs_eager']:.2f}x | {vs_compiled} | "
                     f"{r['triton_tflops']:.0f} | {r['ratio_to_symmetric_limit']:.2f} | "
                     f"{r['rel_err_triton']:.1e} / {r['rel_err_eager']:.1e} |")

    def verdict(key: str) -> str:
        value, ok = t[key], t["met"][key]
        if value is None:
            return f"{key}: not run"
        return f"{key} {value:.2f} (target {t['targets'][key]}): {'met' if ok else 'MISSED'}"

    lines += ["", f"Targets: {'; '.join(verdict(k) for k in t['met'])}. Crossover (smallest single square "
              f"size from which Triton is never slower than eager): {c.get('single_square_min_dim')}.", ""]
    if data.get("fp16_safe"):
        lines += ["fp16 rescale-restore NS5 (FusionOpt open question 2b), from an fp32 input; errors against the "
                  "fp32 iteration of that input:", "",
                  "| batch × m × n | fp16-safe fused (Triton) ms | same unfused (torch) ms | plain fp16 (Triton) ms | "
                  "bf16 (Triton) ms | unfused / fused | fused / plain fp16 | rel. error fused / unfused / fp16 / "
                  "bf16 |", "|---|---|---|---|---|---|---|---|"]
        for r in data["fp16_safe"]:
            lines.append(f"| {r['batch']}×{r['m']}×{r['n']} | {_ms(r['fused_ms'])} | {_ms(r['unfused_torch_ms'])} | "
                         f"{_ms(r['plain_fp16_ms'])} | {_ms(r['plain_bf16_ms'])} | {r['fused_vs_unfused']:.2f}x | "
                         f"{r['fused_vs_plain_fp16']:.2f} | {r['rel_err_fused']:.1e} / "
                         f"{r['rel_err_unfused_torch']:.1e} / {r['rel_err_plain_fp16']:.1e} / "
                         f"{r['rel_err_plain_bf16']:.1e} |")
        lines.append("")
    lines += [
              "| elementwise (fp32) | ms | GB/s | share of copy bandwidth |", "|---|---|---|---|",
              f"| fused_adamw_ repair ({e['numel']:,} entries) | {_ms(e['adamw_repair_ms'])} | "
              f"{e['adamw_repair_gbps']:.0f} | {e['adamw_repair_fraction_of_copy']:.2f} |",
              f"| momentum_update_ repair | {_ms(e['momentum_repair_ms'])} | {e['momentum_repair_gbps']:.0f} | "
              f"{e['momentum_fraction_of_copy']:.2f} |"]
    lines += render_fused_step(f, data["copy_gbps"]) + render_sweep(data.get("block_sweep") or [])
    lines += render_ablation(data.get("one_launch_ablation") or [])
    lines += render_spectral_step(data.get("spectral_step") or [])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter, tiny shapes")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON path (default {JSON_PATH}; "
                        "the dry run writes only when given)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile reference")
    parser.add_argument("--results-md", default=str(ROOT / "RESULTS.md"),
                        help="where a GPU run's table goes ('' to skip; a dry run never writes it)")
    parser.add_argument("--render-only", action="store_true", help="re-render RESULTS.md from the JSON")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.render_only:
        data = json.loads((args.out or JSON_PATH).read_text())
        if data["dry_run"]:
            raise SystemExit("kernels: a dry run's timings mean nothing; RESULTS.md takes GPU runs only")
        _publish(data, args.results_md)
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        print("kernels: triton is not installed; nothing to benchmark (pip install nonans-optim[triton]).")
        return 0
    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            # triton reads TRITON_INTERPRET when @triton.jit decorates: run in a fresh interpreter process.
            env = dict(os.environ, TRITON_INTERPRET="1")
            return subprocess.call([sys.executable, "-m", "experiments", "kernels", *argv],
                                   env=env, cwd=ROOT)
    elif not torch.cuda.is_available():
        print("kernels: no CUDA device here — the kernel benchmark needs a GPU; no results written. "
              "(`--dry-run` exercises the script on CPU.)")
        return 0
    result = run(args.dry_run, compile_ref=not args.no_compile)
    out = args.out if (args.out is not None or args.dry_run) else JSON_PATH
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    if not args.dry_run:
        _publish(result, args.results_md)
    return 0


def _publish(data: dict[str, Any], results_md: str) -> None:
    from experiments.questions_io import replace_section

    text = render(data)
    print(text)
    if results_md:
        replace_section(Path(results_md), "kernels", text, title="Triton kernels on a GPU (issue 4)")


if __name__ == "__main__":
    sys.exit(main())
