"""Pieces shared by the scalar and spectral paths: event counts, the last-line guard, skip snapshots."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.autograd.graph import increment_version

from .._global_state import GLOBAL_KEY
from ..detection import Tally, tally
from ..resolution import STAGE_INDEX

__all__ = ["check_sizes", "check_spectral_sizes", "record", "record_tally", "record_inf", "assemble_counts",
           "eager_guard", "dense_counts", "recent_flags", "mark_written", "resolution_written", "take_snapshot",
           "keep_flags", "commit_update", "restore_if_bad"]

# The eager paths' counts of a step are kept as they come — per (parameter, stage), a finished [nan, inf]
# pair, a Tally, or an "inf" count — and assembled once, at the end of the step (assemble_counts): summing
# and stacking them one tensor at a time cost a handful of 0-d ops per tensor and stage, each a kernel
# launch on a GPU. ctx["counts"] is that list of (parameter index, stage index, kind, payload).


def record(ctx: dict[str, Any], index: int, stage: str, counts: torch.Tensor | None) -> None:
    """Add this step's int64 [nan, inf] ``counts`` for (parameter ``index``, ``stage``) to the step context."""
    if counts is not None:
        ctx["counts"].append((index, STAGE_INDEX[stage], "pair", counts))


def record_tally(ctx: dict[str, Any], index: int, stage: str, t: Tally, keep: torch.Tensor | None = None) -> None:
    """Add a :class:`~nonans_optim.detection.Tally`'s counts, times the 0-d bool ``keep`` when given (a held
    tensor writes nothing, so it counts nothing)."""
    ctx["counts"].append((index, STAGE_INDEX[stage], "tally", (t, keep)))


def record_inf(ctx: dict[str, Any], index: int, stage: str, n: torch.Tensor, minus: torch.Tensor | None = None
               ) -> None:
    """Add [0, n - minus] (0-d int64 tensors; ``minus`` optional) — overflows, a bypassed preconditioner, a
    capped spike: the counts that go in the "inf" column."""
    ctx["counts"].append((index, STAGE_INDEX[stage], "inf", (n, minus)))


def assemble_counts(ctx: dict[str, Any], P: int, S: int, device: torch.device,
                    const: Callable[[str, tuple, torch.device], torch.Tensor]) -> torch.Tensor | None:
    """This step's (P, S, 2) int64 counts from the records in ``ctx["counts"]`` (None when there are none):
    each kind stacked and computed once, then added into the block by (parameter, stage), repeated keys
    summed. ``const(name, values, device)``: a cached int64 tensor of host ``values`` on ``device`` (the
    optimizer's, so that a step copies nothing to the device once the shapes have been seen)."""
    recs = ctx["counts"]
    if not recs:
        return None
    rows, keys = [], []
    pairs = [r for r in recs if r[2] == "pair"]
    if pairs:
        rows.append(torch.stack([r[3] for r in pairs]))
        keys += [r[0] * S + r[1] for r in pairs]
    tallies = [r for r in recs if r[2] == "tally"]
    if tallies:
        ts = [r[3][0] for r in tallies]
        finite, inf = torch.stack([t.finite for t in ts]), torch.stack([t.inf for t in ts])
        nonfinite = const("numel", tuple(t.numel for t in ts), device) - finite
        block = torch.stack((nonfinite - inf, inf), 1)
        if any(r[3][1] is not None for r in tallies):
            yes = torch.ones((), dtype=torch.bool, device=device)
            block = block * torch.stack([yes if r[3][1] is None else r[3][1] for r in tallies]).unsqueeze(1)
        rows.append(block)
        keys += [r[0] * S + r[1] for r in tallies]
    infs = [r for r in recs if r[2] == "inf"]
    if infs:
        n = torch.stack([r[3][0] for r in infs]).to(torch.int64)
        if any(r[3][1] is not None for r in infs):
            zero = torch.zeros((), dtype=torch.int64, device=device)
            n = n - torch.stack([zero if r[3][1] is None else r[3][1] for r in infs])
        rows.append(torch.nn.functional.pad(n.unsqueeze(1), (1, 0)))
        keys += [r[0] * S + r[1] for r in infs]
    flat = torch.zeros(P * S, 2, dtype=torch.int64, device=device)
    flat.index_add_(0, const("keys", tuple(keys), device), torch.cat(rows) if len(rows) > 1 else rows[0])
    return flat.view(P, S, 2)


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


