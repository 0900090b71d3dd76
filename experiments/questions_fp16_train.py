"""Open question 2, in training: the NS5 inputs a real run produces, with and without KL-Shampoo, traced in fp16.

questions_numerics.py maps where fp16 NS5 breaks on synthetic matrices of chosen entry scales; what it cannot
say is which of those scales training produces. Here each spectral step's NS5 input — the momentum matrix M,
or with KL-Shampoo the preconditioned one, whose scale the inverse factor roots set — is recorded while the
optimizer runs with ``ns5_dtype="fp16"`` (our path: fp32 normalisation, then the fp16 iteration), and each input
is also traced through the naive foil (cast → fp16 norm → iterate, ``trace_naive``) to see whether the common
implementation would have broken on it and at which stage. Recorded per matrix and step: max |M|, ‖M‖_F, the
foil's stage and its error against the fp32 NS5 of the same input, the fraction of M's non-zero entries the
foil's cast flushes to 0, the same fraction after our normalisation (entries below fp16's smallest subnormal,
2⁻²⁴, relative to ‖M‖_F), and our fp16 output's finiteness and error against fp32 NS5 — what a flushed entry
costs the direction.

How the inputs are seen: ``impl="loop"`` (the readable ground truth) calls ``_spectral.ns5`` once per matrix or
same-shape batch; :func:`recording` wraps that one name for the run and restores it after. The wrapper only
reads its argument and returns the real call's output, so the run trains as it would unobserved.
"""
from __future__ import annotations

import contextlib
import statistics
from typing import Any, Iterator

import torch

from nonans_optim.ns5 import normalise, ns5
from nonans_optim.optimizers import _spectral

from .questions_io import md_table
from .questions_numerics import H, render_q2, run_q2, trace_naive
from .tasks import make_task, train

__all__ = ["recording", "run_q2_train", "render_q2_train", "summary", "trace_rows", "run_q2_with_training",
           "render_q2_all", "ARMS"]

#: label -> optimizer (tasks.make_optimizer's names): SF-NorMuon alone, with KL-Shampoo, and FullFusion
#: (NS5 + MONA + KL-Shampoo with NorMuon and schedule-free), all at their defaults apart from fp16 NS5.
ARMS = {"SF-NorMuon": "sfnormuon", "SF-NorMuon + KL-Shampoo": "fusion:ns5+normuon+sf+shampoo",
        "FullFusion": "fullfusion"}


def _r(x: float) -> float:
    """Four significant digits: the trace holds thousands of inputs, and the results JSON is committed."""
    return float(f"{x:.4g}")


def _trace(M: torch.Tensor, out: torch.Tensor) -> list[dict[str, Any]]:
    rows = []
    for G, O in zip(M.reshape(-1, *M.shape[-2:]).float(), out.reshape(-1, *out.shape[-2:])):
        nz = G != 0
        ours = normalise(G).to(H)
        ref = ns5(G, dtype="fp32")
        naive = trace_naive(G, ref, real=False)
        finite = bool(torch.isfinite(O).all())
        rows.append({"shape": list(G.shape), "amax": _r(float(G.abs().max())), "fro": _r(float(G.double().norm())),
                     "naive_stage": naive["stage"], "naive_flushed": _r(naive["flushed_frac"]),
                     "naive_rel_err": _r(naive["rel_err"]),
                     "ours_flushed": _r(float((nz & (ours == 0)).float().sum() / nz.sum().clamp_min(1))),
                     "ours_finite": finite,
                     "ours_rel_err": _r(float((O.float() - ref).norm() / ref.norm())) if finite else float("nan")})
    return rows


@contextlib.contextmanager
def recording() -> Iterator[list[dict[str, Any]]]:
    """Inside: every NS5 call of the spectral loop path appends its inputs' traces to the yielded list."""
    real, log = _spectral.ns5, []

    def traced(M, *args, **kwargs):
        out = real(M, *args, **kwargs)
        log.extend(_trace(M.detach(), out.detach()))
        return out

    _spectral.ns5 = traced
    try:
        yield log
    finally:
        _spectral.ns5 = real


