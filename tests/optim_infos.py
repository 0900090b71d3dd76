"""The table of optimizer configurations that drives the generic tests (our take on torch's OptimInfo)."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch
from torch import nn

import nonans_optim as no


@dataclasses.dataclass(frozen=True)
class OptimInfo:
    name: str
    cls: Callable[..., torch.optim.Optimizer]
    kwargs: dict[str, Any]
    moment_keys: tuple[str, ...]  # buffers that must be preserved at non-finite gradient entries
    schedule_free: bool = False

    def make(self, params, **overrides):
        """The optimizer, under ``impl="foreach"`` unless the info or the caller names one: the library's
        default, "auto", is "fused" on a CPU with a C compiler, which the "-fused" infos already run, and
        tests/test_auto_impl.py checks that identity; foreach keeps its place in the generic suite."""
        return self.cls(params, **{"impl": "foreach", **self.kwargs, **overrides})


INFOS = [
    OptimInfo("AdamW", no.AdamW, {"lr": 1e-2}, ("exp_avg", "exp_avg_sq")),
    OptimInfo("SFAdamW", no.SFAdamW, {"lr": 1e-2}, ("exp_avg_sq",), schedule_free=True),
    OptimInfo("Muon", no.Muon, {"lr": 1e-2}, ("momentum_buffer", "exp_avg", "exp_avg_sq")),
    OptimInfo("SFNorMuon", no.SFNorMuon, {"lr": 1e-2},
              ("momentum_buffer", "exp_avg_sq"), schedule_free=True),
    OptimInfo("FullFusion", no.FullFusion, {"lr": 1e-2},
              ("momentum_buffer", "mona_prev_grad", "mona_diff_avg", "exp_avg_sq"), schedule_free=True),
    OptimInfo("Fusion-mona", no.Fusion, {"lr": 1e-2, "components": ("ns5", "mona")},
              ("momentum_buffer", "mona_prev_grad", "mona_diff_avg", "exp_avg", "exp_avg_sq")),
]
# The native fused loops (impl="fused", nonans_optim/native) through the whole generic suite as well, for
# the optimizers they cover, under every policy.
FUSED = ("AdamW", "SFAdamW", "Muon", "SFNorMuon", "FullFusion", "Fusion-mona")
INFOS += [OptimInfo(f"{i.name}-fused", i.cls, {**i.kwargs, "impl": "fused"}, i.moment_keys, i.schedule_free)
          for i in INFOS if i.name in FUSED]
IDS = [i.name for i in INFOS]


def impl_cases(impls: tuple[str, ...]) -> list[tuple[OptimInfo, str]]:
    """(info, impl) pairs for tests parametrised by implementation: every info under each of ``impls``,
    except an info that fixes its own ``impl``, which runs under that one only."""
    return [(i, impl) for i in INFOS for impl in ((i.kwargs["impl"],) if "impl" in i.kwargs else impls)]


def impl_ids(cases: list[tuple[OptimInfo, str]]) -> list[str]:
    return [f"{i.name}-{impl}" if "impl" not in i.kwargs else i.name for i, impl in cases]


class TinyNet(nn.Module):
    """Embedding, conv, Linear, LayerNorm and biases: every routing case in a few hundred parameters."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc1 = nn.Linear(8 + 4, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 12)
        self.head = nn.Linear(12, 3)

    def forward(self, tokens, img):
        h = torch.cat([self.embed(tokens).mean(1), self.conv(img).mean((2, 3))], dim=1)
        return self.head(torch.tanh(self.fc2(torch.relu(self.norm(self.fc1(h))))))


