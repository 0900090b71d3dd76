"""Newton-Schulz orthogonalisation (NS5): the one entry point of the library.

``ns5(G)`` returns an approximation of the polar factor ``U Vᵀ`` of ``G = U S Vᵀ`` by running the quintic
iteration of Keller Jordan's Muon (``KellerJordan/Muon`` muon.py, ``zeropower_via_newtonschulz5``):

    A = X Xᵀ;  X ← a X + (b A + c A²) X,   (a, b, c) = (3.4445, -4.7750, 2.0315)

Why the numerics look the way they do (the 3.2 bound is derived in ``tests/test_ns5.py``; where a naive
fp16 NS5 breaks is measured in OPEN_QUESTIONS.md, Q2):

* Once ``‖X‖₂ ≤ 1`` nothing inside the quintic can overflow even fp16: every intermediate stays ≈ ≤ 3.2.
  What does fail in low precision is the *normalisation*: casting an un-normalised gradient (entries
  > 65504 become Inf in fp16), or taking its Frobenius norm in a narrow type (the norm overflows to Inf,
  the division gives an all-zero update — silent), or an ``eps`` floor that swamps tiny inputs.
* So we normalise in fp32 first: divide by an exact power of two taken from the max-abs entry (exact, so
  it cannot change the direction and keeps ``‖G‖_F²`` inside fp32's range for any finite input), then by
  the Frobenius norm, and only then cast to the hot dtype. The output is invariant to the input's scale
  (bit-exact for power-of-two scales) and a zero input gives a zero output.
* Work happens on the short side: a tall matrix is transposed so that ``X Xᵀ`` is ``min(m, n)`` square.

Leading dimensions are a batch: same-shape matrices are stacked and run through one batched matmul
chain, which is how the optimizers call it (one NS5 per shape bucket, not per parameter).

Backends: ``"torch"`` (this file, the reference and the test oracle of every kernel), ``"triton"``
(``nonans_optim.kernels``, CUDA only), ``"auto"`` (Triton on CUDA for matrices whose short side is at least
:data:`TRITON_MIN_DIM` — the crossover measured by ``python -m experiments kernels`` on an H100; set
``NONANS_NS5_TRITON_MIN_DIM`` to your GPU's — and torch otherwise). ``NONANS_NS5_BACKEND`` overrides ``"auto"``
(an empty value is unset, as for every variable here) wherever :func:`ns5` runs: in ``no.ns5`` and in the
optimizers' ``impl="loop"``/``"foreach"`` steps, where ``triton`` on a CPU tensor is refused as the argument
is. ``impl="fused"``/``"compiled"`` (and ``"auto"``'s fused path) normalise the momentum inside their own
kernels and call :func:`iterate`, the torch iteration, so neither variable reaches them.

Methods: ``"standard"`` (the iteration above), ``"gram"`` (``nonans_optim.ns5_gram``: the same polynomial
iterated on the s×s Gram matrix, with a restart every two steps; fewer FLOPs for wide matrices), ``"auto"``
(Gram on the torch backend where the long/short side ratio is at least ``GRAM_MIN_ASPECT``, measured by
``python -m experiments ns5-method``; standard otherwise and always on Triton). ``NONANS_NS5_METHOD``
overrides ``"auto"``.
"""
from __future__ import annotations

import functools
import numbers
import os
from typing import Sequence

import torch
from einops import rearrange

from nonans_optim import switches
from nonans_optim._workspace import Workspace
from nonans_optim.ns5_gram import iterate_gram

__all__ = ["ns5", "hot_dtype", "normalise", "iterate", "iterate_reference", "KELLER_COEFFICIENTS", "GRAM_MIN_ASPECT",
           "TRITON_MIN_DIM"]

KELLER_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)

# The Frobenius norm of a matrix whose max-abs entry is in [0.5, 1) is at least 0.5, so this eps only
# matters for an all-zero input (0 / eps = 0); it never floors a tiny-but-real input (that was the
# 1e-7 hazard in the reference implementations).
_EPS = 1e-30

# fp16_safe rescale: X' = s·X with b' = b/s², c' = c/s⁴ leaves the iteration unchanged in exact
# arithmetic. With ‖X‖₂ ≤ 1, |(A')²| ≤ 2.1·s⁴, so s = 8 keeps c'·(A')² far below 65504 while lifting
# the smallest entries of X three binary orders away from fp16's subnormal floor.
_FP16_SAFE_SCALE = 8.0

