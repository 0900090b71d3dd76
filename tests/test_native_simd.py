"""The SIMD builds of the native loops against the portable build (``NONANS_NATIVE_SIMD=portable``, the
exact loops alone): the AVX-512 form (nonans_optim/native/simd_avx512.h: the (SF-)AdamW step and the spectral
update), the AVX2 form of the (SF-)AdamW step (scalar_avx2.h) and the generic form a CPU with neither runs
(scalar_entry.h's tested groups). Each is the same arithmetic op for op, so every parameter, state
buffer and event count must be bit-identical — over test_fused.py's fault sequence (NaN, ±Inf, a g²
overflow, the hold rule, a spike the guard rescales, the pre-pass path), under every policy, with the guard
on and off, one and two threads, both branches of the lerp formula; over test_fused_spectral.py's for
SF-NorMuon, Muon and FullFusion (under "skip" too); and with updates that overflow to ±Inf and NaN inside
the step (the update stage's NaN/Inf split), and a step size that is NaN for one step; most runs in bf16
as well (the (SF-)AdamW loop: scalar_avx512_bf16.h or scalar_avx2_bf16.h against the portable
scalar_bf16.h; the spectral loops' bf16 rows, and one value in the window alone: test_fused_bf16.py's 16 x 1
runs). test_fused.py and
test_fused_spectral.py already compare each build with impl="loop" within tolerances; this pins down that the
fast paths changed nothing.

Each build runs in its own subprocess (the library is loaded once per process) and saves its results. The
default build is compared, on an AVX-512 machine the AVX2 form too (``NONANS_NATIVE_SIMD=avx2``), and the
generic form (``NONANS_NATIVE_SIMD=generic``) wherever it is not the default. The AVX2 form and the generic
form's tested groups rely on one bound on the inputs (input_limit_); the exact portable build is what checks
it, which is why the magnitude runs below reach it: a bound too loose writes other bits than the gates.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nonans_optim import native
from nonans_optim._global_state import global_entry

HERE = Path(__file__).parent

_FORM = native.scalar_form()
pytestmark = pytest.mark.skipif(_FORM is None, reason=f"native kernel unavailable: {native.failure()}")
# (NONANS_NATIVE_SIMD, the form that build must report, native.scalar_form): the default; the AVX2 form where
# it is not; the generic form (what a CPU without either runs: aarch64) where it is not
SIMD_BUILDS = ([("auto", _FORM)] + ([("avx2", "avx2")] if _FORM == "avx512" else [])
               + ([("generic", "generic")] if _FORM != "generic" else []))

# (optimizer, policy, threads, extra constructor arguments)
CASES = [(cls, policy, 2, {}) for cls in ("AdamW", "SFAdamW") for policy in ("repair", "skip", "off")]
CASES += [("AdamW", "repair", 1, {"spike_factor": None}), ("SFAdamW", "repair", 1, {"spike_factor": None}),
          ("AdamW", "repair", 2, {"betas": (0.3, 0.99)}),  # 1-β₁ ≥ 0.5: lerp's other formula
          ("SFAdamW", "repair", 2, {"weight_decay": 0.0})]  # no decay of z

_DUMP = r"""
import ast, sys, torch
from mkl_vml import settle_mkl_vml
settle_mkl_vml()  # two processes' results compared bit for bit: see tests/mkl_vml.py
import nonans_optim as no
from nonans_optim import native
from test_fused import _run
from test_fused_spectral import _run as spectral_run
from test_fused_bf16 import BF16_MAX, SPECTRAL_SHAPES, _column_window_run, _spectral_grads

def overflow_run(cls, policy, dtype=torch.float32):
    # Parameters near the fp32 limit and a huge step size: the new y (and z) overflow to ±Inf, and
    # Inf - Inf makes NaN, inside the step with finite gradients — the update stage's NaN/Inf split.
    torch.manual_seed(3)
    params = [torch.randn(s).to(dtype).requires_grad_() for s in ((1000,), (37,), (40, 30))]
    with torch.no_grad():
        for p in (params[0], params[2].view(-1)):
            p[::7] = 3.3e38
            p[1::7] = -3.3e38
    opt = getattr(no, cls)(params, lr=1e38, resolution=policy, impl="fused", spike_factor=None)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        opt.step()
    return params, opt

