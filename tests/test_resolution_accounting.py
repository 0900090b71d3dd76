"""The bookkeeping of the resolution stage (``resolution.py``): the escalation schedule (back-off on repeated
events, growth back, steps under "off" counting as clean), the recent-event window, the event ring, the
summary counters and the count helpers (``storable_mask``, ``inspect``, ``tensor_counts``). Split from
tests/test_resolution.py, which keeps the contract under faults injected into the gradients.
"""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import nonans_optim as no
from optim_infos import make_model, train_steps


@settings(max_examples=200, deadline=None)
@given(bits=st.integers(0, 2 ** 32 - 1), dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
def test_storable_mask_is_finiteness_after_the_cast(bits, dtype):
    """The fp32 threshold compare equals isfinite(x.to(dtype)) for any fp32 bit pattern, and near the
    thresholds (the tie at the dtype's maximum plus half an ulp rounds to Inf)."""
    from nonans_optim.resolution import storable_mask
    x = torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32)
    edges = torch.tensor([65504.0, 65519.996, 65520.0, 3.3895e38, 3.39615e38, 3.3962e38])
    x = torch.cat([x, edges, -edges, edges.nextafter(torch.tensor(0.0)), edges.nextafter(torch.tensor(float("inf")))])
    assert storable_mask(x, dtype).tolist() == torch.isfinite(x.to(dtype)).tolist()


def test_escalation_backs_off_on_repeated_events_and_grows_back():
    model = make_model()
    opt = no.AdamW(model.named_parameters(), lr=1e-2)
    opt.zero_grad()
    res_scale = lambda: opt._global()["resolution"]["scale"]  # noqa: E731

    def bad(step, m):
        if step < 3:
            m.fc1.weight.grad[0, 0] = float("nan")
    train_steps(model, opt, 3, inject=bad)
    idx = [n for n, _ in model.named_parameters()].index("fc1.weight")
    assert res_scale()[idx].item() == 0.25  # first event repaired at full step, two repeats halve twice
    assert opt.metrics()["resolution/escalations"] == 2.0
    assert [e.escalated for e in opt.events] == [False, True, True]
    train_steps(model, opt, 2 * 100, seed=5)
    assert res_scale()[idx].item() == 1.0


def _record(res, step: int, *bad: tuple[int, str, int], native: bool = False) -> None:
    """One step of ``res.record_step`` with ``nan`` NaN entries on each (parameter, stage, nan) of ``bad``
    (none: a clean step); ``native``: the C record (nonans_optim/native) instead of the torch one."""
    from nonans_optim.resolution import STAGE_INDEX, STAGES
    c = torch.zeros(res.num_params, len(STAGES), 2, dtype=torch.int64)
    for param, stage, nan in bad:
        c[param, STAGE_INDEX[stage], 0] = nan
    res.record_step(step, c, native=native)


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_record_step_escalation_arithmetic(native):
    """The GradScaler-like schedule of ``Resolution.record_step``, exactly, on one parameter (repeat window 2,
    growth interval 3, floor 1/8): repeats halve the scale down to the floor — a repeat at the floor is no
    escalation —, an event after ``repeat_window`` clean steps is no repeat and grows nothing (even on the
    step the growth interval is reached), and every third clean step doubles the scale back, capped at 1.
    (The native record comparison in test_fused.py draws too few such sequences to pin this down; the C
    record runs the same sequence.)"""
    from nonans_optim import native as lib
    from nonans_optim.resolution import Resolution
    if native and lib.library() is None:
        pytest.skip(f"no native library here: {lib.failure()}")
    res = Resolution("repair", 2, torch.device("cpu"), growth_interval=3, repeat_window=2, min_scale=0.125,
                     numels=[4, 4])
    bad = {1, 2, 3, 4, 5, 8}  # parameter 0's event steps; parameter 1 stays clean
    scales = []
    for step in range(1, 21):
        _record(res, step, *([(0, "grad", 1)] if step in bad else []), native=native)
        scales.append(res.tensors["scale"].tolist())
    assert [s[0] for s in scales] == [1.0, 0.5, 0.25, 0.125, 0.125,  # first event, three halvings, the floor
                                      0.125, 0.125, 0.125,  # step 8: streak 2 = window, not a repeat, no growth
                                      0.125, 0.125, 0.25, 0.25, 0.25, 0.5, 0.5, 0.5, 1.0, 1.0, 1.0, 1.0]
    assert all(s[1] == 1.0 for s in scales)
    assert res.tensors["escalations"].tolist() == [3, 0]
    assert res.tensors["clean_streak"].tolist() == [12, 20]
    evs = res.materialise(["a", "b"], [4, 4])
    assert [(e.step, e.escalated) for e in evs] == [(1, False), (2, True), (3, True), (4, True), (5, False),
                                                     (8, False)]


