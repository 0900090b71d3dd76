"""``python -m experiments overhead`` — what ``resolution="repair"`` costs on clean steps (issue 3).

For every optimizer (AdamW foreach, compiled and fused — the last also with the opt-in spike guard —,
SFAdamW foreach and fused — again also with the guard —, SFNorMuon foreach, compiled and fused, FullFusion
foreach and fused, Muon foreach and fused) two arms that differ only in the policy, "repair" and "off",
run side by side in interleaved rounds (warm-up first, medians). The two arms of a row are one optimizer
whose ``resolution_policy`` is switched before each sample, so they step the very same tensors: two
separately built optimizers also differ in where their tensors sit, which moved the A/A control (the same
code twice) by ±10% and more on this machine — far more than the 2% target this table judges:

* the optimizer step alone (fixed-seed synthetic gradients, as in step-time);
* a whole training step of a small transformer (forward, backward, step) on a fixed batch.

Reported: median times, the ratio repair/off of the medians, and the median of the per-round paired ratios
(the two arms of a pair run back to back, so the paired ratio cancels most of the machine's drift). Then a
sweep over tensor size for AdamW (fused) — "off", "repair", "repair" with the spike guard — which
separates the guard's extra read of g (free while the tensor is cache-resident, +4 of 28 bytes per entry
once it is not) from the rest of the resolution work.
On a CUDA machine the same runs happen on the GPU and absolute milliseconds are reported with the device
named; on CPU only ratios mean something (a shared machine).

Output: ``results/overhead.json`` and the table between ``<!-- overhead:begin/end -->`` in RESULTS.md.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

import nonans_optim as no
from nonans_optim.optimizers._fused import auto_choice
from experiments._models import MODELS, QUICK, GPTConfig, build_gpt, random_batch, synthetic_grads
from experiments.overhead_controls import build_optimizer, fresh_controls, switched
from experiments.overhead_render import render
from experiments.questions_io import env_prefix, publish
from experiments.step_time import ROOT, interleaved, machine_info, sync

LR = 1e-3
GUARD = 10.0  # the opt-in spike guard's factor in the "spike_factor=10" rows and the size sweep
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "AdamW (foreach)": lambda m, pol: no.AdamW(m.parameters(), lr=LR, resolution=pol, impl="foreach"),
    "AdamW (compiled)": lambda m, pol: no.AdamW(m.parameters(), lr=LR, resolution=pol, impl="compiled"),
    "AdamW (fused)": lambda m, pol: no.AdamW(m.parameters(), lr=LR, resolution=pol, impl="fused"),
    # the same with the opt-in spike guard: what its read-only pre-pass over g costs (functional/spike.py)
    "AdamW (fused, spike_factor=10)": lambda m, pol: no.AdamW(m.parameters(), lr=LR, resolution=pol,
                                                              impl="fused", spike_factor=GUARD),
    "SFAdamW (foreach)": lambda m, pol: no.SFAdamW(m.parameters(), lr=LR, resolution=pol, impl="foreach"),
    "SFAdamW (fused)": lambda m, pol: no.SFAdamW(m.parameters(), lr=LR, resolution=pol, impl="fused"),
    "SFAdamW (fused, spike_factor=10)": lambda m, pol: no.SFAdamW(m.parameters(), lr=LR, resolution=pol,
                                                                  impl="fused", spike_factor=GUARD),
    "SFNorMuon (foreach)": lambda m, pol: no.SFNorMuon(no.param_groups(m), lr=LR, resolution=pol,
                                                       impl="foreach"),
    "SFNorMuon (compiled)": lambda m, pol: no.SFNorMuon(no.param_groups(m), lr=LR, resolution=pol,
                                                        impl="compiled"),
    "SFNorMuon (fused)": lambda m, pol: no.SFNorMuon(no.param_groups(m), lr=LR, resolution=pol, impl="fused"),
    "FullFusion (foreach)": lambda m, pol: no.FullFusion(no.param_groups(m), lr=LR, resolution=pol,
                                                         impl="foreach"),
    "FullFusion (fused)": lambda m, pol: no.FullFusion(no.param_groups(m), lr=LR, resolution=pol, impl="fused"),
    "Muon (foreach)": lambda m, pol: no.Muon(no.param_groups(m), lr=LR, resolution=pol, impl="foreach"),
    "Muon (fused)": lambda m, pol: no.Muon(no.param_groups(m), lr=LR, resolution=pol, impl="fused"),
}
POLICIES = ("repair", "off")
ROUNDS = 15  # default interleaved rounds (each runs every arm twice)


def _step_arms(base: torch.nn.Module, grads: list[torch.Tensor], make) -> dict[str, Callable[[], None]]:
    """{policy: step} for one optimizer whose policy is switched before each sample: both arms step the very
    same tensors (arms built separately differ in memory placement too, which the A/A control showed moving
    a ratio by ±10% and more on its own). Each arm keeps the optimizer's own spike guard setting."""
    opt = build_optimizer(base, grads, make, "repair")
    return {p: switched(opt, p, opt.spike_factor) for p in POLICIES}


