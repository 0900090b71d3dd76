"""Settle MKL VML's kernel choice in this process before anything runs on two threads.

torch's CPU unary float ops on contiguous tensors (sqrt, exp, log, ...) call MKL's VML per chunk of an
intra-op parallel_for (grain 2048, aten/src/ATen/cpu/vml.h), and oneMKL 2024.2 — the version in torch 2.13's
CPU wheels — picks each VML function's kernel lazily on its first call: when that first call runs on two
threads at once, one thread can run a low-accuracy kernel over its whole chunk, once (pytorch/pytorch issue
188792; fix proposed in pull request 188791, a one-element call per function before any concurrent use).

Here it made the impl="loop" ground truth wrong, not the code under test: AdamW's first (v / bc2).sqrt_()
over a 2800-entry parameter came back with relative errors up to 3.1e-4 in its second half (entries
1400-2799, the worker thread's chunk), so tests/test_kernels_scalar_one.py's
test_optimizer_matches_loop[AdamW-repair] failed after test_repair_adds_only_the_resolution_launches, as its
interpreter shard runs them, in 6 of 50 runs (and a copy of the pair in 9 of 55; 0 of 40 with this settling):
33 entries past atol 1e-6, caught by a dispatch-mode spy on the loop's first step, 2026-11-27. One call of each
function on one entry, on the calling thread, settles the choice: tests/conftest.py calls it at import (so
every pytest process, the interpreter suites' too), and scripts a test runs in a fresh interpreter whose
results it compares bit for bit call it first.
"""
from __future__ import annotations

import torch

# the ops aten/src/ATen/cpu/vml.h sends to MKL (IMPLEMENT_VML_MKL), each a VML function of its own
MKL_VML_OPS = ("acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2", "sin", "sqrt",
               "tan", "tanh", "trunc")


def settle_mkl_vml() -> None:
    """Call every MKL-routed unary op once on one fp32 and one fp64 entry, on this thread."""
    for dtype in (torch.float32, torch.float64):
        for op in MKL_VML_OPS:
            getattr(torch, op)(torch.full((1,), 0.5, dtype=dtype))
