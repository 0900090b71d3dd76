"""NS5 Triton kernels against a float64 oracle — on CPU under the Triton interpreter, on a GPU when present.

Triton decides interpreted-vs-compiled when ``@triton.jit`` decorates, i.e. when the kernel modules are
imported, so ``TRITON_INTERPRET=1`` cannot be switched on inside a shared pytest process without leaking
into other tests (the AOT tests need compiled kernels). This file therefore has two faces:

* normal run: ``test_interpreter_suite`` re-runs this very file in a subprocess with ``TRITON_INTERPRET=1``
  (where the cases below are collected on ``cpu``), plus ``gpu``-marked runs of the same cases on CUDA;
* interpreter run (``TRITON_INTERPRET=1``): the cases, on small ragged and batched shapes.

Accuracy criterion: relative Frobenius error against a float64 oracle run on the *same rounded inputs*,
``err_kernel <= K · err_torch`` with torch's reference at the same dtype. K = 1.25 for fp16/bf16: both
implementations accumulate in fp32 and round each product once to the same 16-bit format, so their errors
are dominated by identical roundings (measured ratio 1.00-1.03 over 36 seed/shape cases); 1.25 still fails
a truncating cast (≈1.3-2x, the interpreter's own bf16 cast) or an extra rounding step. K = 3 for fp32,
where both errors are summation-order noise of similar size (measured ≤ 1.4x) while a TF32 slip costs
~10³x. The fused fp16-safe variant is held to 2x (measured ≤ 1.6x on 7x50, where few roundings dominate).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from interpreted import assert_interpreted_suite_passes

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
REPO = Path(__file__).resolve().parents[1]
K = {torch.float32: 3.0, torch.float16: 1.25, torch.bfloat16: 1.25}
K_FP16_SAFE = 2.0
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
B_COEF, C_COEF, A_COEF = -4.7750, 2.0315, 3.4445
CUDA = torch.cuda.is_available()


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def _input(shape, dtype, device, seed=0):
    from nonans_optim.ns5 import normalise

    g = torch.Generator().manual_seed(seed)
    return normalise(torch.randn(*shape, generator=g)).to(device=device, dtype=dtype)


def _assert_within(kernel_err: float, torch_err: float, k: float, what: str, contraction: int = 0) -> None:
    """kernel error ≤ k × torch's error at the same dtype. In fp32, torch's error may be the output rounding
    alone (cuBLAS on an H100: 7.6e-8 for a 1030-long contraction, 2026-11-25), which no single-pass fp32
    accumulation reaches; there the bar is the probabilistic bound √K·u of a K-term fp32 sum (Higham and
    Mary, "A new approach to probabilistic rounding error analysis", SISC 2019), u = 2⁻²⁴."""
    floor = math.sqrt(contraction) * 2.0 ** -24 if contraction else 0.0
    bar = k * max(torch_err, floor)
    assert kernel_err <= bar, f"{what}: kernel error {kernel_err:.3e} > {k} x max(torch {torch_err:.3e}, {floor:.1e})"


# ----------------------------------------------------------------------------------------------- cases
def case_gram(device, dtype, shape):
    from nonans_optim.kernels import gram, gram_reference

    X = _input(shape, dtype, device)
    A = gram(X)
    assert A.shape == (shape[0], shape[1], shape[1]) and A.dtype == dtype
    assert torch.equal(A, A.mT), "gram output must be exactly symmetric (one triangle, mirrored)"
    X64 = X.double()
    oracle = X64 @ X64.mT
    _assert_within(_rel(A, oracle), _rel(gram_reference(X), oracle), K[dtype], f"gram {dtype} {shape}",
                   contraction=shape[2] if dtype is torch.float32 else 0)


def case_gram_scaled(device, shape):
    """fp32 input, rescaled by 8 and rounded to fp16 on load (the fp16-safe first iteration)."""
    from nonans_optim.kernels import gram, gram_reference

    X = _input(shape, torch.float32, device) * 1e-3  # entries near fp16's subnormal range before scaling
    A = gram(X, in_scale=8.0, dtype=torch.float16)
    assert A.dtype == torch.float16 and torch.equal(A, A.mT)
    X64 = X.double() * 8.0
    oracle = X64 @ X64.mT
    ref = gram_reference(X, in_scale=8.0, dtype=torch.float16)
    _assert_within(_rel(A, oracle), _rel(ref, oracle), K[torch.float16], f"scaled gram {shape}")


def case_poly(device, dtype, shape):
    from nonans_optim.kernels import gram_reference, poly, poly_reference

    A = gram_reference(_input(shape, dtype, device))
    A = (A + A.mT) / 2  # exactly symmetric, as the kernel requires
    P = poly(A, B_COEF, C_COEF)
    assert P.shape == A.shape and P.dtype == dtype
    assert torch.equal(P, P.mT), "poly output must be exactly symmetric"
    oracle = poly_reference(A.double(), B_COEF, C_COEF)
    _assert_within(_rel(P, oracle), _rel(poly_reference(A, B_COEF, C_COEF), oracle), K[dtype],
                   f"poly {dtype} {shape}")


def case_axpb(device, dtype, shape, scaled=False):
    from nonans_optim.kernels import axpb, axpb_reference, gram_reference, poly_reference

    X = _input(shape, dtype, device)
    Bm = poly_reference(gram_reference(X), B_COEF, C_COEF)
    kw = dict(in_scale=8.0, out_scale=0.125, out_dtype=torch.float32) if scaled else {}
    Y = axpb(Bm, X, A_COEF, **kw)
    assert Y.shape == X.shape and Y.dtype == kw.get("out_dtype", dtype)
    X64 = X.double() * (8.0 if scaled else 1.0)
    oracle = (A_COEF * X64 + Bm.double() @ X64) * (0.125 if scaled else 1.0)
    _assert_within(_rel(Y, oracle), _rel(axpb_reference(Bm, X, A_COEF, **kw), oracle), K[dtype],
                   f"axpb {dtype} {shape} scaled={scaled}")


def case_ns5_iterate(device, dtype, shape):
    from nonans_optim.kernels import ns5_iterate, ns5_iterate_reference
    from nonans_optim.ns5 import KELLER_COEFFICIENTS

    coefficients = [KELLER_COEFFICIENTS] * 5
    X = _input(shape, dtype, device)
    X_before = X.clone()
    Y = ns5_iterate(X, coefficients)
    assert Y.shape == X.shape and Y.dtype == dtype
    assert torch.equal(X, X_before), "ns5_iterate must not write into its input"
    oracle = ns5_iterate_reference(X.double(), coefficients)
    _assert_within(_rel(Y, oracle), _rel(ns5_iterate_reference(X, coefficients), oracle), K[dtype],
                   f"ns5_iterate {dtype} {shape}")


def case_ns5_fp16_safe(device, shape):
    from nonans_optim.kernels import ns5_iterate_fp16_safe, ns5_iterate_fp16_safe_reference, ns5_iterate_reference
    from nonans_optim.ns5 import KELLER_COEFFICIENTS

    coefficients = [KELLER_COEFFICIENTS] * 5
    X = _input(shape, torch.float32, device, seed=1)
    Y = ns5_iterate_fp16_safe(X, coefficients)
    assert Y.dtype == torch.float32 and Y.shape == X.shape
    oracle = ns5_iterate_reference(X.double(), coefficients)
    _assert_within(_rel(Y, oracle), _rel(ns5_iterate_fp16_safe_reference(X, coefficients), oracle),
                   K_FP16_SAFE, f"ns5_iterate_fp16_safe {shape}")
    one = ns5_iterate_fp16_safe(X, coefficients[:1])  # first and last iteration at once: s·(1/s)
    oracle1 = ns5_iterate_reference(X.double(), coefficients[:1])
    _assert_within(_rel(one, oracle1), _rel(ns5_iterate_fp16_safe_reference(X, coefficients[:1]), oracle1),
                   K_FP16_SAFE, "fp16-safe single iteration")


def case_ns5_entry_point(device):
    """``nonans_optim.ns5.ns5(backend='triton')`` — tall, batched input — agrees with the torch backend."""
    from nonans_optim.ns5 import ns5

    g = torch.Generator().manual_seed(3)
    G = torch.randn(2, 56, 36, generator=g).to(device)
    for dtype, tol in (("fp32", 1e-5), ("fp16_safe", 5e-3)):
        Y = ns5(G, dtype=dtype, backend="triton")
        R = ns5(G, dtype=dtype, backend="torch")
        assert Y.shape == G.shape and Y.dtype == G.dtype
        assert _rel(Y, R.double()) < tol, f"ns5 {dtype}: triton vs torch {_rel(Y, R.double()):.2e}"
    assert torch.equal(ns5(torch.zeros(1, 24, 40, device=device), backend="triton"),
                       torch.zeros(1, 24, 40, device=device))


SHAPES = [(3, 40, 72), (1, 5, 9), (2, 33, 33)]  # ragged vs 16/32 interpreter tiles, batched, tiny, square
GPU_SHAPES = [(3, 200, 520), (2, 256, 256), (1, 70, 1030)]  # ragged vs 64/128 tiles

if INTERPRETED:
    import interpreter_patches
    import triton
    import triton.language as tl  # a module global: the interpreter finds the language in a kernel's globals
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @triton.jit
    def _helper(x):
        return x * 2.0 + tl.abs(x)

    @triton.jit
    def _helper_loop(X, Y, N, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros((BLOCK,), tl.float32)
        for i in range(N):
            acc += _helper(tl.load(X + i * BLOCK + offs))
        tl.store(Y + offs, acc + tl.sum(acc, axis=0))  # tl.sum: a helper of tl.standard (tl.core's globals)

    def test_language_patches_are_shared_per_launch(monkeypatch):
        """tests/interpreter_patches.py (installed by conftest): a launch patches triton.language once
        however many helper calls it makes — stock Triton patches again at every call — and computes exactly
        what stock patching computes."""
        from triton.runtime import interpreter

        assert interpreter_patches.installed(), (
            f"triton {triton.__version__}: tests/interpreter_patches.py no longer applies to this interpreter "
            "(the interpreter suites run up to 2x slower without it): adapt it to the new version")
        n, block = 7, 16
        x = torch.randn(n * block)
        patched = []
        stock = interpreter_patches._stock

        def counted(fn):
            patched.append(fn.__name__)
            return stock(fn)

        def run():
            patched.clear()
            y = torch.empty(block)
            _helper_loop[(1,)](x, y, n, BLOCK=block)
            return y, list(patched)

        monkeypatch.setattr(interpreter_patches, "_stock", counted)
        shared, shared_patches = run()
        monkeypatch.setattr(interpreter, "_patch_lang", counted)  # stock Triton: every call patches
        monkeypatch.setattr(interpreter.GridExecutor, "__call__", interpreter.GridExecutor.__call__._stock)
        plain, plain_patches = run()
        assert plain_patches.count("_helper") == n and shared_patches.count("_helper") == 0, (
            plain_patches, shared_patches)
        assert shared_patches[0] == plain_patches[0] == "_helper_loop" and len(shared_patches) <= 2
        assert torch.equal(shared, plain)
        acc = (x.view(n, block) * 2 + x.view(n, block).abs()).sum(0)
        torch.testing.assert_close(shared, acc + acc.sum())

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("shape", SHAPES, ids=str)
    def test_gram(dtype, shape):
        case_gram("cpu", dtype, shape)

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("shape", SHAPES, ids=str)
    def test_poly(dtype, shape):
        case_poly("cpu", dtype, shape)

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("shape", SHAPES, ids=str)
    def test_axpb(dtype, shape):
        case_axpb("cpu", dtype, shape)

    def test_scaled_variants():
        case_gram_scaled("cpu", (3, 40, 72))
        case_axpb("cpu", torch.float16, (3, 40, 72), scaled=True)

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_ns5_iterate(dtype):
        case_ns5_iterate("cpu", dtype, (3, 40, 72))

    def test_ns5_fp16_safe():
        case_ns5_fp16_safe("cpu", (3, 40, 72))

    def test_ns5_entry_point():
        case_ns5_entry_point("cpu")

    @settings(max_examples=6, deadline=None)
    @given(b=st.integers(1, 3), m=st.integers(1, 40), extra=st.integers(0, 40), dtype=st.sampled_from(DTYPES),
           seed=st.integers(0, 2**16))
    def test_property_symmetric_and_accurate(b, m, extra, dtype, seed):
        from nonans_optim.kernels import gram, gram_reference, poly, poly_reference

        X = _input((b, m, m + extra), dtype, "cpu", seed)
        A = gram(X)
        assert torch.equal(A, A.mT)
        oracle = X.double() @ X.double().mT
        _assert_within(_rel(A, oracle), _rel(gram_reference(X), oracle), K[dtype], "gram property")
        P = poly(A, B_COEF, C_COEF)
        assert torch.equal(P, P.mT)
        oracle = poly_reference(A.double(), B_COEF, C_COEF)
        _assert_within(_rel(P, oracle), _rel(poly_reference(A, B_COEF, C_COEF), oracle), K[dtype], "poly property")

    def test_zero_iterations_and_bad_inputs():
        from nonans_optim.kernels import axpb, gram, ns5_iterate, ns5_iterate_fp16_safe, poly

        X = _input((1, 8, 12), torch.float32, "cpu")
        assert ns5_iterate(X, []) is X
        with pytest.raises(ValueError, match="wide"):
            ns5_iterate(X.mT.contiguous(), [(1.0, 0.0, 0.0)])
        with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
            gram(X.double())
        square = _input((1, 8, 8), torch.float32, "cpu")
        with pytest.raises(ValueError, match="alias"):
            gram(square, out=square)
        with pytest.raises(ValueError, match="alias"):
            poly(square, 1.0, 1.0, out=square)
        with pytest.raises(ValueError, match="alias"):
            axpb(square, X, 1.0, out=X)
        with pytest.raises(ValueError, match="power of two"):
            ns5_iterate_fp16_safe(X, [(1.0, 0.0, 0.0)], scale=6.0)

    def test_benchmark_dry_run(tmp_path):
        from experiments import kernels as bench

        out = tmp_path / "kernels.json"
        assert bench.main(["--dry-run", "--out", str(out)]) == 0
        data = json.loads(out.read_text())
        assert data["dry_run"] is True and "interpreter" in data["device"]
        shapes = {(r["batch"], r["m"], r["n"]) for r in data["ns5"]}
        assert shapes == set(bench.DRY_SHAPES)
        for row in data["ns5"]:
            assert row["triton_ms"] > 0 and row["eager_ms"] > 0 and row["compiled_ms"] > 0
            # the benchmark's own accuracy column: bf16 kernel vs bf16 eager against an fp32 run
            assert row["rel_err_triton"] <= K[torch.bfloat16] * row["rel_err_eager"]
        assert data["elementwise"]["adamw_repair_gbps"] > 0
        # FusionOpt 2b: the fused fp16-safe variant, its unfused torch twin, plain fp16 and bf16, each timed
        # and each within its dtype's error of the fp32 iteration (the fused one no worse than the unfused)
        assert {(r["batch"], r["m"], r["n"]) for r in data["fp16_safe"]} == set(bench.FP16_DRY_SHAPES)
        for r in data["fp16_safe"]:
            assert all(r[f"{arm}_ms"] > 0 for arm in ("fused", "unfused_torch", "plain_fp16", "plain_bf16"))
            assert r["rel_err_fused"] <= K_FP16_SAFE * r["rel_err_unfused_torch"] and r["rel_err_plain_bf16"] < 0.05
        fused = data["fused_step"]
        assert fused["numel"] == 4096 and all(fused[f"{k}_ms"] > 0 for k in ("repair", "off", "torch_fused"))
        text = bench.render(data)  # the GPU run's RESULTS.md section, exercised on the dry run's JSON
        assert all(f"| {b}×{m}×{n} |" in text for b, m, n in bench.DRY_SHAPES) and "Targets:" in text
        assert 'AdamW(impl="fused") repair / off' in text and "open question 2b" in text
        assert f"measured {data['date']}" in text  # which run a table is: its date is in the section
        assert "GPU time per step" not in text  # the profiler's breakdown is a CUDA run's only
        fused["device_us"] = {"repair": {"_update_kernel": 400.0, "_stats_kernel": 9.0, "total": 409.0},
                              "off": {"_update_kernel": 380.0, "total": 380.0}}
        text = bench.render(data)
        assert "| repair | " in text and "| 409 | `_update_kernel` 400, `_stats_kernel` 9 |" in text
        # the launch-shape sweep ran every shape, each arm timed (GPU µs only from a CUDA run), and renders
        from experiments.kernels_step import CONFIGS
        assert [(r["block"], r["warps"]) for r in data["block_sweep"]] == list(CONFIGS)
        assert all(r["repair_ms"] > 0 and r["off_ms"] > 0 and "repair_device_us" not in r for r in data["block_sweep"])
        assert "| 1024 × 4 | " in text and "| — | — |" in text
        # the one-launch kernel's timing-only variants, beside "off", at two shapes
        from nonans_optim.kernels.scalar_one import ABLATIONS
        looping = ["looping programs, 3 per SM", "looping programs, 12 per SM"]
        assert [r["variant"] for r in data["one_launch_ablation"]] == ["off", *ABLATIONS, *looping] * 2
        assert all(r["ms"] > 0 and "device_us" not in r for r in data["one_launch_ablation"])
        assert "per-program cost, by suspect" in text and "| 1024 × 8 | no hold-rule prologue |" in text
        # the spectral fused step: both optimizers, both policies, timed (GPU µs only from a CUDA run)
        spec = data["spectral_step"]
        assert [(r["optimizer"], r["policy"]) for r in spec] == [
            (cls, arm) for cls in ("SFNorMuon", "FullFusion") for arm in ("repair", "off", "repair, unfolded")]
        assert all(r["ms"] > 0 and "device_us" not in r for r in spec)
        assert "| FullFusion | off | " in text
        with pytest.raises(SystemExit, match="GPU runs only"):  # a dry run never reaches RESULTS.md
            bench.main(["--render-only", "--out", str(out), "--results-md", str(tmp_path / "R.md")])
        assert not (tmp_path / "R.md").exists()
        assert set(data["targets"]["met"]) == set(bench.TARGETS)

    def test_block_sweep_runs_every_kernel_at_its_shape(monkeypatch):
        """The launch-shape sweep gives every kernel of the step the shape it names — the one-launch kernel
        (the "repair" default) too, which until 2026-11-27 kept its own 2048 x 8 over the sweep's layout."""
        from experiments.kernels_step import CONFIGS, bench_block_sweep
        from nonans_optim.kernels import scalar_one

        seen = set()
        real_step = scalar_one.scalar_step_one_

        def recorded(*args, **kwargs):
            seen.add(scalar_one.elementwise_block())
            return real_step(*args, **kwargs)
        monkeypatch.setattr(scalar_one, "scalar_step_one_", recorded)
        rows = bench_block_sweep(lambda step: (step(), 1.0)[1], torch.device("cpu"), 4096, lambda *_: None)
        assert [(r["block"], r["warps"]) for r in rows] == list(CONFIGS)
        assert seen == set(CONFIGS)  # the one-launch step ran at each shape, as the row says
        kw = dict.fromkeys(("sf", "decay_z", "sel", "counters", "numel", "dense", "scratch", "step", "backoff",
                            "min_scale", "growth_interval", "repeat_window"))
        with pytest.raises(ValueError, match="ablate takes the bits of ABLATIONS"):  # before anything is read
            real_step(*[None] * 8, **kw, ablate=4)

