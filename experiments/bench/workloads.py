"""The registry of the eight workloads, in the issue's order (key → :class:`~.spec.Workload`).

Each workload's ``expect_*`` flags record what its calibrated runs show; where a stock arm survives, that
is a measured result, reported as such (never forced to fail)."""
from __future__ import annotations

import dataclasses

from .workloads_objective import W4_DIVERSITY, W6_POLICY_GRADIENT, W8_FAULTS
from .workloads_precision import W2_AGGRESSIVE_LR, W3_OUTLIERS, W7_NORM
from .workloads_spectral import W1_FP16_NS5, W5_SHAMPOO

__all__ = ["WORKLOADS"]

_ORDERED = [
    # NS5's safe normalisation avoids the hazard: nothing non-finite reaches the resolution stage
    dataclasses.replace(W1_FP16_NS5, expect_events=False),
    # GradScaler survives by skipping the overflowing steps (counted as steps lost)
    dataclasses.replace(W2_AGGRESSIVE_LR, expect_baseline_fails=True),
    W3_OUTLIERS,
    # fp32 never overflows within the budget: the loss diverges finitely in every arm
    dataclasses.replace(W4_DIVERSITY, expect_baseline_fails=False, expect_events=False),
    # KL-Shampoo alone (RMS-matched direction) stays finite here
    dataclasses.replace(W5_SHAMPOO, expect_baseline_fails=False, expect_events=False),
    W6_POLICY_GRADIENT,
    W7_NORM,
    W8_FAULTS,
]
WORKLOADS = {w.key: w for w in _ORDERED}
