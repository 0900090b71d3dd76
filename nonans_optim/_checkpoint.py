"""What the optimizer shell checks before ``load_state_dict`` changes anything, and what ``copy.deepcopy``
and pickle carry — the checkpoint side of :class:`nonans_optim._base.NonansOptimizer`.

torch's own ``Optimizer.load_state_dict`` checks only the number of groups and of parameters per group,
then swaps the state in. For a torch optimizer a wrong checkpoint fails at the next step with a size or key
error. Here it could do worse: the native CPU loops (``impl="fused"``, the default's choice) index every
state tensor by its parameter's size, so a state tensor of another shape — a checkpoint of a model with
another width, same parameter count — was read and written out of bounds (heap corruption, a crash some
steps later). So a checkpoint is checked whole before anything is replaced: every state tensor against
the shape a step of *this* optimizer would create for that parameter, and the keys it needs.

Group hyperparameters the checkpoint lacks are taken from the loading optimizer's current groups, as
torch's own ``__setstate__`` fills keys added in later versions — a checkpoint of ``torch.optim.AdamW``
lacks ``warmup_steps``, a checkpoint loaded a second time has gained torch's ``differentiable``; neither
says anything about the state. A torch feature this library does not implement (``amsgrad``,
``maximize``) is refused rather than silently dropped.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_loadable", "with_group_defaults", "step_from_params", "CARRIED", "GLOBAL_KEY", "needs_init",
           "global_entry", "legacy_global", "move_global_to_carrier", "copy_to"]

# The key, in one parameter's state (the "carrier": the first trainable parameter), of the optimizer-level
# state — global step, Polyak EMAs, resolution counters, train/eval mode. Up to v0.x it sat at the top of
# ``state`` as a non-parameter key; torch's own state_dict() passes that through, but
# ``torch.distributed.checkpoint`` (get_optimizer_state_dict: FSDP2, torchtitan, Lightning's and
# accelerate's distributed checkpoints) maps every state key to a parameter name and raised KeyError on
# it. Inside a parameter's state it travels like any nested optimizer state (Shampoo's, say); such
# checkpoints are still loaded (:func:`move_global_to_carrier`).
GLOBAL_KEY = "nonans"

# torch.optim.AdamW group flags whose non-default value changes the algorithm; this library has neither.
_UNSUPPORTED = {"amsgrad": False, "maximize": False}

# Instance attributes a copy (copy.deepcopy, pickle) must carry besides torch's defaults, state and
# param_groups: the settings read at every step() (torch's __getstate__ keeps only its own three, so a
# deep copy had no policy, impl or mode and failed at its first step). Caches (the counters' Resolution
# object, device index tensors) are rebuilt on first use.
CARRIED = ("_impl", "_policy", "_spike_factor", "_pending_loss", "_training",
           "components", "_schedule_free", "_uses_polyak")


def needs_init(st: dict) -> bool:
    """True when a parameter's state has none of its own entries yet (the carrier's may hold only the
    optimizer-level dict)."""
    return not st or st.keys() <= {GLOBAL_KEY}


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


def _ids(state_dict: dict[str, Any]) -> list:
    return [i for g in state_dict.get("param_groups", ()) for i in g.get("params", ())]


def global_entry(state_dict: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
    """(position of the carrier among the checkpoint's parameters, the optimizer-level dict), or None."""
    state = state_dict.get("state", {})
    for pos, pid in enumerate(_ids(state_dict)):
        st = state.get(pid)
        if isinstance(st, dict) and isinstance(st.get(GLOBAL_KEY), dict):
            return pos, st[GLOBAL_KEY]
    return None


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
    ids = _ids(state_dict)
    if ids:  # (an optimizer without parameters has nowhere to keep it, and nothing to keep)
        pid = ids[carrier]
        state[pid] = {**state.get(pid, {}), GLOBAL_KEY: glob}
    return {**state_dict, "state": state}


def _groups_fit(opt, state_dict: Any) -> list | None:
    """The saved groups when their counts match ``opt``'s (else None: torch's own load raises then)."""
    saved = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not isinstance(saved, list) or len(saved) != len(opt.param_groups):
        return None
    if any(len(s.get("params", ())) != len(g["params"]) for s, g in zip(saved, opt.param_groups)):
        return None
    return saved


def with_group_defaults(opt, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with every group key ``opt`` uses that a saved group lacks taken from ``opt``'s current
    group — a new dict; the caller's checkpoint is not modified."""
    saved = _groups_fit(opt, state_dict)
    if saved is None:
        return state_dict
    groups = [{**{k: v for k, v in g.items() if k != "params"}, **s} for g, s in zip(opt.param_groups, saved)]
    return {**state_dict, "param_groups": groups}


def check_loadable(opt, state_dict: dict[str, Any], named: list[bool] | None = None) -> None:
    """Raise ValueError, before anything is replaced, when ``state_dict`` does not fit ``opt``: a group
    using a torch feature this library lacks, or a parameter whose saved state lacks a key a step of ``opt``
    needs (saved by another optimizer, or with other components) or holds a tensor of another shape (saved
    for another model). Counts that do not match are left to torch's error; extra keys are carried.
    Called on the result of :func:`with_group_defaults`, so every group key ``opt`` uses is there;
    ``named``: per saved group, whether it had parameter names before that (for the error's hint)."""
    saved_groups = _groups_fit(opt, state_dict)
    if saved_groups is None:
        return
    name = type(opt).__name__
    state = state_dict.get("state", {})
    for i, (group, saved) in enumerate(zip(opt.param_groups, saved_groups)):
        used = sorted(k for k, off in _UNSUPPORTED.items() if saved.get(k, off) != off)
        if used:
            raise ValueError(f"this state_dict does not fit {name}: param group {i} uses {used}, which "
                             f"{name} does not implement")
        merged = {**saved, "params": group["params"]}
        for j, (pid, p) in enumerate(zip(saved["params"], group["params"])):
            st = state.get(pid)
            if not st or needs_init(st):
                continue
            where = f"the state of parameter {j} of group {i} (shape {tuple(p.shape)})"
            expected = opt._expected_state(merged, j, torch.empty_like(p, device="meta"))
            lacking = sorted(set(expected) - set(st))
            if lacking:
                renamed = named is not None and ("param_names" in group) != named[i]
                hint = ("was it saved by another optimizer, or with other components?" if not renamed else
                        "one of the checkpoint and this optimizer was given parameter names and the other "
                        "was not; names decide which parameters take the scalar path")
                raise ValueError(f"this state_dict does not fit {name}: {where} has no {lacking} ({hint})")
            for key, want in expected.items():
                got = st[key]
                if isinstance(want, torch.Tensor) and (not isinstance(got, torch.Tensor) or got.shape != want.shape):
                    shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                    raise ValueError(f"this state_dict does not fit {name}: {where} has {key!r} of shape "
                                     f"{shape}, this optimizer keeps {tuple(want.shape)} (was it saved for "
                                     "another model?)")


def step_from_params(state_dict: dict[str, Any]) -> int | None:
    """The global step of a checkpoint saved without the optimizer-level state (``torch.optim.AdamW``'s):
    the largest per-parameter ``step``, or None when it has none. Read once at load time, on the host."""
    steps = [float(st["step"]) for pid, st in state_dict.get("state", {}).items()
             if pid != GLOBAL_KEY and isinstance(st, dict) and "step" in st]
    return int(max(steps)) if steps else None
