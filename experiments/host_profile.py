"""Where the host time of one ``step()`` goes: total, Triton launches, and the Python functions that cost it.

Why: on a GPU the default (SF-)AdamW step is bound by the host, not the device (RESULTS.md, "overhead-gpu":
0.9 ms "off" and 1.3 ms "repair" for a step whose memory traffic takes tens of microseconds on an H100), so
the resolution step's overhead there is host time — extra launches and their Python glue. A launch count
(``sync-audit``) says how many; this says how long each costs the host and which lines of this library pay
the rest, so the next change can aim at the largest share instead of a guess.

Three measurements of a step function ``fn`` (:func:`host_profile`), each over ``steps`` calls:

* ``host_us``: the time to *issue* a step — the loop timed without a device sync inside it (the device
  catches up after the clock stops), the best of ``repeats``; on a CPU this is the whole step;
* ``triton``: per kernel name, launches per step and the mean host time of one launch — the wall time of
  Triton's ``run`` (argument binding, specialisation key, cache lookup, the driver call), wrapped while the
  steps run; a compile-ahead ``warmup`` call is not counted;
* ``functions``: cProfile's own time per step of the costliest functions (profiled: each call pays the
  profiler's overhead too, so read the shares, not the absolute microseconds).

The sync-audit experiment records this for every row under "repair" and "off" (``sync_audit.py``).
"""
from __future__ import annotations

import contextlib
import cProfile
import collections
import pstats
import time
from typing import Any, Callable, Iterator

import torch

__all__ = ["host_profile", "triton_launches", "function_costs", "triton_summary", "function_diff"]


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def triton_launches() -> Iterator[dict[str, list[float]]]:
    """{kernel name: [host seconds of each launch]} of the Triton launches made inside the block: Triton's
    ``run`` (compiled, and the interpreter's) wrapped for the duration. Empty when triton is not installed."""
    times: dict[str, list[float]] = collections.defaultdict(list)
    classes = []
    try:
        from triton.runtime.jit import JITFunction
        classes.append(JITFunction)
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    except ImportError:
        pass
    originals = {cls: cls.__dict__["run"] for cls in classes if "run" in cls.__dict__}

    def wrap(original: Callable) -> Callable:
        def run(self, *args, grid, warmup, **kwargs):
            if warmup:
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
            t0 = time.perf_counter()
            try:
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                times[getattr(getattr(self, "fn", None), "__name__", repr(self))].append(time.perf_counter() - t0)
        return run

    for cls, original in originals.items():
        cls.run = wrap(original)
    try:
        yield times
    finally:
        for cls, original in originals.items():
            cls.run = original


def function_costs(fn: Callable[[], None], steps: int, top: int) -> list[dict[str, Any]]:
    """The ``top`` functions by cProfile own time over ``steps`` calls of ``fn``: name (file:line function,
    the path from the package folder on), own and cumulative µs per step, calls per step."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    prof.disable()
    rows = []
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in pstats.Stats(prof).stats.items():
        short = path
        for anchor in ("nonans_optim/", "kernels/", "torch/", "triton/", "experiments/"):
            if anchor in path:
                short = anchor + path.rsplit(anchor, 1)[1]
                break
        rows.append({"function": f"{short}:{line} {name}", "own_us": tottime / steps * 1e6,
                     "cum_us": cumtime / steps * 1e6, "calls": ncalls / steps})
    rows.sort(key=lambda r: -r["own_us"])
    return rows[:top]


def host_profile(fn: Callable[[], None], *, steps: int = 20, repeats: int = 5, top: int = 12,
                 device: torch.device | None = None) -> dict[str, Any]:
    """Host time of ``fn`` (one optimizer step) on ``device``: see the module docstring. ``fn`` should have
    run a few times already (state created, kernels compiled)."""
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        best = min(best, time.perf_counter() - t0)
        _sync(device)
    with triton_launches() as times:
        for _ in range(steps):
            fn()
        _sync(device)
    triton = {name: {"launches": len(ts) / steps, "us": 1e6 * sum(ts) / len(ts)} for name, ts in sorted(times.items())}
    functions = function_costs(fn, steps, top)
    _sync(device)
    return {"host_us": best / steps * 1e6, "steps": steps, "triton": triton, "functions": functions}


def triton_summary(profile: dict[str, Any]) -> tuple[float, float]:
    """(Triton launches per step, their host µs per step) of one :func:`host_profile`."""
    t = profile.get("triton", {})
    return (sum(k["launches"] for k in t.values()), sum(k["launches"] * k["us"] for k in t.values()))


def function_diff(a: dict[str, Any], b: dict[str, Any], top: int = 8) -> list[tuple[str, float, float]]:
    """(function, own µs/step in ``a``, in ``b``) for the functions whose own time grew most from ``b`` to
    ``a`` (two :func:`host_profile` results, say "repair" and "off"); a function missing from one list
    counts 0 there (it was not among that profile's costliest)."""
    own_a = {r["function"]: r["own_us"] for r in a["functions"]}
    own_b = {r["function"]: r["own_us"] for r in b["functions"]}
    names = sorted(set(own_a) | set(own_b), key=lambda n: own_b.get(n, 0.0) - own_a.get(n, 0.0))
    return [(n, own_a.get(n, 0.0), own_b.get(n, 0.0)) for n in names[:top]
            if own_a.get(n, 0.0) > own_b.get(n, 0.0)]
