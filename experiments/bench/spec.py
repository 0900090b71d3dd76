"""The data types shared by workloads, arms and the harness.

A :class:`Workload` builds a :class:`Task` for a size ("tiny" for the test suite, "default" for the CPU
benchmark, "scale" for a GPU) and a seed. ``clean=True`` builds the same problem with the cause of the
singularity removed — the clean run's reference metric comes from it.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

__all__ = ["OptimSpec", "Task", "Workload", "SIZES"]

SIZES = ("tiny", "default", "scale")


@dataclasses.dataclass
class OptimSpec:
    """Which optimizer family a workload trains with, and its hyperparameters.

    kind: "adamw" (stock torch.optim.AdamW vs nonans_optim.AdamW), "muon" (a stock Muon-style optimizer
    with a naive NS5 in ``hot`` dtype vs nonans_optim.Fusion(("ns5",))) or "shampoo" (the reference
    KL-Shampoo update, :class:`~.kl_shampoo_stock.StockKLShampoo`, vs nonans_optim.Fusion(("shampoo",
    "ns5"))). ``stock_lr``: the stock arms' rate where it means something else than ours (KL-Shampoo's
    raw lr·U vs Fusion's RMS-matched step); None means ``lr``."""

    kind: str
    lr: float
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    hot: str = "fp32"  # muon: the NS5 hot dtype of the stock arm ("fp16" or "fp32")
    stock_lr: float | None = None


@dataclasses.dataclass
class Task:
    """One trainable problem.

    loss_fn(model, data_index) -> scalar loss (forward pass included, autocast inside when ``amp``);
    evaluate(model) -> the final metric, computed in fp32 on held-out clean data (lower is better);
    fault(model, data_index) mutates gradients after backward (workload 8's injection only)."""

    model: nn.Module
    loss_fn: Callable[[nn.Module, int], torch.Tensor]
    evaluate: Callable[[nn.Module], float]
    optim: OptimSpec
    steps: int
    metric: str
    amp: bool = False
    clip: float | None = 1.0
    fault: Callable[[nn.Module, int], None] | None = None


@dataclasses.dataclass
class Workload:
    """A benchmark workload: a real cause of a singularity and how to build it."""

    key: str
    title: str
    cause: str
    build: Callable[..., Task]  # build(size: str, seed: int, clean: bool) -> Task
    notes: str = ""
    guards: str = "clip_grad_norm_(1.0)"
    #: what the calibrated default/tiny runs show (the tests hold the benchmark to it): does the stock arm
    #: fail, and does the singularity reach our optimizer's resolution stage (events > 0)?
    expect_baseline_fails: bool = True
    expect_events: bool = True
