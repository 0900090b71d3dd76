"""Open question 2 — where does fp16 NS5 fail, and does our normalisation (or a rescale) fix it?

No training: NS5 is run on Gaussian, low-rank (rank 4) and heavy-tailed (Gaussian × Pareto(1.5), tail index 1.5)
matrices of size 64²…1024² at input scales 1e-8…1e4 (a gradient or momentum matrix of that entry magnitude). Each
run is traced stage by stage, and the first stage that breaks is recorded:

* ``cast``  — the fp16 cast makes an entry Inf (|g| > 65504), or flushes every entry to 0;
* ``norm``  — the Frobenius norm taken in fp16 overflows (→ X/Inf = 0: a *silent* zero update) or is 0;
* ``poly``  — an intermediate of the quintic (A = XXᵀ, B = bA + cA², aX + BX) is non-finite;
* ``ok``    — finite and non-zero; then the relative error against the fp32 result is reported.

Foil: the common implementation (cast → fp16 norm with a 1e-7 floor → iterate; ``nonans_optim.ns5.ns5_naive``).
Ours: fp32 power-of-two + Frobenius normalisation, then fp16 (``ns5(G, dtype="fp16")``) or the rescaled
``"fp16_safe"``. fp16 matmul on this CPU is ~50x slower than fp32, so above ``real_max`` the matmuls are
*emulated*: fp16 operands multiplied with fp32 accumulation and rounded to fp16 (what GPU tensor cores do);
at and below ``real_max`` the real ``ns5_naive``/``ns5`` are run too and must agree with the trace.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from nonans_optim.ns5 import KELLER_COEFFICIENTS, _FP16_SAFE_SCALE, normalise, ns5, ns5_naive

__all__ = ["make_input", "trace_naive", "trace_ours", "run_q2", "render_q2"]

H = torch.float16


def make_input(kind: str, n: int, scale: float, seed: int = 0) -> torch.Tensor:
    """An n×n fp32 matrix with entries of magnitude ~``scale``."""
    g = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        G = torch.randn(n, n, generator=g)
    elif kind == "lowrank":
        G = torch.randn(n, 4, generator=g) @ torch.randn(4, n, generator=g) / 2.0
    elif kind == "heavytail":  # a Gaussian times a Pareto(1.5) scale: tail index 1.5, infinite variance
        u = torch.rand(n, n, generator=g).clamp_min(1e-12)
        G = torch.randn(n, n, generator=g) * u.pow(-1 / 1.5)
    else:
        raise ValueError(kind)
    return G * scale


def _mm(a: torch.Tensor, b: torch.Tensor, real: bool) -> torch.Tensor:
    return a @ b if real else (a.float() @ b.float()).to(H)


def _iterate(X: torch.Tensor, coeffs, real: bool) -> tuple[torch.Tensor, str | None]:
    for k, (a, b, c) in enumerate(coeffs):
        A = _mm(X, X.mT, real)
        B = b * A + c * _mm(A, A, real)
        X = a * X + _mm(B, X, real)
        if not (torch.isfinite(A).all() and torch.isfinite(B).all() and torch.isfinite(X).all()):
            return X, f"poly@{k + 1}"
    return X, None


def _classify(X: torch.Tensor, ref: torch.Tensor, stage: str | None) -> dict[str, Any]:
    finite = bool(torch.isfinite(X).all())
    zero = finite and float(X.abs().max()) == 0.0
    err = float((X.float() - ref).norm() / ref.norm()) if finite and not zero else float("nan")
    if stage is None:
        stage = "zero-output" if zero else ("ok" if finite else "nonfinite")
    return {"stage": stage, "finite": finite, "zero": zero, "rel_err": err}


def trace_naive(G: torch.Tensor, ref: torch.Tensor, real: bool, eps: float = 1e-7) -> dict[str, Any]:
    """The foil, stage by stage (same arithmetic as ``ns5_naive``)."""
    X = G.to(H)
    if not torch.isfinite(X).all():
        stage = "cast-overflow"
    elif float(X.abs().max()) == 0.0:
        stage = "cast-underflow"
    else:
        stage = None
    nrm = X.norm()
    if stage is None and not torch.isfinite(nrm):
        stage = "norm-overflow"
    X = X / (nrm + eps)
    coeffs = [KELLER_COEFFICIENTS] * 5
    X, poly = _iterate(X, coeffs, real)
    out = _classify(X, ref, stage or poly)
    out["flushed_frac"] = float(((G != 0) & (G.to(H) == 0)).float().mean())
    return out


def trace_ours(G: torch.Tensor, ref: torch.Tensor, real: bool, safe: bool) -> dict[str, Any]:
    """Our ns5 in fp16 (``safe``: the s = 8 rescale with b/s², c/s⁴), stage by stage."""
    X = normalise(G)
    coeffs = [KELLER_COEFFICIENTS] * 5
    if safe:
        s = _FP16_SAFE_SCALE
        coeffs, X = [(a, b / s**2, c / s**4) for a, b, c in coeffs], X * s
    X = X.to(H)
    stage = "cast-overflow" if not torch.isfinite(X).all() else None
    X, poly = _iterate(X, coeffs, real)
    X = X.float() / (_FP16_SAFE_SCALE if safe else 1.0)
    return _classify(X, ref, stage or poly)


def run_q2(sizes=(64, 128, 256, 512, 1024), kinds=("gaussian", "lowrank", "heavytail"),
           scales=(1e-8, 1e-4, 1.0, 1e2, 1e4), real_max: int = 128) -> dict[str, Any]:
    rows, crosscheck = [], []
    for kind in kinds:
        for n in sizes:
            for scale in scales:
                G = make_input(kind, n, scale)
                ref = ns5(G, dtype="fp32")
                real = n <= real_max
                row = {"kind": kind, "n": n, "scale": scale, "real_fp16": real, "amax": float(G.abs().max()),
                       "fro": float(G.double().norm()),
                       "naive": trace_naive(G, ref, real), "fp16": trace_ours(G, ref, real, False),
                       "fp16_safe": trace_ours(G, ref, real, True)}
                rows.append(row)
                if real:  # the real library functions must agree with the trace
                    nv, ours = ns5_naive(G), ns5(G, dtype="fp16")
                    crosscheck.append({"kind": kind, "n": n, "scale": scale,
                                       "naive_finite_nonzero": bool(torch.isfinite(nv).all() and nv.abs().max() > 0),
                                       "trace_naive_ok": row["naive"]["stage"] == "ok",
                                       "ns5_fp16_finite": bool(torch.isfinite(ours).all())})
    return {"rows": rows, "crosscheck": crosscheck, "sizes": list(sizes), "kinds": list(kinds),
            "scales": list(scales), "real_max": real_max}


def first_failure(data: dict[str, Any], impl: str) -> dict[tuple[str, float], Any]:
    """Smallest size at which ``impl`` breaks, per (kind, scale); None if it never does."""
    out: dict[tuple[str, float], Any] = {}
    for r in data["rows"]:
        key = (r["kind"], r["scale"])
        out.setdefault(key, None)
        if r[impl]["stage"] != "ok" and (out[key] is None or r["n"] < out[key][0]):
            out[key] = (r["n"], r[impl]["stage"])
    return out


def render_q2(data: dict[str, Any]) -> str:
    from .questions_io import md_table
    fails = {impl: first_failure(data, impl) for impl in ("naive", "fp16", "fp16_safe")}
    rows = []
    for kind in data["kinds"]:
        for scale in data["scales"]:
            cells = []
            for impl in ("naive", "fp16", "fp16_safe"):
                f = fails[impl][(kind, scale)]
                cells.append("never (≤%d²)" % max(data["sizes"]) if f is None else f"{f[0]}² ({f[1]})")
            errs = [r for r in data["rows"] if r["kind"] == kind and r["scale"] == scale]
            worst = max((r["fp16_safe"]["rel_err"] for r in errs if math.isfinite(r["fp16_safe"]["rel_err"])),
                        default=float("nan"))
            worst16 = max((r["fp16"]["rel_err"] for r in errs if math.isfinite(r["fp16"]["rel_err"])),
                          default=float("nan"))
            worst_naive = max((r["naive"]["rel_err"] for r in errs if math.isfinite(r["naive"]["rel_err"])),
                              default=float("nan"))
            flushed = max(r["naive"]["flushed_frac"] for r in errs)
            rows.append([kind, f"{scale:.0e}", *cells, f"{worst_naive:.1e}", f"{100 * flushed:.0f}%",
                         f"{worst16:.1e}", f"{worst:.1e}"])
    agree = sum(c["naive_finite_nonzero"] == c["trace_naive_ok"] for c in data["crosscheck"])
    return (md_table(["input", "entry scale", "naive fp16: first failure", "ours fp16", "ours fp16_safe",
                      "naive worst rel err (when finite)", "naive: entries flushed to 0",
                      "ours fp16 worst rel err vs fp32", "fp16_safe worst rel err"], rows)
            + f"\n\nCross-check: the real `ns5_naive` agreed with the stage trace on {agree}/{len(data['crosscheck'])} "
              f"cases run in real fp16 (n ≤ {data['real_max']}); the real `ns5(dtype='fp16')` was finite on "
              f"{sum(c['ns5_fp16_finite'] for c in data['crosscheck'])}/{len(data['crosscheck'])}.")
