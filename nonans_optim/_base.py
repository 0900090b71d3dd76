"""The shared Optimizer shell: lazy state, the global step, train()/eval(), set_loss() and the resolution
bookkeeping. No algorithm math lives here (see ``functional/`` and ``optimizers/_scalar.py`` and
``optimizers/_spectral.py``); a group's admission and hyperparameter checks are in ``_groups.py``, the
checkpoint side in ``_checkpoint.py``, a group's step size in ``_stepsize.py``, and ``metrics()`` and
``events`` in ``_telemetry.py``.

Optimizer-level state — the global step, the Polyak EMAs, the resolution counters, the train/eval mode —
lives in one parameter's state, under the key ``"nonans"`` (:data:`._global_state.GLOBAL_KEY`; the
parameter is the first trainable one, the "carrier"). So every checkpoint path carries it as it carries
per-parameter state: torch's ``state_dict()``, and ``torch.distributed.checkpoint``, which accepts only
parameter keys in ``state``.
"""
from __future__ import annotations

import numbers
from typing import Any, Callable

import numpy as np
import torch
from torch.optim import Optimizer

from . import switches
from ._checkpoint import Checkpointed
from ._distributed import warn_per_rank_loss
from ._transfer import to_device
from ._groups import GroupAdmission
from ._stepsize import StepSize
from ._telemetry import Telemetry
from ._validation import _check_float
from .optimizers._common import assemble_counts, record_inf
from .resolution import POLICIES, STAGES, Resolution, check_policy

__all__ = ["NonansOptimizer"]


