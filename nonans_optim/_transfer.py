"""Host → device copies that never make the host wait.

Why this exists: ``step()`` must not synchronise with a GPU (contract item 3, ``resolution.py``), yet a
few small host-built tensors must reach the device inside it — index lists, parameter sizes, the compiled
path's hyperparameters and bias corrections. ``torch.tensor(values, device="cuda")`` copies from pageable
memory and blocks (on an H100, 2026-11-25, ``torch.cuda.set_sync_debug_mode("error")`` raised on it at the
first step of every optimizer; ``python -m experiments sync-audit`` lists the sites). From pageable memory
even a ``non_blocking`` copy may make the driver wait for the stream (CUDA runtime API, "API
synchronization behavior": such a copy is first staged into pinned memory). From pinned memory a
``non_blocking`` copy is a true asynchronous DMA, and torch's caching host allocator keeps the pinned block
from being reused until the copy's stream has passed it, so the source may be dropped at once.
"""
from __future__ import annotations

import torch

__all__ = ["to_device"]


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` (a CPU tensor) on ``device``, without a host sync on CUDA; unchanged where it already is."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
