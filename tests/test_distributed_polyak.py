"""The Polyak step under data parallelism (two gloo ranks): with ``polyak_group`` every rank takes the step
size a single process takes on the whole batch, replicated or sharded; without it, set_loss() warns.

Each rank's loss differs (its own batch); the gradients are averaged over the ranks as DDP does. Before
``polyak_group`` each rank derived its own multiplier from its own loss, and the replicas drifted apart."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import nonans_optim as no

STEPS = 5
# the value given to set_loss: 0.1 x the loss, so that loss / mean|g| (about 13-17 here) lands inside the
# multiplier's clamp [0.1, 10] on each rank, where each rank's own loss gives its own multiplier
LOSS_SCALE = 0.1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 6, generator=g) * (1 + 3 * rank), torch.randn(16, 3, generator=g)  # rank 1: 4x larger


def _local(model: nn.Module, rank: int, step: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """This rank's loss and gradients (not averaged)."""
    model.zero_grad()
    x, y = _batch(rank, step)
    loss = (model(x) - y).square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _make(params, **kw):
    return no.SFNorMuon(params, lr=1e-2, ns5_dtype="fp32", impl="foreach", **kw)


def _worker(rank: int, store: str, out: str, sharded: bool) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        model = _model()
        params = list(model.parameters())
        mine = params[rank::2] if sharded else params  # sharded: each rank steps every other tensor (ZeRO)
        opt = _make(mine, polyak_group=dist.group.WORLD)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            _make(params).set_loss(1.0)  # no group: warns that the step size follows this rank alone
            _make(params, polyak_group=dist.group.WORLD).set_loss(1.0)
        for step in range(STEPS):
            loss, grads = _local(model, rank, step)
            for p, g in zip(params, grads):
                dist.all_reduce(g)
                p.grad = g / 2
            opt.set_loss(LOSS_SCALE * loss)
            opt.step()
            if sharded:  # each shard's new values to both ranks, as ZeRO's broadcast does
                for i, p in enumerate(params):
                    dist.broadcast(p.data, src=i % 2)
        torch.save({"params": [p.detach() for p in params], "mult": opt.metrics()["fusion/gamma_mult"],
                    "warnings": [str(w.message) for w in seen]}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _reference() -> tuple[list[torch.Tensor], float]:
    """One process, the whole batch: the mean of the ranks' gradients and losses."""
    model = _model()
    opt = _make(model.parameters())
    twins = [_model(), _model()]
    for step in range(STEPS):
        for twin in twins:
            twin.load_state_dict(model.state_dict())
        (l0, g0), (l1, g1) = (_local(t, r, step) for r, t in enumerate(twins))
        for p, a, b in zip(model.parameters(), g0, g1):
            p.grad = (a + b) / 2
        opt.set_loss((LOSS_SCALE * l0 + LOSS_SCALE * l1) / 2)  # (the ranks' sum, in their order)
        opt.step()
    return [p.detach() for p in model.parameters()], opt.metrics()["fusion/gamma_mult"]


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "sharded"])
def test_polyak_group_gives_every_rank_the_whole_batch_step(sharded, tmp_path):
    import torch.multiprocessing as mp
    out = str(tmp_path / "out")
    mp.spawn(_worker, args=(str(tmp_path / "store"), out, sharded), nprocs=2)
    runs = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    want, mult = _reference()
    assert 0.1 < mult < 10  # the Polyak step is on, and not at a clamp, where every rank would agree anyway
    for run in runs:
        # replicated: the same sums in the same order; sharded: Σ|g| adds the shards' partial sums (rounding)
        assert run["mult"] == (pytest.approx(mult, rel=1e-6, abs=0) if sharded else mult)
        for p, q in zip(run["params"], want):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        assert len(run["warnings"]) == 1 and "polyak_group=dist.group.WORLD" in run["warnings"][0]
    for p, q in zip(runs[0]["params"], runs[1]["params"]):
        assert torch.equal(p, q)


def test_polyak_group_must_be_a_process_group():
    with pytest.raises(ValueError, match="polyak_group must be a torch.distributed ProcessGroup"):
        _make(_model().parameters(), polyak_group="world")
