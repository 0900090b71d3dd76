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
"""
from __future__ import annotations

import os

import pytest
import torch
from interpreted import GPU_COPY, assert_interpreted_suite_passes, marker

pytest.importorskip("triton")

import nonans_optim as no  # noqa: E402
from optim_infos import (assert_params_and_state_close, assert_resolution_matches,  # noqa: E402
                         assert_skip_holds_as_the_loop_does, event_tuples)
from test_fused import _run  # noqa: E402  (its fault sequence, on any device)
from triton_launches import break_kernel, count_launches, step_launches, steps_never_sync  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
ADAMW_FAMILY = pytest.mark.parametrize("cls", [no.AdamW, no.SFAdamW], ids=["AdamW", "SFAdamW"])


def case_lazy_decisions_read_only_what_can_be_held(device):
    """Under "repair" without the guard no statistics launch runs: the decide kernel reads a tensor only
    when it can be held (a recent event and a non-finite first entry), block by block until a finite entry.
    The hold flags are those of the full statistics; the "bad entry" bit is then "every entry bad" only."""
    import triton.language as tl

    from nonans_optim.kernels._elementwise import elementwise_block
    from nonans_optim.kernels._multi import _layout
    from nonans_optim.kernels.decisions import decisions

    block, _ = elementwise_block()
    nan = float("nan")
    gs = [torch.randn(n, device=device) for n in (300, 300, 40, 3 * block + 5, 3 * block + 5, 1)]
    gs[0][7] = nan  # first entry finite: never a candidate
    gs[1][0] = nan  # recent, bad first entry, finite after: scanned, not held
    gs[2][0] = nan  # bad first entry, no recent event: not a candidate
    gs[3].fill_(nan)  # recent and every entry bad, over several scan blocks: held
    gs[4].fill_(float("inf"))
    gs[4][-1] = 1.0  # recent, bad but for its very last entry: scanned to the end, not held
    gs[5].fill_(nan)  # a one-entry tensor, all bad, recent: held
    n = len(gs)
    recent = torch.tensor([True, True, False, True, True, True], device=device)
    sel = torch.arange(n, device=device)
    res = (torch.ones(n, device=device), recent, torch.zeros(n, device=device),
           torch.zeros(n, 6, 2, dtype=torch.int64, device=device))
    layout = _layout(tuple(g.numel() for g in gs), block, str(device))
    addr = torch.tensor([[0, g.data_ptr(), 0, 0] for g in gs], dtype=torch.int64, device=device)
    flags = {lazy: decisions(addr, layout, sel, res, 1, None, tl.float32, False, lazy=lazy)[1].tolist()
             for lazy in (False, True)}
    held = [1 if i in (3, 5) else 0 for i in range(n)]
    assert [f & 1 for f in flags[False]] == [f & 1 for f in flags[True]] == held
    assert [(f >> 3) & 1 for f in flags[False]] == [1] * n  # exact: every tensor has a bad entry
    assert [(f >> 3) & 1 for f in flags[True]] == held  # lazy: only the held ones are known to


def _force_triton(monkeypatch):
    """impl="fused" on the Triton kernels, failing instead of falling back to impl="compiled"."""
    from nonans_optim.optimizers import _fused

    def no_fallback(*args, **kwargs):
        raise AssertionError("the Triton path fell back to impl='compiled'")

    monkeypatch.setenv("NONANS_FUSED_BACKEND", "triton")
    monkeypatch.setattr(_fused, "compiled_scalar_update", no_fallback)


# test_fused.py's fault sequence on 40 x 70 entries under the interpreter (11 blocks of 256; its 300 x 70 took
# 82 blocks a step, and these cases most of the suite's 5.3 minutes on a 2-core CI machine) and on a GPU as it is
def _shapes(device) -> list[tuple[int, ...]]:
    from test_fused import SHAPES
    return [(40, 70), *SHAPES[1:]] if device == "cpu" else SHAPES


def case_optimizer_matches_loop(device, cls, policy, monkeypatch):
    _force_triton(monkeypatch)
    # with the guard the finite giants of the fault sequence are spikes (rescaled before they reach a
    # moment); without it they overflow the moments: both runs, so every stage is exercised
    for factor, stages in ((10.0, {"grad", "spike"}), (None, {"grad", "moment"})):
        ref, ref_opt = _run(cls, "loop", policy, device=device, spike_factor=factor, shapes=_shapes(device))
        got, got_opt = _run(cls, "fused", policy, device=device, spike_factor=factor, shapes=_shapes(device))
        assert_params_and_state_close(ref, ref_opt, got, got_opt, equal_nan=True)
        if policy == "off":
            return
        assert_resolution_matches(ref_opt, got_opt)
        assert stages <= {e[2] for e in event_tuples(got_opt)}


def case_skip_holds_as_the_loop_does(device, cls, monkeypatch):
    """"skip" holds a persistent whole-tensor loss as the loop does (the decision kernel held only under
    "repair")."""
    _force_triton(monkeypatch)
    assert_skip_holds_as_the_loop_does(cls, "fused", device=device)


def case_launch_failure_falls_back(device, monkeypatch):
    """A kernel that fails to launch (a compile error on another Triton version) must leave nothing
    half-done: one warning, the step counts put back, and the step — and every later one — runs
    impl="compiled", so the run matches impl="loop" as if Triton had never been tried."""
    from nonans_optim.kernels import scalar_step as k

    break_kernel(monkeypatch, k, "_update_kernel")  # after stats and decide have run
    ref, ref_opt = _run(no.AdamW, "loop", "repair", device=device)
    with pytest.warns(RuntimeWarning, match="simulated compile failure") as record:
        got, got_opt = _run(no.AdamW, "fused", "repair", device=device)
    assert sum("Triton kernels failed" in str(w.message) for w in record) == 1
    assert_params_and_state_close(ref, ref_opt, got, got_opt, equal_nan=True)
    assert_resolution_matches(ref_opt, got_opt)  # the failed launch did not move the guard's EMA or counts


def case_clean_repair_is_off(device, cls, monkeypatch):
    monkeypatch.setenv("NONANS_FUSED_BACKEND", "triton")
    runs = [_run(cls, "fused", policy, device=device, clean=True, shapes=_shapes(device))[0]
            for policy in ("repair", "off")]
    for p, q in zip(*runs):
        assert torch.equal(p, q)


def _one_sizes() -> tuple[int, ...]:
    """3, 1, 1, 1 and 2 blocks of the kernels' block (2048 on a GPU: 4100, 7, 300, 1, 2100; 256 under the
    interpreter, where the GPU's sizes took 9x the blocks and a minute of a 2-core CI machine)."""
    from nonans_optim.kernels._elementwise import elementwise_block
    b = elementwise_block()[0]
    return 2 * b + 4, 7, 300, 1, b + 52


