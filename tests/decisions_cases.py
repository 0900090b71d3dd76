"""The cases of ``test_kernels_decisions.py`` — the folded statistics-and-decide launch against the two
launches, on any device — and their helpers, moved out of that file so that it keeps the two-faced
wiring only and ``test_kernels_program_order.py`` imports them from a helper module, not a test module."""
from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch

import nonans_optim as no
from optim_infos import assert_params_and_state_close, assert_resolution_matches, same_tree
from scalar_one_cases import _shapes
from spectral_step_cases import _run_wide
from triton_launches import force_triton_paths


def _gradients(device, block: int) -> list[torch.Tensor]:
    """Six gradients across every decision: clean, a few bad entries, every entry bad (two), a spike, and
    one entry; several blocks each where it matters (the last ticket is then a later block's)."""
    torch.manual_seed(0)
    gs = [torch.randn(n, device=device) for n in (3 * block + 5, 300, 2 * block, 2 * block + 1, 40, 1)]
    gs[1][[0, 7, 299]] = torch.tensor([float("nan"), float("inf"), -float("inf")], device=device)
    gs[2].fill_(float("nan"))  # every entry bad, recent: held
    gs[3].fill_(float("inf"))  # every entry bad, no recent event: not held
    gs[4] *= 1e3  # a spike against the EMA below
    return gs


def _decide(device, policy: int, guard: bool, rule: bool, tickets):
    """decisions() on :func:`_gradients`: (DEC, flags), with a seeded norm EMA (read with ``guard``) and the
    hold rule's "recent" as flags or, with ``rule``, as a RecentRule over counters."""
    import triton.language as tl

    from nonans_optim.kernels._elementwise import elementwise_block
    from nonans_optim.kernels._multi import _layout
    from nonans_optim.kernels.decisions import decisions
    from nonans_optim.resolution import Resolution

    block, _ = elementwise_block()
    gs = _gradients(device, block)
    n = len(gs)
    recent = torch.tensor([False, True, True, False, True, True], device=device)
    if rule:  # the counters behind the same flags: an own-stage event within the window where recent
        r = Resolution("repair", n, torch.device(device), numels=[g.numel() for g in gs])
        r.tensors["events"][:, 0] = recent.long()
        recent = r.recent_rule()
        assert torch.equal(recent.flags(), torch.tensor([False, True, True, False, True, True], device=device))
    ema = torch.tensor([100.0, 100.0, 100.0, 100.0, 2.0, 100.0], device=device)  # 10 x 2.0 < the spike's norm
    res = (torch.ones(n, device=device), recent, ema, torch.zeros(n, 6, 2, dtype=torch.int64, device=device))
    layout = _layout(tuple(g.numel() for g in gs), block, str(device))
    addr = torch.tensor([[0, g.data_ptr(), 0, 0] for g in gs], dtype=torch.int64, device=device)
    sel = torch.arange(n, device=device)
    return decisions(addr, layout, sel, res, policy, 10.0 if guard else None, tl.float32, False, lazy=False,
                     tickets=tickets)