class SmallNet(nn.Module):
    """TinyNet's routes in five tensors — an embedding (scalar by type), a conv kernel and two Linear weights
    (spectral), a bias (scalar, 1-D) — with TinyNet's names for its Linear layers (``fc1``, ``fc2``) and its
    inputs. For the tests that run ``impl="compiled"``: the group's update is one graph over every tensor of
    the group, and inductor's cold compile grows by about a second per tensor of it on a 2-core CPU (RESULTS.md,
    "First step of impl="compiled""). The three files that switched ran 227 s -> 177 s on an empty inductor cache
    (pytest -n 2, an AMD EPYC; session notes, 2026-11-28)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.conv = nn.Conv2d(1, 4, 3, bias=False)
        self.fc1 = nn.Linear(8 + 4, 16, bias=False)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, tokens, img):
        h = torch.cat([self.embed(tokens).mean(1), self.conv(img).mean((2, 3))], dim=1)
        return self.fc2(torch.tanh(self.fc1(h)))


class Wide(nn.Module):
    """Two Linear layers whose width changes every shape but not the number of parameter tensors."""

    def __init__(self, width: int):
        super().__init__()
        torch.manual_seed(width)
        self.fc1, self.fc2 = nn.Linear(6, width), nn.Linear(width, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def steps_on(model, opt, n: int, seed: int = 0) -> None:
    """``n`` steps of ``opt`` on ``model`` (a :class:`Wide`) with a mean-square loss on fresh inputs."""
    g = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(16, 6, generator=g).to(dtype)).square().mean().backward()
        opt.step()


def make_model(seed: int = 0, dtype=torch.float32, *, small: bool = False) -> nn.Module:
    """TinyNet, or with ``small`` :class:`SmallNet` (for tests that compile), seeded and cast to ``dtype``."""
    torch.manual_seed(seed)
    return (SmallNet() if small else TinyNet()).to(dtype)


def make_batch(seed: int = 1, n: int = 32, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 11, (n, 5), generator=g)
    img = torch.randn(n, 1, 5, 5, generator=g).to(dtype)
    y = torch.randint(0, 3, (n,), generator=g)
    return tokens, img, y


def loss_fn(model, batch):
    tokens, img, y = batch
    return nn.functional.cross_entropy(model(tokens, img).float(), y)


@contextlib.contextmanager
def no_host_sync():
    """CUDA only: any host synchronisation inside the block raises (``torch.cuda.set_sync_debug_mode``)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def train_steps(model, opt, n: int, *, seed: int = 0, inject=None, dtype=torch.float32):
    """n steps on fresh batches (images in ``dtype``); ``inject(step, model)`` may corrupt gradients after
    backward."""
    loss = None
    for i in range(n):
        batch = make_batch(seed * 1000 + i, dtype=dtype)
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        if inject is not None:
            inject(i, model)
        if hasattr(opt, "set_loss"):
            opt.set_loss(loss)
        opt.step()
    return loss


def state_tensors(opt) -> dict[str, torch.Tensor]:
    out = {}
    for i, p in enumerate(opt._all_params()):
        for k, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                out[f"{i}.{k}"] = v
    return out


def all_finite(model, opt) -> bool:
    """Every parameter of ``model`` and every floating-point state tensor of ``opt`` finite (the invariant)."""
    return all(torch.isfinite(p).all() for p in model.parameters()) and all(
        torch.isfinite(v).all() for v in state_tensors(opt).values() if v.is_floating_point())


