"""Helpers of the Triton kernel tests for launches: a kernel made to fail at launch (``break_kernel``), steps
with host synchronisation made an error (``steps_never_sync``), and the launches and torch ops of a step
counted under the interpreter (``count_launches``, ``step_launches``), and both paths held to their Triton
kernels (``force_triton_paths``). Moved from ``test_kernels_scalar_step.py`` and ``test_kernels_step_size.py``,
whose neighbours imported them from a test module."""
from __future__ import annotations

import contextlib

import torch
from optim_infos import no_host_sync


def force_triton_paths(monkeypatch) -> None:
    """impl="fused" on the Triton kernels, failing instead of falling back to impl="compiled", on the
    (SF-)AdamW path and the spectral one (each suite's own helper; imported here, not at the top, because
    those case modules import this one)."""
    from scalar_one_cases import _force_triton as force_scalar_triton
    from spectral_step_cases import _force_triton as force_spectral_triton

    force_scalar_triton(monkeypatch)
    force_spectral_triton(monkeypatch)


def break_kernel(monkeypatch, module, name: str) -> None:
    """Make ``module.name`` fail at launch as a compile error on another Triton version would, on the
    Triton backend, with this process's record of earlier failures cleared."""
    from nonans_optim.optimizers import _fused_triton

    class Broken:
        def __getitem__(self, grid):
            return self.warmup

        def warmup(self, *args, **kwargs):
            raise RuntimeError("simulated compile failure")

    monkeypatch.setenv("NONANS_FUSED_BACKEND", "triton")
    monkeypatch.setattr(_fused_triton, "_FAILED", [])
    monkeypatch.setattr(module, name, Broken())


def steps_never_sync(opt, params, steps: int = 3) -> None:
    """Step ``opt`` on fresh CUDA gradients with host synchronisation made an error."""
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        with no_host_sync():
            opt.step()


# ops that launch nothing on a GPU (allocation, views, metadata)
_NO_LAUNCH = ("aten.empty", "aten.new_empty", "aten.empty_strided", "aten.view", "aten._to_copy", "aten.detach",
              "aten.select", "aten.slice", "aten.alias", "aten.lift_fresh", "aten.unsqueeze", "aten.expand",
              "aten.as_strided", "aten.reshape", "aten._unsafe_view", "aten.t.", "profiler.")


@contextlib.contextmanager
def count_launches(monkeypatch):
    """(Triton launches by kernel name, torch ops issued outside them) while the block runs, under the
    interpreter — both Counters, cleared by the caller between the steps it compares. Ops the interpreter
    itself issues while it runs a kernel, and ops that launch nothing on a GPU, are not counted."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime import interpreter

    launches, inside = Counter(), []
    real = interpreter.InterpretedFunction.run

    def run(self, *args, **kwargs):
        launches[self.fn.__name__] += 1
        inside.append(1)
        try:
            return real(self, *args, **kwargs)
        finally:
            inside.pop()
    monkeypatch.setattr(interpreter.InterpretedFunction, "run", run)

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if not inside and not name.startswith(_NO_LAUNCH):
                self.ops[name] += 1
            return func(*args, **(kwargs or {}))

    with Ops() as mode:
        yield launches, mode.ops


def step_launches(monkeypatch, opt, params) -> dict:
    """{policy: (torch ops, Triton launches)} of one step of ``opt`` under "repair" and under "off": one
    optimizer whose policy is switched (its first steps, which build the state and the count block, are
    not counted)."""
    from collections import Counter

    seen = {}
    with count_launches(monkeypatch) as (launches, ops):
        for policy in ("repair", "off", "repair"):
            opt.resolution_policy = policy
            for q in params:
                q.grad = torch.randn_like(q)
            opt.step()
            launches.clear()
            ops.clear()
            opt.step()
            seen[policy] = (Counter(ops), Counter(launches))
    return seen
