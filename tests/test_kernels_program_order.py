"""The Triton kernels whose programs hand work to one another, with the programs run in other orders.

Two kernels let whichever program takes a launch's (or a tensor's) last ticket finish the work of the others:
the one-launch (SF-)AdamW "repair" step (``kernels/scalar_one.py``: the deferred blocks and the record) and the
folded statistics and decisions (``kernels/decisions.py``, the default). Under the
interpreter the programs ran by ascending id only, so the last ticket always went to the highest id — a
kernel that chose by id would have passed. Here each launch's programs also run reversed and shuffled
(``interpreter_patches.programs_in_order``); the results must equal the ascending runs' references.

Interpreter only (a normal run re-runs this file under ``TRITON_INTERPRET=1`` in a subprocess): on a GPU the
order is the hardware's, which the ``gpu`` copies in test_kernels_scalar_one.py and test_kernels_decisions.py
run.
"""
from __future__ import annotations

import os

import pytest
import torch
from interpreted import assert_interpreted_suite_passes

pytest.importorskip("triton")

import nonans_optim as no  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ORDERS = ["reversed", "shuffled"]

if INTERPRETED:
    from interpreter_patches import programs_in_order
    from decisions_cases import case_folded_decisions_equal_two_launches, case_folded_run_equals_two_launch_run
    from scalar_one_cases import case_one_launch_matches_loop

    pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

    @pytest.mark.parametrize("order", ORDERS)
    @pytest.mark.parametrize("policy, guard", [(1, True), (2, False)], ids=["repair-guard", "skip"])
    def test_folded_decisions_in_any_order(order, policy, guard, monkeypatch):
        programs_in_order(monkeypatch, order)
        case_folded_decisions_equal_two_launches("cpu", policy, guard, True)

    @pytest.mark.parametrize("order", ORDERS)
    def test_folded_run_in_any_order(order, monkeypatch):
        programs_in_order(monkeypatch, order)
        case_folded_run_equals_two_launch_run("cpu", no.SFNorMuon, "repair", {}, monkeypatch)

    @pytest.mark.parametrize("order", ORDERS)
    @pytest.mark.parametrize("programs", [None, 2], ids=["per-block", "looping"])
    def test_one_launch_step_in_any_order(order, programs, monkeypatch):
        programs_in_order(monkeypatch, order)
        case_one_launch_matches_loop("cpu", no.AdamW, monkeypatch, programs)

    def test_the_order_is_changed(monkeypatch):
        """The patch reaches the launch: a kernel storing its program id in a list of slots, in the order
        the programs run, shows the order asked for (else the tests above would test ascending order only)."""
        import triton
        import triton.language as tl

        @triton.jit
        def _ids(OUT, COUNT):
            slot = tl.atomic_add(COUNT, 1)
            tl.store(OUT + slot, tl.program_id(0))

        seen = {}
        for order in ("ascending", "reversed", "shuffled"):
            with monkeypatch.context() as m:
                programs_in_order(m, order)
                out, count = torch.zeros(6, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
                _ids[(6,)](out, count)
                seen[order] = out.tolist()
        assert seen["ascending"] == [0, 1, 2, 3, 4, 5] and seen["reversed"] == [5, 4, 3, 2, 1, 0]
        assert sorted(seen["shuffled"]) == list(range(6)) and seen["shuffled"] not in (seen["ascending"],
                                                                                      seen["reversed"])
else:
    def test_interpreter_suite():
        """Run the cases under TRITON_INTERPRET=1 in a fresh process (tests/interpreted.py)."""
        assert_interpreted_suite_passes(__file__, timeout=600)
