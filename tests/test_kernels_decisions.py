"""The Triton path's statistics and decide launches as one (``kernels/decisions.py``, the default;
``NONANS_TRITON_FOLD_DECIDE=0`` runs two): the same decisions as the two launches, the tickets left zero, one launch
fewer per group, and whole runs with faults equal to the two-launch runs.

Same two-faced layout as ``test_kernels_scalar_step.py``: a normal run re-runs this file under
``TRITON_INTERPRET=1`` in a subprocess (CPU tensors, ``NONANS_FUSED_BACKEND=triton``), and the ``gpu``-marked
copies run on CUDA. The interpreter runs programs one after another by ascending id, so here the last ticket
is always the last block's; tests/test_kernels_program_order.py runs these cases with the programs reversed and
shuffled, and on a GPU any block may take it, which is what the ``gpu`` copies are for. On a GPU the float64
norm's last bit may differ between the two forms (the reduction's lanes follow the launch's warps,
decisions.py): there the guard's scale and EMA are compared to 1e-6, everything else exactly.
"""
from __future__ import annotations

import os

import pytest
import torch
from interpreted import GPU_COPY, assert_interpreted_suite_passes, marker

pytest.importorskip("triton")

from decisions_cases import (RUN_IDS, RUNS, case_folded_decisions_equal_two_launches,  # noqa: E402
                             case_folded_run_equals_two_launch_run, case_one_launch_fewer_per_group,
                             case_tickets_refused_where_they_cannot_serve)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()


def _define(device, marks=()):
    mark = marker(marks)

    @mark
    @pytest.mark.parametrize("rule", [False, True], ids=["flags", "counters"])
    @pytest.mark.parametrize("guard", [False, True], ids=["noguard", "guard"])
    @pytest.mark.parametrize("policy", [1, 2], ids=["repair", "skip"])
    def test_folded_decisions_equal_two_launches(policy, guard, rule):
        case_folded_decisions_equal_two_launches(device, policy, guard, rule)

    @mark
    def test_tickets_refused_where_they_cannot_serve():
        case_tickets_refused_where_they_cannot_serve(device)

    @mark
    @pytest.mark.parametrize("cls, policy, kw", RUNS, ids=RUN_IDS)
    def test_folded_run_equals_two_launch_run(cls, policy, kw, monkeypatch):
        case_folded_run_equals_two_launch_run(device, cls, policy, kw, monkeypatch)

    return (test_folded_decisions_equal_two_launches, test_tickets_refused_where_they_cannot_serve,
            test_folded_run_equals_two_launch_run)


if INTERPRETED:
    pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
    (test_folded_decisions_equal_two_launches, test_tickets_refused_where_they_cannot_serve,
     test_folded_run_equals_two_launch_run) = _define("cpu")

    def test_one_launch_fewer_per_group(monkeypatch):
        """Interpreter-only: the launches are counted at the interpreter's run (count_launches), which a CUDA
        launch never enters — the gpu copy counted nothing on the H200 (2026-11-27)."""
        case_one_launch_fewer_per_group("cpu", monkeypatch)
else:
    def test_interpreter_suite():
        """Run the cases under TRITON_INTERPRET=1 in a fresh process (tests/interpreted.py)."""
        assert_interpreted_suite_passes(__file__, timeout=600)

    (test_gpu_folded_decisions_equal_two_launches, test_gpu_tickets_refused_where_they_cannot_serve,
     test_gpu_folded_run_equals_two_launch_run) = _define("cuda", marks=GPU_COPY)