def run_q2_train(tasks=("digits", "charlm"), arms=tuple(ARMS), steps: int = 100, lr: float = 3e-3,
                 seed: int = 0) -> dict[str, Any]:
    runs = []
    for task in tasks:
        for arm in arms:
            with recording() as log:
                r = train(make_task(task, seed), ARMS[arm], seed=seed, lr=lr, steps=steps, evals=2, set_loss=True,
                          opt_kwargs={"ns5_dtype": "fp16", "impl": "loop"})
            runs.append({"task": task, "arm": arm, "steps": r["steps"], "diverged": r["diverged"],
                         "events": r["events"], "final_val_loss": r["final"]["val_loss"],
                         "trace": {k: [x[k] for x in log] for k in (log[0] if log else {})}})
    return {"config": {"tasks": list(tasks), "arms": list(arms), "steps": steps, "lr": lr, "seed": seed},
            "runs": runs}


def trace_rows(run: dict[str, Any]) -> list[dict[str, Any]]:
    """A run's trace, one dict per NS5 input (the JSON holds it as columns: a seventh of the size)."""
    cols = run["trace"]
    return [dict(zip(cols, values)) for values in zip(*cols.values())]


def summary(run: dict[str, Any]) -> dict[str, Any]:
    """One run's trace in numbers: how many NS5 inputs, the foil's stages, the input scales, the flush."""
    t = trace_rows(run)
    stages: dict[str, int] = {}
    for x in t:
        stages[x["naive_stage"]] = stages.get(x["naive_stage"], 0) + 1
    return {"inputs": len(t), "naive_broke": sum(x["naive_stage"] != "ok" for x in t), "stages": stages,
            "amax_max": max(x["amax"] for x in t), "fro_median": statistics.median(x["fro"] for x in t),
            "fro_max": max(x["fro"] for x in t), "fro_min": min(x["fro"] for x in t),
            "naive_flushed_max": max(x["naive_flushed"] for x in t),
            "naive_err_max": max((x["naive_rel_err"] for x in t if x["naive_stage"] == "ok"), default=float("nan")),
            "ours_flushed_max": max(x["ours_flushed"] for x in t),
            "ours_nonfinite": sum(not x["ours_finite"] for x in t),
            "ours_err_median": statistics.median(x["ours_rel_err"] for x in t),
            "ours_err_max": max(x["ours_rel_err"] for x in t),
            # what a flush costs: the worst error of the inputs with more than 1% of entries flushed, and of
            # the rest (None where there are none)
            "ours_err_max_flushed": max((x["ours_rel_err"] for x in t if x["ours_flushed"] > 0.01), default=None),
            "ours_err_max_unflushed": max((x["ours_rel_err"] for x in t if x["ours_flushed"] <= 0.01),
                                          default=None)}


def render_q2_train(data: dict[str, Any]) -> str:
    rows = []
    for r in data["runs"]:
        s = summary(r)
        stages = ", ".join(f"{k} {v}" for k, v in sorted(s["stages"].items()))
        rows.append([r["task"], r["arm"], s["inputs"], f"{s['fro_min']:.1e} / {s['fro_median']:.1e} / "
                     f"{s['fro_max']:.1e}", f"{s['amax_max']:.1e}", stages,
                     f"{100 * s['naive_flushed_max']:.1f}%", f"{s['naive_err_max']:.1e}",
                     f"{100 * s['ours_flushed_max']:.1f}%", s["ours_nonfinite"],
                     f"{s['ours_err_median']:.1e} / {s['ours_err_max']:.1e}", r["events"],
                     f"{r['final_val_loss']:.4g}"])
    c = data["config"]
    return (f"Training trace: {c['steps']} steps per run, lr {c['lr']}, seed {c['seed']}, `ns5_dtype=\"fp16\"`, "
            "`impl=\"loop\"`; every NS5 input of the run (one row per matrix and step).\n\n"
            + md_table(["task", "optimizer", "NS5 inputs", "‖M‖_F min / median / max", "max |M|",
                        "naive fp16: stage (count)", "naive: entries flushed to 0 (worst input)",
                        "naive: worst rel err vs fp32 (when ok)", "ours: entries flushed to 0 (worst input)",
                        "ours: non-finite outputs", "ours: rel err vs fp32, median / worst",
                        "resolution events", "final val loss"], rows))


def run_q2_with_training(train: dict[str, Any] | None = None, **numerics) -> dict[str, Any]:
    """Q2's whole run: the synthetic map (``questions_numerics.run_q2(**numerics)``) and, under ``"train"``,
    the training trace (``run_q2_train(**train)``)."""
    return {**run_q2(**numerics), "train": run_q2_train(**(train or {}))}


def render_q2_all(data: dict[str, Any]) -> str:
    return render_q2(data) + (f"\n\n{render_q2_train(data['train'])}" if "train" in data else "")
