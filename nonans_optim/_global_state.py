"""Where the optimizer-level state lives in a state_dict, and the older layouts a load still accepts.

The optimizer-level state (global step, Polyak EMAs, resolution counters, train/eval mode) is one dict in
one parameter's state, under :data:`GLOBAL_KEY`. These pure functions find it in a checkpoint, reduce a
checkpoint holding several (ZeroRedundancyOptimizer's consolidated one) to one, and convert the layouts of
older checkpoints; ``_checkpoint.py`` checks a checkpoint and loads it with them.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

__all__ = ["GLOBAL_KEY", "needs_init", "copy_to", "param_ids", "global_entry", "one_global", "legacy_global",
           "move_global_to_carrier", "step_from_params"]

# The key, in one parameter's state (the "carrier": the first trainable parameter), of the optimizer-level
# state — global step, Polyak EMAs, resolution counters, train/eval mode. Until commit fa21cf5 it sat at the top
# of ``state`` as a non-parameter key; torch's own state_dict() passes that through, but
# ``torch.distributed.checkpoint`` (get_optimizer_state_dict: FSDP2, torchtitan, Lightning's and
# accelerate's distributed checkpoints) maps every state key to a parameter name and raised KeyError on
# it. Inside a parameter's state it travels like any nested optimizer state (Shampoo's, say); such
# checkpoints are still loaded (:func:`move_global_to_carrier`).
GLOBAL_KEY = "nonans"

def needs_init(st: dict) -> bool:
    """True when a parameter's state has none of its own entries yet (the carrier's may hold only the
    optimizer-level dict). Every path's state has a ``step``: that one lookup answers the steady state,
    asked once per parameter per step."""
    return "step" not in st and (not st or st.keys() <= {GLOBAL_KEY})


def copy_to(x: Any, device: torch.device) -> Any:
    """``x`` (nested dicts and lists of tensors and scalars) with every tensor copied to ``device`` in its
    own dtype: a loaded optimizer must not write into the caller's checkpoint, and torch's load casts a
    parameter's floating state to the parameter's dtype, which the fp32 counters must not take."""
    if isinstance(x, torch.Tensor):
        return x.to(device, copy=True)
    if isinstance(x, dict):
        return {k: copy_to(v, device) for k, v in x.items()}
    if isinstance(x, list):
        return [copy_to(v, device) for v in x]
    return x


def param_ids(state_dict: dict[str, Any]) -> list:
    return [i for g in state_dict.get("param_groups", ()) for i in g.get("params", ())]


def _holders(state_dict: dict[str, Any]) -> list[tuple[int, Any]]:
    """(position among the checkpoint's parameters, id) of every parameter whose state holds an
    optimizer-level dict, in order (one, unless several optimizers' states were merged: :func:`one_global`)."""
    state = state_dict.get("state", {})
    return [(pos, pid) for pos, pid in enumerate(param_ids(state_dict))
            if isinstance(state.get(pid), dict) and isinstance(state[pid].get(GLOBAL_KEY), dict)]


def global_entry(state_dict: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
    """(position of the carrier among the checkpoint's parameters, the optimizer-level dict), or None."""
    held = _holders(state_dict)
    return (held[0][0], state_dict["state"][held[0][1]][GLOBAL_KEY]) if held else None


def one_global(state_dict: dict[str, Any], name: str) -> dict[str, Any]:
    """``state_dict`` with one optimizer-level dict — a new dict where it had several, the caller's is not
    modified. ZeroRedundancyOptimizer's consolidated ``state_dict`` holds one per rank, each in the state of
    that rank's carrier, and each rank's resolution counters are indexed by *its shard's* parameters: loaded
    into one optimizer, the first would have been taken whole and its counters, escalation scales and
    spike-guard averages given to other parameters. The first is kept without its counters (they start
    afresh: the step, Polyak state and mode are every rank's alike), the others dropped, with a warning."""
    held = [pid for _, pid in _holders(state_dict)]
    if len(held) < 2:
        return state_dict
    warnings.warn(f"{name}.load_state_dict: the checkpoint holds the optimizer-level state of {len(held)} "
                  "optimizers (ZeroRedundancyOptimizer's consolidated state_dict: one per rank, each counting "
                  "events by its own shard's parameters); the resolution counters cannot be matched to "
                  "parameters and start afresh, the step, Polyak state and mode are taken from the first.",
                  RuntimeWarning, stacklevel=4)
    state = dict(state_dict["state"])
    first = {k: v for k, v in state[held[0]][GLOBAL_KEY].items() if k != "resolution"}
    state[held[0]] = {**state[held[0]], GLOBAL_KEY: first}
    for pid in held[1:]:
        state[pid] = {k: v for k, v in state[pid].items() if k != GLOBAL_KEY}
    return {**state_dict, "state": state}


def legacy_global(glob: dict[str, Any]) -> dict[str, Any]:
    """An optimizer-level dict of the old layout in the current one: its policy history — a list of
    [first step, policy] — becomes the (K, 2) ``policy_log`` tensor of the counters
    (:class:`nonans_optim.resolution.Resolution`)."""
    from .resolution import POLICIES
    history = glob.get("resolution_policies") or []
    res = glob.get("resolution")
    glob = {k: v for k, v in glob.items() if k != "resolution_policies"}
    if res is None or "policy_log" in res:
        return glob
    K = res["ring_step"].shape[0]
    log = torch.full((K, 2), -1, dtype=torch.int64)
    rows = [[int(step), POLICIES.index(policy)] for step, policy in history][-K:]
    if rows:
        log[K - len(rows):] = torch.tensor(rows, dtype=torch.int64)
    res = {**res, "policy_log": log.to(res["ring_step"].device)}
    return {**glob, "resolution": res, "logged_policy": rows[-1][1] if rows else -1}


def move_global_to_carrier(state_dict: dict[str, Any], carrier: int) -> dict[str, Any]:
    """``state_dict`` in the current layout — a new dict, the caller's is not modified: an optimizer-level
    dict saved at the top of ``state`` (the old layout) moves into the state of parameter number
    ``carrier`` (this optimizer's carrier), and its policy history becomes the counters' ``policy_log``."""
    state = state_dict.get("state")
    if not isinstance(state, dict) or GLOBAL_KEY not in state:
        return state_dict
    state = dict(state)
    glob = legacy_global(state.pop(GLOBAL_KEY))
    ids = param_ids(state_dict)
    if ids:  # (an optimizer without parameters has nowhere to keep it, and nothing to keep)
        pid = ids[carrier]
        state[pid] = {**state.get(pid, {}), GLOBAL_KEY: glob}
    return {**state_dict, "state": state}


def step_from_params(state_dict: dict[str, Any]) -> int | None:
    """The global step of a checkpoint saved without the optimizer-level state (``torch.optim.AdamW``'s):
    the largest per-parameter ``step``, or None when it has none. Read once at load time, on the host."""
    steps = [float(st["step"]) for pid, st in state_dict.get("state", {}).items()
             if pid != GLOBAL_KEY and isinstance(st, dict) and "step" in st]
    return int(max(steps)) if steps else None
