"""``python -m experiments step-time`` — optimizer step time side by side with the peers (issue 2).

Every arm owns a copy of the same GPT-like model (:mod:`experiments._models`) with the same fixed-seed
synthetic gradients; no forward/backward is run, only ``step()``. Arms run in interleaved rounds (A B C …
A B C …, the order rotated each round) after a warm-up, and each arm's median is compared with torch's
fused AdamW and with the fastest Muon-family peer *measured in the same run* — the machine is shared and
noisy, so only same-run ratios mean anything. The same run measures the machine's bf16/fp32 matmul rate on
the NS5 shapes, which turns the dense NS5 FLOP count into a floor for any Muon-family step.

Output: ``results/step_time.json`` and the table between ``<!-- step-time:begin/end -->`` in RESULTS.md.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from experiments.questions_io import at_commit, checkout_commit, cpu_model, publish

import nonans_optim as no
from nonans_optim._global_state import GLOBAL_KEY
from experiments._models import (DEFAULT, QUICK, build_gpt, count_params, hidden_matrices, ns5_flops,
                                 synthetic_grads)

ROOT = Path(__file__).resolve().parent.parent
MUON_PEERS = ("torch Muon + AdamW", "heavyball Muon + AdamW", "pytorch_optimizer Muon",
              "pytorch_optimizer NorMuon")
LR = 1e-3


# ----------------------------------------------------------------------------------------- shared helpers
def machine_info() -> dict[str, Any]:
    info = {"platform": platform.platform(), "cpu": cpu_model(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "loadavg_start": list(os.getloadavg()),
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": checkout_commit()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def run_child(module: str, argv: list[str], env: dict[str, str] | None = None,
              timeout: float | None = None) -> Any:
    """``python -m module *argv`` in a fresh process (the timing experiments' way to start from nothing:
    a process that had run other arms moved their ratios), its stdout parsed as JSON; raises with the
    command and the end of its stderr when it fails. ``env``: variables added to this process's;
    ``timeout``: seconds before a hung child is killed (``subprocess.TimeoutExpired``)."""
    cmd = [sys.executable, "-m", module, *argv]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env=None if env is None else {**os.environ, **env}, timeout=timeout)
    if proc.returncode != 0:
        prefix = "".join(f"{k}={v} " for k, v in (env or {}).items())
        raise RuntimeError(f"{prefix}{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def add_child_arguments(ap: argparse.ArgumentParser, *, quick_help: str, sample_ms: float, threads: int,
                        processes_help: str) -> None:
    """The flags of a timing experiment that measures in fresh processes of itself (:func:`run_child`): the
    parent's, and the hidden ``--child`` its children run with; :func:`child_argv` repeats them to a child."""
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--sample-ms", type=float, default=sample_ms, help="each sample times about this long")
    ap.add_argument("--threads", type=int, default=threads)
    ap.add_argument("--processes", type=int, default=None, help=processes_help)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


def child_argv(args: argparse.Namespace) -> list[str]:
    """A child's arguments: ``--child`` and the timing flags of :func:`add_child_arguments` as the parent
    resolved them (so every child measures alike)."""
    return (["--child", "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--sample-ms",
             str(args.sample_ms), "--threads", str(args.threads)] + (["--quick"] if args.quick else []))


def inner_for(step: Callable[[], Any], sample_ms: float) -> int:
    """Calls per timed sample of the child-process experiments: enough for about ``sample_ms``, from the time
    of one call of ``step`` (made here)."""
    start = time.perf_counter()
    step()
    return max(1, round(sample_ms * 1e-3 / max(time.perf_counter() - start, 1e-9)))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def interleaved(arms: dict[str, Callable[[], Any]], *, rounds: int, warmup: int, inner: int,
                device: torch.device) -> dict[str, list[float]]:
    """Seconds per call of each arm: ``warmup`` untimed calls each, then ``rounds`` rounds in which every
    arm runs ``inner`` calls back to back (timed together, divided by ``inner``); arm order rotates.

    An arm with a ``settle`` attribute (``overhead_controls.switched``: arms that switch one optimizer's
    policy) has it called, untimed, right before each of its samples: the first step after a switch does
    the switch's own work — the first "repair" step after "off" steps folds those steps into the
    resolution counters (``Resolution.pass_clean_steps``, several small torch ops) — which a run under one
    policy never does. Timed, it was charged to the repair arm of every sample (2026-11-26)."""
    names = list(arms)
    for name in names:
        for _ in range(warmup):
            arms[name]()
    sync(device)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            settle = getattr(arms[name], "settle", None)
            if settle is not None:
                settle()
            sync(device)
            t0 = time.perf_counter()
            for _ in range(inner):
                arms[name]()
            sync(device)
            times[name].append((time.perf_counter() - t0) / inner)
    return times


