"""How many kernels "repair" adds to an eager (foreach) step: a budget per parameter.

On a GPU an eager step of a small model is bound by the host issuing kernels, one per torch op (the H100
sync-audit and overhead-gpu tables of 2026-11-25 as published at commit 42143de, no longer in RESULTS.md: the
then-default foreach SF-NorMuon step launched 4244 kernels under "repair" where "off" launched 752, and took
4x as long, 53.40 vs 13.20 ms). Per tensor the resolution needs a few elementwise passes (detection,
the gates, the counts of each stage); everything else — summing counts, hold flags, stacking — is done for
the whole step at once (``optimizers/_common.assemble_counts``, ``keep_flags``). This test counts the torch
ops of one clean step under each policy on the CPU (an op here is a launch there; ``experiments/op_count.py``
counts them, and ``python -m experiments op-count`` publishes them for the default GPT), so that per-tensor
bookkeeping crawling back in fails here rather than in a GPU session that happens to measure it.
"""
from __future__ import annotations

import pytest
import torch

from experiments.op_count import ops_by_policy
from optim_infos import INFOS

# Extra torch ops per parameter that "repair" may add to a clean foreach step, counted at the margin
# (blocks of Linear + LayerNorm added to a model: four parameters each, one matrix and three vectors), so
# that the per-step constants (the record, the spike guard's statistics) do not dilute it. Measured with
# _extra_ops on 2026-11-25: 35 (AdamW) to 51 (FullFusion) while each tensor's counts were summed, stacked
# and gated one tensor at a time; 20 to 28.25 once they were assembled per step.
BUDGET = 30


def _extra_ops(info, blocks: int) -> tuple[int, int]:
    """(ops "repair" adds to one clean foreach step, parameter count) of a stack of ``blocks`` blocks."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(blocks)
                                  for m in (torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))])
    model(torch.randn(4, 16)).square().mean().backward()
    n = ops_by_policy(info.make(model.parameters(), impl="foreach"))
    return n["repair"] - n["off"], sum(1 for _ in model.parameters())


@pytest.mark.parametrize("info", [i for i in INFOS if "impl" not in i.kwargs], ids=lambda i: i.name)
def test_repair_adds_few_ops_per_parameter(info):
    (e1, p1), (e2, p2) = _extra_ops(info, 2), _extra_ops(info, 6)
    per_param = (e2 - e1) / (p2 - p1)
    assert per_param <= BUDGET, (f"{info.name}: 'repair' adds {per_param:.1f} torch ops per parameter to a clean "
                                 f"foreach step (budget {BUDGET})")
