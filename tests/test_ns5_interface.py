"""``nonans_optim.ns5``'s interface and its exact iteration: hot-dtype names and ``hot_dtype``'s choice, input
checks, backend selection and the environment variables, and an independent float64 oracle (``steps``,
``coefficients``, the short side, per-matrix normalisation). Split from tests/test_ns5.py, which keeps the
numerical properties (band, finiteness, scale invariance, layout, naive fp16, the overflow bound).
"""
from __future__ import annotations

import importlib
import re

import numpy as np
import pytest
import torch

from nonans_optim.ns5 import hot_dtype, ns5
from test_ns5 import METHODS

ns5_module = importlib.import_module("nonans_optim.ns5")  # the package attribute `ns5` is the function


# --------------------------------------------------------------------------- argument handling
def test_hot_dtype_auto_never_returns_fp16(monkeypatch):
    for native in (True, False):
        monkeypatch.setattr(ns5_module, "_cpu_has_native_bf16", lambda native=native: native)
        for device in ("cpu", "cuda", "meta"):
            for req in ("auto", None):
                assert hot_dtype(device, req) in (torch.bfloat16, torch.float32)
        assert hot_dtype("cpu") == (torch.bfloat16 if native else torch.float32)
    assert hot_dtype("cuda") == torch.bfloat16
    assert hot_dtype("cpu", "fp16_safe") == torch.float16
    assert hot_dtype("cpu", torch.float64) == torch.float64


@pytest.mark.parametrize("bad", ["cuda", "Triton", ""])
def test_unknown_backend_names_the_choices(bad):
    with pytest.raises(ValueError, match=re.escape(f"backend must be one of 'auto', 'torch', 'triton', got {bad!r}")):
        ns5(torch.randn(3, 3), backend=bad)


@pytest.mark.parametrize("bad", ["fp8", "half", "FP32", ""])
def test_unknown_hot_dtype_names_the_value(bad):
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        hot_dtype("cpu", bad)
    with pytest.raises(ValueError):
        ns5(torch.randn(3, 3), dtype=bad)


def test_ns5_rejects_vectors_and_integers():
    with pytest.raises(ValueError, match="matrix"):
        ns5(torch.randn(5))
    with pytest.raises(ValueError, match="floating"):
        ns5(torch.ones(3, 3, dtype=torch.int64))