def state_bytes(opts: list[torch.optim.Optimizer], params: set[int]) -> tuple[int, int]:
    """(bytes of per-parameter state, bytes of optimizer-level state) over all tensors in ``opt.state``."""
    per, glob = 0, 0

    def walk(x) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, dict):
            return sum(walk(v) for v in x.values())
        if isinstance(x, (list, tuple)):
            return sum(walk(v) for v in x)
        return 0

    for opt in opts:
        for key, st in opt.state.items():
            if isinstance(st, dict) and GLOBAL_KEY in st:  # one parameter carries ours' optimizer-level state
                glob += walk(st[GLOBAL_KEY])
                st = {k: v for k, v in st.items() if k != GLOBAL_KEY}
            if isinstance(key, torch.Tensor) and id(key) in params:
                per += walk(st)
            else:
                glob += walk(st)
    return per, glob


def matmul_gflops(dtype: torch.dtype, shapes: list[tuple[int, int]], *, repeats: int = 5) -> float:
    """Achieved GFLOP/s of X·Xᵀ-style batched matmuls on the NS5 shapes (short side × long side)."""
    rates = []
    for m, n in shapes:
        s, l = min(m, n), max(m, n)
        X = torch.randn(4, s, l).to(dtype)
        torch.bmm(X, X.mT)
        t0 = time.perf_counter()
        for _ in range(repeats):
            torch.bmm(X, X.mT)
        rates.append(repeats * 2 * 4 * s * s * l / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


# ----------------------------------------------------------------------------------------------- the arms
class _Chain:
    """Several optimizers stepped as one (Muon on hidden matrices + AdamW on the rest)."""

    def __init__(self, *opts):
        self.opts = opts

    def step(self):
        for o in self.opts:
            o.step()


def _peer_factories() -> dict[str, Callable]:
    f: dict[str, Callable] = {
        "torch AdamW (foreach)": lambda m, h, r: torch.optim.AdamW(m.parameters(), lr=LR, foreach=True),
        "torch AdamW (fused)": lambda m, h, r: torch.optim.AdamW(m.parameters(), lr=LR, fused=True),
    }
    if hasattr(torch.optim, "Muon"):
        f["torch Muon + AdamW"] = lambda m, h, r: _Chain(torch.optim.Muon(h, lr=LR),
                                                        torch.optim.AdamW(r, lr=LR, fused=True))
    try:
        import heavyball
        f["heavyball Muon + AdamW"] = lambda m, h, r: _Chain(heavyball.Muon(h, lr=LR),
                                                            torch.optim.AdamW(r, lr=LR, fused=True))
    except Exception:  # noqa: BLE001 — optional peer
        pass
    try:
        import pytorch_optimizer as po
        groups = lambda h, r: [{"params": h, "use_muon": True}, {"params": r, "use_muon": False}]  # noqa
        f["pytorch_optimizer Muon"] = lambda m, h, r: po.Muon(groups(h, r), lr=LR)
        if hasattr(po, "NorMuon"):
            f["pytorch_optimizer NorMuon"] = lambda m, h, r: po.NorMuon(groups(h, r), lr=LR)
    except Exception:  # noqa: BLE001 — optional peer
        pass
    return f


def _our_factories() -> dict[str, Callable]:
    groups = no.param_groups
    return {
        "ours AdamW (foreach, repair)": lambda m, h, r: no.AdamW(m.parameters(), lr=LR, impl="foreach"),
        "ours AdamW (compiled, repair)": lambda m, h, r: no.AdamW(m.parameters(), lr=LR, impl="compiled"),
        "ours AdamW (fused, repair)": lambda m, h, r: no.AdamW(m.parameters(), lr=LR, impl="fused"),
        "ours SFAdamW (foreach, repair)": lambda m, h, r: no.SFAdamW(m.parameters(), lr=LR, impl="foreach"),
        "ours SFAdamW (compiled, repair)": lambda m, h, r: no.SFAdamW(m.parameters(), lr=LR,
                                                                      impl="compiled"),
        "ours SFAdamW (fused, repair)": lambda m, h, r: no.SFAdamW(m.parameters(), lr=LR, impl="fused"),
        "ours SFNorMuon (foreach, repair)": lambda m, h, r: no.SFNorMuon(groups(m), lr=LR, impl="foreach"),
        "ours SFNorMuon (compiled, repair)": lambda m, h, r: no.SFNorMuon(groups(m), lr=LR, impl="compiled"),
        "ours SFNorMuon (fused, repair)": lambda m, h, r: no.SFNorMuon(groups(m), lr=LR, impl="fused"),
        "ours FullFusion (foreach, repair)": lambda m, h, r: no.FullFusion(groups(m), lr=LR, impl="foreach"),
        "ours FullFusion (compiled, repair)": lambda m, h, r: no.FullFusion(groups(m), lr=LR,
                                                                            impl="compiled"),
        "ours FullFusion (fused, repair)": lambda m, h, r: no.FullFusion(groups(m), lr=LR, impl="fused"),
    }


def build_arms(cfg, device: torch.device, only: list[str] | None) -> dict[str, tuple[Any, list, list]]:
    """name → (optimizer, its model's parameters, the gradients), each arm on its own model copy."""
    base = build_gpt(cfg, device=device)
    grads = synthetic_grads(base)
    out = {}
    for name, make in {**_peer_factories(), **_our_factories()}.items():
        if only and not any(s.lower() in name.lower() for s in only):
            continue
        model = copy.deepcopy(base)
        own = [g.clone() for g in grads]  # per arm: a peer that wrote into its gradients cannot affect others
        for p, g in zip(model.parameters(), own):
            p.grad = g
        hidden, rest = hidden_matrices(model)
        try:
            out[name] = (make(model, hidden, rest), list(model.parameters()), own)
        except Exception as err:  # noqa: BLE001 — a peer that cannot be built here is reported, not fatal
            warnings.warn(f"step-time: skipping {name!r}: {type(err).__name__}: {err}")
    return out


def _stepper(opt, params: list[torch.Tensor], grads: list[torch.Tensor]) -> Callable[[], None]:
    """step() with the gradients re-attached first: some peers (heavyball) set ``p.grad = None`` after a
    step, which would make every later step a no-op. Every arm pays the same few pointer assignments."""
    def step() -> None:
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
    return step


# ------------------------------------------------------------------------------------------------- run
def run(args) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cfg = QUICK if args.quick else DEFAULT
    machine = machine_info()
    if args.quick:  # heavyball compiles with max-autotune by default: minutes of compile for a smoke test
        try:
            import heavyball.utils
            heavyball.utils.compile_mode = None
            machine["heavyball_compile"] = "off (--quick)"
        except Exception:  # noqa: BLE001
            pass
    arms = build_arms(cfg, device, args.only)
    skipped = [n for n in {**_peer_factories(), **_our_factories()} if n not in arms]
    t_start = time.perf_counter()
    times = interleaved({n: _stepper(o, ps, gs) for n, (o, ps, gs) in arms.items()}, rounds=args.rounds,
                        warmup=args.warmup, inner=args.inner, device=device)
    wall = time.perf_counter() - t_start
    model = build_gpt(cfg)
    hidden_shapes = [tuple(p.shape) for p in hidden_matrices(model)[0]]
    flops = ns5_flops(hidden_shapes)
    uniq = sorted(set(hidden_shapes))
    rate = {"bf16": matmul_gflops(torch.bfloat16, uniq), "fp32": matmul_gflops(torch.float32, uniq)}
    machine["loadavg_end"] = list(os.getloadavg())
    n_params = count_params(model)
    med = {n: statistics.median(t) for n, t in times.items()}
    fused = med.get("torch AdamW (fused)")
    peers = {n: med[n] for n in MUON_PEERS if n in med}
    fastest = min(peers, key=peers.get) if peers else None
    rows = []
    for name, (opt, params, _) in arms.items():
        opts = list(opt.opts) if isinstance(opt, _Chain) else [opt]
        per, glob = state_bytes(opts, {id(p) for p in params})
        t = times[name]
        rows.append({"name": name, "median_ms": 1e3 * med[name], "mean_ms": 1e3 * statistics.fmean(t),
                     "min_ms": 1e3 * min(t), "max_ms": 1e3 * max(t), "rounds": len(t),
                     "vs_fused_adamw": med[name] / fused if fused else None,
                     "vs_fastest_muon_peer": med[name] / peers[fastest] if fastest else None,
                     "state_bytes_per_param": per / n_params, "global_state_bytes": glob})
    by = {r["name"]: r for r in rows}
    targets = _targets(by, fastest)
    return {"command": "python -m experiments step-time" + (" --quick" if args.quick else ""),
            "machine": machine, "model": {**vars(cfg), "params": n_params,
                                          "hidden_shapes": [list(s) for s in hidden_shapes]},
            "settings": {"rounds": args.rounds, "warmup": args.warmup, "inner": args.inner,
                         "device": str(device), "lr": LR, "wall_s": wall},
            "matmul_gflops": rate, "ns5_gflop": flops / 1e9,
            "ns5_floor_ms": {k: flops / (v * 1e9) * 1e3 for k, v in rate.items()},
            "fastest_muon_peer": fastest, "skipped": skipped, "arms": rows, "targets": targets}


def _targets(by: dict[str, dict], fastest: str | None) -> list[dict[str, Any]]:
    out = []
    sfns = [r for n, r in by.items() if n.startswith("ours SFNorMuon")]
    sfn = min(sfns, key=lambda r: r["median_ms"]) if sfns else None
    if sfn and fastest:
        out.append({"target": f"SFNorMuon ≤ 0.85x fastest Muon-family peer ({sfn['name']})",
                    "value": sfn["vs_fastest_muon_peer"], "limit": 0.85, "met": sfn["vs_fastest_muon_peer"] <= 0.85})
    ours = [r for n, r in by.items() if n.startswith("ours AdamW")]
    if ours and by.get("torch AdamW (fused)"):
        best = min(ours, key=lambda r: r["median_ms"])
        out.append({"target": f"AdamW with resolution ≤ 1.2x torch fused AdamW ({best['name']})",
                    "value": best["vs_fused_adamw"], "limit": 1.2, "met": best["vs_fused_adamw"] <= 1.2})
    adamw = by.get("ours AdamW (foreach, repair)") or by.get("torch AdamW (fused)")
    if sfn and adamw:
        out.append({"target": "SFNorMuon state ≤ AdamW state (bytes/param)",
                    "value": sfn["state_bytes_per_param"], "limit": adamw["state_bytes_per_param"],
                    "met": sfn["state_bytes_per_param"] <= adamw["state_bytes_per_param"]})
    return out


def render(data: dict[str, Any]) -> str:
    m, s = data["machine"], data["settings"]
    lines = [f"Command: `{data['command']}` (JSON: `results/step_time.json`), measured {m['date']}{at_commit(m)}.",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads, {m['platform']}, "
             f"torch {m['torch']}; load average {m['loadavg_start'][0]:.1f} → {m['loadavg_end'][0]:.1f} "
             "(a shared machine: compare ratios within this run, not absolute times across runs).",
             f"Model: GPT-like d={data['model']['d']}, {data['model']['layers']} layers, "
             f"{data['model']['params'] / 1e6:.2f}M parameters; synthetic gradients, step only; "
             f"{s['warmup']} warm-up steps, {s['rounds']} interleaved rounds of {s['inner']} step(s); ratios "
             "of medians. The mean includes periodic work the median leaves out (KL-Shampoo's basis refresh "
             "runs every 10th step: with the default 5 + 20 steps, 2 of the 20 timed steps, its real share).",
             f"Matmul rate on the NS5 shapes: bf16 {data['matmul_gflops']['bf16']:.0f} GFLOP/s, fp32 "
             f"{data['matmul_gflops']['fp32']:.0f} GFLOP/s; dense NS5 = {data['ns5_gflop']:.1f} GFLOP → floor "
             f"{data['ns5_floor_ms']['bf16']:.1f} ms (bf16) / {data['ns5_floor_ms']['fp32']:.1f} ms (fp32).",
             "", "| optimizer | median ms | mean ms | min–max ms | × torch fused AdamW | × fastest Muon peer "
             "| state bytes/param | optimizer-level state |", "|---|---|---|---|---|---|---|---|"]
    fmt = lambda x: "—" if x is None else f"{x:.2f}"  # noqa: E731
    for r in data["arms"]:
        star = " (fastest peer)" if r["name"] == data["fastest_muon_peer"] else ""
        mean = fmt(r.get("mean_ms"))  # JSON written before the column existed has none
        lines.append(f"| {r['name']}{star} | {r['median_ms']:.2f} | {mean} | {r['min_ms']:.2f}–{r['max_ms']:.2f} | "
                     f"{fmt(r['vs_fused_adamw'])} | {fmt(r['vs_fastest_muon_peer'])} | "
                     f"{r['state_bytes_per_param']:.2f} | {r['global_state_bytes'] / 1024:.0f} KiB |")
    if data["skipped"]:
        lines.append(f"\nNot measured (not installed or failed to build): {', '.join(data['skipped'])}.")
    lines.append("\nTargets: " + "; ".join(
        f"{t['target']}: {t['value']:.2f} vs {t['limit']:.2f} — {'met' if t['met'] else 'MISSED'}"
        for t in data["targets"]) + ".")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments step-time", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 2 rounds (for tests)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--inner", type=int, default=1, help="steps per arm per round")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--only", nargs="*", help="substrings of arm names to keep")
    ap.add_argument("--out", default=str(ROOT / "results" / "step_time.json"))
    ap.add_argument("--results-md", default=str(ROOT / "RESULTS.md"), help="'' to skip rendering")
    args = ap.parse_args(argv)
    # 5 + 20 steps: the timed steps 6-25 hold exactly two of KL-Shampoo's every-10th-step refreshes
    args.rounds = args.rounds or (2 if args.quick else 20)
    args.warmup = args.warmup or (2 if args.quick else 5)
    data = run(args)
    publish(data, Path(args.out), render(data), args.results_md, "step-time", "Optimizer step time (issue 2)")
    return 0