def _train_arms(base: torch.nn.Module, batch, make) -> dict[str, Callable[[], None]]:
    """{policy: training step} of one model and one optimizer, the policy switched as in :func:`_step_arms`."""
    model = copy.deepcopy(base)
    opt = make(model, "repair")
    x, y = batch

    def arm(policy: str) -> Callable[[], None]:
        step = switched(opt, policy, opt.spike_factor)

        def train_step() -> None:
            opt.zero_grad(set_to_none=True)
            loss = model.loss(x, y)
            loss.backward()
            opt.set_loss(loss)
            step()
        train_step.settle = step.settle  # an untimed optimizer step after the switch, no forward/backward
        return train_step

    return {p: arm(p) for p in POLICIES}


def _paired(times: dict[str, list[float]], name: str) -> dict[str, float]:
    rep, off = times[f"{name} | repair"], times[f"{name} | off"]
    med_r, med_o = statistics.median(rep), statistics.median(off)
    return {"repair_ms": 1e3 * med_r, "off_ms": 1e3 * med_o, "ratio_of_medians": med_r / med_o,
            "median_paired_ratio": statistics.median(r / o for r, o in zip(rep, off)),
            "overhead_ms": 1e3 * (med_r - med_o)}


def _timed(fn: Callable[[], None], device) -> float:
    """Seconds of one call of ``fn``, the device synchronised on both sides."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def _inner(args, seconds: float) -> int:
    """Steps per timed sample for a step of ``seconds``: at least ``args.inner``, and enough for about
    ``args.sample_ms``."""
    return max(args.inner, math.ceil(args.sample_ms * 1e-3 / max(seconds, 1e-9)))


def _interleave_pairs(arms: dict[str, Callable], names: list[str], args,
                      device) -> tuple[dict[str, list[float]], dict[str, int]]:
    """interleaved() with each optimizer's repair/off arms kept adjacent (the rotation moves whole pairs,
    and which of the two runs first alternates with the round). Each sample times ``inner`` calls back to
    back: at least ``args.inner``, and enough for about ``args.sample_ms`` (from the last warm-up call), so
    a 2 ms step is not timed one call at a time against a shared machine's jitter. Returns the seconds
    per call and the inner count of each optimizer (``names``: the rows, in order)."""
    out: dict[str, list[float]] = {k: [] for k in arms}
    inner: dict[str, int] = {}
    for name in names:
        slowest = 0.0
        for pol in POLICIES:
            for _ in range(args.warmup):
                last = _timed(arms[f"{name} | {pol}"], device)
            slowest = max(slowest, last)
        inner[name] = _inner(args, slowest)
    for r in range(args.rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            pols = POLICIES if r % 2 == 0 else POLICIES[::-1]
            pair = {f"{name} | {p}": arms[f"{name} | {p}"] for p in pols if f"{name} | {p}" in arms}
            for key, t in interleaved(pair, rounds=1, warmup=0, inner=inner[name], device=device).items():
                out[key] += t
    return out, inner


SWEEP_OPTIMIZER = "AdamW (fused)"
SWEEP_SIZES, QUICK_SWEEP_SIZES = (1 << 16, 1 << 20, 1 << 24), (1 << 10, 1 << 12)
# bytes per entry an fp32 AdamW step must move: read p, g, m, v and write p, m, v; the guard's pre-pass
# reads g once more, which is free only while the tensor's g is still in a cache when the update re-reads it
STEP_BYTES, GUARD_BYTES = 28, 32


def _size_sweep(args, device) -> list[dict[str, Any]]:
    """What the spike guard and the rest of "repair" cost as a function of tensor size, on one tensor:
    "off", "repair" with and without the guard, and "off" once more (the A/A), interleaved, each sample about
    ``args.sample_ms`` long. All four arms are one optimizer whose policy and guard are switched between
    samples, so they step the very same tensors: arms built separately also differ in memory placement,
    which the A/A control (overhead_controls.py) showed moving a paired ratio by several percent on its own
    — more than the effect this sweep is after on a cache-resident tensor."""
    rows = []
    for n in (QUICK_SWEEP_SIZES if args.quick else SWEEP_SIZES):
        torch.manual_seed(0)
        base = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n, device=device))])
        grads = [torch.randn(n, device=device) * 1e-2]
        opt = build_optimizer(base, grads, OPTIMIZERS[SWEEP_OPTIMIZER], "repair")
        arms = {"off": switched(opt, "off"), "repair": switched(opt, "repair"),
                "repair_guard": switched(opt, "repair", GUARD), "aa": switched(opt, "off")}
        for _ in range(args.warmup):
            arms["off"]()
        inner = _inner(args, _timed(arms["off"], device))
        times = interleaved(arms, rounds=2 * args.rounds, warmup=args.warmup, inner=inner, device=device)
        off = times["off"]
        rows.append({"entries": n, "state_mib": 4 * n * 4 / 2 ** 20, "off_ms": 1e3 * statistics.median(off),
                     "inner": inner, "design": "same tensors",
                     **{f"{k}_paired_ratio": statistics.median(a / b for a, b in zip(times[k], off))
                        for k in ("repair", "repair_guard", "aa")}})
        del arms, opt
    return rows


def _controls(args, device) -> list[dict[str, Any]]:
    """overhead_controls.fresh_controls() on CPU, where the 2% target applies (none on a GPU)."""
    return fresh_controls(args) if device.type == "cpu" else []


def run(args) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device if args.device != "auto" else
                          ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg: GPTConfig = QUICK if args.quick else MODELS[args.model]
    runs = auto_runs(device)  # which rows the default, impl="auto", runs here
    defaults = default_rows(runs)
    # --defaults: only each optimizer as constructed by default (what a GPU-sized model has time for)
    names = list(defaults if args.defaults else OPTIMIZERS)
    machine = machine_info()
    base = build_gpt(cfg, device=device)
    grads = synthetic_grads(base)
    batch = random_batch(cfg, args.batch, device=device)
    t0 = time.perf_counter()
    ctrl = [] if args.defaults else _controls(args, device)  # in fresh processes of their own
    step_arms = {f"{n} | {p}": arm for n in names for p, arm in _step_arms(base, grads, OPTIMIZERS[n]).items()}
    step_times, step_inner = _interleave_pairs(step_arms, names, args, device)
    del step_arms
    train_arms = {f"{n} | {p}": arm for n in names for p, arm in _train_arms(base, batch, OPTIMIZERS[n]).items()}
    train_times, train_inner = _interleave_pairs(train_arms, names, args, device)
    sweep = [] if args.defaults else _size_sweep(args, device)
    machine["loadavg_end"] = list(os.getloadavg())
    rows = []
    for name in names:
        opt_row, train_row = _paired(step_times, name), _paired(train_times, name)
        rows.append({"optimizer": name, "step": opt_row, "train_step": train_row,
                     # the step's extra cost as a share of a whole training step
                     "overhead_share_of_train_step": (opt_row["repair_ms"] - opt_row["off_ms"]) /
                     train_row["off_ms"]})
    gpu = device.type == "cuda"
    limit = {"step": None if gpu else 1.02, "train_share": 0.003 if gpu else None}
    return {"command": env_prefix() + "python -m experiments overhead" + (" --quick" if args.quick else "") +
            (" --device cuda" if gpu else "") + (f" --model {args.model}" if args.model != "default" else "") +
            (" --defaults" if args.defaults else "") + (f" --rounds {args.rounds}" if args.rounds != ROUNDS else ""),
            "machine": machine, "device": torch.cuda.get_device_name() if gpu else "cpu",
            "model": {**vars(cfg), "batch": args.batch, "name": "quick" if args.quick else args.model,
                      "params": sum(p.numel() for p in base.parameters())},
            "settings": {"rounds": args.rounds, "warmup": args.warmup, "inner": args.inner,
                         "sample_ms": args.sample_ms, "inner_step": step_inner, "inner_train_step": train_inner,
                         "wall_s": time.perf_counter() - t0, "design": "same tensors", "settled": True},
            "targets": {"cpu_step_ratio_max": 1.02, "gpu_train_share_max": 0.003, "applies": limit},
            "auto_runs": runs, "default_rows": defaults,
            "rows": rows, "size_sweep": sweep, "bytes_per_entry": {"step": STEP_BYTES, "with_guard": GUARD_BYTES},
            "controls": ctrl,
            "raw_ms": {"step": {k: [1e3 * x for x in v] for k, v in step_times.items()},
                       "train_step": {k: [1e3 * x for x in v] for k, v in train_times.items()}}}


def auto_runs(device: torch.device) -> dict[str, str]:
    """{optimizer class: the impl its default, impl="auto", runs on ``device``}
    (nonans_optim.optimizers._fused.auto_choice; until 2026-11-26 the spectral optimizers ran "foreach" on
    CUDA, which the JSONs of earlier GPU runs record)."""
    classes = dict.fromkeys(name.partition(" (")[0] for name in OPTIMIZERS)
    return dict.fromkeys(classes, auto_choice(device))


def default_rows(auto_runs: dict[str, str]) -> dict[str, float | None]:
    """{row: that optimizer's default spike_factor} for the rows that are each optimizer's default
    configuration: the impl that auto runs here, and no explicit spike_factor (so the library's own default,
    read from a constructed optimizer rather than restated here)."""
    out = {}
    for name in OPTIMIZERS:
        cls_name = name.partition(" (")[0]
        if name == f"{cls_name} ({auto_runs[cls_name]})":
            out[name] = getattr(no, cls_name)([torch.nn.Parameter(torch.zeros(3, 3))]).spike_factor
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments overhead", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 2 rounds (for tests)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--inner", type=int, default=1, help="at least this many steps per timed sample")
    ap.add_argument("--sample-ms", type=float, default=None,
                    help="time enough steps per sample for about this long (default 25; --quick 0)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--model", default="default", choices=sorted(MODELS),
                    help="the GPT's shape: 'default' (d=256, 4 layers) or 'gpt2-small' (≈124M parameters, for "
                    "judging the GPU target on a training step that is not launch-bound); its own JSON and section")
    ap.add_argument("--defaults", action="store_true",
                    help="only each optimizer as constructed by default (impl='auto'), no size sweep or controls")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    ap.add_argument("--out", default=None, help="JSON path (default results/overhead.json, on a GPU "
                    "results/overhead_cuda.json: the CPU table stays)")
    ap.add_argument("--results-md", default=str(ROOT / "RESULTS.md"), help="'' to skip rendering")
    ap.add_argument("--render-only", action="store_true", help="re-render RESULTS.md from the JSON at --out")
    args = ap.parse_args(argv)
    if args.render_only:
        out = Path(args.out) if args.out else ROOT / "results" / _json_name(args.device == "cuda", args.model)
        _publish(json.loads(out.read_text()), out, args.results_md)
        return 0
    args.rounds = args.rounds or (2 if args.quick else ROUNDS)
    args.warmup = args.warmup or (2 if args.quick else 3)
    if args.sample_ms is None:
        args.sample_ms = 0.0 if args.quick else 25.0
    data = run(args)
    gpu = data["device"] != "cpu"
    out = Path(args.out) if args.out else ROOT / "results" / _json_name(gpu, data["model"]["name"])
    data["json"] = str(out.relative_to(ROOT)) if out.is_relative_to(ROOT) else str(out)
    _publish(data, out, args.results_md)
    return 0


def section(data: dict[str, Any]) -> str:
    """The RESULTS.md section a run's JSON belongs in: a GPU run has its own, so the CPU table stays, and so
    does a run on another model (``--model``)."""
    tag = _model_tag(data.get("model", {}).get("name", "default"))
    return ("overhead-gpu" if data.get("device", "cpu") != "cpu" else "overhead") + (f"-{tag}" if tag else "")


def _model_tag(model: str) -> str:
    """The model's name where a run's JSON, section and title carry it: "" for the default model and the
    --quick one (the tables published before --model keep their places)."""
    return "" if model in ("default", "quick") else model


def _json_name(gpu: bool, model: str) -> str:
    """results/ file of a run: overhead[_cuda][_MODEL].json."""
    tag = _model_tag(model)
    return "overhead" + ("_cuda" if gpu else "") + (f"_{tag}" if tag else "") + ".json"


def _publish(data: dict[str, Any], out: Path, results_md: str) -> None:
    """The JSON to ``out`` and the table into RESULTS.md's CPU or GPU section (a run, or --render-only)."""
    gpu = data.get("device", "cpu") != "cpu"
    tag = _model_tag(data["model"].get("name", "default"))
    title = "Resolution overhead on clean steps" + (", GPU" if gpu else "") + (f", {tag}" if tag else "") + " (issue 3)"
    publish(data, out, render(data), results_md, section(data), title)