def _one_launch_run(cls, impl: str, device: str, monkeypatch, *, one: bool):
    """Eight steps on which the faults take every branch of the one-launch step's decisions: sparse NaN/±Inf
    on step 2 (no tensor a candidate); the 3-block tensor lost whole on steps 3–5 (after step 2's event on
    it, a candidate whose every block is deferred, then held); the 2-block tensor's first block lost on steps
    4 and 5 (a candidate: its first block deferred, then updated by the last program — its second block has
    finite entries, so it is not held), then lost whole on steps 7 and 8 (held); the one-entry tensor lost on
    step 6 (no recent event: continued, not held)."""
    monkeypatch.setenv("NONANS_TRITON_ONE_LAUNCH", "1" if one else "0")
    torch.manual_seed(0)
    sizes = _one_sizes()
    params = [torch.nn.Parameter(torch.randn(n, device=device)) for n in sizes]
    opt = cls(params, lr=1e-2, weight_decay=0.1, impl=impl)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 9):
        grads = [torch.randn(n, generator=gen) for n in sizes]
        if step == 2:
            grads[0][3], grads[2][0], grads[4][-1] = float("nan"), float("inf"), float("-inf")
        if step in (3, 4, 5):
            grads[0].fill_(float("nan"))
        if step in (4, 5):
            grads[4][:sizes[4] - 50] = float("nan")  # the first block and two entries of the second
        if step == 6:
            grads[3].fill_(float("-inf"))
        if step in (7, 8):
            grads[4].fill_(float("nan"))
        for q, g in zip(params, grads):
            q.grad = g.to(device)
        opt.step()
    return params, opt