def same_tree(x, y) -> bool:
    """Deep equality of state_dict trees (tensors bit for bit, dtypes included)."""
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(same_tree(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(same_tree(u, v) for u, v in zip(x, y))
    return x == y


def assert_params_and_state_close(ref, ref_opt, got, got_opt, *, rtol=1e-5, atol=1e-6, equal_nan=False):
    """Two runs of the same steps (an implementation against the loop ground truth): parameters and every
    state buffer agree within float tolerance, and hold the same state keys."""
    for p, q in zip(ref, got):
        torch.testing.assert_close(q, p, rtol=rtol, atol=atol, equal_nan=equal_nan)
        assert ref_opt.state[p].keys() == got_opt.state[q].keys()
        for key, val in ref_opt.state[p].items():
            torch.testing.assert_close(got_opt.state[q][key], val, rtol=rtol, atol=atol, equal_nan=equal_nan)


def assert_params_and_state_near(ref, ref_opt, got, got_opt, *, rel: float) -> None:
    """Two runs of the same steps whose arithmetic rounds differently at an ill-conditioned operation: per
    parameter and state tensor, max|got − ref| ≤ ``rel`` · max|ref| (same state keys).

    Why a bound on the tensor's scale and not elementwise tolerances: KL-Shampoo's basis refresh is a
    subspace iteration whose QR turns an ulp of difference in its input into ~1e-3 of the basis's scale
    within five steps (tests/test_kl_conditioning.py measures it), and everything downstream inherits that.
    Elementwise tolerances then measure the problem's conditioning, not the code; a wrong stack member, a
    lost guard scale or a held tensor that moved still differ by a large share of the scale."""
    for key, want, have in floating_pairs(ref, ref_opt, got, got_opt):
        gap, scale = gap_and_scale(want, have)
        assert gap <= rel * scale, f"{key}: max |got - ref| {gap:.3g} > {rel} x max |ref| {scale:.3g}"


def floating_pairs(ref, ref_opt, got, got_opt):
    """(key, ref's tensor, got's tensor) for every parameter ("param") and floating-point state tensor of two
    runs of the same steps, after checking that they hold the same state keys, shapes and dtypes and equal
    non-floating entries. The optimizer's global state ("nonans") is left to assert_resolution_matches."""
    for p, q in zip(ref, got):
        assert ref_opt.state[p].keys() == got_opt.state[q].keys()
        pairs = [("param", p.detach(), q.detach())] + [(k, v, got_opt.state[q][k]) for k, v in ref_opt.state[p].items()]
        for key, want, have in pairs:
            if key == "nonans":
                continue
            if not (torch.is_tensor(want) and want.is_floating_point()):
                assert torch.equal(torch.as_tensor(have), torch.as_tensor(want)), key
                continue
            assert have.shape == want.shape and have.dtype == want.dtype, key
            yield key, want, have


def gap_and_scale(want: torch.Tensor, have: torch.Tensor) -> tuple[float, float]:
    """(max|have − want|, max|want|), both 0 for an empty tensor."""
    if not want.numel():
        return 0.0, 0.0
    return (have - want).abs().max().item(), want.abs().max().item()


def event_tuples(opt) -> list[tuple]:
    """The optimizer's events as comparable tuples."""
    return [(e.step, e.param, e.stage, e.nan_count, e.inf_count, e.escalated) for e in opt.events]


def assert_resolution_matches(ref_opt, got_opt, *, ema_rtol: float = 1e-5) -> None:
    """Two runs of the same steps under a resolution policy (an implementation against the loop): every
    Resolution tensor — counts, events, the event ring, escalation state — is identical, the spike guard's
    norm EMA agrees within ``ema_rtol`` (a norm summed in another order), and so do the events."""
    ref_res, got_res = ref_opt._global()["resolution"], got_opt._global()["resolution"]
    assert ref_res.keys() == got_res.keys()
    for key in ref_res:
        if key != "grad_norm_ema":
            assert torch.equal(got_res[key], ref_res[key]), key
    torch.testing.assert_close(got_res["grad_norm_ema"], ref_res["grad_norm_ema"], rtol=ema_rtol, atol=0)
    assert event_tuples(got_opt) == event_tuples(ref_opt)


def assert_skip_holds_as_the_loop_does(cls, impl: str, device: str = "cpu") -> None:
    """A persistent whole-tensor loss under "skip" (twice all-NaN within the repeat window), the second
    time on finite state whose update overflows: ``impl`` holds the tensor as impl="loop" does — same
    events (no "update" count on the held step), parameters and escalation scale."""
    def run(which):
        p = torch.nn.Parameter(torch.ones(40, device=device))
        opt = cls([p], lr=1e-2, impl=which, resolution="skip")
        for step in range(4):
            g = torch.randn(40, generator=torch.Generator().manual_seed(step)).to(device)
            if step >= 2:
                g.fill_(float("nan"))
            if step == 3:  # finite state whose update overflows: m / bc1 (AdamW), z - p in the lerp (SF)
                with torch.no_grad():
                    if "z" in opt.state[p]:
                        opt.state[p]["z"][:5], p[:5] = 3e38, -3e38
                    else:
                        opt.state[p]["exp_avg"][:5] = 3e38
            p.grad = g
            opt.step()
            assert torch.isfinite(p).all()
        return p, opt

    (ref, ref_opt), (got, got_opt) = run("loop"), run(impl)
    assert not [e for e in event_tuples(ref_opt) if e[0] == 4 and e[2] == "update"]  # held: nothing counted
    assert event_tuples(got_opt) == event_tuples(ref_opt)
    torch.testing.assert_close(got, ref)
    res = [o._global()["resolution"]["scale"] for o in (ref_opt, got_opt)]
    assert torch.equal(res[0].cpu(), res[1].cpu())
