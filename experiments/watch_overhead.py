"""Overhead of ``nonans_optim.watch`` on CPU: forward+backward of a small MLP and a small transformer.

Variants, timed in interleaved rounds (the order rotates every round, so drifting load on a shared
machine hits all variants alike): ``off`` (no hooks), ``watch`` (``watch(model)`` with ``reset()`` every
step, as in a training loop) and ``anomaly`` (``torch.autograd.detect_anomaly(check_nan=True)``, the stock
tool for the same question). Reported: median ms per step and
the median over rounds of the per-round ratio to ``off`` (paired, so robust to load changes between
rounds). Writes ``results/watch_overhead.json`` with the machine description and prints a table.

    python -m experiments.watch_overhead [--rounds 12] [--steps 8] [--threads 1] [--out PATH]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn

from experiments.questions_io import at_commit, checkout_commit, cpu_model
from nonans_optim.watch import watch

VARIANTS = ("off", "watch", "anomaly")
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "watch_overhead.json"


class TinyTransformer(nn.Module):
    """Embedding, two pre-norm encoder layers (d=128, 4 heads), head: ~30 modules, like a small LM."""

    def __init__(self, vocab: int = 512, d: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 4, dim_feedforward=4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.encoder(self.embed(tokens))))


def build_cases() -> dict[str, tuple[nn.Module, torch.Tensor, callable]]:
    """name -> (model, input, loss_fn); fixed seeds so every run times the same work."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                        nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))
    x = torch.randn(64, 128)
    y = torch.randint(0, 10, (64,))
    tf = TinyTransformer()
    tokens = torch.randint(0, 512, (8, 64))
    return {
        "mlp": (mlp, x, lambda out: nn.functional.cross_entropy(out, y)),
        "transformer": (tf, tokens, lambda out: nn.functional.cross_entropy(
            out[:, :-1].reshape(-1, out.shape[-1]), tokens[:, 1:].reshape(-1))),
    }


def time_variant(variant: str, model: nn.Module, inp: torch.Tensor, loss_fn, steps: int) -> float:
    """Seconds per forward+backward step, averaged over ``steps`` consecutive steps."""
    handle = watch(model) if variant == "watch" else None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "Anomaly Detection has been enabled"
            ctx = torch.autograd.detect_anomaly(check_nan=True) if variant == "anomaly" else nullcontext()
        with ctx:
            t0 = time.perf_counter()
            for _ in range(steps):
                if handle is not None:
                    handle.reset()
                model.zero_grad(set_to_none=True)
                loss_fn(model(inp)).backward()
            elapsed = time.perf_counter() - t0
    finally:
        if handle is not None:
            assert handle.first_nonfinite() is None  # the run is clean: nothing may be reported
            handle.remove()
    return elapsed / steps


def measure(name: str, model, inp, loss_fn, rounds: int, steps: int, variants) -> dict:
    for variant in variants:  # warm-up: allocator, autograd caches, first-call costs
        time_variant(variant, model, inp, loss_fn, 2)
    per = {v: [] for v in variants}
    for r in range(rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for variant in order:
            per[variant].append(time_variant(variant, model, inp, loss_fn, steps))
    row = {"model": name, "params": sum(p.numel() for p in model.parameters()),
           "modules": sum(1 for _ in model.modules())}
    for v in variants:
        row[f"ms_{v}"] = 1e3 * statistics.median(per[v])
        if v != "off":
            row[f"ratio_{v}"] = statistics.median(a / b for a, b in zip(per[v], per["off"]))
    return row


def machine() -> dict:
    return {"platform": platform.platform(), "processor": cpu_model(),
            "python": platform.python_version(), "torch": torch.__version__, "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "commit": checkout_commit()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.watch_overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=8, help="steps per timed block")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: less noise)")
    parser.add_argument("--no-anomaly", action="store_true", help="skip the detect_anomaly reference")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--results-md", default="RESULTS.md", help="section to update ('' to skip)")
    parser.add_argument("--render-only", action="store_true", help="re-render RESULTS.md from --out")
    args = parser.parse_args(argv)
    if args.render_only:
        from experiments.questions_io import replace_section
        replace_section(Path(args.results_md), "watch", render(json.loads(args.out.read_text())),
                        title="Overhead of nonans_optim.watch() (issue 3)")
        return 0
    torch.set_num_threads(args.threads)
    variants = tuple(v for v in VARIANTS if not (args.no_anomaly and v == "anomaly"))
    t0 = time.perf_counter()
    rows = [measure(name, *case, args.rounds, args.steps, variants) for name, case in build_cases().items()]
    cmd = " ".join(["python -m experiments.watch_overhead", *(argv if argv is not None else sys.argv[1:])])
    result = {"experiment": "watch_overhead", "command": cmd,
              "machine": machine(), "settings": {"rounds": args.rounds, "steps": args.steps,
                                                 "threads": args.threads, "variants": list(variants)},
              "wall_s": round(time.perf_counter() - t0, 1), "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    header = f"{'model':<12}{'params':>9}{'modules':>9}" + "".join(f"{'ms ' + v:>12}" for v in variants) \
        + "".join(f"{v + '/off':>14}" for v in variants if v != "off")
    print(header)
    for row in rows:
        print(f"{row['model']:<12}{row['params']:>9}{row['modules']:>9}"
              + "".join(f"{row['ms_' + v]:>12.3f}" for v in variants)
              + "".join(f"{row['ratio_' + v]:>14.3f}" for v in variants if v != "off"))
    print(f"machine: {result['machine']}\nwrote {args.out}")
    if args.results_md:
        from experiments.questions_io import replace_section
        replace_section(Path(args.results_md), "watch", render(result),
                        title="Overhead of nonans_optim.watch() (issue 3)")
    return 0


def render(result: dict) -> str:
    """Markdown table of one run's JSON (ratios are medians of paired per-round ratios)."""
    from experiments.questions_io import md_table
    m = result["machine"]
    lines = [f"Command: `{result['command']}` (JSON: `results/watch_overhead.json`); "
             + (f"measured {m['date']}{at_commit(m)}, " if "date" in m else "") + f"{m['platform']}, "
             f"{m['cpu_count']} CPUs, torch {m['torch']}, {m['torch_threads']} thread(s). Forward + backward "
             "time with `watch(model)` attached vs without, and `torch.autograd.detect_anomaly` as the "
             "reference; CPU timings from a shared machine: read the ratios.", ""]
    variants = result["settings"]["variants"]
    header = ["model", "params", "modules"] + [f"ms {v}" for v in variants] + \
        [f"{v}/off" for v in variants if v != "off"]
    rows = [[r["model"], r["params"], r["modules"]] + [r[f"ms_{v}"] for v in variants]
            + [r[f"ratio_{v}"] for v in variants if v != "off"] for r in result["results"]]
    return "\n".join(lines) + "\n" + md_table(header, rows)


if __name__ == "__main__":
    sys.exit(main())
