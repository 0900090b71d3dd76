"""Pieces shared by the scalar and spectral paths: event counts, the last-line guard, skip snapshots."""
from __future__ import annotations

from typing import Any

import torch

from ..resolution import STAGE_INDEX, inspect

__all__ = ["record", "take_snapshot", "commit_update", "restore_if_bad"]


def record(ctx: dict[str, Any], index: int, stage: str, counts: torch.Tensor | None) -> None:
    """Add this step's [nan, inf] ``counts`` for (parameter ``index``, ``stage``) to the step context."""
    if counts is not None:
        key = (index, STAGE_INDEX[stage])
        prev = ctx["counts"].get(key)
        ctx["counts"][key] = counts if prev is None else prev + counts


def take_snapshot(params: list[torch.Tensor], states: list[dict]) -> list:
    """Copies of every parameter and state tensor ("skip" policy: restored when a gradient was bad)."""
    return [(p.clone(), {k: v.clone() for k, v in st.items() if k != "step"}) for p, st in zip(params, states)]


def commit_update(p: torch.Tensor, st: dict, y_new: torch.Tensor, z_new: torch.Tensor | None,
                  ctx: dict[str, Any], index: int, repair: bool) -> None:
    """Write the new parameter (and schedule-free z), keeping the old value wherever the new one is not
    finite — the last line of the invariant, for overflow that no earlier gate could see."""
    if repair:
        ok, counts = inspect(y_new)
        torch.where(ok, y_new, p, out=p)  # a select straight into p: no extra copy pass
        if z_new is not None:
            ok_z, counts_z = inspect(z_new)
            torch.where(ok_z, z_new, st["z"], out=st["z"])
            counts = counts + counts_z
        record(ctx, index, "update", counts)
        return
    p.copy_(y_new)
    if z_new is not None:
        st["z"].copy_(z_new)


def restore_if_bad(p: torch.Tensor, st: dict, snap: tuple, ok: torch.Tensor) -> None:
    """Select the snapshot for the whole tensor when ``ok`` (0-d bool) is False — a select, never 0·x."""
    p_old, st_old = snap
    p.copy_(torch.where(ok, p, p_old))
    for k, old in st_old.items():
        st[k].copy_(torch.where(ok, st[k], old))