else:
    @pytest.mark.parametrize("shard", range(2))
    def test_interpreter_suite(shard):
        """Run the cases above under TRITON_INTERPRET=1 in fresh processes (see the module docstring), in two
        shards (tests/interpreted.py: the whole suite took 164 s, a long tail for CI's two workers)."""
        assert_interpreted_suite_passes(__file__, timeout=900, shard=(shard, 2))

    def test_package_works_without_triton():
        """With triton unimportable, ``nonans_optim.kernels`` still imports and says so; ns5 falls back."""
        code = ("import sys; sys.modules['triton'] = None\n"
                "import importlib, torch, nonans_optim.kernels as k\n"
                "n = importlib.import_module('nonans_optim.ns5')\n"
                "assert k.available() is False\n"
                "try:\n    k.ns5_iterate\nexcept ImportError:\n    pass\nelse:\n    raise SystemExit('imported')\n"
                "assert n._triton_ns5() is None\n"
                "G = torch.randn(8, 12)\n"
                "assert torch.equal(n.ns5(G, backend='auto'), n.ns5(G, backend='torch'))\n")
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                              env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
        assert proc.returncode == 0, proc.stderr[-3000:]

    def test_benchmark_without_cuda_writes_nothing(tmp_path, monkeypatch):
        from experiments import kernels as bench

        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        out = tmp_path / "kernels.json"
        assert bench.main(["--out", str(out)]) == 0
        assert not out.exists()

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
    @pytest.mark.gpu
    @pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
    def test_gpu_pieces(dtype, shape):
        case_gram("cuda", dtype, shape)
        case_poly("cuda", dtype, shape)
        case_axpb("cuda", dtype, shape)

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.gpu
    @pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
    def test_gpu_ns5(dtype):
        case_ns5_iterate("cuda", dtype, (3, 200, 520))
        case_ns5_iterate("cuda", dtype, (1, 1024, 1024))

    @pytest.mark.gpu
    @pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
    def test_gpu_fp16_safe_and_entry_point():
        case_gram_scaled("cuda", (3, 200, 520))
        case_axpb("cuda", torch.float16, (3, 200, 520), scaled=True)
        case_ns5_fp16_safe("cuda", (3, 200, 520))
        case_ns5_entry_point("cuda")