def keep_flags(ctx: dict[str, Any], indices: list[int], grads: list[Tally]) -> list[torch.Tensor]:
    """Per tensor, 0-d bool: *not* held. Held: the tensor's gradient had no finite entry *and* the
    parameter had an event within the repeat window — a persistent loss of observations, where continuing
    from momentum only drifts. An isolated whole-tensor event still takes its continuation step
    (README.md, "Resolution"). Computed for the group at once (four ops, not three per tensor)."""
    if not grads:
        return []
    recent = recent_flags(ctx)
    recent = recent.index_select(0, ctx["device_indices"](indices, recent.device))
    return list((~recent | (torch.stack([t.finite for t in grads]) != 0)).unbind())


def _guarded_write(dst: torch.Tensor, new: torch.Tensor, keep: torch.Tensor | None) -> Tally:
    """dst ← new where finite and ``keep`` (0-d bool: not held) — one select straight into dst; returns the
    tally of ``new`` (:func:`record_tally` applies ``keep`` to it).

    ``new`` is first rounded to dst's dtype: the value that would be stored is the one that must be finite
    (an fp32 result near fp32's maximum is Inf in bf16), and a 0-d bf16/fp16 parameter's update arrives in
    fp32 — a 0-d tensor times the 0-d fp32 step size promotes, where a parameter with dimensions would not
    — which ``where(out=dst)`` refused, so such a parameter (a CLIP-style ``logit_scale``) crashed "repair"."""
    if new.dtype is not dst.dtype:  # (a dtype compare, not a .to() call per tensor on the host-bound paths)
        new = new.to(dst.dtype)
    ok, t = tally(new)
    if keep is not None:  # a 0-d flag folded into the bool mask, not a second full-size select
        ok &= keep
    torch.where(ok, new, dst, out=dst)
    return t


def commit_update(p: torch.Tensor, st: dict, y_new: torch.Tensor, z_new: torch.Tensor | None,
                  ctx: dict[str, Any], index: int, repair: bool, keep: torch.Tensor | None = None) -> None:
    """Write the new parameter (and schedule-free z), keeping the old value wherever the new one is not
    finite — the last line of the invariant, for overflow that no earlier gate could see — and everywhere
    when ``keep`` (see :func:`keep_flags`) is False."""
    if repair:
        record_tally(ctx, index, "update", _guarded_write(p, y_new, keep), keep)
        if z_new is not None:
            record_tally(ctx, index, "update", _guarded_write(st["z"], z_new, keep), keep)
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


def check_spectral_sizes(sizes: list[int], rows: list[int], bufs: list[torch.Tensor],
                         zs: list[torch.Tensor] | None = None, vs: list[torch.Tensor] | None = None,
                         monas: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None) -> None:
    """:func:`check_sizes` for every state tensor a fused spectral kernel indexes (native loops and Triton
    alike): the momentum buffer, schedule-free z and MONA's G_prev and A by the parameter's size, NorMuon's
    row moment by its matrix's row count. None: that component is off."""
    check_sizes(sizes, "momentum_buffer", bufs)
    if zs is not None:
        check_sizes(sizes, "z", zs)
    if monas is not None:
        check_sizes(sizes, "mona_prev_grad", monas[0])
        check_sizes(sizes, "mona_diff_avg", monas[1])
    if vs is not None:
        check_sizes(rows, "normuon_row_sq", vs)
