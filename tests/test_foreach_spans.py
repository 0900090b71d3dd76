"""The eager foreach (SF-)AdamW step in spans of at most ``FOREACH_SPAN`` entries: the same values as one
span, and no foreach call over more entries than a span (what bounds "repair"'s and "skip"'s temporaries)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import nonans_optim as no
from nonans_optim.optimizers import _scalar
from optim_infos import make_model, state_tensors, train_steps


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), max_size=12), st.integers(1, 60))
def test_spans_cover_the_list_in_order_within_the_limit(sizes, limit):
    spans = _scalar.foreach_spans(sizes, limit)
    assert [i for a, b in spans for i in range(a, b)] == list(range(len(sizes)))  # every tensor once, in order
    assert all(b > a for a, b in spans)
    for a, b in spans:  # within the limit, or one tensor that is larger on its own
        assert sum(sizes[a:b]) <= limit or b - a == 1
    for (a, b), (c, _) in zip(spans, spans[1:]):  # and no two neighbours that would have fitted together
        assert sum(sizes[a:b]) + sizes[c] > limit


def _inject(step, m):
    if step == 1:
        m.fc1.weight.grad[0, 0] = float("nan")
    if step == 3:
        m.fc2.weight.grad.fill_(float("inf"))


@pytest.mark.parametrize("policy", ["repair", "skip", "off"])
@pytest.mark.parametrize("cls", [no.AdamW, no.SFAdamW, no.FullFusion], ids=lambda c: c.__name__)
def test_spans_change_no_value(monkeypatch, cls, policy):
    """Parameters, state and events of the foreach step equal those of one span, with spans of 40 entries
    (the TinyNet's tensors are 5 to 176 entries), NaN and Inf injected; every foreach call the scalar path
    makes stays within a span. FullFusion: its biases, norms and embeddings take the scalar path."""
    runs = []
    for limit in (None, 40):
        if limit is not None:
            monkeypatch.setattr(_scalar, "FOREACH_SPAN", limit)
        model = make_model()
        params = model.named_parameters() if cls is no.FullFusion else model.parameters()
        opt = cls(params, lr=1e-2, impl="foreach", resolution=policy)
        widest = []  # entries in each foreach call on v (out of place under "repair", in place under "off")
        for name in ("_foreach_mul", "_foreach_mul_"):
            def spy(tensors, *a, _real=getattr(torch, name), **k):
                widest.append(sum(t.numel() for t in tensors))
                return _real(tensors, *a, **k)
            monkeypatch.setattr(torch, name, spy)
        if policy == "off":  # no injection: "off" would end in NaN
            train_steps(model, opt, 4)
        else:
            train_steps(model, opt, 5, inject=_inject)
        monkeypatch.undo()
        runs.append((model, opt, widest))
    (m1, o1, w1), (m2, o2, w2) = runs
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    ref, got = state_tensors(o1), state_tensors(o2)
    assert ref.keys() == got.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    assert [(e.step, e.param, e.stage, e.nan_count, e.inf_count) for e in o1.events] == \
        [(e.step, e.param, e.stage, e.nan_count, e.inf_count) for e in o2.events]
    if policy != "off":
        assert o1.events  # the injection made events, so the comparison above is not of two empty lists
    largest = max(p.numel() for p in m1.parameters())
    assert max(w1) > 40 and w2 and max(w2) <= max(40, largest)  # one span before, spans of 40 entries after