def nan_step_size_run(cls, dtype=torch.float32):
    # A tensor lr filled with NaN for one step: every new y (and z) NaN from finite inputs and finite
    # hyperparameters otherwise — what the AVX2 loop's early test, a bound on the inputs, could not see.
    torch.manual_seed(7)
    params = [torch.randn(s).to(dtype).requires_grad_() for s in ((1000,), (37,), (40, 30))]
    lr = torch.tensor(1e-3)
    opt = getattr(no, cls)(params, lr=lr, resolution="repair", impl="fused", spike_factor=None)
    gen = torch.Generator().manual_seed(8)
    for step in range(4):
        lr.fill_(float("nan") if step == 2 else 1e-3)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        opt.step()
    return params, opt

def v_only_run(cls, n, pos, dtype=torch.float32):
    # A finite gradient entry whose square overflows: only its new v is non-finite (d = m / Inf = 0 leaves
    # y and z finite), the one value the AVX-512 loop's test (vcheck_'s v·y + z) sees through a product —
    # in a four-vector step of the clean loop (n = 256) and in a partial last vector (n = 17).
    torch.manual_seed(6)
    p = torch.randn(n).to(dtype).requires_grad_()
    opt = getattr(no, cls)([p], lr=1e-3, resolution="repair", impl="fused", spike_factor=None)
    for step in range(3):
        p.grad = (torch.randn(n) * 1e-3).to(dtype)
        if step == 1:
            p.grad[pos] = 1e30
        opt.step()
    assert opt.state_dict()["state"][0]["exp_avg_sq"].isfinite().all()
    return [p], opt

def magnitude_run(cls, lr, eps, top, top_grad, zero_v=False, dtype=torch.float32, **kw):
    # Parameters, state and gradients whose magnitudes spread log-uniformly from 1e-30 to 10^top (gradients
    # after the first step: 10^top_grad), with random signs: some entries sit just under the bound of the
    # AVX2 loop's early test (input_limit_ in scalar_avx2.h, at most clean_limit_ in scalar_entry.h, which
    # depends on lr and eps) and some just over it, and the largest overflow inside the step — for the AVX-512
    # loop, which tests the new values, the same runs put finite sums of huge terms beside overflowing ones.
    # A quarter of the entries get a (negative, finite) v that cancels the coming g², so the new v is about 0
    # and the denominator about eps: the case the bound is sharp for. The portable build tests every value it
    # computes, so a test that let an overflowing entry through writes other bits. The AVX-512 test is per
    # 64 entries (AVX2: 32), so a run meant to reach the bound keeps most magnitudes below it (a small top):
    # one entry over it sends its neighbours to the exact path too. zero_v: the quarter gets v = +0 instead,
    # which the AVX2 form's test (on the old v, which must not be negative) lets through, so a large m over a
    # denominator of about eps is where its bound is sharp (AdamW; a bound 1000x too loose fails it).
    gen = torch.Generator().manual_seed(5)

    def spread(n, lo=-30.0, hi=38.5):
        sign = torch.randint(0, 2, (n,), generator=gen) * 2 - 1
        return sign * 10.0 ** (lo + (hi - lo) * torch.rand(n, generator=gen))

    params = [spread(n, hi=top).to(dtype).requires_grad_() for n in (40_000, 999)]
    opt = getattr(no, cls)(params, lr=lr, eps=eps, resolution="repair", impl="fused", spike_factor=None, **kw)
    for p in params:
        p.grad = spread(p.numel()).clamp(-1e19, 1e19).to(dtype)
    opt.step()
    beta2 = opt.param_groups[0]["betas"][1]
    b2, one_m_b2 = torch.tensor(beta2), torch.tensor(1 - beta2)  # as the kernel rounds them: fp32
    for p in params:  # moments over the same range too
        st = opt.state[p]
        st["exp_avg_sq"].copy_(spread(p.numel(), hi=top).abs())
        st["z" if cls == "SFAdamW" else "exp_avg"].copy_(spread(p.numel(), hi=top))
    for _ in range(2):
        for p in params:
            g = spread(p.numel(), hi=top_grad)
            p.grad = g.to(dtype)
            v = opt.state[p]["exp_avg_sq"]
            cancel = torch.zeros_like(v) if zero_v else -((one_m_b2 * g) * g) / b2
            v.copy_(torch.where((torch.rand(v.shape, generator=gen) < 0.25) & cancel.isfinite(), cancel, v))
        opt.step()
    return params, opt