# method="auto" takes the Gram iteration on the torch backend when long side / short side >= this.
# Measured by `python -m experiments ns5-method` (results/ns5_method.json, 2026-11-22; RESULTS.md, "Newton-Schulz:
# standard vs Gram iteration on CPU"; bf16, 2 threads, a shared 2-core AMD EPYC with AVX512-BF16, iteration only,
# same-round ratios gram/standard, batch 1 and 4 and the GPT buckets): l/s = 4: 0.817-0.857, l/s = 3: 0.885-0.943,
# l/s = 2: 0.921-1.01 (batch-1 256×512 broke even), l/s = 1.5: 1.07-1.12, square: 1.17-1.22. FLOPs predict the
# crossover at 1.5 (ns5_gram.gram_flops); 3 is the smallest measured ratio at which Gram won on every shape, batch
# 1 and 4.
GRAM_MIN_ASPECT = 3.0

# backend="auto" takes the Triton kernels on CUDA for matrices whose short side is at least this. Measured by
# `python -m experiments kernels` on an H100 (the run of 2026-11-25: results/kernels.json at commit 319bdff; the
# current file holds a later H200 run, RESULTS.md "Triton kernels on a GPU", with the same crossover; 5 bf16
# iterations, medians of triton.testing.do_bench): Triton beat eager torch on every single matrix from a short
# side of 4096 on (4096², 8192², 4096×11008) and lost on every smaller one (256² to 2048², where each of its 15
# launches cost the host ~80 us in a cProfile of that session, not published: triton's autotuner and JIT
# dispatch) and on every batched stack measured (short sides 512 to 2048). NONANS_NS5_TRITON_MIN_DIM overrides
# it (another GPU has another crossover).
TRITON_MIN_DIM = 4096
_METHODS = switches.NS5_METHODS


_NATIVE_BF16: list[bool] = []  # filled once; a plain global, not lru_cache, so torch.compile traces it


def _cpu_has_native_bf16() -> bool:
    """True when this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16).

    Measured on the CI machines: bf16 matmul ≈ 2.1x fp32 there, fp16 ≈ 50x *slower* than fp32, so fp16 is
    never the CPU default. Read once (the optimizers ask at construction); a user's torch.compile'd
    training step then reads the cached answer — dynamo warns about tracing into an lru_cache."""
    if not _NATIVE_BF16:
        try:
            with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
                flags = f.read()
        except OSError:
            flags = ""
        _NATIVE_BF16.append(("avx512_bf16" in flags) or ("amx_bf16" in flags))
    return _NATIVE_BF16[0]


def hot_dtype(device: torch.device | str, requested: str | torch.dtype | None = "auto") -> torch.dtype:
    """Resolve the NS5 compute dtype. ``"auto"``: bf16 on CUDA; on CPU bf16 only with native bf16 matmul,
    else fp32. ``"fp16_safe"`` resolves to fp16 (the rescale is applied by :func:`ns5`)."""
    if isinstance(requested, torch.dtype):
        return requested
    if requested is None or requested == "auto":
        dev = torch.device(device)
        if dev.type == "cuda":
            return torch.bfloat16
        if dev.type == "cpu" and _cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
             "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
             "fp16_safe": torch.float16}
    if requested not in table:
        raise ValueError(f"hot dtype {requested!r} is not one of 'auto', {sorted(table)}")
    return table[requested]


def normalise(G: torch.Tensor) -> torch.Tensor:
    """fp32 copy of ``G`` scaled to unit Frobenius norm per matrix (last two dims); zero stays zero.

    Step 1 divides by 2**e with max|G| = f·2**e, f ∈ [0.5, 1) — exact in binary floating point, so a
    1e30-scaled input and a 1e-30-scaled input land on the same bits. Step 2 divides by the norm, which is
    now ≥ 0.5 for any non-zero matrix and cannot overflow (≤ sqrt(numel)).

    An fp64 G is scaled in fp64 first and cast after: its entries may lie outside fp32's range (an fp64 G
    of 1e300 became Inf, then NaN; one of 1e-300 became 0), and for one inside it the result is the same
    (a power-of-two scaling commutes with the rounding to fp32, subnormals aside)."""
    Gw = G if G.dtype == torch.float64 else G.float()
    # max|G| from two read-only reductions (abs().amax() would first write |G| out in full; vector_norm
    # with ord=inf over two dims ran 14x slower on CPU); NaN propagates through amax, amin and maximum
    dims = (-2, -1)
    amax = torch.maximum(Gw.amax(dim=dims, keepdim=True), Gw.amin(dim=dims, keepdim=True).neg())
    _, exponent = torch.frexp(amax)
    # Multiply by 2**-e as two exact power-of-two factors built on the small (..., 1, 1) tensor: a single
    # factor overflows fp32 for e < -127, and torch.ldexp on the full matrix cost 7x more on CPU. After the
    # first product X is this function's own buffer, so the rest runs in place (no further full-size
    # allocations: on CPU each fresh one is page-faulted in again).
    half = torch.div(exponent, 2, rounding_mode="floor")
    one = torch.ones_like(amax)
    X = Gw * torch.ldexp(one, -half)
    X.mul_(torch.ldexp(one, half - exponent))
    X = X.float()  # (a no-op for every dtype but fp64)
    norm = torch.linalg.matrix_norm(X, keepdim=True)
    return X.div_(norm + _EPS)


