"""The multi-tensor Triton (SF-)AdamW step wired into ``impl="fused"``, in three launches
(``kernels/scalar_step.py``) and in one (``kernels/scalar_one.py``, the default "repair" step): against
``impl="loop"``, its fallbacks, its launch counts. Split from ``test_kernels_scalar_step.py`` (the kernels
against their oracle); the launch helpers both use are in ``triton_launches.py``.

Same two-faced layout as ``test_kernels_scalar_step.py``: a normal run re-runs this file under
``TRITON_INTERPRET=1`` in a subprocess (on the CPU, with ``NONANS_FUSED_BACKEND=triton`` so the optimizer
takes this path there), and runs the ``gpu``-marked copies on CUDA, where "auto" already picks Triton.

Pinned down:
* the optimizer: AdamW/SFAdamW ``impl="fused"`` on this path vs ``impl="loop"`` over the fault sequence of
  ``test_fused.py`` (parameters, state, the Resolution tensors, the events), and a clean "repair" step
  bit-identical to "off" — with a fallback to ``impl="compiled"`` made to fail the test;
* a launch that fails (a compile error) leaves nothing half-done and falls back to ``impl="compiled"``;
* ``NONANS_TRITON_ONE_LAUNCH=1`` (``kernels/scalar_one.py``): the default "repair" step in one launch, against
  ``impl="loop"`` and bit for bit against the three launches, on faults that take each of its branches (held,
  deferred and not held), its launch and op counts equal to "off"'s, its failure path;
* under "repair" without the guard (no statistics launch) the decide kernel reads only the tensors that
  can be held, with the flags of the full statistics;
* what "repair" asks of the host beyond "off", counted under the interpreter: no torch op, and the decide
  and record launches (the statistics launch too with the spike guard) when the step takes three launches;
* the switches: ``NONANS_FUSED_BACKEND``, ``NONANS_TRITON_ONE_LAUNCH``; Triton forced where it cannot run
  (CPU tensors, no interpreter) runs ``impl="compiled"``;
* GPU only: no host synchronisation in the step, in three launches and in one
  (``torch.cuda.set_sync_debug_mode("error")``), and ``impl="auto"`` on CUDA is ``impl="fused"``, bit for bit.

The cases themselves (and ``_force_triton``, ``_shapes``) are in ``scalar_one_cases.py``; this file wires them to
the CPU interpreter and to CUDA.
"""
from __future__ import annotations

import os

import pytest
import torch
from interpreted import GPU_COPY, assert_interpreted_suite_passes, marker

pytest.importorskip("triton")

import nonans_optim as no  # noqa: E402
from scalar_one_cases import (_force_triton, case_clean_repair_is_off, case_launch_failure_falls_back,  # noqa: E402
                              case_lazy_decisions_read_only_what_can_be_held,
                              case_one_launch_failure_falls_back, case_one_launch_is_one_launch,
                              case_one_launch_matches_loop, case_optimizer_matches_loop,
                              case_repair_adds_only_the_resolution_launches,
                              case_skip_holds_as_the_loop_does)
from test_fused import _run  # noqa: E402  (its fault sequence, on any device)
from triton_launches import steps_never_sync  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
ADAMW_FAMILY = pytest.mark.parametrize("cls", [no.AdamW, no.SFAdamW], ids=["AdamW", "SFAdamW"])


def _define(device, marks=()):
    mark = marker(marks)

    @mark
    def test_lazy_decisions_read_only_what_can_be_held():
        case_lazy_decisions_read_only_what_can_be_held(device)

    @mark
    @pytest.mark.parametrize("policy", ["repair", "skip", "off"])
    @ADAMW_FAMILY
    def test_optimizer_matches_loop(cls, policy, monkeypatch):
        case_optimizer_matches_loop(device, cls, policy, monkeypatch)

    @mark
    @ADAMW_FAMILY
    def test_clean_repair_is_off(cls, monkeypatch):
        case_clean_repair_is_off(device, cls, monkeypatch)

    @mark
    def test_launch_failure_falls_back(monkeypatch):
        case_launch_failure_falls_back(device, monkeypatch)

    @mark
    @ADAMW_FAMILY
    def test_skip_holds_as_the_loop_does(cls, monkeypatch):
        case_skip_holds_as_the_loop_does(device, cls, monkeypatch)

    @mark
    @pytest.mark.parametrize("programs", [None, 2], ids=["per-block", "looping"])
    @ADAMW_FAMILY
    def test_one_launch_matches_loop(cls, programs, monkeypatch):
        case_one_launch_matches_loop(device, cls, monkeypatch, programs)

    @mark
    def test_one_launch_failure_falls_back(monkeypatch):
        case_one_launch_failure_falls_back(device, monkeypatch)

    return (test_optimizer_matches_loop, test_clean_repair_is_off, test_launch_failure_falls_back,
            test_skip_holds_as_the_loop_does, test_lazy_decisions_read_only_what_can_be_held,
            test_one_launch_matches_loop, test_one_launch_failure_falls_back)


