"""Named scratch tensors reused across calls (the NS5 iterations' ``out=`` buffers).

Why: a Newton-Schulz step allocates a few MiB of intermediates per matrix bucket, and on CPU the allocator
hands such blocks back to the OS when they are freed, so every step page-faults them in again. On the
3.4M-parameter GPT of ``python -m experiments step-time`` that cost about 3 ms of a 22 ms NS5 (a scratch
measurement, 2026-11-22, commit d737121, not in RESULTS.md: keeping freed memory in the process with
``MALLOC_TRIM_THRESHOLD_``/``MALLOC_MMAP_THRESHOLD_``). pytorch_optimizer's
Muon preallocates its buffers for the same reason (``optimizer/utils/matrix.py``).
"""
from __future__ import annotations

import torch

__all__ = ["Workspace"]


class Workspace:
    """Tensors by name, allocated on first use and again only when the shape, dtype or device changes.

    A tensor handed out stays valid until the same name is requested again: callers that keep a result
    across calls (a batched NS5 output consumed after the next bucket's iteration) use one Workspace each."""

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        t = self._tensors.get(name)
        if t is None or t.shape != shape or t.dtype != like.dtype or t.device != like.device:
            t = self._tensors[name] = torch.empty(shape, dtype=like.dtype, device=like.device)
        return t

    def other(self, name: str, shape: tuple[int, ...], like: torch.Tensor, avoid: torch.Tensor) -> torch.Tensor:
        """One of the pair ``name0``/``name1`` that is not ``avoid`` (ping-pong: out= may not alias an input)."""
        first = self.get(name + "0", shape, like)
        return first if first.data_ptr() != avoid.data_ptr() else self.get(name + "1", shape, like)