class NonansOptimizer(Checkpointed, GroupAdmission, StepSize, Telemetry, Optimizer):
    """Base of every nonans_optim optimizer. Subclasses implement ``_step_group(group, ctx)``."""

    #: True when any parameter takes a schedule-free path (then train()/eval() swap y ↔ x).
    _schedule_free: bool = False
    _uses_polyak: bool = False
    #: implementations this optimizer accepts for ``impl=``.
    _impls: tuple[str, ...] = ("auto", "loop", "foreach", "compiled")
    # True where one param group is handled by one kernel call, so that call may record the step's counts
    # (optimizers/_fused.py): the scalar-only optimizers; a Fusion group runs several paths.
    _counts_from_one_call = False

    def __init__(self, params, defaults: dict[str, Any], *, resolution: str, impl: str,
                 spike_factor: float | None = None):
        switches.check_all()  # the environment switches its steps read: a bad one raises here, not mid-step
        self.spike_factor = spike_factor  # validated by the property
        self.resolution_policy, self.impl = resolution, impl  # validated by the properties
        self._check_group(defaults)  # the defaults, then every group as torch adds it (add_param_group)
        super().__init__(params, defaults)
        self._pending_loss: torch.Tensor | None = None
        self._training = True
        self._resolution: Resolution | None = None
        self._index_cache: dict[tuple, torch.Tensor] = {}
        self._carrier_cache: torch.Tensor | None = None
        self._last_gamma: torch.Tensor | None = None  # γ of param_groups[0] at the last step (metrics())
        self._workspaces: dict = {}  # the native spectral path's buffers kept between steps (_fused_spectral)

    # ------------------------------------------------------------------ param bookkeeping
    def _all_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _num_params(self) -> int:
        """len(_all_params()) without building the list (asked on every step)."""
        return sum(len(g["params"]) for g in self.param_groups)

    def _first_param(self) -> torch.Tensor:
        """_all_params()[0] without building the list; only called when there are parameters."""
        return next(p for g in self.param_groups for p in g["params"])

    def _param_names(self) -> list[str | int]:
        names: list[str | int] = []
        for group in self.param_groups:
            gn = group.get("param_names")
            names.extend(gn if gn is not None else [None] * len(group["params"]))
        return [n if n is not None else i for i, n in enumerate(names)]

    # resolution_policy, impl and spike_factor are read at every step(), so they may be changed between
    # steps; each is checked when set, not deep inside the next step.
    @property
    def impl(self) -> str:
        return self._impl

    @impl.setter
    def impl(self, value: str) -> None:
        if value not in self._impls:
            raise ValueError(f"impl must be one of {self._impls} for {type(self).__name__}, got {value!r}")
        self._impl = value

    @property
    def spike_factor(self) -> float | None:
        return self._spike_factor

    @spike_factor.setter
    def spike_factor(self, value: float | None) -> None:
        if value is not None:
            _check_float("spike_factor", value, low=1.0)
        self._spike_factor = value

    @property
    def resolution_policy(self) -> str:
        """"repair", "skip" or "off": read at every ``step()``, so it may be changed between steps."""
        return self._policy

    @resolution_policy.setter
    def resolution_policy(self, value: str) -> None:
        self._policy = check_policy(value)

    def _get_resolution(self, step: int | None = None, st: dict[str, Any] | None = None) -> Resolution:
        """The counters, created (or resized, after ``add_param_group``, or restored after a load) on first
        use; ``load_state_dict`` and ``add_param_group`` drop them, so a step finds them already made.
        ``step``: called from that step, which runs under the current policy (``metrics()`` and ``events``
        read between steps, where a policy just set has not applied to anything yet), and ``st``: its
        optimizer-level state, which it has at hand (one lookup fewer in the host work that only "repair"
        and "skip" do on every step)."""
        res = self._resolution
        P = self._num_params()
        st = self._global() if st is None else st
        # (the counters in the state are not this object's when something else replaced the state: a
        # ZeroRedundancyOptimizer or DCP load writes it without going through load_state_dict)
        if res is None or res.num_params != P or st.get("resolution") is not res.tensors:
            res = Resolution(self._policy, P, self._first_param().device,
                             numels=[p.numel() for p in self._all_params()])
            saved = st.get("resolution")
            if saved is not None and saved["scale"].shape[0] <= P:  # fewer: parameters added since
                res.load_state_dict(saved, grow=True)
            self._resolution = res
            st["resolution"] = res.tensors  # the same dict from now on: record_step updates it in place
        code = POLICIES.index(self._policy)
        if st.get("logged_policy", -1) != code:
            # a fresh optimizer, a policy changed since the last step, or a checkpoint saved under another
            # policy: this one applies from this step (or, read between steps, the coming one); events
            # before it keep the labels of the policy they were recorded under
            res.set_policy(self._policy, st["step"] + 1 if step is None else step)
            st["logged_policy"] = code
        return res

    # ------------------------------------------------------------------ user-facing API
    @torch.compiler.disable  # dynamo drops attribute writes on an Optimizer (see below)
    def set_loss(self, loss: torch.Tensor | float) -> None:
        """Give this step's loss (the Polyak input). Harmless for optimizers without a Polyak step.

        Keeps the tensor on its device — no sync; a NaN/Inf loss is handled inside step(): where the
        Polyak step uses it, the loss EMA keeps its value (the multiplier is the ratio of the EMAs as they
        stand, so it does not fall back to 1 once a finite loss was seen) and a "loss" event is recorded.
        The Polyak ratio assumes a loss ≥ 0: a negative loss EMA pins the multiplier at its 0.1 floor. Accepts a real
        number (numpy scalars included) or a one-element real tensor; a bool or complex value is refused
        here rather than at the step. Under data parallelism give the optimizer ``polyak_group`` and call
        this on every rank (:mod:`nonans_optim._distributed`); without it, it warns once there.

        Not traced by torch.compile (nor are train()/eval()): inside a compiled training step dynamo
        discarded the writes these make to the optimizer, so the Polyak step silently never turned on and
        eval() swapped the parameters but left the mode "train" (an audit, 2026-11-25; torch disables
        dynamo on its own zero_grad and load_state_dict the same way)."""
        if isinstance(loss, numbers.Real) and not isinstance(loss, (bool, np.bool_)):
            try:
                loss = torch.tensor(float(loss))
            except OverflowError:  # an int past float's range (10**400): no float loss to keep
                raise ValueError(f"set_loss got {loss!r:.40}, which no float can hold") from None
        if isinstance(loss, np.ndarray) and loss.size == 1 and loss.dtype.kind in "iuf":
            loss = torch.tensor(float(loss.reshape(())))
        if (not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.dtype == torch.bool
                or loss.is_complex() or loss.is_meta):  # (a meta tensor has no value: step() failed halfway)
            raise ValueError(f"set_loss expects a real scalar loss (a number or a one-element real tensor), "
                             f"got {loss!r:.80}")
        self._pending_loss = loss.detach()
        if self._num_params():  # in the state, so that a resumed run keeps its Polyak step on
            self._global()["loss_given"] = True
        if self._uses_polyak and getattr(self, "_polyak_group", None) is None:
            warn_per_rank_loss(self)

    @torch.compiler.disable
    def train(self, mode: bool = True) -> "NonansOptimizer":
        """Schedule-free swap: parameters go back to y (where gradients are taken). No-op otherwise."""
        if not mode:
            return self.eval()
        if not self._training:
            self._swap(to_train=True)
        self._set_mode(True)
        return self

    @torch.compiler.disable
    def eval(self) -> "NonansOptimizer":
        """Schedule-free swap: parameters hold the averaged x (evaluate and checkpoint here)."""
        if self._training:
            self._swap(to_train=False)
        self._set_mode(False)
        return self

    def _set_mode(self, training: bool) -> None:
        """Record the mode in the state too: a checkpoint taken after eval() holds x in the parameters, and
        the optimizer that loads it must know that, or its train() would not swap back to y."""
        self._training = training
        if self._num_params():
            self._global()["train_mode"] = training

    def _swap(self, *, to_train: bool) -> None:  # overridden by schedule-free optimizers
        return None

    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """One optimizer step; ``closure`` (re-evaluates the model, returns the loss) is called first, under
        grad mode, and its loss returned, as in torch.optim. Its loss is *not* fed to the Polyak step: that
        stays what :meth:`set_loss` turns on (call it inside the closure to opt in), so ``step(closure)``
        takes the same step as ``closure(); step()`` — trainers that always pass a closure (Lightning's
        automatic optimisation) would otherwise switch a 10x step multiplier on (OPEN_QUESTIONS.md, Q5).

        Not traced by an outer torch.compile: a compiled training step breaks its graph here and runs the
        step as written (its impl — native loops, foreach, or its own compiled kernels). Traced, the host
        bookkeeping guarded on values that change every step (the schedule-free weight sum, the step
        count), so dynamo recompiled at every step until its limit and then fell back anyway, and it
        dropped the step's writes to the optimizer's attributes (an audit, 2026-11-25)."""
        if not self._training and self._schedule_free:  # before the closure: its forward would see x
            raise RuntimeError(
                f"{type(self).__name__}.step() called in eval mode: the parameters hold the schedule-free "
                "average x, not y. Call optimizer.train() before training steps (and optimizer.eval() "
                "before evaluation or checkpointing).")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:  # validate before any state changes (the closure made the grads)
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                # dtype, shape, device: only reachable through p.grad.data = ... (torch's setter refuses them).
                # The native loops trust the sizes: a gradient of 10 entries for a parameter of 20M was read
                # out of bounds and crashed the process (an audit, 2026-11-26); torch's AdamW raises
                # (is not, get_device: the cheapest forms, asked per parameter per step. Meta and CPU share -1:
                # a meta gradient on a CPU parameter passes here and fails at the step's first op, as in torch)
                if g.dtype is not p.dtype or g.shape != p.shape or g.get_device() != p.get_device():
                    raise RuntimeError(f"{type(self).__name__}: a gradient of dtype {g.dtype}, shape "
                                       f"{tuple(g.shape)} on {g.device} for a parameter of dtype {p.dtype}, shape "
                                       f"{tuple(p.shape)} on {p.device}; a gradient must have its parameter's "
                                       "dtype, shape and device")
        if not self._num_params():
            return loss
        device_type = self._first_param().device.type
        # (is_autocast_enabled raises for a device type autocast does not know: meta parameters, whose step
        # torch's AdamW runs)
        if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
            with torch.autocast(device_type, enabled=False):
                self._run_step()
        else:
            self._run_step()
        return loss

    def _run_step(self) -> None:
        """The step proper: the global step, the resolution context, each group, the record.

        Never under autocast (``step`` leaves the caller's region): the step's matmuls — KL-Shampoo's factor
        updates and roots — would run in the autocast dtype, and in fp16 a finite gradient of |g| ≈ 300
        overflowed G·Gᵀ, so every step recorded a "direction" event, the factor never updated and the step
        size halved down to 2⁻¹⁰ (an audit, 2026-11-26). torch's own optimizers are unaffected only because
        their steps hold no matmul."""
        st = self._global()
        st["step"] += 1
        res = self._get_resolution(st["step"], st) if self._policy != "off" else None
        if res is not None and st["step"] - st.get("recorded_step", st["step"] - 1) > 1:
            res.pass_clean_steps(st["step"] - st["recorded_step"] - 1)  # steps run under "off" since the last record
        ctx = {"step": st["step"], "resolution": res, "counts": [], "loss": self._pending_loss,
               "index": 0, "dense": None, "guard": self._guard, "device_indices": self._device_indices,
               "guard_in_kernel": False, "workspaces": self._workspaces,
               "spike_factor": self.spike_factor if res is not None else None,
               # a native kernel may fold the counts itself (one C call, not two) when its group is the
               # step's only producer of counts; it then sets "recorded"
               "record_in_kernel": self._counts_from_one_call and len(self.param_groups) == 1,
               "recorded": False}
        self._pending_loss = None
        ctx["recent"] = None  # Resolution.recent(), computed on first use (_common.recent_flags)
        self._before_groups(ctx)
        for group in self.param_groups:
            self._step_group(group, ctx)
            ctx["index"] += len(group["params"])
        if res is not None and not ctx["recorded"]:
            res.record_step(st["step"], self._assemble_counts(ctx, res.num_params, res.tensors["scale"].device),
                            native=self.impl in ("fused", "auto"))
        if res is not None:
            st["recorded_step"] = st["step"]

    def _gradients(self, group: dict[str, Any], ctx: dict[str, Any]) -> dict[int, torch.Tensor]:
        """{position in group: gradient to use} for the parameters with a gradient — after the spike guard
        (:mod:`nonans_optim.functional.spike`) when ``spike_factor`` is set and resolution is on, unless the
        compiled implementation applies the guard inside its kernels (``ctx["guard_in_kernel"]`` records which:
        a compiled path that falls back to eager applies it then, exactly once)."""
        found = {j: p.grad for j, p in enumerate(group["params"]) if p.grad is not None}
        ctx["guard_in_kernel"] = ctx["spike_factor"] is not None and self._guard_in_kernel()
        if ctx["spike_factor"] is None or not found or ctx["guard_in_kernel"]:
            return found
        js = list(found)
        guarded = self._guard(list(found.values()), [ctx["index"] + j for j in js], ctx)
        return dict(zip(js, guarded))

    def _guard_in_kernel(self) -> bool:
        """True when impl="compiled" can run, and always for impl="fused" and "auto": their kernels apply the
        spike guard themselves (and a fallback to eager applies it there: ``_common.eager_guard``)."""
        if self.impl in ("fused", "auto"):
            return True
        if self.impl != "compiled":
            return False
        from .optimizers._compiled import compile_available
        return compile_available()

    def _guard(self, grads: list[torch.Tensor], idx: list[int], ctx: dict[str, Any]) -> list[torch.Tensor]:
        """The eager spike guard on ``grads`` (global parameter indices ``idx``): updates the norm EMAs and
        this step's spike counts; returns new gradient tensors (``p.grad`` is never touched)."""
        from .functional.spike import spike_guard
        res = ctx["resolution"]
        ema = res.tensors["grad_norm_ema"]
        sel = self._device_indices(idx, ema.device)
        guarded, new_ema, trigger = spike_guard(grads, ema.index_select(0, sel), ctx["spike_factor"])
        ema.index_copy_(0, sel, new_ema)
        for i, f in zip(idx, trigger.unbind()):
            record_inf(ctx, i, "spike", f)
        return guarded

    def _device_indices(self, idx: list[int], device: torch.device) -> torch.Tensor:
        """int64 tensor of ``idx`` on ``device``, built once per index set (no host→device copy per step)."""
        return self._device_constant("indices", tuple(idx), device)

    def _before_groups(self, ctx: dict[str, Any]) -> None:
        """Optimizer-wide quantities computed once per step (subclasses add the Polyak multiplier)."""
        device = self._first_param().device
        ctx["unit_scale"] = torch.ones((), dtype=torch.float32, device=device)
        ctx["gamma_mult"] = None

    def _step_group(self, group: dict[str, Any], ctx: dict[str, Any]) -> None:
        raise NotImplementedError

    def _idle_group(self, group: dict[str, Any], ctx: dict[str, Any]) -> None:
        """A group none of whose parameters has a gradient this step: its schedule-free weight sum still
        advances, as every group's does on every step (``schedulefree``'s reference adds each step's weight
        to the group's sum before it looks at the gradients). It advanced only on steps with a gradient, so
        a parameter's average x depended on which group it sat in — 0.083 apart on an audit's run
        (2026-11-26), a parameter without gradients for five steps in its own group vs in a shared one."""
        if "sf_weight_sum" in group:
            self._schedule(group, ctx)

    def _assemble_counts(self, ctx: dict[str, Any], P: int, device: torch.device) -> torch.Tensor:
        """(P, S, 2) int64 counts of this step: what the eager paths recorded (``_common.assemble_counts``),
        plus the dense block the compiled kernels accumulated (``ctx["dense"]``)."""
        dense = ctx["dense"]
        flat = assemble_counts(ctx, P, len(STAGES), device, self._device_constant)
        if flat is None:
            return dense if dense is not None else torch.zeros(P, len(STAGES), 2, dtype=torch.int64, device=device)
        return flat if dense is None else flat + dense

    def _device_constant(self, name: str, values: tuple, device: torch.device,
                         dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """A tensor of host ``values`` on ``device``, built once per (name, values, dtype): a step then copies
        nothing to the device once its shapes have been seen (index sets, sizes, the count layout)."""
        key = (name, values, str(device), dtype)
        t = self._index_cache.get(key)
        if t is None:
            if len(self._index_cache) > 256:  # a bound, for a run whose patterns keep changing
                self._index_cache.clear()
            t = self._index_cache[key] = to_device(torch.tensor(values, dtype=dtype), device)
        return t
