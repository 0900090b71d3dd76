"""``watch(model)``: name the first module whose forward output or backward gradient turned non-finite.

Why device-side flags. ``torch.autograd.detect_anomaly`` answers the same question by checking every
autograd node on the host (roughly 2x the step time on CPU, RESULTS.md "Overhead of nonans_optim.watch()";
a device sync per node on GPU). Here every hook only *enqueues* a few tiny ops: ``(t - t).sum() != 0`` per
tensor (True iff some entry is NaN/±Inf; one ``aminmax`` pass for large tensors), then ``torch.where``
writes a packed event code into a 0-d int64 flag that starts at -1 and is written only while it is still
-1. Hooks fire in execution order, so the first write wins and the flag holds the first event, without
any host-device synchronisation.
:meth:`Watch.first_nonfinite` and :meth:`Watch.report` are the only methods that read the flags (one sync
per device and phase).

What is recorded (each module is numbered in ``model.named_modules()`` order; ``call`` counts the
module's forward calls since the last :meth:`Watch.reset`, so a module reused in one forward is told
apart):

* forward, ``where="output"``: the module returned a non-finite floating tensor (anywhere in a nested
  tuple/list/dict) while its inputs were finite (they are checked first) — the module made it. Forward
  hooks fire when a module *returns*, so a child is always seen before its parent: the innermost module
  is named.
* forward, ``where="input"``: the module was *called* with a non-finite input: the value was made by
  code outside every watched module's output — the forward body of ``inside`` (the enclosing module at
  call time, e.g. a functional ``torch.log`` between two layers), or the data itself when ``inside`` is
  None (the root module's input).
* backward, ``where="grad_input"``: the gradient that a module's own backward sent to its inputs is
  non-finite while the gradient arriving at its output was finite (``sqrt`` at 0, ``x / ‖x‖`` at 0).
  Checked for leaf modules (no children), on the autograd nodes that feed the module's inputs.
* backward, ``where="grad_param"``: same, for the gradient a leaf module sends to its own parameters
  (e.g. a finite output gradient times a non-finite saved input: the forward was already non-finite).
  A module with children may hold parameters of its own too (a ViT's ``pos_embed`` and ``cls_token``, a
  LayerScale written into a block's forward): their gradients are checked by a hook on each such
  parameter, and named ``grad_param`` of that module with its last call. Backward reaches them after
  the gradients at the module's output and its children, which are checked first, so the event is the
  first only when everything before it was finite — the module's own body made it (``sqrt`` of its
  parameter at 0, say). Without this, such a gradient went unnamed: no leaf module holds the parameter.
* backward, ``where="grad_output"``: the gradient arriving at a module's output is non-finite: it was
  made by backward code outside every watched leaf — the body of ``inside`` between this module's output
  and its consumers, or the loss when the module is the root.

Why not ``register_full_backward_hook``: it wraps module outputs in an identity autograd Function, and
any in-place op on such an output (``nn.ReLU(inplace=True)`` after a BatchNorm, as in torchvision's
ResNets) then raises in forward. Watching must not break a model, so backward checks use hooks on the
autograd nodes themselves (``Node.register_prehook`` / ``Node.register_hook``), found from the module's
output tensors and bounded by its input edges.
"""
from __future__ import annotations

import dataclasses
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

__all__ = ["Watch", "watch"]

