"""torch.optim conventions of precision a user relies on without reading our docs: fp64 parameters step as
torch's AdamW steps them, fp16 and bf16 ones (a 0-d one included) step without crashing or silently stalling,
and a warning names the fp16 case that cannot work. Moved out of tests/test_conventions.py (the other
conventions) to keep the files small."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import nonans_optim as no
from optim_infos import Wide


def test_polyak_l1_norm_of_fp16_gradients_does_not_overflow():
    """Σ|g| of an fp16 gradient passes 65504 at 300x300 ones: taken in fp16 it was Inf, and the finite
    gradient dropped out of Ḡ as if it were non-finite (γ stayed 1)."""
    p = nn.Parameter(torch.zeros(300, 300, dtype=torch.float16))
    opt = no.SFNorMuon([p])
    for _ in range(3):
        p.grad = torch.ones_like(p)
        opt.set_loss(2.0)
        opt.step()
    m = opt.metrics()
    assert m["fusion/gnorm_ema"] == 1.0 and m["fusion/gamma_mult"] == 2.0


def test_fp16_parameters_on_the_adam_path_warn():
    """In fp16 the Adam moments of an ordinary gradient underflow (v and eps round to 0): the eager paths
    divided 0 by 0 every step, repaired it and never moved the parameter, the fused one took ~8x the step.
    A warning names it where the parameters are given; bf16 and spectral-routed fp16 matrices are fine."""
    half = nn.Linear(4, 4).half()
    with pytest.warns(UserWarning, match="float16"):
        no.AdamW(half.parameters())
    with pytest.warns(UserWarning, match=r"1 float16 parameter\(s\) \(shapes \[\(4,\)\]\)"):
        no.SFNorMuon(half.parameters())  # the bias only: the weight takes NS5
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        no.AdamW(nn.Linear(4, 4).bfloat16().parameters())
        no.SFNorMuon([nn.Parameter(torch.randn(4, 4, dtype=torch.float16))])


@pytest.mark.parametrize("impl", ["loop", "foreach", "compiled", "auto"])
def test_fp64_adamw_is_torchs_adamw(impl):
    """fp64 parameters get γ, the hyperparameters and the bias corrections in fp64: the steps equal
    torch.optim.AdamW's (compiled: inductor's own operation order, within 1e-8), and a decay factor
    1 - lr·wd = 1 - 1e-8 is applied, not rounded to 1 (in fp32 it was: 7.7e-7 off torch after 20 steps)."""
    p0 = torch.randn(7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ref, got = nn.Parameter(p0.clone()), nn.Parameter(p0.clone())
    ref_opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=1e-5)
    got_opt = no.AdamW([got], lr=1e-3, weight_decay=1e-5, impl=impl)
    for t in range(20):
        ref.grad = torch.randn(7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(t))
        got.grad = ref.grad.clone()
        ref_opt.step()
        got_opt.step()
    torch.testing.assert_close(got, ref, rtol=1e-8 if impl == "compiled" else 0, atol=0)
    w = nn.Parameter(torch.ones(3, dtype=torch.float64))
    w.grad = torch.zeros(3, dtype=torch.float64)
    no.AdamW([w], lr=1.0, weight_decay=1e-8, impl=impl).step()
    assert torch.equal(w, torch.full((3,), 1 - 1e-8, dtype=torch.float64))


@pytest.mark.parametrize("impl", ["loop", "foreach", "compiled", "auto"])
@pytest.mark.parametrize("name", ["FullFusion", "SFNorMuon"])
def test_fp64_fusion_with_set_loss_steps(name, impl):
    """The Polyak L1 norm of fp64 gradients is taken in fp64 (a norm may only widen its input: asking
    for fp32 raised, so every fp64 Fusion step after set_loss() failed — a regression of the fp32-sum fix)."""
    model = Wide(5).double()
    opt = getattr(no, name)(model.parameters(), lr=1e-2, impl=impl)
    for _ in range(2):
        loss = model(torch.randn(4, 6, dtype=torch.float64)).square().mean()
        loss.backward()
        opt.set_loss(loss)
        opt.step()
        opt.zero_grad()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert opt.metrics()["fusion/gamma_mult"] != 1.0  # the Polyak step ran


class LogitScale(nn.Module):
    """A Linear and a 0-d parameter (CLIP's ``logit_scale``): a 0-d tensor takes part in type promotion
    differently from one with dimensions, which three paths got wrong (below)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.lin = nn.Linear(6, 4)
        self.logit_scale = nn.Parameter(torch.tensor(2.6))

    def forward(self, x):
        return self.lin(x) * self.logit_scale.exp()


@pytest.mark.parametrize("name", ["AdamW", "SFAdamW", "Muon", "SFNorMuon"])
@pytest.mark.parametrize("impl,dtype", [("loop", torch.bfloat16), ("foreach", torch.float16)])
def test_a_half_precision_0d_parameter_steps_and_repair_equals_off(dtype, name, impl):
    """The 0-d parameter's update came out in fp32 (0-d times the 0-d fp32 step size promotes), and the
    guarded write into the bf16/fp16 parameter raised under "repair" and "skip": AdamW and Muon crashed at
    their first step on such a model, which torch.optim.AdamW steps."""
    runs = {}  # (the eager paths: the compiled kernel, which impl="fused" runs for 16-bit groups, had no crash)
    for policy in ("repair", "skip", "off"):
        model = LogitScale().to(dtype)
        opt = getattr(no, name)(model.named_parameters(), lr=1e-2, impl=impl, resolution=policy)
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 6, generator=g).to(dtype)).float().square().mean().backward()
            opt.step()
        runs[policy] = [p.detach().clone() for p in model.parameters()]
        assert model.logit_scale.dtype == dtype and model.logit_scale.dim() == 0
    assert not torch.equal(runs["off"][0], LogitScale().to(dtype).logit_scale)  # it moved
    for policy in ("repair", "skip"):
        assert all(torch.equal(a, b) for a, b in zip(runs[policy], runs["off"])), policy


@pytest.mark.parametrize("impl", ["foreach", "compiled", "fused"])
def test_fp64_parameters_of_any_shape_match_torch_adamw(impl):
    """fp64 groups run the compiled kernel under impl="compiled" and "fused" (the native loops are fp32).
    There a 0-d tensor's in-place writes were lost (its moments never moved: 1e-2 off torch's AdamW after
    five steps), and under "repair" the per-parameter step sizes were rounded to fp32 (a 1-D fp32 scale
    times the 0-d fp64 γ promotes to fp32: 1e-9 off). Both now match torch to fp64 rounding."""
    shapes = [(), (1,), (3,), (4, 5)]
    gen = torch.Generator().manual_seed(0)
    ref = [nn.Parameter(torch.randn(s, dtype=torch.float64, generator=gen)) for s in shapes]
    ours = [nn.Parameter(p.detach().clone()) for p in ref]
    t_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    o_opt = no.AdamW(ours, lr=1e-2, weight_decay=0.1, impl=impl)
    for _ in range(5):
        for p, q in zip(ref, ours):
            p.grad = torch.randn(p.shape, dtype=torch.float64, generator=gen)
            q.grad = p.grad.clone()
        t_opt.step()
        o_opt.step()
    for p, q in zip(ref, ours):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-15)
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(o_opt.state[q][k], t_opt.state[p][k], rtol=0, atol=1e-15)

