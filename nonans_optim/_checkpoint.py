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

:class:`Checkpointed` is the shell's mixin for all of this: where the optimizer-level state lives (inside
one parameter's state, so that ``torch.distributed.checkpoint`` carries it; how a checkpoint holds it, and
the older layouts, are ``_global_state.py``'s), ``load_state_dict`` with its checks and torch's load hooks,
and the copy protocol.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from ._global_state import (GLOBAL_KEY, copy_to, global_entry, legacy_global, move_global_to_carrier,
                            needs_init, one_global, param_ids, step_from_params)
from .functional.polyak import init_polyak

__all__ = ["Checkpointed", "check_loadable", "with_group_defaults", "CARRIED"]

# Instance attributes a copy (copy.deepcopy, pickle) must carry besides torch's defaults, state and
# param_groups: the settings read at every step() (torch's __getstate__ keeps only its own three, so a
# deep copy had no policy, impl or mode and failed at its first step). Caches (the counters' Resolution
# object, device index tensors) are rebuilt on first use.
CARRIED = ("_impl", "_policy", "_spike_factor", "_pending_loss", "_training",
           "components", "_schedule_free", "_uses_polyak")


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
    glob = global_entry(state_dict)
    if glob is not None:
        check_global(opt, glob[1], name)
    for i, (group, saved) in enumerate(zip(opt.param_groups, saved_groups)):
        merged = {**saved, "params": group["params"]}  # (the checks look at the tensors: a path's shapes)
        try:  # the constructor's checks on the group as it will be loaded, normalising it as they do (into
            # ``saved``, a copy of the caller's: see with_group_defaults): a loaded eps=nan, lr=-1 or betas=(1.5,
            # 0.9) passed and trained wrong or failed halfway through a later step (an audit, 2026-11-26)
            opt._check_group(merged)
        except ValueError as err:
            raise ValueError(f"this state_dict does not fit {name}: param group {i}: {err}") from None
        saved.update({k: v for k, v in merged.items() if k != "params"})
        for j, (pid, p) in enumerate(zip(saved["params"], group["params"])):
            st = state.get(pid)
            where = f"the state of parameter {j} of group {i} (shape {tuple(p.shape)})"
            if pid in state and not isinstance(st, dict):
                raise ValueError(f"this state_dict does not fit {name}: {where} is a {type(st).__name__}, "
                                 "not a dict")
            if needs_init(st or {}):
                continue
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


def check_global(opt, glob: dict[str, Any], name: str) -> None:
    """Raise ValueError when the optimizer-level dict of a checkpoint lacks what a step reads, or holds it in
    a form the step cannot take: the load swapped such a dict in and every later ``step()`` failed (a
    missing ``step`` or ``polyak``: KeyError; a float step tensor: a ctypes error halfway through a step,
    parameters already updated; counters without ``scale``: KeyError), so the optimizer was lost (an audit,
    2026-11-26). The counters are loaded into a scratch copy here, with the checks their real load runs at
    the next step (shapes, the parameter count)."""
    from .functional.polyak import init_polyak
    from .resolution import Resolution

    def bad(what: str) -> ValueError:
        return ValueError(f"this state_dict does not fit {name}: its optimizer-level state ({GLOBAL_KEY!r}) {what}")

    step = glob.get("step")
    if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_floating_point() and not step.is_complex():
        step = int(step)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise bad(f"has step {glob.get('step')!r}, not a non-negative integer")
    polyak = glob.get("polyak")
    lacking = sorted(set(init_polyak(torch.device("cpu"))) - set(polyak)) if isinstance(polyak, dict) else None
    if lacking is None or lacking:
        raise bad(f"has no Polyak state {lacking or ''}".rstrip())
    res = glob.get("resolution")
    if res is not None:
        if not isinstance(res, dict) or not all(isinstance(v, torch.Tensor) for v in res.values()):
            raise bad("holds resolution counters that are not a dict of tensors")
        scratch = Resolution(opt.resolution_policy, opt._num_params(), torch.device("cpu"))
        try:  # (its own checks: the keys, 'scale' per parameter, every shape against the parameter count)
            scratch.load_state_dict({k: v.to("cpu") for k, v in res.items()}, grow=True)
        except ValueError as err:
            raise bad(f"does not load: {err}") from None