def iterate_reference(X: torch.Tensor, coefficients: Sequence[tuple[float, float, float]], *,
                      tall: bool = False, workspace: Workspace | None = None) -> torch.Tensor:
    """The NS iteration on a normalised, wide (m ≤ n) batch ``X`` of shape (B, m, n), in X's dtype.

    This is the torch reference and the oracle every kernel in ``nonans_optim.kernels`` is tested against;
    kernels implement the same signature. ``workspace``: as in :func:`nonans_optim.ns5_gram.iterate_gram`
    (``out=`` buffers reused across calls; the same arithmetic)."""
    ws = workspace if workspace is not None else Workspace()
    s = X.shape[-1] if tall else X.shape[-2]
    small = (*X.shape[:-2], s, s)
    for a, b, c in coefficients:
        A = ws.get("A", small, X)
        B = ws.get("B", small, X)
        Y = ws.other("X", tuple(X.shape), X, avoid=X)
        if tall:  # X is (B, l, s): the same iteration transposed, XᵀX and X·B (B is symmetric)
            torch.bmm(X.mT, X, out=A)
            torch.baddbmm(A, A, A, beta=b, alpha=c, out=B)
            torch.baddbmm(X, X, B, beta=a, alpha=1.0, out=Y)
        else:
            torch.bmm(X, X.mT, out=A)
            torch.baddbmm(A, A, A, beta=b, alpha=c, out=B)  # b·A + c·A²
            torch.baddbmm(X, B, X, beta=a, alpha=1.0, out=Y)  # a·X + B·X
        X = Y
    return X


def _resolve_backend(backend: str, device: torch.device, shape: tuple[int, ...]) -> str:
    if backend not in switches.NS5_BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, switches.NS5_BACKENDS))}, got {backend!r}")
    if backend == "auto":
        backend = switches.ns5_backend()
    if backend == "auto":
        # Triton only where it has been measured to win (TRITON_MIN_DIM, or the user's own measurement)
        min_dim = switches.ns5_triton_min_dim(TRITON_MIN_DIM)
        if device.type == "cuda" and min(shape) >= min_dim and _triton_ns5() is not None:
            return "triton"
        return "torch"
    if backend == "triton" and device.type != "cuda" and not os.environ.get("TRITON_INTERPRET"):
        raise ValueError("backend='triton' needs a CUDA tensor (or TRITON_INTERPRET=1 for the interpreter)")
    return backend


def _check_method(method: str, requested_backend: str) -> None:
    if method not in _METHODS:
        raise ValueError(f"method must be 'auto', 'standard' or 'gram', got {method!r}")
    if method == "gram" and requested_backend == "triton":
        raise ValueError("method='gram' has no Triton kernel: use backend='torch' or 'auto'")


def _resolve_method(method: str, requested_backend: str, backend: str, shape: tuple[int, ...]) -> str:
    """"standard" or "gram". An explicit ``method="gram"`` runs the torch Gram iteration (there is no Gram
    kernel), so it conflicts only with an explicit ``backend="triton"``; ``"auto"`` (and the env var,
    which only overrides ``"auto"``) never leaves the Triton kernel."""
    _check_method(method, requested_backend)
    if method == "auto":
        method = switches.ns5_method()
        if backend == "triton":
            return "standard"
    if method == "auto":
        s, l = min(shape), max(shape)
        return "gram" if s > 0 and l >= GRAM_MIN_ASPECT * s else "standard"
    return method


def iterate(X: torch.Tensor, coefficients: Sequence[tuple[float, float, float]], *, method: str = "auto",
            tall: bool = False, workspace: Workspace | None = None) -> torch.Tensor:
    """The torch iteration on a normalised batch X already in the hot dtype — wide (B, s, l), or tall
    (B, l, s) with ``tall=True`` (iterated in place of its transpose: no transposed copies) — with the method
    chosen as :func:`ns5` would on the torch backend. For callers that normalise X themselves (the compiled
    spectral path fuses the normalisation into the pass that produces the momentum)."""
    method = _resolve_method(method, "torch", "torch", tuple(X.shape[-2:]))
    if method == "gram":
        return iterate_gram(X, coefficients, tall=tall, workspace=workspace)
    return iterate_reference(X, coefficients, tall=tall, workspace=workspace)


@functools.lru_cache(maxsize=None)
def _triton_ns5():
    try:
        from nonans_optim.kernels.ns5 import ns5_iterate  # type: ignore[import-not-found]
    except Exception:  # triton missing or too old: the torch path is always there
        return None
    return ns5_iterate