_WHERE = {"forward": ("output", "input", None), "backward": ("grad_input", "grad_output", "grad_param")}
_CODE_LIMIT = 2**62  # packed codes above this saturate the call index (int64 headroom)
_RECENT = 32  # how many recently checked tensors are remembered to skip re-checking them
_MAX_NODES = 4096  # traversal budget for one leaf module's backward subgraph
_MINMAX_FROM = 1 << 18  # entries from which a tensor's check is one aminmax pass (_nonfinite_by_device)


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Floating/complex dense tensors in a nested tuple/list/dict (HF ModelOutput is a dict), dataclass
    (whose fields are walked: a NaN inside one was blamed on the code that received it) or a tensor. Meta
    tensors hold no values and are left out (reading a flag made on the meta device raised)."""
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if (item.is_floating_point() or item.is_complex()) and item.layout == torch.strided \
                    and not item.is_meta:
                out.append(item)
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (tuple, list)):
            stack.extend(item)
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            stack.extend(getattr(item, f.name, None) for f in dataclasses.fields(item))
    return out


def _nonfinite_by_device(tensors: Iterable[torch.Tensor], infs: bool = True) -> dict[torch.device, torch.Tensor]:
    """One 0-d bool tensor per device: some entry of some tensor on it is NaN or ±Inf (``infs=False``:
    NaN) — no sync.

    ``(t - t).sum() != 0``: x - x is exactly 0 for every finite x and NaN for NaN/±Inf, and a sum of zeros
    is exactly 0 in any dtype, so this is exact — and on CPU about 10x faster than ``isfinite(t).all()``
    (9.8 vs 111 µs on 256², one thread — the bool reduction is not vectorised there; a scratch measurement,
    2026-11-22, commit 01be525, not in RESULTS.md). From :data:`_MINMAX_FROM` entries on, ``aminmax``
    instead: one pass and no temporary of the tensor's size (``t - t`` is one: a language model's logits
    doubled at the loss; an audit, 2026-11-26), 1.4x faster at 1M fp32 entries and 3.4x at 4M (scratch A/Bs,
    2026-11-26, commits aa83279 and 77dc1ee; not in RESULTS.md); a NaN propagates into both ends and a ±Inf
    entry is one of them, so lo·0 + hi·0 is NaN exactly when an entry is not finite (never lo + hi, which
    can overflow). Below it the three small ops it adds cost more than they save (the hooks of a small
    MLP's forward and backward). NaN only: ``amax``, which propagates NaN and passes ±Inf. Complex tensors through their
    real view; 8-bit floats, which have no such reductions on CPU, widened first (a float8 output crashed
    the model's forward); empty tensors have nothing to check. Callers run it under ``no_grad`` so
    nothing is added to the autograd graph."""
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if not t.numel():
            continue
        if t.element_size() == 1:
            t = t.float()
        if t.is_complex():
            t = torch.view_as_real(t)
        if not infs:
            peak = t.amax()
            bad = peak != peak
        elif t.numel() >= _MINMAX_FROM:
            lo, hi = torch.aminmax(t)
            bad = lo * 0 + hi * 0
        else:
            bad = torch.sub(t, t).sum()
        groups.setdefault(t.device, []).append(bad)
    if not infs:
        return {dev: (v[0] if len(v) == 1 else torch.stack(v).any()) for dev, v in groups.items()}
    return {dev: (v[0] if len(v) == 1 else torch.stack(v).sum()) != 0 for dev, v in groups.items()}


class Watch:
    """Hooks on every module of ``model`` that record the first non-finite event per phase.

    Use as a context manager (hooks removed on exit) or call :meth:`remove`. Call :meth:`reset` once per
    step to forget earlier events and call counts. See the module docstring for the meaning of fields."""

    def __init__(self, model: nn.Module, *, forward: bool = True, backward: bool = True,
                 inputs: bool = True, infs: bool = True) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"watch() needs an nn.Module, got {type(model).__name__}")
        self.forward, self.backward, self.inputs, self.infs = forward, backward, inputs, infs
        self._names: list[str] = []
        self._types: list[str] = []
        self._handles: list[Any] = []
        self._removed = False
        for idx, (name, module) in enumerate(model.named_modules()):
            self._names.append(name)
            self._types.append(type(module).__name__)
            leaf = next(module.children(), None) is None
            self._handles.append(module.register_forward_pre_hook(
                self._make_pre_hook(idx, leaf), with_kwargs=True))
            self._handles.append(module.register_forward_hook(
                self._make_post_hook(idx), with_kwargs=True, always_call=True))
            if backward and not leaf:  # a leaf's parameters are reached through its boundary nodes
                for prm in module._parameters.values():
                    if prm is not None and prm.requires_grad:
                        self._handles.append(prm.register_hook(self._make_param_hook(idx)))
        self._slots = 3 * len(self._names)
        self.reset()

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        """Remove every hook (idempotent). Node hooks already attached to a live autograd graph become
        no-ops; the recorded flags stay readable."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._removed = True

    def reset(self) -> None:
        """Forget all events, call counts and cached checks (host-side only: no device work)."""
        self._flags: dict[str, dict[torch.device, list[torch.Tensor]]] = {"forward": {}, "backward": {}}
        self._seq = {"forward": 0, "backward": 0}
        self._calls = [0] * len(self._names)
        self._parents = [-1] * len(self._names)  # each module's enclosing module at its last call
        self._active: list[tuple[int, int, int, list]] = []  # (idx, call, parent, input edges)
        self._recent: OrderedDict[int, tuple[weakref.ref, int]] = OrderedDict()

    # ----------------------------------------------------------------- reading (the only syncs)
    def first_nonfinite(self) -> dict | None:
        """The first event of the forward phase, else of the backward phase, else None (syncs)."""
        report = self.report()
        return report["forward"] or report["backward"]

    def report(self) -> dict:
        """``{"forward": event | None, "backward": event | None}``; an event is a dict with keys
        ``phase, module, type, call, where, inside`` (``module``/``inside`` are qualified names as in
        ``named_modules()``, ``""`` for the root; ``inside`` is None at the root)."""
        return {phase: self._read(phase) for phase in ("forward", "backward")}

    def _read(self, phase: str) -> dict | None:
        best: tuple[int, int] | None = None
        for seq, code in self._flags[phase].values():
            s, c = torch.stack([seq, code]).tolist()
            if s >= 0 and (best is None or s < best[0]):
                best = (s, c)
        if best is None:
            return None
        rest, slot = divmod(best[1], self._slots)
        call, parent = divmod(rest, len(self._names) + 1)
        idx, where = divmod(slot, 3)
        return {"phase": phase, "module": self._names[idx], "type": self._types[idx], "call": call,
                "where": _WHERE[phase][where], "inside": self._names[parent - 1] if parent else None}

    def __repr__(self) -> str:
        state = "removed" if self._removed else "active"
        return f"Watch({len(self._names)} modules, {state})"

    # ----------------------------------------------------------------- recording (no syncs)
    def _record(self, phase: str, tensors: list[torch.Tensor], idx: int, call: int, parent: int,
                where: int) -> None:
        """Enqueue: flag ← code where (flag unset) & (some tensor not finite). Python-side work only
        decides *which* tensors to check; no tensor value is read on the host."""
        if self._removed or not tensors:
            return
        seq = self._seq[phase]
        self._seq[phase] += 1
        code = ((call * (len(self._names) + 1) + parent + 1) * self._slots) + 3 * idx + where
        if code >= _CODE_LIMIT:  # absurd call counts without reset(): keep the module, lose the call
            code = (parent + 1) * self._slots + 3 * idx + where
        with torch.no_grad():
            for dev, bad in _nonfinite_by_device(tensors, self.infs).items():
                flags = self._flags[phase].get(dev)
                if flags is None:
                    flags = [torch.full((), -1, dtype=torch.int64, device=dev) for _ in range(2)]
                    self._flags[phase][dev] = flags
                write = bad & (flags[0] < 0)
                flags[0] = torch.where(write, seq, flags[0])
                flags[1] = torch.where(write, code, flags[1])

    def _unchecked(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Drop tensors already checked and not modified since (same object, same ``_version``): a layer's
        input is usually the previous layer's output, and a container returns its last child's output.
        Inference tensors (``torch.inference_mode``) have no version counter — reading it raises — so they
        are always checked."""
        fresh = []
        for t in tensors:
            if t.is_inference():
                fresh.append(t)
                continue
            seen = self._recent.get(id(t))
            if seen is not None and seen[0]() is t and seen[1] == t._version:
                continue
            fresh.append(t)
            self._recent[id(t)] = (weakref.ref(t), t._version)
            self._recent.move_to_end(id(t))
            if len(self._recent) > _RECENT:
                self._recent.popitem(last=False)
        return fresh

    def _make_pre_hook(self, idx: int, leaf: bool):
        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._removed:
                return None
            call = self._calls[idx]
            self._calls[idx] += 1
            parent = self._active[-1][0] if self._active else -1
            self._parents[idx] = parent
            tensors = _tensors((args, kwargs)) if (self.forward and self.inputs) or leaf else []
            edges = []
            if self.backward and leaf and torch.is_grad_enabled():
                edges = [(get_gradient_edge(t), 0) for t in tensors if t.requires_grad]
                edges += [(get_gradient_edge(p), 2) for p in module._parameters.values()
                          if p is not None and p.requires_grad]
            self._active.append((idx, call, parent, edges))
            if self.forward and self.inputs:
                self._record("forward", self._unchecked(tensors), idx, call, parent, 1)
            return None
        return pre_hook

    def _make_post_hook(self, idx: int):
        def post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self._removed:
                return None
            while self._active and self._active[-1][0] != idx:  # a child raised: unwind its entry
                self._active.pop()
            if not self._active:
                return None
            _, call, parent, edges = self._active.pop()
            tensors = _tensors(output)
            if self.forward:
                self._record("forward", self._unchecked(tensors), idx, call, parent, 0)
            if self.backward and torch.is_grad_enabled():
                self._hook_grad_output(tensors, idx, call, parent)
                if edges:
                    self._hook_grad_input(tensors, edges, idx, call, parent)
            return None
        return post_hook

    def _make_param_hook(self, idx: int):
        """A hook on a parameter a module with children holds itself: its gradient (summed over its uses),
        attributed to that module's last call, as ``grad_param``."""
        def param_hook(grad: torch.Tensor) -> None:
            if not self._removed:  # (a use outside the module, or no call since reset(): call 0)
                self._record("backward", [grad], idx, max(self._calls[idx] - 1, 0), self._parents[idx], 2)
            return None
        return param_hook

    def _hook_grad_output(self, outputs: list[torch.Tensor], idx: int, call: int, parent: int) -> None:
        """Pre-hook on each output's autograd node: sees d(loss)/d(output) before the module's backward.

        A container returns its last child's tensor, so several modules share one output node. The
        gradient arrives there from outside the *outermost* of them, so the outer module (its forward hook
        runs last) takes over the node's attribution instead of adding a second hook."""
        key = ("nonans_optim.watch", id(self))
        for t in outputs:
            node = t.grad_fn
            if node is None:
                continue
            meta = node.metadata.get(key)
            if meta is not None:
                meta["who"] = (idx, call, parent)
                meta["nrs"].add(t.output_nr)
                continue
            meta = {"who": (idx, call, parent), "nrs": {t.output_nr}}
            node.metadata[key] = meta

            def prehook(grad_outputs, meta=meta):
                grads = [grad_outputs[i] for i in sorted(meta["nrs"]) if grad_outputs[i] is not None]
                self._record("backward", grads, *meta["who"], 1)
            node.register_prehook(prehook)

    def _hook_grad_input(self, outputs: list[torch.Tensor], edges: list, idx: int, call: int,
                         parent: int) -> None:
        """Post-hooks on the module's boundary nodes (those with an edge into one of its inputs or its own
        parameters): they see exactly the gradient this module contributes to its inputs (``grad_input``)
        and parameters (``grad_param``), not the sum over all consumers of a shared input.

        The walk starts at the outputs' nodes and never enters an input's node or a node created before
        the module ran (sequence number ≤ the inputs' newest), so it stays inside the module's subgraph."""
        targets = {(id(e.node), e.output_nr): kind for e, kind in edges}
        stop = {id(e.node) for e, _ in edges}
        floor = max((e.node._sequence_nr() for e, _ in edges if e.node.next_functions), default=-1)
        stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
        seen: dict[int, Any] = {}
        boundary: list[tuple[Any, list[tuple[int, int]]]] = []
        while stack and len(seen) < _MAX_NODES:
            node = stack.pop()
            if id(node) in seen or id(node) in stop:
                continue
            seen[id(node)] = node
            hits = []
            for k, (nxt, nr) in enumerate(node.next_functions):
                if nxt is None:
                    continue
                kind = targets.get((id(nxt), nr))
                if kind is not None:
                    hits.append((k, kind))
                elif nxt.next_functions and nxt._sequence_nr() > floor:
                    stack.append(nxt)
            if hits:
                boundary.append((node, hits))
        for node, hits in boundary:
            def posthook(grad_inputs, grad_outputs, hits=hits):
                for want in (0, 2):  # input gradients first: they are what flows on to other modules
                    grads = [grad_inputs[k] for k, kind in hits if kind == want and grad_inputs[k] is not None]
                    self._record("backward", grads, idx, call, parent, want)
            node.register_hook(posthook)


def watch(model: nn.Module, *, forward: bool = True, backward: bool = True, inputs: bool = True,
          infs: bool = True) -> Watch:
    """Watch ``model`` for the first non-finite forward output and backward gradient.

    Args:
        model: the module; every submodule present now is watched (modules added later are not).
        forward: check every module's outputs (and, with ``inputs``, its inputs) in forward.
        backward: check gradients at module outputs, leaf modules' input and parameter gradients, and
            the gradients of parameters that modules with children hold themselves, in backward.
        inputs: also check forward inputs, so a value made between modules (functional code in a parent's
            forward, or the data) is attributed to that code instead of to the next layer.
        infs: count ±Inf as non-finite (so an fp16 overflow is named where it happens, before it turns
            into NaN further on). A model that carries -Inf on purpose — a float attention mask such as
            ``nn.Transformer.generate_square_subsequent_mask``, logits masked with -Inf — needs
            ``infs=False``: otherwise the mask is the first event of every clean step, and only the first
            event is kept, so a real NaN later in the step goes unreported. Then only NaN counts.

    Example::

        with nonans_optim.watch(model) as w:
            for batch in loader:
                w.reset()
                loss = loss_fn(model(batch)); loss.backward()
                ...
            print(w.first_nonfinite())  # e.g. {'phase': 'forward', 'module': 'blocks.3.attn', ...}
    """
    return Watch(model, forward=forward, backward=backward, inputs=inputs, infs=infs)
