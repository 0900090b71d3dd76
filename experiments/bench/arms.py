"""The arms of the benchmark: which optimizer (and which guards) each run uses.

* ``clean``      — the stock optimizer on the clean variant of the task (the reference metric).
* ``baseline``   — the stock optimizer with the usual guards: ``clip_grad_norm_`` and, where the task
                   trains under fp16 autocast, ``torch.amp.GradScaler``.
* ``rollback``   — ``baseline`` plus a checkpoint every K steps and a rollback on a non-finite loss or
                   parameter (the offending batch is skipped); it counts the steps it recomputes.
* ``nonans``     — our optimizer with ``resolution="repair"``, the same clipping, no GradScaler. Note that
                   torch's ``clip_grad_norm_`` multiplies every gradient by a NaN coefficient as soon as one
                   entry is NaN (the whole step becomes NaN), and by 0 as soon as one entry is Inf (every
                   finite entry becomes an observed 0, the Inf entries NaN) — with clipping, a single
                   non-finite entry costs the whole step's observation (measured on workload 4).
* ``nonans_off`` — the same optimizer with ``resolution="off"``: the control that shows the algorithm
                   alone (e.g. the safe NS5) vs the resolution stage.
* peers          — heavyball, pytorch_optimizer, schedulefree, when installed (detected, never imported
                   when absent).

"Stock" means torch.optim.AdamW for "adamw" workloads, a Muon-style optimizer written the common way
(momentum, then NS5 that casts *first* and normalises in the hot dtype: :func:`nonans_optim.ns5.ns5_naive`)
for "muon", and for "shampoo" the reference KL-Shampoo update (:class:`.kl_shampoo_stock.StockKLShampoo`:
bf16 state, W -= lr·U with no RMS matching) on 2-D parameters plus torch AdamW on the rest; its clean run
keeps the same update with fp32 state.
"""
from __future__ import annotations

import importlib.util
import math

import torch
from torch.optim import Optimizer

import nonans_optim
from nonans_optim.ns5 import ns5_naive

from .kl_shampoo_stock import StockKLShampoo
from .spec import Task

__all__ = ["ARMS", "STOCK_ARMS", "OURS_ARMS", "PEERS", "NaiveMuon", "Chain", "make_optimizer", "peer_status",
           "peer_arms"]

STOCK_ARMS = ("clean", "baseline", "rollback")
OURS_ARMS = ("nonans", "nonans_off")
ARMS = STOCK_ARMS + OURS_ARMS
PEERS = ("heavyball", "pytorch_optimizer", "schedulefree")

_HOT = {"fp16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16}


class NaiveMuon(Optimizer):
    """Muon as it is commonly written (KellerJordan/Muon muon.py; FusionOpt's fp16 path): Nesterov
    momentum, NS5 on the momentum cast to the hot dtype *before* normalising, update RMS-matched to 0.2
    (Moonlight) so the learning rate means the same as in :class:`nonans_optim.Fusion`.

    A foil, not a product: with ``hot=float16`` an entry above 65504 becomes Inf at the cast and the
    normalisation turns it into NaN; that is the failure workload 1 measures."""

    def __init__(self, params, lr: float, momentum: float = 0.95, weight_decay: float = 0.0,
                 hot: torch.dtype = torch.float16):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, hot=hot))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "momentum_buffer" not in st:
                    st["momentum_buffer"] = torch.zeros_like(p)
                buf = st["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buf, group["momentum"])  # Nesterov
                O = ns5_naive(update.reshape(p.shape[0], -1), dtype=group["hot"]).view_as(p)
                O = O * (0.2 * math.sqrt(max(O.shape[0], O[0].numel())))
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(O, alpha=-group["lr"])


class Chain:
    """Several optimizers stepped as one (Muon for matrices + AdamW for the rest)."""

    def __init__(self, *optimizers: Optimizer):
        self.optimizers = optimizers

    @property
    def param_groups(self):
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self):
        out = {}
        for o in self.optimizers:
            out.update(o.state)
        return out

    def step(self):
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return [o.state_dict() for o in self.optimizers]

    def load_state_dict(self, states):
        for o, s in zip(self.optimizers, states):
            o.load_state_dict(s)