def ns5(
    G: torch.Tensor,
    steps: int | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    coefficients: Sequence[tuple[float, float, float]] | None = None,
    backend: str = "auto",
    method: str = "auto",
) -> torch.Tensor:
    """Orthogonalise ``G`` (shape (..., m, n)) by ``steps`` Newton-Schulz quintic iterations.

    Args:
        G: one matrix or a batch of same-shape matrices; any floating dtype; tall or wide.
        steps: number of iterations (default 5, or ``len(coefficients)``; a ``steps`` that disagrees with
            the ``coefficients`` given is refused rather than ignored).
        dtype: hot dtype of the iteration: ``None``/``"auto"`` (see :func:`hot_dtype`), ``"bf16"``,
            ``"fp32"``, ``"fp16"`` or ``"fp16_safe"`` (fp16 with a power-of-two rescale that keeps entries
            away from the subnormal floor), or a ``torch.dtype``.
        coefficients: per-step (a, b, c); default Keller's coefficients repeated ``steps`` times.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        method: ``"auto"``, ``"standard"`` or ``"gram"`` (module docstring; ``NONANS_NS5_METHOD``
            overrides ``"auto"``). Both keep every guarantee below.

    Returns:
        A tensor of ``G``'s shape and dtype. Finite for every finite input; exactly zero for a zero input.
        Not differentiable (the iteration writes into preallocated buffers): a ``G`` that requires grad is
        refused — pass ``G.detach()``.
    """
    if G.ndim < 2:
        raise ValueError(f"ns5 needs a matrix or a batch of matrices, got shape {tuple(G.shape)}")
    if not G.is_floating_point():
        raise ValueError(f"ns5 needs a floating-point tensor, got {G.dtype}")
    if G.requires_grad and torch.is_grad_enabled():
        raise ValueError("ns5 is not differentiable: G requires grad; pass G.detach() (or call it under "
                         "torch.no_grad())")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0):
        raise ValueError(f"steps must be an integer >= 0, got {steps!r}")
    if coefficients is None:
        coefficients = [KELLER_COEFFICIENTS] * (5 if steps is None else steps)
    elif steps is not None and steps != len(coefficients):
        raise ValueError(f"steps={steps} but {len(coefficients)} coefficient triples were given: one (a, b, c) "
                         "per step; leave steps out to run them all")
    requested = "auto" if dtype is None else dtype
    hot = hot_dtype(G.device, requested)
    if not hot.is_floating_point:  # an integer hot dtype would round the normalised G to zeros
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype!r}")
    requested_backend = backend
    _check_method(method, requested_backend)  # before the backend: its CUDA check would mask this error
    backend = _resolve_backend(backend, G.device, tuple(G.shape[-2:]))
    method = _resolve_method(method, requested_backend, backend, tuple(G.shape[-2:]))
    if method == "gram":
        backend = "torch"
    if G.numel() == 0:  # nothing to orthogonalise, and the max-reduction below has no identity
        return torch.empty_like(G)

    batch_shape = G.shape[:-2]
    X = rearrange(normalise(G), "... m n -> (...) m n")
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.mT
    X = X.contiguous()
    if requested == "fp16_safe":
        s = _FP16_SAFE_SCALE
        coefficients = [(a, b / s**2, c / s**4) for a, b, c in coefficients]
        X = X * s
    X = X.to(hot)
    if backend == "triton":
        fn = _triton_ns5()
        if fn is None:
            raise RuntimeError("backend='triton' requested but nonans_optim.kernels could not be imported")
        X = fn(X, list(coefficients))
    elif method == "gram":
        X = iterate_gram(X, coefficients)
    else:
        X = iterate_reference(X, coefficients)
    X = X.float()
    if requested == "fp16_safe":
        X = X / _FP16_SAFE_SCALE
    if tall:
        X = X.mT
    return X.reshape(*batch_shape, *X.shape[-2:]).to(G.dtype)


def ns5_naive(G: torch.Tensor, steps: int = 5, *, dtype: torch.dtype = torch.float16,
              eps: float = 1e-7) -> torch.Tensor:
    """The common implementation, kept as a *foil* for tests and experiments — do not use it to train.

    Casts first, then takes the norm in the hot dtype, with a 1e-7 floor (as Keller's Muon and FusionOpt
    do). In fp16 this overflows to Inf for ‖G‖_F > 65504 (a silent all-zero or NaN update) and underflows
    for tiny inputs; :func:`ns5` exists because of it."""
    X = G.to(dtype)
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)
    a, b, c = KELLER_COEFFICIENTS
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    if tall:
        X = X.mT
    return X.to(G.dtype)
