"""The vocabulary of resolution events, and the event ring read back as :class:`SingularityEvent` objects.

Split from :mod:`.resolution`, which keeps the device-side counters and the record of a step; this module is
what a user sees of them (``optimizer.events``, ``metrics()``) and the names every path agrees on: the stages
where a non-finite value can be met, and what each policy did about it.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

__all__ = ["STAGES", "STAGE_INDEX", "PARAM_STAGES", "ACTIONS", "HELD", "SingularityEvent", "materialise"]

# Where a non-finite value can be met. "grad": the incoming gradient. "moment": a moment update that
# overflowed with a finite gradient (g² > fp32 max in exp_avg_sq; g - m inside the lerp of exp_avg, the
# momentum buffer or MONA's average, when both are huge and of opposite signs): that entry keeps its value.
# "direction": NS5 / KL-Shampoo / NorMuon output. "update": the new parameter and schedule-free z (an entry
# of each counted: up to 2·numel per schedule-free parameter). "loss":
# the value given to set_loss(). "spike": a finite gradient whose norm jumped above spike_factor × its
# running mean and was rescaled (counts: [0, 1]).
STAGES = ("grad", "moment", "direction", "update", "loss", "spike")
STAGE_INDEX = {name: i for i, name in enumerate(STAGES)}
# The stages that are a parameter's own: "loss" is the optimizer's (kept in row 0 of the count block),
# so it is reported but never counts toward a parameter's escalation or hold rule.
PARAM_STAGES = tuple(s != "loss" for s in STAGES)

# What was done about it, by policy. Escalation is reported separately (it rides on either action).
ACTIONS = {"repair": "repaired", "skip": "skipped", "off": "none"}
# ...except where "repair" held the parameter instead (no finite gradient entry, on a parameter that had an
# event of any kind within the repeat window: it kept its value and state, as "skip" would; the
# continuation step of README.md's "Resolution" is for an isolated loss)
HELD = "held"


def _action(policy: str, held: bool) -> str:
    return HELD if held and policy == "repair" else ACTIONS[policy]


@dataclasses.dataclass(frozen=True)
class SingularityEvent:
    """One resolved singularity: at optimizer ``step``, on parameter ``param`` (its name when the
    optimizer was given named parameters, else its index in ``state_dict()`` order), in ``stage``.

    ``nan_count``/``inf_count``: entries found NaN / ±Inf — of each tensor the stage writes: in the
    "update" stage of a schedule-free parameter those are y (the parameter) and z, each counted, so the two
    may add up to 2·``numel`` there (every other stage: at most ``numel``) — except in the "spike" stage, where
    ``inf_count`` is 1 for a gradient the spike guard capped (finite, counted in that column so the two
    still add up to the stage's count; repeated spikes escalate like any event). A "loss" event (a
    non-finite ``set_loss()`` value) belongs to no parameter: ``param`` is None and ``numel`` 1, and it
    backs off no parameter's step size. ``action``: "repaired", "skipped" or "none" by the policy in force
    then, and "held" where "repair" held the parameter — no finite gradient entry, and an event of any kind
    on it within the repeat window, so it kept its value and state rather than continue from momentum.
    ``escalated``: this event backed the parameter's step size off
    (a repeat within the window). ``events`` keeps the last 63 steps that had any (a ring of 64 slots, one
    of them the free slot a clean step writes: 64 only until the first clean step after it filled)."""

    step: int
    param: str | int | None
    stage: str
    nan_count: int
    inf_count: int
    numel: int
    action: str
    escalated: bool = False


def materialise(tensors: dict[str, torch.Tensor], policy_at: Callable[[int, list], str], names: list[str | int],
                numels: list[int]) -> list[SingularityEvent]:
    """The events in the ring of a Resolution's ``tensors`` (the last K steps that had any), read back to the
    host: the one place the counters are synchronised, and only when ``optimizer.events`` is read.
    ``policy_at(step, log)``: the policy in force at a step (its action); ``names``/``numels``: per parameter."""
    t = {k: v.cpu() for k, v in tensors.items() if k.startswith("ring")}
    log = tensors["policy_log"].tolist()
    K = t["ring_step"].shape[0]
    ptr = int(t["ring_ptr"])
    out: list[SingularityEvent] = []
    for j in range(max(0, ptr - K), ptr):
        slot = j % K
        counts = t["ring_counts"][slot]
        for p_idx, s_idx in (counts.sum(-1) > 0).nonzero().tolist():
            nan, inf = counts[p_idx, s_idx].tolist()
            own = PARAM_STAGES[s_idx]  # the loss stage sits in row 0 but belongs to no parameter
            out.append(SingularityEvent(
                step=int(t["ring_step"][slot]), param=names[p_idx] if own else None, stage=STAGES[s_idx],
                nan_count=nan, inf_count=inf, numel=numels[p_idx] if own else 1,
                action=_action(policy_at(int(t["ring_step"][slot]), log),
                               own and bool(t["ring_held"][slot, p_idx])),
                escalated=own and bool(t["ring_escalated"][slot, p_idx])))
    return out