def _split(model):
    groups = nonans_optim.param_groups(model)
    spectral = [p for g in groups if g["path"] == "spectral" for p in g["params"]]
    scalar = [p for g in groups if g["path"] == "scalar" for p in g["params"]]
    return spectral, scalar


def make_optimizer(arm: str, task: Task, **ours_kwargs):
    """The optimizer for ``arm`` on ``task`` (a torch Optimizer, a :class:`Chain`, or ours). ``ours_kwargs``
    go to our spectral optimizers only (ablations of one library option on a bench workload)."""
    spec, model = task.optim, task.model
    ours = arm in OURS_ARMS
    resolution = "off" if arm == "nonans_off" else "repair"
    if arm.startswith("peer_"):
        return _make_peer(arm[len("peer_"):], model.parameters(), spec)
    if spec.kind == "adamw":
        if ours:
            return nonans_optim.AdamW(model.parameters(), lr=spec.lr, betas=spec.betas,
                                      weight_decay=spec.weight_decay, resolution=resolution)
        return torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=spec.betas,
                                 weight_decay=spec.weight_decay)
    if spec.kind == "muon":
        if ours:  # the library's NS5 in the same fp16 hot dtype: it normalises in fp32 *before* the cast
            return nonans_optim.Fusion(nonans_optim.param_groups(model), components=("ns5",), lr=spec.lr,
                                       weight_decay=spec.weight_decay, ns5_dtype=spec.hot, polyak=False,
                                       resolution=resolution, **ours_kwargs)
        spectral, scalar = _split(model)
        hot = _HOT["fp32" if arm == "clean" else spec.hot]
        return Chain(NaiveMuon(spectral, lr=spec.lr, weight_decay=spec.weight_decay, hot=hot),
                     torch.optim.AdamW(scalar, lr=spec.lr, weight_decay=spec.weight_decay))
    if spec.kind == "shampoo":
        if ours:
            return nonans_optim.Fusion(nonans_optim.param_groups(model), components=("shampoo", "ns5"),
                                       lr=spec.lr, weight_decay=spec.weight_decay, polyak=False,
                                       resolution=resolution, **ours_kwargs)
        # the reference applies KL-Shampoo to every matrix; vectors go to AdamW at the same rate
        lr = spec.stock_lr if spec.stock_lr is not None else spec.lr
        mats = [p for p in model.parameters() if p.dim() == 2]
        rest = [p for p in model.parameters() if p.dim() != 2]
        cast = torch.float32 if arm == "clean" else torch.bfloat16
        return Chain(StockKLShampoo(mats, lr=lr, weight_decay=spec.weight_decay, cast_dtype=cast),
                     torch.optim.AdamW(rest, lr=lr, weight_decay=spec.weight_decay))
    raise ValueError(f"unknown optimizer kind {spec.kind!r}")


def peer_status() -> dict[str, str]:
    """{peer: "installed" | "not installed"} — found with importlib, never imported when absent."""
    return {name: ("installed" if importlib.util.find_spec(name) is not None else "not installed")
            for name in PEERS}


def _make_peer(name: str, params, spec):
    """The peer's AdamW-family optimizer with the workload's hyperparameters (imported only when asked)."""
    if name == "heavyball":
        import heavyball
        return heavyball.AdamW(params, lr=spec.lr, betas=spec.betas, weight_decay=spec.weight_decay,
                               compile_step=False)
    if name == "pytorch_optimizer":  # StableAdamW: AdamW with update clipping, the stability-minded variant
        from pytorch_optimizer import StableAdamW
        return StableAdamW(params, lr=spec.lr, betas=spec.betas, weight_decay=spec.weight_decay)
    if name == "schedulefree":
        from schedulefree import AdamWScheduleFree
        return AdamWScheduleFree(params, lr=spec.lr, betas=spec.betas, weight_decay=spec.weight_decay)
    raise ValueError(f"unknown peer {name!r}")


def peer_arms(task_kind: str) -> list[str]:
    """Peer arms to run on a workload: installed peers, AdamW workloads only (their AdamW variants)."""
    if task_kind != "adamw":
        return []
    return [f"peer_{n}" for n, status in peer_status().items() if status == "installed"]
