"""Tests for the Gram Newton-Schulz method (``nonans_optim.ns5_gram``, ``ns5(method="gram")``).

The properties mirror tests/test_ns5.py (whose input generators are reused) and hold for the Gram method
with the same tolerances: Gram is the same polynomial iteration, so the band [0.6818, 1.2024] of p⁵ and
the cos ≥ 0.966 bound derived there apply unchanged. What is specific to Gram:

* In float64 Gram and standard agree to rounding (``test_gram_is_the_standard_iteration_in_fp64``) for
  any bounded per-step coefficients and any restart schedule — the algebra Q_{k+1} = P_k Q_k,
  R_{k+1} = P_k R_k P_k is exact.
* Accuracy against the fp64 *standard* iteration (the fair oracle: Keller's NS5 does not converge to
  U Vᵀ): Gram's error is at most K_ERR = 3x the standard method's at the same dtype. Measured worst ratio
  over 84 cases (7 shapes × Gaussian/rank-1/rank-4/κ = 10, 1e2, 1e4 × 2 seeds): 2.15 in bf16, 2.12 in
  fp32, 2.14 in fp16; on the 24 cases of ``test_gram_error_is_within_k_times_standard`` 0.83-1.72 (bf16)
  and 0.83-2.09 (fp32); on ill-conditioned inputs Gram is often *more* accurate (ratio ≈ 0.8).
* The hazard (module docstring of ns5_gram): without restarts, rounding makes eigenvalues of R negative on
  the tiny-σ directions and they grow unchecked, so bf16 output singular values leave the band — measured
  for σ log-spread over 1e-4..1 (``test_ill_conditioned_bf16_needs_the_restart``): σ_max 261 (64×256) and
  22 (128×128), relative error 37 and 4.0. With a restart every two steps σ_max stays 1.20 and the error
  (0.090, 0.055) is *below* the standard method's (0.110, 0.066). Dao et al.'s single restart after step
  2 stays finite but its last three-step segment is not self-correcting: σ_max 1.30 / 1.36, outside the
  band — which is why the default here restarts every two steps ([2, 2, 1]). In fp32 the unrestarted
  variant is 30x less accurate than standard (1.4e-4 vs 4.5e-6) but stays in the band at five steps.

Runtime (``pytest tests/test_ns5_gram.py``, 64 tests): 3-7 s on 2 idle CPU cores, ≈ 20 s when shared.
"""
from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from nonans_optim.ns5 import GRAM_MIN_ASPECT, KELLER_COEFFICIENTS, iterate_reference, normalise, ns5
from nonans_optim.ns5_gram import gram_flops, iterate_gram, segments, standard_flops
from test_ns5 import BAND, FAST

ns5_module = importlib.import_module("nonans_optim.ns5")
KELLER5 = [KELLER_COEFFICIENTS] * 5
K_ERR = 3.0  # Gram error / standard error, both against the fp64 standard iteration (measured ≤ 2.15)


# --------------------------------------------------------------------------- exactness and cost
def bounded_quintics(n: int = 64, seed: int = 0) -> list[tuple[float, float, float]]:
    """Random (a, b, c) whose p(σ) = aσ + bσ³ + cσ⁵ maps [0, 1.25] into itself, so iterates stay ≤ 1.25
    and an absolute tolerance is meaningful (unbounded ones overflow fp64 within 7 steps)."""
    rng = np.random.default_rng(seed)
    x = np.linspace(0.0, 1.25, 2001)
    out: list[tuple[float, float, float]] = []
    while len(out) < n:
        a, c, target = rng.uniform(1.0, 4.0), rng.uniform(0.0, 2.5), rng.uniform(0.7, 1.0)
        b = target - a - c  # p(1) = target
        y = a * x + b * x**3 + c * x**5
        if y.min() >= 0.0 and y.max() <= 1.25:
            out.append((float(a), float(b), float(c)))
    return out


QUINTICS = bounded_quintics()


@st.composite
def coefficient_schedules(draw):
    steps = draw(st.integers(0, 7))
    if draw(st.booleans()):
        return [KELLER_COEFFICIENTS] * steps
    # per-step coefficients: the algebra must not depend on Keller's values or on their being constant
    return [draw(st.sampled_from(QUINTICS)) for _ in range(steps)]