def test_auto_backend_takes_triton_from_the_measured_crossover(monkeypatch):
    """backend="auto": Triton on CUDA from a short side of TRITON_MIN_DIM (the H100 crossover of
    `python -m experiments kernels`), torch below it and on every CPU tensor; the variable overrides it."""
    pytest.importorskip("triton")
    from nonans_optim.ns5 import TRITON_MIN_DIM, _resolve_backend

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv("NONANS_NS5_TRITON_MIN_DIM", raising=False)
    monkeypatch.delenv("NONANS_NS5_BACKEND", raising=False)
    assert _resolve_backend("auto", cuda, (TRITON_MIN_DIM, 2 * TRITON_MIN_DIM)) == "triton"
    assert _resolve_backend("auto", cuda, (TRITON_MIN_DIM // 2, 4 * TRITON_MIN_DIM)) == "torch"
    assert _resolve_backend("auto", cpu, (TRITON_MIN_DIM, TRITON_MIN_DIM)) == "torch"
    monkeypatch.setenv("NONANS_NS5_TRITON_MIN_DIM", "512")
    assert _resolve_backend("auto", cuda, (512, 512)) == "triton"
    assert _resolve_backend("auto", cuda, (511, 4096)) == "torch"
    monkeypatch.setenv("NONANS_NS5_TRITON_MIN_DIM", "big")
    with pytest.raises(ValueError, match="NONANS_NS5_TRITON_MIN_DIM"):
        _resolve_backend("auto", cuda, (512, 512))


def test_empty_environment_variables_are_unset(monkeypatch):
    """`NONANS_NS5_BACKEND=` (a variable cleared in a launcher script) means unset, as for the other
    variables here; it raised "must be 'auto', 'torch' or 'triton', got ''" in no.ns5 and in every
    loop/foreach spectral step (an audit, 2026-11-26)."""
    G = torch.randn(6, 9)
    ref = ns5(G)
    for var in ("NONANS_NS5_BACKEND", "NONANS_NS5_METHOD", "NONANS_NS5_TRITON_MIN_DIM"):
        monkeypatch.setenv(var, "")
    assert torch.equal(ns5(G), ref)
    from nonans_optim import SFNorMuon
    p = torch.nn.Parameter(torch.randn(6, 9))
    p.grad = torch.randn(6, 9)
    SFNorMuon([p], impl="foreach").step()
    assert torch.isfinite(p).all()


# --------------------------------------------------------------------------- independent float64 oracle
def ns_oracle(G: np.ndarray, coefficients) -> np.ndarray:
    """The quintic iteration written out in float64 numpy on G / ‖G‖_F, one matrix at a time, on the
    wide orientation — shares no code with nonans_optim (not even its coefficient constant)."""
    out = np.empty_like(G)
    for i, g in enumerate(G.reshape(-1, *G.shape[-2:])):
        tall = g.shape[0] > g.shape[1]
        X = (g.T if tall else g) / np.linalg.norm(g)
        for a, b, c in coefficients:
            A = X @ X.T
            X = a * X + (b * A + c * A @ A) @ X
        out.reshape(-1, *G.shape[-2:])[i] = X.T if tall else X
    return out


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", [(2, 6, 20), (20, 6), (7, 7), (3, 1, 9)])
def test_float64_hot_dtype_reproduces_the_exact_iteration(method, shape):
    """With a float64 hot dtype ns5 is the textbook iteration up to the fp32 normalisation (~1e-7 relative,
    amplified at most a⁵ ≈ 490x): Keller's literal coefficients, exactly ``steps`` steps (0 to 6; 0 is the
    normalised input, pinning the Frobenius norm), and an explicit ``coefficients`` schedule is honoured."""
    G = torch.from_numpy(np.random.default_rng(5).standard_normal(shape))
    keller = (3.4445, -4.7750, 2.0315)
    for steps in (0, 1, 2, 5, 6):
        O = ns5(G, steps, dtype=torch.float64, method=method).numpy()
        np.testing.assert_allclose(O, ns_oracle(G.numpy(), [keller] * steps), atol=2e-5, rtol=0)
    custom = [(2.0, -1.5, 0.5), (3.0, -3.2, 1.2), (1.875, -1.25, 0.375)]  # per-step, not Keller's
    O = ns5(G, dtype=torch.float64, method=method, coefficients=custom).numpy()
    np.testing.assert_allclose(O, ns_oracle(G.numpy(), custom), atol=2e-5, rtol=0)
    assert torch.equal(ns5(G, 3, dtype=torch.float64, method=method, coefficients=custom), torch.from_numpy(O))


def test_steps_that_disagree_with_the_coefficients_are_refused():
    """``steps`` was silently ignored beside ``coefficients``: ns5(G, 2, coefficients=five) ran five."""
    G = torch.randn(4, 6)
    with pytest.raises(ValueError, match="steps=2 but 3 coefficient triples"):
        ns5(G, 2, coefficients=[(3.4445, -4.7750, 2.0315)] * 3)
    with pytest.raises(ValueError, match="steps must be an integer"):
        ns5(G, -1)


@pytest.mark.parametrize("method", METHODS)
def test_iteration_runs_on_the_short_side(method):
    """A tall input is transposed so that the Gram matrix is min(m, n) square: counted with torch's FLOP
    counter, 8×64 and 64×8 cost the same, the short-side formula (the long side would be ≥ 6x more)."""
    from torch.utils.flop_counter import FlopCounterMode

    from nonans_optim.ns5_gram import gram_flops, standard_flops
    expected = (gram_flops if method == "gram" else standard_flops)(8, 64)
    for shape in ((2, 8, 64), (2, 64, 8)):
        with FlopCounterMode(display=False) as fc:
            ns5(torch.randn(shape), dtype="fp32", method=method)
        assert fc.get_total_flops() == 2 * expected, shape


@pytest.mark.parametrize("method", METHODS)
def test_batch_members_are_normalised_independently(method):
    """Each matrix of a batch gets its own power-of-two and Frobenius normalisation: a 1e30-scaled and a
    1e-30-scaled matrix stacked together give exactly their per-matrix results (a batch-wide max-abs
    would flush the small one to zero in fp32), and normalise() gives every non-zero matrix a Frobenius
    norm of 1 to fp32 rounding — its eps never shrinks a real input."""
    g = torch.Generator().manual_seed(6)
    A, B = torch.randn(6, 10, generator=g), torch.randn(6, 10, generator=g)
    G = torch.stack([A * 1e30, B * 1e-30, torch.zeros(6, 10)])
    O = ns5(G, dtype="fp32", method=method)
    assert torch.equal(O[0], ns5(A * 1e30, dtype="fp32", method=method))
    assert torch.equal(O[1], ns5(B * 1e-30, dtype="fp32", method=method))
    assert torch.equal(O[2], torch.zeros(6, 10))
    norms = torch.linalg.matrix_norm(ns5_module.normalise(G).double())
    torch.testing.assert_close(norms, torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64), atol=1e-6, rtol=0)