def test_recent_is_an_own_stage_event_within_the_window():
    """``Resolution.recent()`` (the hold rule's "recent event"): true while fewer than ``repeat_window`` clean
    steps followed a parameter's last event on one of its own stages, false from the ``repeat_window``-th on;
    a "loss" event (row 0 of the count block: nobody's) never makes parameter 0 recent."""
    from nonans_optim.resolution import Resolution
    res = Resolution("repair", 3, torch.device("cpu"), repeat_window=2, numels=[4, 4, 4])
    assert res.recent().tolist() == [False, False, False]
    _record(res, 1, (0, "loss", 1))  # parameter 0's row, the loss stage
    seen = [res.recent().tolist()]
    _record(res, 2, (1, "moment", 1))
    seen.append(res.recent().tolist())
    for step in (3, 4):
        _record(res, step)
        seen.append(res.recent().tolist())
    assert seen == [[False, False, False], [False, True, False], [False, True, False], [False, False, False]]


@pytest.mark.parametrize("impl", ["loop", "fused"])
def test_steps_under_off_count_as_clean_steps(impl):
    """Steps run under "off" record nothing, but they are steps: an event 150 steps after the last one is
    not a repeat, and the backed-off scale has grown back as over 150 clean "repair" steps. Until 2026-11-26
    the window did not advance under "off": the event was held and escalated (an audit)."""
    runs = []
    for middle in ("repair", "off"):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(4, 4))
        opt = no.AdamW([w], lr=1e-2, impl=impl)
        gen = torch.Generator().manual_seed(1)
        for step in range(1, 160):
            opt.resolution_policy = middle if 4 <= step <= 153 else "repair"
            w.grad = torch.randn(4, 4, generator=gen)
            if step in (1, 2, 154):  # a repeat (held, scale 0.5), then one 152 steps later
                w.grad.fill_(float("nan"))
            before = w.detach().clone()
            opt.step()
            if step == 154:
                assert not torch.equal(w, before), middle  # a continuation step, not held
        res = opt._global()["resolution"]
        runs.append((w, res, [(e.step, e.action, e.escalated) for e in opt.events]))
    (wa, ra, ea), (wb, rb, eb) = runs
    assert ea == eb == [(1, "repaired", False), (2, "held", True), (154, "repaired", False)]
    assert ra["scale"].item() == 1.0 and ra["scale"].item() == rb["scale"].item()  # grown back at step 102
    assert torch.equal(ra["clean_streak"], rb["clean_streak"])
    loaded = no.AdamW([torch.nn.Parameter(wb.detach().clone())], impl=impl)
    loaded.load_state_dict(copy.deepcopy(opt.state_dict()))  # the last recorded step travels too
    assert loaded._global()["recorded_step"] == 159