def case_one_launch_matches_loop(device, cls, monkeypatch, programs: int | None = None):
    """``NONANS_TRITON_ONE_LAUNCH=1`` (kernels/scalar_one.py): the default "repair" step in one launch matches
    impl="loop" — parameters, state, every Resolution tensor, the events — and the three-launch path bit for
    bit, and leaves its scratch zeroed for the next step. ``programs``: that many programs, each looping over
    blocks (``scalar_step_one_(programs=...)``; two for the eight or nine blocks here)."""
    from nonans_optim.kernels import scalar_one

    _force_triton(monkeypatch)
    calls = []
    real = scalar_one.scalar_step_one_

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs, **({} if programs is None else {"programs": programs}))
    monkeypatch.setattr(scalar_one, "scalar_step_one_", counted)
    ref, ref_opt = _one_launch_run(cls, "loop", device, monkeypatch, one=True)
    three, three_opt = _one_launch_run(cls, "fused", device, monkeypatch, one=False)
    assert not calls
    got, got_opt = _one_launch_run(cls, "fused", device, monkeypatch, one=True)
    assert len(calls) == 8  # every step took the one launch
    assert_params_and_state_close(ref, ref_opt, got, got_opt)
    assert_resolution_matches(ref_opt, got_opt)
    for p, q in zip(three, got):
        assert torch.equal(p, q)
        for key, val in three_opt.state[p].items():
            if isinstance(val, torch.Tensor):  # (the optimizer-level dict: its Resolution tensors below)
                assert torch.equal(val, got_opt.state[q][key]), key
    for key, val in three_opt._global()["resolution"].items():
        assert torch.equal(val, got_opt._global()["resolution"][key]), key
    actions = {(e.step, e.param): e.action for e in got_opt.events if e.stage == "grad"}
    assert {actions[k] for k in ((3, 0), (4, 0), (5, 0), (7, 4), (8, 4))} == {"held"}
    assert {actions[k] for k in ((2, 0), (4, 4), (5, 4), (6, 3))} == {"repaired"}
    (scratch,) = got_opt._resolution._scratch.values()  # one group: one scratch
    n = len(_one_sizes())  # its tickets, deferred count and flags are zero again; deferred ids were written
    assert int(scratch[:2 + n].abs().sum()) == 0 and int(scratch[2 + n:].abs().sum()) > 0


def case_one_launch_is_one_launch(monkeypatch):
    """By default (``NONANS_TRITON_ONE_LAUNCH`` unset, as "1") "repair" asks of the host exactly what "off"
    does: one launch, the same torch ops. Where the step needs more than the hold rule before writing (the
    spike guard, "skip") or its group is not the step's only producer of counts (two parameter groups), the
    three launches run; "0" runs them always; any other value is refused."""
    from collections import Counter

    _force_triton(monkeypatch)
    monkeypatch.delenv("NONANS_TRITON_ONE_LAUNCH", raising=False)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (300, 7, 64, 1)]
    for cls in (no.AdamW, no.SFAdamW):
        seen = step_launches(monkeypatch, cls(params, lr=1e-3, impl="fused"), params)
        (rep_ops, rep_launch), (off_ops, off_launch) = seen["repair"], seen["off"]
        assert rep_ops == off_ops, (rep_ops, off_ops)
        assert (rep_launch, off_launch) == (Counter(["_one_launch_kernel"]), Counter(["_update_kernel"]))
        for opt in (cls(params, lr=1e-3, impl="fused", spike_factor=10.0),
                    cls([{"params": params[:2]}, {"params": params[2:]}], lr=1e-3, impl="fused")):
            assert "_one_launch_kernel" not in step_launches(monkeypatch, opt, params)["repair"][1]
        opt = cls(params, lr=1e-3, impl="fused", resolution="skip")
        with count_launches(monkeypatch) as (launches, _):
            for _ in range(2):
                for q in params:
                    q.grad = torch.randn_like(q)
                opt.step()
        # "skip" needs the statistics: one launch with the decisions (kernels/decisions.py), per step
        assert launches["_stats_decide_kernel"] == 2 and "_one_launch_kernel" not in launches
    monkeypatch.setenv("NONANS_TRITON_ONE_LAUNCH", "0")
    opt = no.AdamW(params, lr=1e-3, impl="fused")
    assert step_launches(monkeypatch, opt, params)["repair"][1] == Counter(["_decide_kernel", "_update_kernel",
                                                                           "_record_kernel"])
    monkeypatch.setenv("NONANS_TRITON_ONE_LAUNCH", "yes")
    with pytest.raises(ValueError, match="NONANS_TRITON_ONE_LAUNCH must be one of '0', '1', got 'yes'"):
        opt.step()