if INTERPRETED:
    pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

    def test_repair_adds_only_the_resolution_launches(monkeypatch):
        case_repair_adds_only_the_resolution_launches(monkeypatch)

    def test_one_launch_is_one_launch(monkeypatch):
        case_one_launch_is_one_launch(monkeypatch)

    (test_optimizer_matches_loop, test_clean_repair_is_off, test_launch_failure_falls_back,
     test_skip_holds_as_the_loop_does, test_lazy_decisions_read_only_what_can_be_held, test_one_launch_matches_loop,
     test_one_launch_failure_falls_back) = _define("cpu")
else:
    @pytest.mark.parametrize("shard", range(2))
    def test_interpreter_suite(shard):
        """Run the cases under TRITON_INTERPRET=1 in fresh processes (tests/interpreted.py), in two shards:
        these cases were most of the time of the suite they were split from (test_kernels_scalar_step.py:
        57 s of the two files' 84 s on a 2-core machine after the split), so CI's two workers still share them."""
        assert_interpreted_suite_passes(__file__, timeout=600, shard=(shard, 2))

    def test_one_launch_switch(monkeypatch):
        """``NONANS_TRITON_ONE_LAUNCH``: on unless "0"; any other value than "0"/"1" is refused by name."""
        from nonans_optim.optimizers._fused_triton import one_launch

        monkeypatch.delenv("NONANS_TRITON_ONE_LAUNCH", raising=False)
        assert one_launch()
        monkeypatch.setenv("NONANS_TRITON_ONE_LAUNCH", "0")
        assert not one_launch()
        monkeypatch.setenv("NONANS_TRITON_ONE_LAUNCH", "1")
        assert one_launch()
        monkeypatch.setenv("NONANS_TRITON_ONE_LAUNCH", "yes")
        with pytest.raises(ValueError, match="NONANS_TRITON_ONE_LAUNCH must be one of '0', '1', got 'yes'"):
            one_launch()

    def test_backend_choice(monkeypatch):
        from nonans_optim.optimizers._fused_triton import backend

        monkeypatch.delenv("NONANS_FUSED_BACKEND", raising=False)
        assert backend(torch.device("cpu")) == "native" and backend(torch.device("cuda")) == "triton"
        monkeypatch.setenv("NONANS_FUSED_BACKEND", "native")
        assert backend(torch.device("cuda")) == "native"
        monkeypatch.setenv("NONANS_FUSED_BACKEND", "cuda")
        with pytest.raises(ValueError, match="NONANS_FUSED_BACKEND"):
            backend(torch.device("cpu"))

    def test_triton_on_cpu_without_interpreter_runs_compiled(monkeypatch):
        """Forcing Triton where it cannot run (CPU tensors, no interpreter) takes impl="compiled", with the
        same results — never a Triton launch on host pointers."""
        monkeypatch.setenv("NONANS_FUSED_BACKEND", "triton")
        got = _run(no.AdamW, "fused", "repair")[0]
        want = _run(no.AdamW, "compiled", "repair")[0]
        for p, q in zip(got, want):
            assert torch.equal(p, q)

    (test_gpu_optimizer_matches_loop, test_gpu_clean_repair_is_off, test_gpu_launch_failure_falls_back,
     test_gpu_skip_holds_as_the_loop_does, test_gpu_lazy_decisions_read_only_what_can_be_held,
     test_gpu_one_launch_matches_loop, test_gpu_one_launch_failure_falls_back) = _define("cuda", marks=GPU_COPY)

    @pytest.mark.gpu
    @pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
    @ADAMW_FAMILY
    def test_gpu_fused_step_never_syncs(cls):
        params = [torch.randn(300, 70, device="cuda", requires_grad=True), torch.randn(5, device="cuda")]
        steps_never_sync(cls(params, lr=1e-2, impl="fused"), params)

    @pytest.mark.gpu
    @pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
    @ADAMW_FAMILY
    def test_gpu_one_launch_step_never_syncs(cls, monkeypatch):
        monkeypatch.setenv("NONANS_TRITON_ONE_LAUNCH", "1")
        params = [torch.randn(300, 70, device="cuda", requires_grad=True), torch.randn(5, device="cuda")]
        steps_never_sync(cls(params, lr=1e-2, impl="fused"), params)

    @pytest.mark.gpu
    @pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
    @ADAMW_FAMILY
    def test_gpu_auto_runs_the_triton_kernels(cls, monkeypatch):
        """impl="auto" on CUDA is impl="fused" (the Triton kernels) — bit for bit, with no fallback taken —
        through the fault sequence of test_fused._run."""
        from nonans_optim.optimizers import _fused_triton

        _force_triton(monkeypatch)
        got, got_opt = _run(cls, "auto", "repair", device="cuda")
        want, want_opt = _run(cls, "fused", "repair", device="cuda")
        assert not _fused_triton._FAILED
        for p, q in zip(got, want):
            assert torch.equal(p, q)
        assert [e.action for e in got_opt.events] == [e.action for e in want_opt.events]