out = {"simd_width": torch.tensor(native.library().nonans_simd_width()), "form": native.scalar_form()}
for cls in ("AdamW", "SFAdamW"):
    # β₂ = 0.5 makes the cancelling v exact (scaling by a power of two): the new v is exactly 0 there. The
    # second run reaches the bound (about 4e7 for SFAdamW, 3e6 for AdamW; a bound 1000x too loose fails it)
    for i, (lr, eps, top, top_grad, kw) in enumerate((
            (1e-3, 1e-8, 38.5, 19.0, {}), (1.0, 1e-30, 6.0, 11.0, {"weight_decay": 0.5, "betas": (0.9, 0.5)}),
            (1e6, 1e-8, 20.0, 19.0, {"betas": (0.9, 0.5)}), (1e-3, 1e-8, 38.5, 19.0, {"betas": (0.3, 0.99)}),
            (1.0, 1e-30, 8.0, 6.0, {"weight_decay": 0.5, "betas": (0.9, 0.5), "zero_v": True}),
            (1e-3, 0.0, 38.5, 19.0, {}))):  # eps = 0: no bound (clean_limit_ is 0), AVX2's late test decides
        for dtype in (torch.float32, torch.bfloat16):
            params, opt = magnitude_run(cls, lr, eps, top, top_grad, dtype=dtype, **kw)
            out[(cls, "magnitude", i, str(dtype))] = (params, opt.state_dict())
    for n, pos in ((256, 5), (256, 63), (17, 16)):
        for dtype in (torch.float32, torch.bfloat16):
            params, opt = v_only_run(cls, n, pos, dtype)
            out[(cls, "v_only", n, pos, str(dtype))] = (params, opt.state_dict())
for i, (cls, policy, threads, kw) in enumerate(ast.literal_eval(sys.argv[2])):
    params, opt = _run(getattr(no, cls), "fused", policy, threads=threads, **kw)
    out[i] = (params, opt.state_dict())
    if not kw:  # bf16 (scalar_avx512_bf16.h in an AVX-512 build), with and without the guard
        for factor in (10.0, None):
            params, opt = _run(getattr(no, cls), "fused", policy, threads=threads, dtype=torch.bfloat16,
                               spike_factor=factor)
            out[(i, "bf16", factor)] = (params, opt.state_dict())

def spectral_bf16_run(cls, policy):
    # test_fused_bf16.py's spectral fault sequence on bf16 matrices (spectral_post.c's bf16 rows take the
    # AVX-512 row loop in that build, the portable one otherwise)
    torch.manual_seed(0)
    params = [(0.1 * torch.randn(s)).bfloat16().requires_grad_() for s in SPECTRAL_SHAPES]
    opt = cls([{"params": params, "path": "spectral"}], lr=1e-2, weight_decay=0.1, resolution=policy, impl="fused")
    gen = torch.Generator().manual_seed(1)
    for t in range(6):
        for p, g in zip(params, _spectral_grads(t, gen)):
            p.grad = g
        opt.step()
    return params, opt

for cls in ("SFNorMuon", "Muon", "FullFusion"):
    for threads in (1, 2):
        params, opt = spectral_run(cls=getattr(no, cls), threads=threads)
        out[(cls, threads)] = (params, opt.state_dict())
    for policy in ("repair", "off"):
        params, opt = spectral_bf16_run(getattr(no, cls), policy)
        out[(cls, policy, "spectral-bf16")] = (params, opt.state_dict())
    params, opt = spectral_run(cls=getattr(no, cls), resolution="skip")
    out[(cls, "skip")] = (params, opt.state_dict())