def case_one_launch_failure_falls_back(device, monkeypatch):
    """A one-launch kernel that fails to launch falls back as the three-launch path does (one warning, the
    step counts put back, impl="compiled" from then on, the run equal to impl="loop"), and its scratch is
    dropped: a launch that stopped part way could have left tickets in it."""
    from nonans_optim.kernels import scalar_one

    break_kernel(monkeypatch, scalar_one, "_one_launch_kernel")
    monkeypatch.setenv("NONANS_TRITON_ONE_LAUNCH", "1")
    ref, ref_opt = _run(no.AdamW, "loop", "repair", device=device, spike_factor=None)
    with pytest.warns(RuntimeWarning, match="simulated compile failure") as record:
        got, got_opt = _run(no.AdamW, "fused", "repair", device=device, spike_factor=None)
    assert sum("Triton kernels failed" in str(w.message) for w in record) == 1
    assert_params_and_state_close(ref, ref_opt, got, got_opt, equal_nan=True)
    assert_resolution_matches(ref_opt, got_opt)
    assert not got_opt._resolution._scratch


def case_repair_adds_only_the_resolution_launches(monkeypatch):
    """What "repair" asks of the host beyond "off" on this path, counted (under the interpreter, the CPU's
    stand-in for a GPU's launches) and not one torch op — the hold rule's recent flags are read from the
    counters in the decide kernel and the count block is reused, zeroed by the record kernel (each was a
    host-issued launch per step: an H100 sync-audit counted 12 launches per AdamW repair step against 3
    under "off" before). Three launches (``NONANS_TRITON_ONE_LAUNCH=0``; the default runs one, see
    case_one_launch_is_one_launch), no spike guard: the decide and record kernels alone — no statistics
    launch, whose program per block ran on every clean step; with the guard, which needs the norm, the
    statistics and decisions as one launch (kernels/decisions.py; tests/test_kernels_decisions.py counts the
    two launches of ``NONANS_TRITON_FOLD_DECIDE=0``)."""
    from collections import Counter

    _force_triton(monkeypatch)
    monkeypatch.setenv("NONANS_TRITON_ONE_LAUNCH", "0")
    params = [torch.nn.Parameter(torch.randn(n)) for n in (300, 7, 64, 1)]
    for cls in (no.AdamW, no.SFAdamW):
        for factor, extra in ((None, ["_decide_kernel", "_record_kernel"]),
                              (10.0, ["_stats_decide_kernel", "_record_kernel"])):
            seen = step_launches(monkeypatch, cls(params, lr=1e-3, impl="fused", spike_factor=factor), params)
            (rep_ops, rep_launch), (off_ops, off_launch) = seen["repair"], seen["off"]
            assert rep_ops == off_ops, (rep_ops, off_ops)
            assert rep_launch - off_launch == Counter(extra), (cls.__name__, factor)


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