class Checkpointed:
    """The checkpoint side of the optimizer shell (mixed into :class:`nonans_optim._base.NonansOptimizer`,
    before ``torch.optim.Optimizer``): where the optimizer-level state lives (:data:`GLOBAL_KEY` in the
    carrier's state), ``load_state_dict`` with its checks and hooks, and what a copy carries."""

    def _carrier(self) -> torch.Tensor:
        """The parameter whose state holds the optimizer-level dict: the one that holds it already (a
        loaded checkpoint decides), else the first that requires grad — torch.distributed.checkpoint
        drops the state of frozen parameters — else the first. Only called when there are parameters."""
        c = self._carrier_cache
        if c is None:
            params = self._all_params()
            c = next((p for p in params if GLOBAL_KEY in self.state.get(p, ())), None)
            if c is None:
                c = next((p for p in params if p.requires_grad), params[0])
            self._carrier_cache = c
        if not c.requires_grad:
            c = self._move_carrier(c)
        return c

    def _move_carrier(self, c: torch.Tensor) -> torch.Tensor:
        """The carrier was frozen (``requires_grad_(False)``, fine-tuning that freezes the first layers
        mid-run): the optimizer-level dict moves to the first parameter that still requires grad. There it
        is where a resumed run's optimizer, built with the same parameters frozen, looks for it — a
        ``dcp.load`` found no ``nonans`` entry under that parameter and failed (torch's AdamW resumes), and
        DCP drops a frozen parameter's state when it saves. Nothing moves while every parameter is frozen."""
        new = next((p for p in self._all_params() if p.requires_grad), None)
        if new is None:
            return c
        glob = self.state.get(c, {}).pop(GLOBAL_KEY, None)
        if glob is not None:
            self.state[new][GLOBAL_KEY] = glob
        self._carrier_cache = new
        return new

    def _global_state(self) -> dict[str, Any] | None:
        """The optimizer-level state, or None before anything made it (never creates it)."""
        if not self._num_params():
            return None
        return self.state.get(self._carrier(), {}).get(GLOBAL_KEY)

    def _global(self) -> dict[str, Any]:
        """Optimizer-level state, created lazily on the parameters' device, with every key from the start:
        ``dcp.load`` fills only the entries the loading optimizer already has (a key added later, such as
        the mode on the first eval(), would be dropped from a checkpoint)."""
        st = self._global_state()
        if st is None:
            device = self._first_param().device
            # logged_policy: the code of the policy in the last row of the counters' policy_log (-1: none),
            # a host int beside the log so that deciding whether to log a change never reads the device;
            # recorded_step: the last step the counters recorded (the steps after it ran under "off");
            # events_sent_step: the step up to which a logger sent ``events`` (integrations/wandb.py), in the
            # state so that a resumed job does not send the checkpoint's events a second time
            st = {"step": 0, "polyak": init_polyak(device), "train_mode": self._training, "loss_given": False,
                  "logged_policy": -1, "recorded_step": 0, "events_sent_step": -1}
            self.state[self._carrier()][GLOBAL_KEY] = st
        return st

    @torch.compiler.disable  # (as torch's own load_state_dict)
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, after checking that the checkpoint fits this optimizer (:mod:`._checkpoint`: keys,
        and the shape of every state tensor), with group keys it lacks taken from the current groups. A
        checkpoint without the optimizer-level state (``torch.optim.AdamW``'s) resumes the global step
        from its parameters' ``step``.

        Load hooks keep torch's contract: pre-hooks see the checkpoint as given and may adapt it (torch's
        docs suggest one to remap parameters) before anything here checks it; post-hooks run once the load
        is complete, the optimizer-level state included. torch's load would run them around its own part
        only — the checks refused what a pre-hook was about to fix, and post-hooks saw the previous run's
        counters (an audit, 2026-11-25)."""
        state_dict = state_dict.copy()  # (shallow, as torch's)
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            state_dict = state_dict if result is None else result
        named = [isinstance(g, dict) and "param_names" in g for g in state_dict.get("param_groups", ())]
        state_dict = with_group_defaults(self, state_dict)  # new dicts: the caller's is not modified
        state_dict = one_global(state_dict, type(self).__name__)
        if self._num_params():  # an old checkpoint kept the optimizer-level state at the top of "state"
            carrier = self._carrier()
            self._carrier_cache = None  # (the loaded state decides it from now on)
            state_dict = move_global_to_carrier(state_dict, [id(p) for p in self._all_params()].index(id(carrier)))
        check_loadable(self, state_dict, named)
        pre, post = self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks
        self._optimizer_load_state_dict_pre_hooks = self._optimizer_load_state_dict_post_hooks = OrderedDict()
        try:  # torch's part, with the hooks run here instead
            super().load_state_dict(state_dict)
        finally:
            self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = pre, post
        self._finish_load(state_dict)
        for hook in post.values():
            hook(self)

    def _finish_load(self, state_dict: dict[str, Any]) -> None:
        """After torch's part of a load: buffer dtypes, and the optimizer-level state as saved."""
        self._restore_state_dtypes(state_dict)
        self._resolution, self._carrier_cache, self._last_gamma = None, None, None
        self._workspaces.clear()  # kept per group, and torch's load made new group dicts
        saved = global_entry(state_dict)
        if saved is None and self._num_params():
            step = step_from_params(state_dict)
            if step is not None:
                self._global()["step"] = step
        elif saved is not None:  # torch cast it to its carrier's dtype: take it as saved, on the params' device
            carrier = self._all_params()[saved[0]]
            self._carrier_cache = carrier
            st = self.state[carrier][GLOBAL_KEY] = copy_to(saved[1], self._first_param().device)
            st["step"] = int(st["step"])  # (check_global allowed an integer 0-d tensor: the step is a host int)
            self._training = bool(st.get("train_mode", True))
            # whether set_loss() was ever called (it turns the Polyak step on for good); checkpoints saved
            # before the flag was stored tell it by a finite loss having been seen
            st.setdefault("loss_given", bool(st["polyak"]["loss_seen"]))
            st.setdefault("recorded_step", st["step"])  # (saved before it was kept: no "off" stretch known)
            st.setdefault("events_sent_step", -1)  # (saved before it was kept: which were sent is unknown)

    def _expected_state(self, group: dict[str, Any], j: int, p: torch.Tensor) -> dict[str, Any]:
        """The state a step creates for parameter ``j`` of ``group`` (``p`` may be a meta tensor: then so are
        the tensors), which a checkpoint's state must match in keys and shapes."""
        raise NotImplementedError

    # copy.deepcopy and pickle: torch's __getstate__ keeps defaults, state and param_groups only
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update({k: self.__dict__[k] for k in CARRIED if k in self.__dict__})
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # also called by torch's load_state_dict, with state and groups only
        self.__dict__.setdefault("_resolution", None)
        self.__dict__.setdefault("_index_cache", {})
        self.__dict__.setdefault("_carrier_cache", None)
        self.__dict__.setdefault("_workspaces", {})  # (a copy never shares the original's buffers)
        legacy = self.state.pop(GLOBAL_KEY, None)  # an optimizer pickled with the old layout
        if legacy is not None and self._num_params():
            self.state[self._carrier()][GLOBAL_KEY] = legacy_global(legacy)

    def _restore_state_dtypes(self, state_dict: dict[str, Any]) -> None:
        """torch casts every floating state tensor to its parameter's dtype on load; each is put back in the
        dtype this optimizer keeps it in — the one a step creates (:meth:`_expected_state`) — from the
        checkpoint's own tensor, not from torch's cast. Until 2026-11-26 only the momentum buffer was: the
        fp32 NorMuon row moment and KL-Shampoo factors of a bf16, fp16 or fp64 model came back in the
        parameter's dtype (16 bits lost for bf16) and the first step after the resume raised on the mixed
        dtypes (an audit). The momentum buffer's dtype is :meth:`_buffer_dtype`'s, from the loaded group's
        ``momentum_dtype`` (Fusion's "bf16" is narrower on purpose; "param" follows the parameter, so a
        bf16 model's checkpoint resumed on an fp32 copy gets fp32 momentum, not the saved bf16 for good)."""
        params = self._all_params()
        groups = [g for g in self.param_groups for _ in g["params"]]
        positions = [j for g in self.param_groups for j in range(len(g["params"]))]
        for pid, p, group, j in zip(param_ids(state_dict), params, groups, positions):
            st, saved = self.state.get(p), state_dict["state"].get(pid)
            if not st or not isinstance(saved, dict) or needs_init(st):
                continue
            wants = {k: v.dtype for k, v in self._expected_state(group, j, torch.empty_like(p, device="meta")).items()
                     if isinstance(v, torch.Tensor) and k != "step"}
            if "momentum_buffer" in wants:  # (its "auto" dtype depends on the device, which a meta tensor lacks)
                wants["momentum_buffer"] = self._buffer_dtype(group, j, p) or p.dtype
            for key, want in wants.items():
                got, orig = st.get(key), saved.get(key)
                if isinstance(got, torch.Tensor) and got.dtype != want and isinstance(orig, torch.Tensor):
                    st[key] = orig.to(device=got.device, dtype=want, copy=True)  # (never the caller's tensor)

    def _buffer_dtype(self, group: dict[str, Any], j: int, p: torch.Tensor) -> torch.dtype | None:
        """The dtype of parameter ``j``'s momentum buffer in ``group`` (None: none kept, or torch's cast to
        the parameter's dtype is right). Fusion's answer depends on ``momentum_dtype``."""
        return None