for cls, p00 in ((no.Muon, BF16_MAX), (no.SFNorMuon, 0.0)):  # one bf16 value in the window (test_fused_bf16)
    q, o = _column_window_run(cls, "fused", torch.float32, 1.0, 1e35, p00)
    slope = (float(o.state[q].get("z", q)[0, 0].detach()) - BF16_MAX) / 1e35
    p, opt = _column_window_run(cls, "fused", torch.bfloat16, 1.0 if slope > 0 else -1.0, 1e36 / abs(slope), p00)
    out[(cls.__name__, "column-window")] = ([p], opt.state_dict())
for cls in ("AdamW", "SFAdamW", "SFNorMuon", "Muon"):
    for dtype in (torch.float32, torch.bfloat16):
        params, opt = nan_step_size_run(cls, dtype)
        out[(cls, "nan-step-size", str(dtype))] = (params, opt.state_dict())
    for policy in ("repair", "off"):
        params, opt = overflow_run(cls, policy)
        out[(cls, policy)] = (params, opt.state_dict())
        params, opt = overflow_run(cls, policy, torch.bfloat16)
        out[(cls, policy, "bf16")] = (params, opt.state_dict())
torch.save(out, sys.argv[1])
"""


def _dump(tmp_path: Path, simd: str) -> dict:
    out = tmp_path / f"{simd}.pt"
    env = {**os.environ, "NONANS_NATIVE_SIMD": simd, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    proc = subprocess.run([sys.executable, "-c", _DUMP, str(out), repr(CASES)], cwd=HERE, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


def _tensors(obj, path=""):
    """Every tensor in a nested structure, keyed by its path."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{path}/{k}")
    elif isinstance(obj, (list, tuple)):
        for k, v in enumerate(obj):
            yield from _tensors(v, f"{path}/{k}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes for a floating tensor (NaN payloads and signed zeros compare too), else itself."""
    return t.detach().reshape(-1).view(torch.uint8) if t.is_floating_point() else t


@pytest.mark.parametrize("simd, form", SIMD_BUILDS, ids=[b[0] for b in SIMD_BUILDS])
def test_simd_build_writes_the_portable_bits(tmp_path, simd, form):
    # the avx2 build against the portable loops built as for the same CPU (no AVX-512 auto-vectorisation)
    fast, portable = _dump(tmp_path, simd), _dump(tmp_path, "portable-avx2" if simd == "avx2" else "portable")
    assert (fast.pop("form"), portable.pop("form")) == (form, "portable")  # two different builds ran
    fast.pop("simd_width"), portable.pop("simd_width")
    assert fast.keys() == portable.keys()
    compared, update_events, overflows = 0, 0, {"AdamW": 0, "SFAdamW": 0}
    for key in fast:
        a, b = dict(_tensors(fast[key])), dict(_tensors(portable[key]))
        assert a.keys() == b.keys(), key
        for name in a:
            assert a[name].dtype == b[name].dtype, (key, name)
            assert torch.equal(_bits(a[name]), _bits(b[name])), (key, name)
            compared += 1
        if isinstance(key, tuple) and key[1:] in (("repair",), ("repair", "bf16")):  # the overflow runs overflowed
            counts = global_entry(fast[key][1])[1]["resolution"]["counts"]
            assert counts[:, 3].sum() > 0, key
            update_events += int(counts[:, 3].sum())
            assert all(torch.isfinite(p).all() for p in fast[key][0]), key
        if isinstance(key, tuple) and key[1] == "magnitude":
            assert all(torch.isfinite(p).all() for p in fast[key][0]), key
            overflows[key[0]] += int(global_entry(fast[key][1])[1]["resolution"]["counts"][:, 1:4].sum())
    assert compared > 100 and update_events > 0
    assert min(overflows.values()) > 0, overflows  # the magnitude runs did overflow inside the step
