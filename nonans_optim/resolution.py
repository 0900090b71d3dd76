"""The resolution stage: detect, repair and account for NaN/Inf inside ``step()`` without a host sync.

The contract (for users: README.md, "Resolution"; tested in ``tests/test_resolution.py``,
``test_resolution_inside.py`` and ``test_resolution_accounting.py``):

1. finite params and state before ``step()`` ⇒ finite after it, for any pattern of NaN/±Inf in gradients
   and for non-finite values that arise inside the step;
2. a non-finite gradient entry is a *missing observation*: moment buffers keep their previous value there,
   finite entries update normally, and the step continues from the optimizer's own estimate;
3. a clean step is bit-identical to ``resolution="off"`` and never synchronises with the host;
4. every event is counted on the device and materialised only when asked for;
5. explicit policies — ``"repair"``, ``"skip"`` (GradScaler-like, per tensor), ``"off"`` — and escalation
   (step-size backoff that grows back, like GradScaler's scale).

Why ``torch.where`` everywhere: OLMo-core's skip-step multiplies the update by a 0/1 flag, and 0·NaN = NaN,
so a NaN gradient still poisons the state. ``where`` selects, it never does arithmetic with the bad value.

This module holds the pure pieces (masks, counts, the event ring, escalation) and :class:`Resolution`,
the device-side bookkeeping object an optimizer owns; what hands its counters to the fused kernels (their
records, the native step's pointers) is in :mod:`._kernel_records`. No function here calls ``.item()``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ._kernel_records import KernelRecords, record_on_triton
from ._transfer import to_device
# the elementwise detection and count helpers live in .detection; re-exported here, where they always were
from .detection import finite_mask, inspect, storable_mask, tensor_counts
# the event vocabulary (stages, actions, SingularityEvent) lives in .events; re-exported here
from .events import ACTIONS, HELD, PARAM_STAGES, STAGE_INDEX, STAGES, SingularityEvent, materialise  # noqa: F401

__all__ = ["POLICIES", "STAGES", "ACTIONS", "SingularityEvent", "Resolution", "RecentRule", "finite_mask",
           "storable_mask", "inspect", "tensor_counts", "check_policy"]

POLICIES = ("repair", "skip", "off")  # a policy's code in Resolution's policy_log is its index here

def check_policy(resolution: str) -> str:
    if resolution not in POLICIES:
        raise ValueError(f"resolution must be one of {POLICIES}, got {resolution!r}")
    return resolution


class RecentRule(NamedTuple):
    """:meth:`Resolution.recent`, not yet evaluated: the counters it reads and its constants.

    Why not the (P,) flags: evaluating them is five small torch ops (compare, compare, mask, any, and),
    and on a GPU each costs the host a launch; a kernel that needs the flag of a few parameters — the
    Triton (SF-)AdamW step's decide kernel — reads these counters itself instead. :meth:`flags` is the
    torch form, the ground truth that kernel is tested against."""

    clean_streak: torch.Tensor  # (P,) int64
    events: torch.Tensor  # (P, S) int64
    param_mask: torch.Tensor  # (S,) bool: PARAM_STAGES on the counters' device
    window: int
    loss_stage: int  # the one stage that is nobody's event (the kernel's form of param_mask)

    def flags(self) -> torch.Tensor:
        """(P,) bool: an event on one of the parameter's own stages within the last ``window`` steps."""
        return (self.clean_streak < self.window) & ((self.events > 0) & self.param_mask).any(-1)


