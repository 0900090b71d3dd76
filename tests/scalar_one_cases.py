"""The cases of ``test_kernels_scalar_one.py`` — the multi-tensor Triton (SF-)AdamW step wired into
``impl="fused"``, in three launches and in one, against ``impl="loop"`` — and their helpers (``_force_triton``,
``_shapes``), moved out of that file so that it keeps the two-faced wiring (the interpreter suite on the CPU, the
``gpu``-marked copies) and this one what each case checks; other kernel tests import the helpers from here. Each
``case_*`` that runs on both takes the device."""
from __future__ import annotations

import pytest
import torch

import nonans_optim as no
from optim_infos import (assert_params_and_state_close, assert_resolution_matches,
                         assert_skip_holds_as_the_loop_does, event_tuples)
from test_fused import _run  # (its fault sequence, on any device)
from triton_launches import break_kernel, count_launches, step_launches


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
