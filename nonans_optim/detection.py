"""Detection and counting: the elementwise pieces of the resolution stage (:mod:`nonans_optim.resolution`
holds the policies, the counters and the event ring). Pure functions of tensors; none reads a value back
to the host, so none synchronises with a device.

Why every test is ``|x| < limit`` rather than ``torch.isfinite``: see :func:`finite_mask`. Why counts come
out as int64 [nan, inf] pairs (or a :class:`Tally` that becomes one): they are added into the (P, S, 2)
count block of a step (one row per parameter and stage), whatever produced them.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["finite_mask", "storable_mask", "Tally", "tally", "inspect", "tensor_counts"]


def finite_mask(x: torch.Tensor) -> torch.Tensor:
    """Elementwise finiteness as ``|x| < inf``: NaN compares false, so this equals ``torch.isfinite`` but
    costs two elementwise ops on CPU where ``isfinite`` lowers to four (3.2 → 1.6 ms on the hidden matrices
    of a 3.4M-parameter GPT: a scratch profile, 2026-11-22, commit c70c69f; not in RESULTS.md)."""
    return x.abs() < float("inf")


# The smallest magnitude that rounds to ±Inf in each 16-bit dtype: the dtype's maximum plus half an ulp
# (the tie rounds to the even neighbour, which is Inf). fp16: 65504 + 16; bf16: (2 - 2^-7) + 2^-8, times 2^127.
_ROUND_TO_INF = {torch.float16: 65520.0, torch.bfloat16: (2.0 - 2.0 ** -8) * 2.0 ** 127}


def storable_mask(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Whether each entry of ``x`` is finite once stored in ``dtype``: :func:`finite_mask` for fp32, else
    a compare against the magnitude that rounds to Inf, made in fp32. Why not ``finite_mask(x.to(dtype))``:
    inductor keeps a 16-bit graph's intermediates in fp32 (it does not emulate the rounding of each op),
    drops the cast of a value that already has the dtype, and would compare the constant in fp16 (where
    65520 is Inf); 9e5 then passes a finiteness test and is written as Inf. The fp32 compare is right
    whether the value was rounded already (Inf fails it) or not."""
    limit = _ROUND_TO_INF.get(dtype)
    if limit is None:
        return finite_mask(x)
    return x.float().abs() < limit


class Tally(NamedTuple):
    """The counts of one tensor's non-finite entries, not yet assembled into [nan, inf]: ``finite`` and
    ``inf`` are 0-d int64 tensors on its device, ``numel`` its size (nan = numel - finite - inf).

    Why not the pair itself: the subtraction and the stacking are 0-d ops, and on a GPU every op is a
    kernel launch of its own (the eager "repair" step of SF-NorMuon's GPT launched 4244 kernels where "off"
    launched 752 on an H100: the sync-audit of 2026-11-25 as published at commit 42143de, no longer in
    RESULTS.md). The optimizer assembles the tallies of a whole step at once
    (``optimizers/_common.assemble_counts``: a few launches, whatever the tensor count)."""
    finite: torch.Tensor
    inf: torch.Tensor
    numel: int

    def pair(self) -> torch.Tensor:
        """int64 [nan_count, inf_count] (three 0-d ops: where one tensor's counts are needed on their own)."""
        return torch.stack(((self.numel - self.finite) - self.inf, self.inf))

    def complete(self) -> torch.Tensor:
        """0-d bool: every entry was finite."""
        return self.finite == self.numel


def tally(x: torch.Tensor) -> tuple[torch.Tensor, Tally]:
    """(finite mask, :class:`Tally`) of ``x`` from one shared ``abs`` pass: the detection the gates need
    and the counts the telemetry needs, in three elementwise passes and two reductions. (A NaN count from
    ``x != x`` would be one more pass over the data; nan = numel - finite - inf needs none.)"""
    a = x.abs()
    ok = a < float("inf")
    # count_nonzero reads the bool mask directly; bool.sum() first widens it to int64 (a copy pass).
    return ok, Tally(torch.count_nonzero(ok), torch.count_nonzero(a == float("inf")), x.numel())


def inspect(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(finite mask, int64 [nan_count, inf_count]) of ``x``: :func:`tally` with the counts assembled."""
    ok, t = tally(x)
    return ok, t.pair()


def tensor_counts(total: torch.Tensor) -> torch.Tensor:
    """[is_nan, is_inf] of a reduction ``total`` of an internal tensor — a tensor-level event count; for a
    (B,) vector of totals (one per matrix of a batch), the (B, 2) rows.

    Used where an entry count would cost passes over data that is almost never bad (the NS5/NorMuon
    output: RMS 0.2, so its sum cannot overflow and is non-finite iff some entry is)."""
    return torch.stack((torch.isnan(total), torch.isinf(total)), -1).to(torch.int64)
