"""A non-finite step size on the Triton paths (``impl="fused"`` on CUDA): contained as the loop contains it.

A tensor ``lr`` that a scheduler fills with NaN or +Inf makes every new parameter non-finite from finite
inputs. The native (SF-)AdamW loop built for AVX2 stored those NaN parameters until 2026-11-27 (its early
test bounded the inputs only: native/scalar_entry.h, ``finite_hyper_``); tests/test_resolution_inside.py
holds every CPU implementation to the loop on that run. This file does the same for the Triton kernels —
the (SF-)AdamW step in one launch (the default "repair" step) and in three, and the spectral step — so the
GPU path is held to it too, not only checked by hand under the interpreter.

Same two-faced layout as ``test_kernels_scalar_step.py``: a normal run re-runs this file under
``TRITON_INTERPRET=1`` in a subprocess (CPU tensors, ``NONANS_FUSED_BACKEND=triton``), and the ``gpu``-marked
copies run on CUDA.
"""
from __future__ import annotations

import os

import pytest
import torch
from interpreted import GPU_COPY, assert_interpreted_suite_passes, marker

pytest.importorskip("triton")

import nonans_optim as no  # noqa: E402
from optim_infos import assert_params_and_state_close, assert_resolution_matches  # noqa: E402
from triton_launches import force_triton_paths  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
SHAPES = [(24, 40), (40,), (16, 24)]  # matrices (the spectral path) and a vector (the AdamW path)
BAD_STEPS = (2, 3)  # the lr is ``value`` on these steps of five, finite again on the last


def _run(cls, impl: str, policy: str, value: float, device: str):
    """Five steps of ``cls`` with a tensor lr, ``value`` on BAD_STEPS; the parameters before the last step."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(0.1 * torch.randn(s).to(device)) for s in SHAPES]
    lr = torch.tensor(1e-2, device=device)
    opt = cls(ps, lr=lr, impl=impl, resolution=policy)
    gen = torch.Generator().manual_seed(1)
    before = None
    for t in range(5):
        lr.fill_(value if t in BAD_STEPS else 1e-2)
        if t == 4:
            before = [p.detach().clone() for p in ps]
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen).to(device)
        opt.step()
    return ps, opt, before


def case_nonfinite_step_size(device, cls, one, policy, value, monkeypatch):
    """Every parameter kept on both bad steps (one "update" event each, nothing else counted), the state
    finite, the run equal to impl="loop" (parameters, state, counters, events), stepping again after."""
    force_triton_paths(monkeypatch)
    monkeypatch.setenv("NONANS_TRITON_ONE_LAUNCH", one)
    ref, ref_opt, _ = _run(cls, "loop", policy, value, device)
    got, got_opt, before = _run(cls, "fused", policy, value, device)
    assert all(torch.isfinite(p).all() for p in got)
    assert all(torch.isfinite(t).all() for p in got for t in got_opt.state[p].values()
               if isinstance(t, torch.Tensor) and t.is_floating_point())
    assert all(not torch.equal(p, b) for p, b in zip(got, before))  # the finite lr steps every parameter
    metrics = got_opt.metrics()
    assert metrics["resolution/events_update"] == len(BAD_STEPS) * len(SHAPES)
    assert metrics["resolution/events_total"] == metrics["resolution/events_update"]
    assert_params_and_state_close(ref, ref_opt, got, got_opt)
    assert_resolution_matches(ref_opt, got_opt)


# (optimizer, NONANS_TRITON_ONE_LAUNCH, policy, value): the AdamW family's default "repair" step in one launch
# and in three, "skip" (always three); the spectral optimizers (their guard on: the statistics launch too)
CASES = [(no.AdamW, "1", "repair", float("nan")), (no.AdamW, "1", "repair", float("inf")),
         (no.AdamW, "0", "repair", float("nan")), (no.AdamW, "1", "skip", float("inf")),
         (no.SFAdamW, "1", "repair", float("nan")), (no.SFAdamW, "0", "repair", float("inf")),
         (no.SFAdamW, "1", "skip", float("nan")),
         (no.SFNorMuon, "1", "repair", float("nan")), (no.SFNorMuon, "1", "skip", float("inf")),
         (no.Muon, "1", "repair", float("inf"))]
IDS = [f"{c.__name__}-{'one' if one == '1' else 'three'}-{p}-{v}" for c, one, p, v in CASES]


def _define(device, marks=()):
    mark = marker(marks)

    @mark
    @pytest.mark.parametrize("cls, one, policy, value", CASES, ids=IDS)
    def test_nonfinite_step_size(cls, one, policy, value, monkeypatch):
        case_nonfinite_step_size(device, cls, one, policy, value, monkeypatch)

    return test_nonfinite_step_size


if INTERPRETED:
    pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
    test_nonfinite_step_size = _define("cpu")
else:
    def test_interpreter_suite():
        """Run the cases under TRITON_INTERPRET=1 in a fresh process (tests/interpreted.py)."""
        assert_interpreted_suite_passes(__file__, timeout=600)

    test_gpu_nonfinite_step_size = _define("cuda", marks=GPU_COPY)