@FAST
@given(coeffs=coefficient_schedules(), restart=st.sampled_from([1, 2, 3, None, (2,), (3,), (1, 4)]),
       s=st.integers(1, 12), extra=st.integers(0, 20), batch=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_gram_is_the_standard_iteration_in_fp64(coeffs, restart, s, extra, batch, seed):
    G = torch.randn(batch, s, s + extra, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    X = normalise(G).double()
    ref = iterate_reference(X, coeffs)
    out = iterate_gram(X, coeffs, restart_after=restart)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)


def test_segments():
    assert segments(5, 2) == [2, 2, 1]
    assert segments(5, (2,)) == [2, 3]  # Dao et al.'s single restart
    assert segments(5, None) == [5] and segments(5, 9) == [5] and segments(6, 2) == [2, 2, 2]
    assert segments(5, 1) == [1] * 5 and segments(0, 2) == [] and segments(5, (3, 1, 7)) == [1, 2, 2]
    with pytest.raises(ValueError, match="restart_after"):
        segments(5, 0)


@pytest.mark.parametrize("restart", [2, (2,), None, 1])
@pytest.mark.parametrize("s,l", [(16, 64), (32, 32), (8, 40)])
def test_flop_helpers_match_torch_flop_counter(restart, s, l):
    """The FLOP formulas are what the code does: counted by torch's own matmul FLOP counter."""
    X = torch.randn(3, s, l)
    with FlopCounterMode(display=False) as fc:
        iterate_gram(X, KELLER5, restart_after=restart)
    assert fc.get_total_flops() == 3 * gram_flops(s, l, 5, restart)
    with FlopCounterMode(display=False) as fc:
        iterate_reference(X, KELLER5)
    assert fc.get_total_flops() == 3 * standard_flops(s, l, 5)
    # the counts quoted in the docstrings
    assert gram_flops(s, l, 5, (2,)) == 28 * s**3 + 8 * s * s * l
    assert gram_flops(s, l, 5, 2) == 22 * s**3 + 12 * s * s * l
    assert standard_flops(s, l) == 20 * s * s * l + 10 * s**3


def test_restart_every_step_is_bit_identical_to_standard():
    """A one-step segment is a·X + B·X in one baddbmm, exactly the standard step."""
    X = normalise(torch.randn(2, 24, 70)).bfloat16()
    assert torch.equal(iterate_gram(X, KELLER5, restart_after=1), iterate_reference(X, KELLER5))


# The ns5() guarantees (finite output, zero in → zero out, scale invariance, the singular-value band,
# batched = per-matrix, tall = wide transposed) run for method="gram" in test_ns5.py, parametrised by method.


# --------------------------------------------------------------------------- accuracy vs the fp64 oracle
def log_spread(B: int, s: int, l: int, lo: float, seed: int) -> torch.Tensor:
    """U diag(σ) Vᵀ with σ log-spaced over [lo, 1], float64."""
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(B, s, s, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(B, l, s, generator=g, dtype=torch.float64))
    return (U * torch.logspace(math.log10(lo), 0.0, s, dtype=torch.float64)) @ V.mT


def errors(G: torch.Tensor, dtype: torch.dtype, **gram_kw) -> tuple[float, float, float]:
    """(standard error, Gram error, Gram σ_max): relative Frobenius errors against fp64 standard NS5."""
    X = normalise(G)
    ref = iterate_reference(X.double(), KELLER5)
    std = iterate_reference(X.to(dtype), KELLER5).double()
    gram = iterate_gram(X.to(dtype), KELLER5, **gram_kw).double()
    err = lambda O: float((O - ref).norm() / ref.norm())  # noqa: E731
    return err(std), err(gram), float(torch.linalg.svdvals(gram).max())


def accuracy_inputs(s: int, l: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"gauss": torch.randn(2, s, l, generator=g, dtype=torch.float64),
            "rank4": torch.randn(2, s, 4, generator=g, dtype=torch.float64)
            @ torch.randn(2, 4, l, generator=g, dtype=torch.float64),
            "kappa100": log_spread(2, s, l, 1e-2, seed)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("s,l", [(16, 16), (32, 96), (64, 256), (96, 128)])
def test_gram_error_is_within_k_times_standard(dtype, s, l):
    for kind, G in accuracy_inputs(s, l, seed=s + l).items():
        e_std, e_gram, smax = errors(G, dtype)
        assert e_gram <= K_ERR * e_std, (kind, e_gram, e_std)
        assert smax <= BAND[1] + 0.03, (kind, smax)


@pytest.mark.parametrize("s,l,seed", [(64, 256, 1), (128, 128, 2)])
def test_ill_conditioned_bf16_needs_the_restart(s, l, seed):
    """σ log-spread over [1e-4, 1], bf16: the hazard is real at these sizes (numbers in the module
    docstring: unrestarted σ_max 261 / 22, restarted 1.20 / 1.20, single restart 1.30 / 1.36)."""
    G = log_spread(2, s, l, 1e-4, seed)
    e_std, e_gram, smax_gram = errors(G, torch.bfloat16, restart_after=2)
    _, e_naive, smax_naive = errors(G, torch.bfloat16, restart_after=None)
    _, _, smax_dao = errors(G, torch.bfloat16, restart_after=(2,))
    assert smax_gram <= BAND[1] + 0.03 and e_gram <= K_ERR * e_std
    assert smax_naive > 5.0 and e_naive > 10 * e_gram  # out of band by far: the unrestarted hazard
    assert smax_dao > BAND[1] + 0.05  # the single restart leaves the band too (why the default is every 2)
    # fp32 has the same hazard, but 2¹⁶ times smaller rounding keeps it under the band at 5 steps
    _, e32_naive, smax32_naive = errors(G, torch.float32, restart_after=None)
    assert smax32_naive <= BAND[1] + 2e-3 and e32_naive < 1e-3


# --------------------------------------------------------------------------- method selection
def test_auto_picks_gram_only_for_wide_enough_matrices_on_torch(monkeypatch):
    monkeypatch.delenv("NONANS_NS5_METHOD", raising=False)
    wide = torch.randn(3, 16, int(16 * GRAM_MIN_ASPECT))
    narrow = torch.randn(3, 16, int(16 * GRAM_MIN_ASPECT) - 1)
    for G in (wide, wide.mT):
        assert torch.equal(ns5(G, dtype="bf16"), ns5(G, dtype="bf16", method="gram"))
        assert not torch.equal(ns5(G, dtype="bf16"), ns5(G, dtype="bf16", method="standard"))
    assert torch.equal(ns5(narrow, dtype="bf16"), ns5(narrow, dtype="bf16", method="standard"))
    resolve = ns5_module._resolve_method
    assert resolve("auto", "torch", "torch", (16, 64)) == "gram"
    assert resolve("auto", "auto", "triton", (16, 64)) == "standard"  # Triton: always standard
    assert resolve("auto", "auto", "torch", (0, 64)) == "standard"
    assert resolve("gram", "auto", "triton", (16, 16)) == "gram"  # explicit gram runs on torch


def test_env_var_overrides_auto_only(monkeypatch):
    narrow = torch.randn(2, 8, 8)
    monkeypatch.setenv("NONANS_NS5_METHOD", "gram")
    assert torch.equal(ns5(narrow, dtype="bf16"), ns5(narrow, dtype="bf16", method="gram"))
    assert ns5_module._resolve_method("auto", "auto", "triton", (16, 64)) == "standard"
    monkeypatch.setenv("NONANS_NS5_METHOD", "standard")
    wide = torch.randn(2, 8, 64)
    assert torch.equal(ns5(wide, dtype="bf16"), ns5(wide, dtype="bf16", method="standard"))
    assert not torch.equal(ns5(wide, dtype="bf16", method="gram"), ns5(wide, dtype="bf16"))  # explicit wins
    assert ns5_module._resolve_method("gram", "torch", "torch", (8, 64)) == "gram"  # explicit wins
    monkeypatch.setenv("NONANS_NS5_METHOD", "fast")
    with pytest.raises(ValueError, match="NONANS_NS5_METHOD.*'fast'"):
        ns5(wide)


@pytest.mark.parametrize("bad", ["Gram", "newton", ""])
def test_bad_method_names_the_argument(bad):
    with pytest.raises(ValueError, match=f"method.*{bad!r}"):
        ns5(torch.randn(4, 8), method=bad)


def test_gram_with_explicit_triton_backend_is_an_error():
    with pytest.raises(ValueError, match="method='gram'.*Triton"):
        ns5(torch.randn(4, 8), method="gram", backend="triton")


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_tall_layout_iterates_the_transpose(method):
    """ns5.iterate(tall=True) on Xᵀ gives (the wide result)ᵀ: the compiled spectral path relies on it to
    skip transposed copies. fp32, so only rounding separates the two orders of the products."""
    from nonans_optim.ns5 import iterate
    X = normalise(torch.randn(3, 24, 80, generator=torch.Generator().manual_seed(0)))
    wide = iterate(X, KELLER5, method=method)
    tall = iterate(X.mT.contiguous(), KELLER5, method=method, tall=True)
    assert tall.shape == (3, 80, 24)
    torch.testing.assert_close(tall, wide.mT, rtol=1e-4, atol=1e-5)


def test_ns5_gram_default_schedule_keeps_ill_conditioned_bf16_in_the_band():
    """ns5(method="gram") itself — not iterate_gram with an explicit ``restart_after`` — uses the
    restart-every-two-steps schedule: on σ log-spread over [1e-4, 1] in bf16 it stays in the band, where no
    restart (σ_max ≈ 261) and Dao's single restart (≈ 1.30) leave it
    (test_ill_conditioned_bf16_needs_the_restart)."""
    G = log_spread(2, 64, 256, 1e-4, 1).float()
    O = ns5(G, dtype="bf16", method="gram").double()
    assert float(torch.linalg.svdvals(O).max()) <= BAND[1] + 0.03


def test_iterate_dispatches_on_the_method():
    """ns5.iterate (the compiled spectral path's entry) runs the iteration the method names, told apart by
    torch's FLOP counter: "gram" and "auto" on a 1:4 matrix run Gram, "standard" and "auto" below
    GRAM_MIN_ASPECT run the standard iteration — in both layouts."""
    from nonans_optim.ns5 import iterate
    for s, l in ((16, 64), (16, 32)):
        X = normalise(torch.randn(2, s, l))
        gram_wins = l >= GRAM_MIN_ASPECT * s
        for method in ("gram", "standard", "auto"):
            gram = method == "gram" or (method == "auto" and gram_wins)
            want = gram_flops(s, l) if gram else standard_flops(s, l)
            for tall in (False, True):
                with FlopCounterMode(display=False) as fc:
                    iterate(X.mT.contiguous() if tall else X, KELLER5, method=method, tall=tall)
                assert fc.get_total_flops() == 2 * want, (s, l, method, tall)
