"""The parts of :class:`~nonans_optim.resolution.Resolution` that hand its counters to the fused kernels:
the record in one Triton launch (CUDA) or one C loop (CPU), and the counters' data pointers a native step
passes, cached per index list (:class:`NativeArgs`). The torch ops of ``Resolution.record_step`` are the
ground truth both records are tested against (tests/test_fused.py, tests/test_kernels_record.py).
"""
from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Callable

import torch

from . import kernels, native
from .events import STAGE_INDEX

if TYPE_CHECKING:
    from .resolution import Resolution

__all__ = ["KernelRecords", "NativeArgs", "record_on_triton"]

_TRITON_RECORD_FAILED: list[str] = []  # the first failure of the Triton record in this process, if any
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # (triton reads it once at import, too)


def record_on_triton(device: torch.device) -> bool:
    """Whether a step's record runs the Triton kernel: CUDA counters (or CPU ones under the interpreter with
    ``NONANS_FUSED_BACKEND=triton``, how CI tests it), triton importable, and no failure so far. The device
    test comes first: a CPU step pays one attribute test, not an environment read or a triton import."""
    if not (device.type == "cuda" or (device.type == "cpu" and _INTERPRETED)) or _TRITON_RECORD_FAILED:
        return False
    from .optimizers._fused_triton import backend

    return backend(device) == "triton" and kernels.available()


class NativeArgs:
    """What :meth:`Resolution.native_args` caches: the pointers of the counters a native kernel reads and
    writes (``ema``, ``sel`` — the int64 global indices —, ``scale``, ``streak``, ``events``), ``pack`` (the
    record pack of ``nonans_record_step_packed``, None where the native record does not cover the counters)
    and ``written`` (every counter tensor a kernel that also records may write through them, for the
    autograd version bump). It holds the tensors it points into, so the pointers stay valid."""

    __slots__ = ("generation", "indices", "sel_tensor", "ema", "sel", "scale", "streak", "events", "pack",
                 "written")

    def __init__(self, res: "Resolution", indices: list[int], sel: torch.Tensor):
        t = res.tensors
        self.generation, self.indices, self.sel_tensor = res.generation, indices, sel
        self.ema, self.sel, self.scale = (t["grad_norm_ema"].data_ptr(), self.sel_tensor.data_ptr(),
                                          t["scale"].data_ptr())
        self.streak, self.events = t["clean_streak"].data_ptr(), t["events"].data_ptr()
        packed = res.native_record_pack()
        self.pack = None if packed is None else packed[0]
        self.written = [t["grad_norm_ema"], *(packed[1] if packed is not None else ())]


class KernelRecords:
    """Mixin of :class:`~nonans_optim.resolution.Resolution` (whose ``tensors``, ``numel``, escalation
    constants, ``generation``, ``_native_cache``, ``_native_args`` and count block it reads): the kernel
    forms of its record and the pointers a native step passes."""

    def native_record_pack(self) -> tuple | None:
        """(packed arguments, counter tensors) with which a native step folds its own counts into the
        counters — what :meth:`record_step` does, inside the same C call (optimizers/_fused.py) — or None
        where the native record does not cover these counters (CUDA, another dtype, no library)."""
        if not self.tensors["scale"].is_cpu:
            return None
        return native.record_pack(self.tensors, numel=self.numel, growth_interval=self.growth_interval,
                                  repeat_window=self.repeat_window, cache=self._native_cache)

    def native_args(self, indices: list[int],
                    device_indices: Callable[[list[int], torch.device], torch.Tensor]) -> "NativeArgs":
        """The data pointers a native step passes for the parameters at global ``indices`` (CPU counters:
        the caller checked), built once per index list and counter generation; ``device_indices``: the
        optimizer's cache of int64 index tensors, asked only when the bundle is (re)built. Rebuilding them each step —
        an index tensor looked up, five pointers read, the record pack checked — cost about 6 us of a
        step's Python glue (a scratch timing, 2026-11-24, commit 4d6067b; not in RESULTS.md), which on a
        cache-resident model is most of what "repair" costs over "off" (RESULTS.md, "overhead", by tensor
        size)."""
        key = (indices[0] if indices else -1, len(indices))  # groups never share a first index
        hit = self._native_args.get(key)
        if hit is not None and hit.generation == self.generation and hit.indices == indices:
            return hit
        sel = device_indices(indices, self.tensors["scale"].device)
        if len(self._native_args) > 256:  # a bound, for a run whose gradient patterns keep changing (MoE)
            self._native_args.clear()
        args = self._native_args[key] = NativeArgs(self, list(indices), sel)
        return args

    @torch.compiler.disable  # a Triton launch: run eagerly inside a compiled step
    def _record_triton(self, step: int, step_counts: torch.Tensor) -> bool:
        from .kernels.record import record_step_

        consume = step_counts is self._count_block  # (contiguous: .contiguous() below is the block itself)
        try:
            record_step_(self.tensors, step_counts.contiguous(), step, numel=self.numel, backoff=self.backoff,
                         min_scale=self.min_scale, growth_interval=self.growth_interval,
                         repeat_window=self.repeat_window, loss_stage=STAGE_INDEX["loss"],
                         grad_stage=STAGE_INDEX["grad"], consume=consume)
        except Exception as err:  # noqa: BLE001 — a compile error, say: nothing was written; torch records
            _TRITON_RECORD_FAILED.append(f"{type(err).__name__}: {err}")
            warnings.warn(f"the Triton record kernel failed ({_TRITON_RECORD_FAILED[0][:300]}); recording "
                          "with torch ops from now on", RuntimeWarning, stacklevel=4)
            return False
        if consume:
            self.count_block_consumed()
        return True

    @torch.compiler.disable  # ctypes and a build cache: run eagerly inside a compiled step
    def _record_native(self, step: int, step_counts: torch.Tensor) -> bool:
        return native.record_step(self.tensors, step_counts, step, numel=self.numel, backoff=self.backoff,
                                   min_scale=self.min_scale, growth_interval=self.growth_interval,
                                   repeat_window=self.repeat_window, cache=self._native_cache)
