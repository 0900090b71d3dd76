"""Pieces shared by the scalar and spectral paths: event counts, the last-line guard, skip snapshots."""
from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import increment_version

from .._checkpoint import GLOBAL_KEY
from ..detection import inspect
from ..resolution import STAGE_INDEX

__all__ = ["check_sizes", "record", "eager_guard", "dense_counts", "recent_flags", "mark_written", "resolution_written",
           "take_snapshot", "hold_flag", "commit_update", "restore_if_bad"]


def record(ctx: dict[str, Any], index: int, stage: str, counts: torch.Tensor | None) -> None:
    """Add this step's [nan, inf] ``counts`` for (parameter ``index``, ``stage``) to the step context."""
    if counts is not None:
        key = (index, STAGE_INDEX[stage])
        prev = ctx["counts"].get(key)
        ctx["counts"][key] = counts if prev is None else prev + counts


def eager_guard(grads: list[torch.Tensor], indices: list[int], ctx: dict[str, Any]) -> list[torch.Tensor]:
    """The spike guard for a group that falls back from a kernel to an eager path: the base leaves the guard
    to the kernels (``ctx["guard_in_kernel"]``), so the fallback applies it here, exactly once."""
    return ctx["guard"](grads, indices, ctx) if ctx["guard_in_kernel"] else grads


def dense_counts(ctx: dict[str, Any], device: torch.device) -> torch.Tensor:
    """This step's dense (P, S, 2) count block, zeroed on first use (``Resolution.count_block``: one block
    kept between steps). The compiled kernels add a whole group's counts into it with one op, where
    :func:`record` costs a few host-side ops per tensor."""
    if ctx["dense"] is None:
        ctx["dense"] = ctx["resolution"].count_block(device)
    return ctx["dense"]


def recent_flags(ctx: dict[str, Any]) -> torch.Tensor:
    """(P,) bool ``Resolution.recent()`` for this step, computed once and only by the paths that need it
    (the fused kernel reads the counters itself)."""
    if ctx["recent"] is None:
        ctx["recent"] = ctx["resolution"].recent()
    return ctx["recent"]


def mark_written(*groups: list[torch.Tensor]) -> None:
    """Bump the autograd version counter of every tensor a native or Triton kernel wrote through a raw
    pointer: torch's own in-place ops do, and without it a graph that saved a parameter before ``step()``
    would silently backprop through the new values instead of raising "modified by an inplace operation"
    (and version-keyed caches would go stale)."""
    increment_version([t for group in groups for t in group])


def resolution_written(ctx: dict[str, Any]) -> list[torch.Tensor]:
    """The Resolution tensors the fused kernels update in place (none under "off")."""
    if ctx["resolution"] is None:
        return []
    ema = ctx["resolution"].tensors["grad_norm_ema"]
    return [ema] if ctx["dense"] is None else [ema, ctx["dense"]]


def take_snapshot(params: list[torch.Tensor], states: list[dict]) -> list:
    """Copies of every parameter and state tensor ("skip" policy: restored when a gradient was bad)."""
    return [(p.clone(), {k: v.clone() for k, v in st.items() if k not in ("step", GLOBAL_KEY)})
            for p, st in zip(params, states)]


def hold_flag(ctx: dict[str, Any], index: int, grad_counts: torch.Tensor, numel: int) -> torch.Tensor:
    """0-d bool: this tensor's gradient had no finite entry *and* the parameter had an event within the
    repeat window — a persistent loss of observations, where continuing from momentum only drifts.
    An isolated whole-tensor event still takes its continuation step (DESIGN.md contract item 2)."""
    return recent_flags(ctx)[index] & (grad_counts.sum() == numel)


def _guarded_write(dst: torch.Tensor, new: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """dst ← new where finite and ``keep`` (0-d bool: not held) — one select straight into dst; returns the
    [nan, inf] counts of what was written (a held tensor writes nothing, so it counts nothing)."""
    ok, counts = inspect(new)
    if keep is not None:  # a 0-d flag folded into the bool mask, not a second full-size select
        ok &= keep
        counts = counts * keep  # integer counts times a bool: exact (no 0·NaN here), one op, not two
    torch.where(ok, new, dst, out=dst)
    return counts


def commit_update(p: torch.Tensor, st: dict, y_new: torch.Tensor, z_new: torch.Tensor | None,
                  ctx: dict[str, Any], index: int, repair: bool, hold: torch.Tensor | None = None) -> None:
    """Write the new parameter (and schedule-free z), keeping the old value wherever the new one is not
    finite — the last line of the invariant, for overflow that no earlier gate could see — and everywhere
    when ``hold`` (see :func:`hold_flag`) is set."""
    if repair:
        keep = None if hold is None else ~hold  # once for p and z
        counts = _guarded_write(p, y_new, keep)
        if z_new is not None:
            counts = counts + _guarded_write(st["z"], z_new, keep)
        record(ctx, index, "update", counts)
        return
    p.copy_(y_new)
    if z_new is not None:
        st["z"].copy_(z_new)


def restore_if_bad(p: torch.Tensor, st: dict, snap: tuple, ok: torch.Tensor) -> None:
    """Select the snapshot for the whole tensor when ``ok`` (0-d bool) is False — a select, never 0·x."""
    p_old, st_old = snap
    torch.where(ok, p, p_old, out=p)
    for k, old in st_old.items():
        torch.where(ok, st[k], old, out=st[k])


def check_sizes(sizes: list[int], key: str, tensors: list[torch.Tensor]) -> None:
    """Raise ValueError unless ``tensors[i]`` has ``sizes[i]`` entries. The fused kernels (native C loops,
    Triton) index every state tensor by its parameter's size, so a state tensor of another size — edited by
    hand, or loaded past the checks of ``load_state_dict`` — would be read and written out of bounds; the
    eager paths fail on it with torch's own size error. Host metadata only (no device sync)."""
    got = [t.numel() for t in tensors]
    if got != sizes:
        i = next(i for i, (a, b) in enumerate(zip(got, sizes)) if a != b)
        raise ValueError(f"state[{key!r}] of a parameter has {got[i]} entries where its parameter needs "
                         f"{sizes[i]}: the optimizer state does not belong to these parameters")
