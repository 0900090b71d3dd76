"""Tests for the ``nonans_optim.watch`` object itself: reset, hook removal, the forward/backward options,
an exception in forward, no host syncs (CPU and CUDA), an unchanged model, argument checks. Split from
tests/test_watch.py, which tests what is reported and shares its model helpers with this file."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from nonans_optim.watch import Watch, watch
from test_watch import ClipZero, Log, Reuse, Sqrt, all_hooks_empty, mlp_with


def test_reset_forgets_events_and_call_counts():
    model = Reuse()
    with watch(model) as w:
        model(torch.ones(2, 4))
        assert w.first_nonfinite()["call"] == 2
        w.reset()
        assert w.report() == {"forward": None, "backward": None}
        model.lin(torch.full((2, 4), float("nan")))  # first call of lin since the reset
        assert w.first_nonfinite() == {"phase": "forward", "module": "lin", "type": "Linear", "call": 0,
                                       "where": "input", "inside": None}
    clean = mlp_with(nn.ReLU())
    with watch(clean) as w:
        clean(torch.full((8, 4), float("nan"))).sum().backward()
        assert w.report()["forward"] is not None and w.report()["backward"] is not None
        w.reset()
        clean(torch.randn(8, 4)).sum().backward()
        assert w.report() == {"forward": None, "backward": None}


def test_context_manager_removes_all_hooks_and_keeps_results():
    model = mlp_with(Log())
    with watch(model) as w:
        assert not all_hooks_empty(model)
        model(torch.randn(8, 4))
    assert all_hooks_empty(model)
    assert w.first_nonfinite()["module"] == "1"
    w.remove()  # idempotent
    assert "removed" in repr(w)


def test_watching_does_not_change_values_and_tolerates_inplace_ops():
    """Full backward hooks would raise here (in-place ReLU on a hooked BatchNorm output)."""
    def build():
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(inplace=True), nn.Linear(8, 1))

    x = torch.randn(16, 4)
    plain = build()
    plain(x).sum().backward()
    watched = build()
    with watch(watched) as w:
        watched(x).sum().backward()
        assert w.first_nonfinite() is None
    for p, q in zip(plain.parameters(), watched.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_forward_false_and_backward_false():
    model = mlp_with(nn.Sequential(ClipZero(), Sqrt()))
    with watch(model, backward=False) as w:
        model(torch.randn(64, 4)).sum().backward()
        assert w.report() == {"forward": None, "backward": None}
    model = mlp_with(Log())
    with watch(model, forward=False) as w:
        model(torch.randn(64, 4)).sum().backward()
        rep = w.report()
    assert rep["forward"] is None and rep["backward"] is not None


def test_exception_in_forward_leaves_watch_usable():
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    model = nn.Sequential(nn.Linear(4, 4), Boom())
    with watch(model) as w:
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.randn(2, 4))
        model[0](torch.full((2, 4), float("nan")))
        assert w.first_nonfinite()["module"] == "0"


def test_hooks_do_not_sync(monkeypatch):
    """Every host read of a tensor value goes through one of these; make them raise while watching."""
    model = mlp_with(nn.Sequential(ClipZero(), Sqrt()))
    x = torch.randn(64, 4)
    w = watch(model)

    def refuse(*args, **kwargs):
        raise AssertionError("host sync inside a watch hook")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"):
            m.setattr(torch.Tensor, name, refuse)
        loss = model(x).sum()
        loss.backward()
    assert w.report()["backward"]["type"] == "Sqrt"  # reading afterwards is the one sync
    w.remove()


def test_node_hooks_left_on_the_graph_record_nothing_after_remove():
    """remove(): the node hooks already on a live graph become no-ops — a backward run after the watch
    ended adds no event to what was recorded while it was active."""
    model = mlp_with(nn.Sequential(ClipZero(), Sqrt()))
    with watch(model) as w:
        out = model(torch.randn(64, 4))
    out.sum().backward()  # Inf gradient from Sqrt (see test_backward_only_nan_is_named_in_backward_phase)
    assert not torch.isfinite(model[0].weight.grad).all()
    assert w.report() == {"forward": None, "backward": None}


def test_rejects_non_module():
    with pytest.raises(TypeError, match="nn.Module"):
        watch(lambda x: x)
    assert isinstance(watch(nn.Linear(2, 2)), Watch)


def test_package_attribute_is_the_function():
    import nonans_optim.watch  # noqa: F401  (any import of the submodule, e.g. by another test)
    assert callable(nonans_optim.watch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_sync_under_cuda_sync_debug_mode():
    model = mlp_with(nn.Sequential(ClipZero(), Sqrt())).cuda()
    x = torch.randn(64, 4, device="cuda")
    with watch(model) as w:
        model(x).sum().backward()  # warm-up (allocator, lazy init)
        w.reset()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            model(x).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert w.report()["backward"]["type"] == "Sqrt"