@contextlib.contextmanager
def _poisoned_empty():
    """``torch.empty`` filled (NaN, the largest integer) while the block runs, so that the kernels' scratch
    holds nothing a previous launch left in the same freed memory: a kernel that read a partial before it
    was written would otherwise read the value the two-launch run had left there, and pass."""
    import torch.utils.deterministic

    before = (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.utils.deterministic.fill_uninitialized_memory = before[1]


def case_folded_decisions_equal_two_launches(device, policy, guard, rule):
    """Every output of the folded launch equals the two launches' (scale and EMA to 1e-6 on a GPU), for
    repair/skip × guard × flags/counters; the tickets are zero after it, and a second launch on them
    decides the same. (Under the interpreter a kernel deciding in a tensor's second-to-last program fails
    here; one deciding in *every* program — the ticket put back after each — would pass, the last program's
    decision being the one left: only the GPU copy runs blocks out of order.)"""
    tickets = torch.zeros(8, dtype=torch.int32, device=device)
    with _poisoned_empty():
        ref_dec, ref_flags = _decide(device, policy, guard, rule, None)
    for _ in range(2):
        with _poisoned_empty():
            dec, flags = _decide(device, policy, guard, rule, tickets)
        assert torch.equal(flags, ref_flags), (flags.tolist(), ref_flags.tolist())
        if device == "cpu":
            assert torch.equal(dec, ref_dec), (dec, ref_dec)
        else:
            torch.testing.assert_close(dec, ref_dec, rtol=1e-6, atol=0)
        assert not tickets.any(), tickets
    # what these gradients must decide: bad entries (bit 3) on 1-3, the held tensor (bit 0) 2 only, "skip"
    # keeps every tensor with a bad entry (bit 1), the guard fires (bit 2) on the spike alone
    bits = lambda b: [(f >> b) & 1 for f in flags.tolist()]  # noqa: E731
    assert bits(3) == [0, 1, 1, 1, 0, 0] and bits(0) == [0, 0, 1, 0, 0, 0]
    assert bits(1) == ([0, 1, 1, 1, 0, 0] if policy == 2 else [0] * 6)
    assert bits(2) == ([0, 0, 0, 0, 1, 0] if guard else [0] * 6)


def case_tickets_refused_where_they_cannot_serve(device):
    """Tickets with the lazy decisions (one launch already), of the wrong dtype or too few: a clear error."""
    import triton.language as tl

    from nonans_optim.kernels._multi import _layout
    from nonans_optim.kernels.decisions import decisions

    g = torch.randn(10, device=device)
    res = (torch.ones(1, device=device), torch.zeros(1, dtype=torch.bool, device=device),
           torch.zeros(1, device=device), torch.zeros(1, 6, 2, dtype=torch.int64, device=device))
    addr = torch.tensor([[0, g.data_ptr(), 0, 0]], dtype=torch.int64, device=device)
    args = (addr, _layout((10,), 64, str(device)), torch.zeros(1, dtype=torch.int64, device=device), res, 1, None,
            tl.float32, False)
    for lazy, tickets in ((True, torch.zeros(1, dtype=torch.int32, device=device)),
                          (False, torch.zeros(1, dtype=torch.int64, device=device)),
                          (False, torch.zeros(0, dtype=torch.int32, device=device))):
        with pytest.raises(ValueError, match="tickets"):
            decisions(*args, lazy=lazy, tickets=tickets)


def case_one_launch_fewer_per_group(device, monkeypatch):
    """What "repair" adds to "off" on the host, folded: the one statistics-and-decide launch and the record
    (two launches apart before: statistics, decide) — for the spectral path and the AdamW path with the guard,
    each a group of its own in one optimizer (SF-NorMuon's own param_groups: spectral and scalar)."""
    from triton_launches import step_launches

    force_triton_paths(monkeypatch)
    torch.manual_seed(0)
    matrices = [torch.nn.Parameter(torch.randn(s, device=device)) for s in ((16, 24), (16, 24), (30, 8))]
    vectors = [torch.nn.Parameter(torch.randn(40, device=device))]
    groups = [{"params": matrices, "path": "spectral"}, {"params": vectors, "path": "scalar"}]
    launches = {}
    for fold in ("0", "1"):
        monkeypatch.setenv("NONANS_TRITON_FOLD_DECIDE", fold)
        seen = step_launches(monkeypatch, no.SFNorMuon(groups, lr=1e-3, impl="fused"), matrices + vectors)
        (rep_ops, rep_launch), (off_ops, off_launch) = seen["repair"], seen["off"]
        assert rep_ops == off_ops
        launches[fold] = rep_launch - off_launch
    assert launches["0"] == Counter({"_stats_kernel": 2, "_decide_kernel": 2, "_record_kernel": 1})
    assert launches["1"] == Counter({"_stats_decide_kernel": 2, "_record_kernel": 1})


# (optimizer, policy, keyword arguments): the spectral path (its guard on by default; FullFusion with
# KL-Shampoo and MONA) and the AdamW path with the guard, or under "skip" (statistics without the guard)
RUNS = [(no.SFNorMuon, "repair", {}), (no.SFNorMuon, "skip", {}), (no.FullFusion, "repair", {}),
        (no.AdamW, "repair", {"spike_factor": 10.0}), (no.SFAdamW, "skip", {"spike_factor": None})]
RUN_IDS = ["SFNorMuon-repair", "SFNorMuon-skip", "FullFusion-repair", "AdamW-guard", "SFAdamW-skip"]


def case_folded_run_equals_two_launch_run(device, cls, policy, kw, monkeypatch):
    """Five steps with faults (partial NaN/Inf, a whole tensor twice, a spike, a moment overflow): the
    folded run equals the two-launch run — parameters, state, counters, events (bit for bit under the
    interpreter; to 1e-6 of each tensor's scale on a GPU, where the norm's last bit may differ)."""
    from nonans_optim.kernels import decisions, scalar_step, spectral_step
    from test_fused import _run

    force_triton_paths(monkeypatch)
    folded = []  # per decisions() call: whether it ran as one launch

    def spy(*args, tickets=None, **kwargs):
        folded.append(tickets is not None)
        return decisions.decisions(*args, tickets=tickets, **kwargs)
    for module in (scalar_step, spectral_step):
        monkeypatch.setattr(module, "decisions", spy)
    runs, calls = {}, {}
    for fold in ("0", "1"):
        monkeypatch.setenv("NONANS_TRITON_FOLD_DECIDE", fold)
        folded.clear()
        if cls in (no.AdamW, no.SFAdamW):  # test_fused.py's fault sequence, as test_kernels_scalar_one runs it
            runs[fold] = _run(cls, "fused", policy, device=device, shapes=_shapes(device), **kw)
        else:
            runs[fold] = _run_wide("fused", policy, device=device, cls=cls, **kw)
        calls[fold] = list(folded)
    assert calls["0"] and not any(calls["0"]) and calls["1"] == [True] * len(calls["0"]), calls
    (ref, ref_opt), (got, got_opt) = runs["0"], runs["1"]
    assert ref_opt.metrics()["resolution/events_total"] > 0
    if device == "cpu":
        assert all(torch.equal(a, b) for a, b in zip(ref, got))
        assert same_tree(ref_opt.state_dict()["state"], got_opt.state_dict()["state"])
    else:
        assert_params_and_state_close(ref, ref_opt, got, got_opt)
    assert_resolution_matches(ref_opt, got_opt)
