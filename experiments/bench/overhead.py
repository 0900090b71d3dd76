"""Overhead of the resolution stage on clean steps: ``resolution="repair"`` vs ``"off"``.

Same model, same clean gradient, two optimizers built from identical copies; their ``step()`` calls are
timed alternately (so machine noise hits both alike) and the ratio of medians is reported. Only a ratio is
meaningful on a shared CPU.
"""
from __future__ import annotations

import copy
import statistics
import time

import torch

from .arms import make_optimizer
from .spec import Workload

__all__ = ["step_overhead"]


def step_overhead(workload: Workload, *, size: str = "default", seed: int = 0, reps: int = 15) -> dict:
    """{"repair_ms", "off_ms", "ratio", "reps"} for the nonans optimizer of ``workload`` on clean steps."""
    torch.manual_seed(seed)
    task = workload.build(size=size, seed=seed, clean=True)
    task.loss_fn(task.model, 0).backward()
    runs = {}
    for arm in ("nonans", "nonans_off"):
        model = copy.deepcopy(task.model)
        t = copy.copy(task)
        t.model = model
        for p, q in zip(model.parameters(), task.model.parameters()):
            p.grad = None if q.grad is None else q.grad.clone()
        runs[arm] = make_optimizer(arm, t)
    times = {arm: [] for arm in runs}
    for i in range(reps + 2):
        for arm, opt in runs.items():
            t0 = time.perf_counter()
            opt.step()
            if i >= 2:  # first two steps initialise state
                times[arm].append(time.perf_counter() - t0)
    repair, off = statistics.median(times["nonans"]), statistics.median(times["nonans_off"])
    return dict(repair_ms=repair * 1e3, off_ms=off * 1e3, ratio=repair / off, reps=reps)