class Resolution(KernelRecords):
    """Device-side counters, event ring and escalation for one optimizer.

    Tensors (all on the parameters' device, all in ``state_dict()``):

    * ``counts`` (P, S, 2) int64 — cumulative [nan, inf] per parameter and stage;
    * ``events`` (P, S) int64 — number of steps on which each (parameter, stage) had an event;
    * ``ring_counts`` (K, P, S, 2) and ``ring_step`` (K,) — the last K steps *that had an event*. The write
      slot only advances on an event step (``ring_ptr += any``), so clean steps keep overwriting the same
      free slot and no branch on a device value is needed;
    * ``scale`` (P,) fp32 and ``clean_streak`` (P,) int64 — escalation: a repeated event (within
      ``repeat_window`` steps of the previous one) halves the parameter's step-size multiplier (floor
      ``min_scale``); every ``growth_interval`` clean steps double it back toward 1;
    * ``policy_log`` (K, 2) int64 — rows [first step, policy code] of the last K times a policy took
      effect, oldest first, [-1, -1] where unused: an event is labelled with the action of the policy in
      force at its step. A fixed-shape tensor, not a list, so that every checkpoint format carries it —
      ``torch.distributed.checkpoint`` loads into tensors of the shape the fresh optimizer has and refuses
      lists in a flattened optimizer state. Appended on the device (a shift), so a change needs no sync.
    """

    def __init__(self, policy: str, num_params: int, device: torch.device, *, ring_size: int = 64,
                 backoff: float = 0.5, growth_interval: int = 100, repeat_window: int = 10,
                 min_scale: float = 2.0 ** -10, numels: list[int] | None = None):
        self.policy = check_policy(policy)
        self.backoff, self.growth_interval, self.min_scale = backoff, growth_interval, min_scale
        self.repeat_window = repeat_window
        self._native_cache: dict = {}  # native.record_step's checked pointers
        # native_args' bundles, one per index list; valid while generation is the one they were made at.
        # The counters are replaced (never resized in place) only by this class — the torch record_step,
        # load_state_dict — and each replacement bumps it.
        self._native_args: dict = {}
        self.generation = 0
        # the step's dense count block, kept between steps (count_block): the Triton record zeroes it as it
        # folds it in, which saves the zero-fill launch of a fresh block on every GPU step
        self._count_block: torch.Tensor | None = None
        self._count_block_dirty = False
        self._scratch: dict = {}  # kernel_scratch's zeroed int32 tensors, one per key
        self._param_mask = to_device(torch.tensor(PARAM_STAGES), device)
        P, S, K = num_params, len(STAGES), ring_size
        # the parameters' sizes (not state: they are the model's), to tell a held step (no finite gradient
        # entry on a parameter with a recent event) in the ring
        self.numel = to_device(torch.tensor(numels if numels is not None else [0] * P, dtype=torch.int64),
                               device)  # (made inside a step: no host sync, as _base._device_indices)
        self.tensors: dict[str, torch.Tensor] = {
            "counts": torch.zeros(P, S, 2, dtype=torch.int64, device=device),
            "events": torch.zeros(P, S, dtype=torch.int64, device=device),
            "ring_counts": torch.zeros(K, P, S, 2, dtype=torch.int64, device=device),
            "ring_step": torch.zeros(K, dtype=torch.int64, device=device),
            "ring_escalated": torch.zeros(K, P, dtype=torch.bool, device=device),
            "ring_held": torch.zeros(K, P, dtype=torch.bool, device=device),
            "ring_ptr": torch.zeros((), dtype=torch.int64, device=device),
            "scale": torch.ones(P, dtype=torch.float32, device=device),
            "clean_streak": torch.zeros(P, dtype=torch.int64, device=device),
            "escalations": torch.zeros(P, dtype=torch.int64, device=device),
            "grad_norm_ema": torch.zeros(P, dtype=torch.float32, device=device),
            "policy_log": torch.full((K, 2), -1, dtype=torch.int64, device=device),
        }

    @property
    def num_params(self) -> int:
        return self.tensors["scale"].shape[0]

    def scale(self, index: int) -> torch.Tensor:
        """0-d view of parameter ``index``'s step-size multiplier (1.0 unless escalated)."""
        return self.tensors["scale"][index]

    def count_block(self, device: torch.device) -> torch.Tensor:
        """A zeroed (P, S, 2) int64 block for one step's counts (``_common.dense_counts``), the same tensor
        every step: zero-filled here unless the last step's Triton record left it zeroed (it clears the
        block as it reads it). Anything else — the torch or C record, a step that raised before its record,
        counts folded with eager ones into a new tensor — leaves it dirty, and the next step fills it."""
        P, S = self.num_params, len(STAGES)
        blk = self._count_block
        if blk is None or blk.device != device or blk.shape[0] != P:
            blk = self._count_block = torch.zeros(P, S, 2, dtype=torch.int64, device=device)
        elif self._count_block_dirty:
            blk.zero_()
        self._count_block_dirty = True
        return blk

    def count_block_consumed(self) -> None:
        """A kernel folded the step's count block into the counters and zeroed it behind its reads (the
        Triton record, or the last program of the one-launch step): the next :meth:`count_block` needs no
        fill."""
        self._count_block_dirty = False

    def kernel_scratch(self, key: tuple, size: int, device: torch.device) -> torch.Tensor:
        """A zeroed int32 tensor of at least ``size`` entries for a kernel that leaves it zeroed — the
        one-launch (SF-)AdamW step's tickets and flags (``kernels/scalar_one.py``) —, kept per ``key`` (one
        per parameter group: two launches of one step never share one), so a step pays no fill. After a launch
        that failed part way, :meth:`drop_scratch`."""
        t = self._scratch.get(key)
        if t is None or t.numel() < size:
            if len(self._scratch) > 64:  # a bound, for a run whose groups' gradient patterns keep changing
                self._scratch.clear()
            t = self._scratch[key] = torch.zeros(size, dtype=torch.int32, device=device)
        return t

    def drop_scratch(self) -> None:
        """Forget every :meth:`kernel_scratch` tensor (a launch that failed may have left one dirty)."""
        self._scratch.clear()

    def recent(self) -> torch.Tensor:
        """(P,) bool: the parameter had an event within the last ``repeat_window`` steps (before this one).

        A whole-tensor event on such a parameter is a *persistent* loss of observations (every batch now
        overflows, say): the optimizers then hold the parameter instead of continuing from momentum, which
        measurably kept pushing a model further into fp16 overflow (bench workload 2: held-out CE 8.4 with
        continuation, 3.3 with the hold)."""
        return self.recent_rule().flags()

    def recent_rule(self) -> RecentRule:
        """What :meth:`recent` computes, for a kernel that evaluates it itself (no torch op issued)."""
        t = self.tensors
        return RecentRule(t["clean_streak"], t["events"], self._stage_mask(t["events"].device), self.repeat_window,
                          STAGE_INDEX["loss"])

    def _stage_mask(self, device: torch.device) -> torch.Tensor:
        """PARAM_STAGES as an (S,) bool tensor on ``device`` (moved once, after a load to another device)."""
        if self._param_mask.device != device:
            self._param_mask = to_device(torch.tensor(PARAM_STAGES), device)
        return self._param_mask

    def _param_events(self, stage_flags: torch.Tensor) -> torch.Tensor:
        """(P,) any of a (P, S) bool over the parameter's own stages (all but "loss")."""
        return (stage_flags & self._stage_mask(stage_flags.device)).any(-1)

    def pass_clean_steps(self, steps: int) -> None:
        """``steps`` optimizer steps ran without a record (under the "off" policy) since the last one: for the
        repeat window and the regrowth they were clean steps, as they would have been recorded — the same
        clean_streak and the same doublings of the scale (one per multiple of ``growth_interval`` the streak
        passes; 2ᵏ is exact in fp32 and min(1, ·) of it is the per-step clamp). Without it an event 50 steps
        after the last one, across an "off" stretch, counted as a repeat: held and escalated (an audit,
        2026-11-26). In place, so pointers the kernels cached stay valid; torch ops, once per return to a
        policy, so nothing runs on the steps under "off"."""
        t = self.tensors
        streak, interval = t["clean_streak"], self.growth_interval
        doublings = (torch.div(streak + steps, interval, rounding_mode="floor")
                     - torch.div(streak, interval, rounding_mode="floor"))
        t["scale"].copy_(torch.clamp(t["scale"] * torch.exp2(doublings.to(torch.float32)), max=1.0))
        streak.add_(steps)

    def record_step(self, step: int, step_counts: torch.Tensor, *, native: bool = False) -> None:
        """Fold one step's (P, S, 2) counts into the counters, the event ring and the escalation state.

        ``native``: do it in the C loop of :mod:`nonans_optim.native` when it is available and the tensors
        are on the CPU, or in one Triton launch (``kernels/record.py``) on CUDA (``impl="fused"`` and
        ``"auto"``: there these thirty small ops cost more than the repair itself); the torch code below is
        the ground truth both are tested against."""
        device = self.tensors["scale"].device
        if native and record_on_triton(device) and self._record_triton(step, step_counts):
            return
        if native and device.type == "cpu" and self._record_native(step, step_counts):
            return  # (CUDA counters never try it: auto on CUDA must not build the C library)
        t = self.tensors
        stage_event = step_counts.sum(-1) > 0  # (P, S)
        param_event = self._param_events(stage_event)  # (P,): the loss stage is nobody's event
        t["counts"] += step_counts
        # Escalation: GradScaler-style backoff per parameter, gated with where (no branch, no sync).
        # Only a *repeated* event backs off: one within ``repeat_window`` steps of the previous event on the
        # same parameter (a persistent fault). Sporadic faults are repaired at full step size: with 1% faulty
        # steps, backing off on every event measurably hurt the final loss (3x here, tests/test_resolution).
        self.generation += 1  # clean_streak and scale are replaced below: cached pointers go stale
        scale, streak = t["scale"], t["clean_streak"]
        seen_before = self._param_events(t["events"] > 0)
        repeated = param_event & seen_before & (streak < self.repeat_window)
        grown = torch.remainder(streak + 1, self.growth_interval) == 0
        new_scale = torch.where(
            repeated, torch.clamp(scale * self.backoff, min=self.min_scale),
            torch.where(grown & ~param_event, torch.clamp(scale * 2.0, max=1.0), scale))
        escalated = repeated & (new_scale < scale)
        # held: the update kernels' hold rule (Resolution.recent at the step's start, and no finite entry)
        whole = (step_counts[:, STAGE_INDEX["grad"]].sum(-1) == self.numel) & (self.numel > 0)
        held = repeated & whole
        t["escalations"] += escalated.to(torch.int64)
        t["clean_streak"] = torch.where(param_event, torch.zeros_like(streak), streak + 1)
        t["scale"] = new_scale
        t["events"] += stage_event.to(torch.int64)
        # Event ring: write into the current free slot; advance only if this step had an event.
        K = t["ring_step"].shape[0]
        slot = torch.remainder(t["ring_ptr"], K).reshape(1)
        t["ring_counts"].index_copy_(0, slot, step_counts.unsqueeze(0))
        t["ring_escalated"].index_copy_(0, slot, escalated.unsqueeze(0))
        t["ring_held"].index_copy_(0, slot, held.unsqueeze(0))
        t["ring_step"].index_copy_(0, slot, torch.full((1,), step, dtype=torch.int64, device=slot.device))
        t["ring_ptr"] += stage_event.any().to(torch.int64)

    def set_policy(self, policy: str, step: int) -> None:
        """The policy from ``step`` on: appended to ``policy_log`` on the device (the optimizer calls it when
        the policy differs from the last one logged)."""
        self.policy = check_policy(policy)
        log = self.tensors["policy_log"]
        row = torch.full((1, 2), int(step), dtype=torch.int64, device=log.device)
        row[:, 1].fill_(POLICIES.index(policy))  # (an item assignment would copy a host scalar: a sync)
        log.copy_(torch.cat((log[1:], row)))

    def policy_at(self, step: int, log: list[list[int]] | None = None) -> str:
        """The policy in force at ``step`` (the earliest logged one before the log starts). ``log``: the
        host copy of ``policy_log`` (read once by :meth:`materialise`)."""
        rows = [r for r in (log if log is not None else self.tensors["policy_log"].tolist()) if r[0] >= 0]
        current = POLICIES[rows[0][1]] if rows else self.policy
        for first, code in rows:
            if first > step:
                break
            current = POLICIES[code]
        return current

    # ----- host side: only called from metrics()/events, never from step() -----
    def materialise(self, names: list[str | int], numels: list[int]) -> list[SingularityEvent]:
        """The event ring read back to the host as events (``optimizer.events``; :func:`.events.materialise`)."""
        return materialise(self.tensors, self.policy_at, names, numels)

    def summary(self) -> dict[str, float]:
        t = {k: self.tensors[k].cpu() for k in ("events", "counts", "escalations", "scale")}
        out = {"resolution/events_total": float(t["events"].sum())}
        for s_idx, stage in enumerate(STAGES):
            out[f"resolution/events_{stage}"] = float(t["events"][:, s_idx].sum())
            out[f"resolution/nan_{stage}"] = float(t["counts"][:, s_idx, 0].sum())
            out[f"resolution/inf_{stage}"] = float(t["counts"][:, s_idx, 1].sum())
        out["resolution/escalations"] = float(t["escalations"].sum())
        out["resolution/min_scale"] = float(t["scale"].min()) if t["scale"].numel() else 1.0
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.tensors.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], *, grow: bool = False) -> None:
        """Take saved counters. ``grow``: they may be of fewer parameters than this Resolution's — those
        of an optimizer that has since had parameters appended (``add_param_group``): the saved ones keep
        their counts, events and escalation, the new ones start fresh."""
        missing = set(self.tensors) - set(state) - {"ring_held"}  # (checkpoints before it: no held steps)
        if missing:
            raise ValueError(f"resolution state is missing {sorted(missing)}")
        if state["scale"].ndim != 1:  # (its length is the saved parameter count every other shape is checked by)
            raise ValueError(f"resolution state 'scale' has shape {tuple(state['scale'].shape)}, expected (P,)")
        P, P0 = self.num_params, state["scale"].shape[0]
        for k, v in state.items():
            if k in self.tensors and v.shape != self.tensors[k].shape and not (grow and P0 < P):
                raise ValueError(f"resolution state {k!r} has shape {tuple(v.shape)}, expected "
                                 f"{tuple(self.tensors[k].shape)} (different number of parameters?)")
        new = {}
        for k, fresh in self.tensors.items():  # in its own dtype: a load that bypassed the optimizer's own
            v = state.get(k, fresh).to(fresh.device, fresh.dtype)  # (ZeRO's) cast fp32 ones to bf16
            if v.shape == fresh.shape:
                new[k] = v.clone()
            else:  # the parameter axis is the one that differs; saved rows first, fresh ones after
                dim = next(d for d, (a, b) in enumerate(zip(v.shape, fresh.shape)) if a != b)
                new[k] = fresh.clone()
                new[k].narrow(dim, 0, P0).copy_(v)
        self.tensors = new
        self.generation += 1
