"""The Polyak step under data-parallel or sharded training: one sum of its statistics over a process group.

Why. The Polyak multiplier γ/lr = clamp(L̄ / Ḡ, 0.1, 10) (functional/polyak.py) is computed from this
process's loss and this process's gradients. Under DistributedDataParallel each rank holds its own batch's
loss while the gradients are already averaged, so every rank derived its own multiplier and applied its own
step size to the same gradients: the replicas drifted apart, silently (an audit, 2026-11-26: 0.21 apart
after five steps of SF-NorMuon on two ranks). Under ZeroRedundancyOptimizer each rank steps a shard, and
its mean |g| was the shard's. Summing [Σ loss, ranks with a loss, Σ|g|, entries] over the group gives every
rank the global mean loss and the global mean |g| — for replicated gradients the sums scale numerator and
denominator alike, for sharded ones they add the shards up — so every rank computes the same multiplier,
the one a single process would on the whole batch and model.

One all_reduce of four numbers inside step(), asynchronous on a GPU (no host sync), run on every step of an
optimizer given ``polyak_group`` whether or not this rank has a loss or gradients (a collective must be
entered by every rank, and which ranks had a loss is not known on the host without a sync). Not automatic
when torch.distributed is initialized: ranks may train independent models, and a collective that some
ranks do not enter hangs; :func:`warn_per_rank_loss` says so once instead.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

__all__ = ["check_group", "sum_polyak_stats", "warn_per_rank_loss"]


def _dist():
    import torch.distributed as dist
    return dist if dist.is_available() else None


def check_group(group: Any) -> Any:
    """``group`` if it is None or a torch.distributed ProcessGroup, else ValueError."""
    if group is None:
        return None
    dist = _dist()
    if dist is None or not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"polyak_group must be a torch.distributed ProcessGroup (e.g. dist.group.WORLD or the "
                         f"data-parallel group) or None, got {group!r:.80}")
    return group


def sum_polyak_stats(l1_sum: torch.Tensor, count: torch.Tensor, loss: torch.Tensor | None, group: Any
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Σ|g|, entries, mean loss over the ranks that gave one) summed over ``group``; fp32 on l1_sum's
    device. The mean loss is NaN where no rank gave one (the caller then passes none on)."""
    zero = torch.zeros((), dtype=torch.float32, device=l1_sum.device)
    if loss is None:
        loss_sum, given = zero, zero
    else:
        loss_sum, given = loss.to(device=l1_sum.device, dtype=torch.float32).reshape(()), zero + 1
    stats = torch.stack((l1_sum.float(), count.float(), loss_sum, given))
    _dist().all_reduce(stats, group=group)
    return stats[0], stats[1], stats[2] / stats[3]


def warn_per_rank_loss(opt: Any) -> None:
    """Once per optimizer: set_loss() under an initialized torch.distributed of several ranks, with no
    ``polyak_group``: each rank's Polyak step size follows its own loss."""
    dist = _dist()
    if (getattr(opt, "_warned_per_rank_loss", False) or dist is None or not dist.is_initialized()
            or dist.get_world_size() < 2):
        return
    opt._warned_per_rank_loss = True
    warnings.warn(f"{type(opt).__name__}.set_loss() with torch.distributed initialized ({dist.get_world_size()} "
                  "ranks) and no polyak_group: the Polyak step size follows this rank's loss alone, so under "
                  "data parallelism the replicas take different steps and drift apart. Pass "
                  "polyak_group=dist.group.WORLD (or the data-parallel group) to the optimizer; if the ranks "
                  "train independent models, ignore this.", RuntimeWarning, stacklevel=4)