def test_event_ring_keeps_the_oldest_event_until_a_clean_step_takes_its_slot():
    """The ring's free slot (``ring_ptr % K``) still holds the oldest event step while no clean step has
    overwritten it: with K slots, the last K event steps are reported until a clean step, then K - 1 (the
    SingularityEvent docstring's "64 only until the first clean step after it filled")."""
    from nonans_optim.resolution import Resolution
    res = Resolution("repair", 2, torch.device("cpu"), ring_size=3, numels=[4, 4])

    def steps():
        return [e.step for e in res.materialise(["a", "b"], [4, 4])]
    for step in (1, 2, 3):
        _record(res, step, (step % 2, "grad", 1))
    assert steps() == [1, 2, 3]  # the ring is full: all three
    _record(res, 4)  # clean: it writes the free slot, which held step 1
    assert steps() == [2, 3]
    _record(res, 5, (0, "grad", 2))  # a repeat of parameter 0's step-2 event: escalated
    assert steps() == [2, 3, 5] and res.materialise(["a", "b"], [4, 4])[-1] == no.SingularityEvent(
        step=5, param="a", stage="grad", nan_count=2, inf_count=0, numel=4, action="repaired", escalated=True)


def test_a_loss_event_is_never_labelled_held():
    """A "loss" event sits in row 0 of the count block but is nobody's: on a step where parameter 0 is held
    (no finite gradient entry twice within the window), the loss event is still "repaired", parameter 0's
    "held"."""
    from nonans_optim.resolution import Resolution
    res = Resolution("repair", 2, torch.device("cpu"), numels=[4, 4])
    _record(res, 1, (0, "grad", 4))  # the first whole-tensor event: a continuation step
    _record(res, 2, (0, "grad", 4), (0, "loss", 1))  # the repeat: held
    assert [(e.step, e.param, e.stage, e.action) for e in res.materialise(["a", "b"], [4, 4])] == [
        (1, "a", "grad", "repaired"), (2, "a", "grad", "held"), (2, None, "loss", "repaired")]


def test_summary_counts_every_stage_and_column():
    """``Resolution.summary()`` (what ``metrics()`` reports): per stage the event steps and the NaN and Inf
    entries, each from its own column, and ``events_total`` over every stage — "loss" and "spike" included."""
    from nonans_optim.resolution import STAGES, Resolution
    res = Resolution("repair", 2, torch.device("cpu"), numels=[4, 4])
    c = torch.zeros(2, len(STAGES), 2, dtype=torch.int64)
    c[0, 0] = torch.tensor([3, 1])  # grad: 3 NaN, 1 Inf
    c[1, 1, 1] = 2  # moment: 2 Inf
    c[0, 4, 0] = 1  # loss: NaN
    c[1, 5, 1] = 1  # spike: one capped gradient
    res.record_step(1, c)
    _record(res, 2)  # a clean step adds nothing
    m = res.summary()
    assert m["resolution/events_total"] == 4.0
    assert [(m[f"resolution/events_{s}"], m[f"resolution/nan_{s}"], m[f"resolution/inf_{s}"]) for s in STAGES] == [
        (1.0, 3.0, 1.0), (1.0, 0.0, 2.0), (0.0, 0.0, 0.0), (0.0, 0.0, 0.0), (1.0, 1.0, 0.0), (1.0, 0.0, 1.0)]


def test_inspect_and_tensor_counts_are_nan_then_inf():
    """``inspect`` (entry counts, as the Polyak loss is counted) and ``tensor_counts`` (a total's flags: a
    direction's tensor-level event): [NaN, Inf] in that order, -Inf counted as Inf."""
    from nonans_optim.resolution import inspect, tensor_counts
    x = torch.tensor([float("nan"), float("inf"), 2.0, float("-inf"), float("-inf")])
    ok, counts = inspect(x)
    assert ok.tolist() == [False, False, True, False, False] and counts.tolist() == [1, 3]
    assert tensor_counts(x).tolist() == [[1, 0], [0, 1], [0, 0], [0, 1], [0, 1]]
    assert tensor_counts(x[0]).tolist() == [1, 0]
