"""An fp16 NS5 (``ns5_dtype="fp16"``) on the Triton spectral step (``impl="fused"`` on CUDA): the kernels
write X in fp32, NS5 iterates on it cast to fp16 (ns5's own order: normalise in fp32, then cast) and its
output is widened for the direction side — as the CPU's native loops do (tests/test_fused_spectral.py::
test_fp16_ns5_runs_the_native_loops_and_follows_the_loop). Until 2026-11-27 such a group ran
``impl="compiled"`` (or, under "auto", foreach: thousands of small launches on a GPU).

Against ``impl="loop"``: events, counts and escalations equal; values within 1e-2 of each tensor's scale,
fp16's rounding rather than fp32's (the loop normalises with another rounding at fp32's last bit, which moves
a few entries of X by an fp16 ulp, and five fp16 iterations spread it). Same two-faced layout as
``test_kernels_scalar_step.py``: the interpreter in CI, the ``gpu``-marked copies on CUDA.
"""
from __future__ import annotations

import os

import pytest
import torch
from interpreted import GPU_COPY, assert_interpreted_suite_passes, marker

pytest.importorskip("triton")

import nonans_optim as no  # noqa: E402
from optim_infos import assert_params_and_state_near, assert_resolution_matches  # noqa: E402
from spectral_step_cases import _force_triton, _run_wide  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
CASES = [(no.SFNorMuon, "repair", 10.0), (no.Muon, "skip", None), (no.FullFusion, "repair", 10.0)]
IDS = [f"{c.__name__}-{p}" for c, p, _ in CASES]


def case_fp16_ns5_follows_the_loop(device, cls, policy, factor, monkeypatch):
    from nonans_optim.optimizers import _fused_triton

    _force_triton(monkeypatch)
    hot = set()
    iterate = _fused_triton.iterate
    monkeypatch.setattr(_fused_triton, "iterate", lambda X, *a, **k: hot.add(X.dtype) or iterate(X, *a, **k))
    kw = dict(device=device, ns5_dtype="fp16", spike_factor=factor, cls=cls)
    ref, ref_opt = _run_wide("loop", policy, **kw)
    got, got_opt = _run_wide("fused", policy, **kw)
    assert hot == {torch.float16}  # the fused step ran, and NS5 in fp16
    assert all(torch.isfinite(p).all() for p in got)
    assert_params_and_state_near(ref, ref_opt, got, got_opt, rel=1e-2)
    assert_resolution_matches(ref_opt, got_opt, ema_rtol=1e-6)


def _define(device, marks=()):
    mark = marker(marks)

    @mark
    @pytest.mark.parametrize("cls, policy, factor", CASES, ids=IDS)
    def test_fp16_ns5_follows_the_loop(cls, policy, factor, monkeypatch):
        case_fp16_ns5_follows_the_loop(device, cls, policy, factor, monkeypatch)

    return test_fp16_ns5_follows_the_loop


if INTERPRETED:
    pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
    test_fp16_ns5_follows_the_loop = _define("cpu")
else:
    def test_interpreter_suite():
        """Run the cases under TRITON_INTERPRET=1 in a fresh process (tests/interpreted.py)."""
        assert_interpreted_suite_passes(__file__, timeout=600)

    test_gpu_fp16_ns5_follows_the_loop = _define("cuda", marks=GPU_COPY)
