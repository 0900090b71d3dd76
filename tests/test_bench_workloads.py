"""A tiny version of every benchmark workload, so the benchmark can never silently stop demonstrating.

For each workload the stock arm must fail the way the workload claims (the run dies with non-finite
parameters, or GradScaler throws steps away because of non-finite values) — or, where the calibrated
benchmark measured that the stock arm survives, it must still survive (a change either way is news).
Our arm must complete with finite parameters and a finite final metric, with resolution events exactly
where the singularity reaches the optimizer.
"""
from __future__ import annotations

import math

import pytest
import torch

from experiments.bench.harness import run_arm
from experiments.bench.report import compare, render_markdown, write_results_section
from experiments.bench.workloads import WORKLOADS


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("key", list(WORKLOADS))
def test_workload_tiny(key):
    wl = WORKLOADS[key]
    base = run_arm(wl, "baseline", size="tiny", seed=0)
    ours = run_arm(wl, "nonans", size="tiny", seed=0)
    if wl.expect_baseline_fails:
        assert base["first_nonfinite_step"] is not None, "the mechanism produced no non-finite value"
        assert (not base["completed"]) or base["scaler_skips"] > 0, base
    else:
        assert base["completed"], "the stock arm now fails: update the workload's expectation and report"
    assert ours["completed"], ours
    assert ours["final_metric"] is not None and math.isfinite(ours["final_metric"])
    if wl.expect_events:
        assert ours["events_total"] >= 1
        assert ours["continuity"] and all(math.isfinite(c["after"]) for c in ours["continuity"])
    else:
        assert ours["events_total"] == 0


def test_report_renders_from_records(tmp_path):
    wl = WORKLOADS["w8_fault_injection"]
    arms = {arm: run_arm(wl, arm, size="tiny", seed=0) for arm in ("clean", "baseline", "rollback", "nonans")}
    cmp_ = compare({wl.key: arms}, {wl.key: {"ratio": 1.25}})
    row = cmp_[wl.key]
    assert row["baseline_completed"] is False and row["nonans_completed"] is True
    assert arms["rollback"]["rollbacks"] >= 1 and row["rollback_lost"] == arms["rollback"]["steps_lost"]
    results = dict(machine=dict(platform="p", cpu_count=2, torch="t"), size="tiny", seed=0, wall_s=1.0,
                   peers={"heavyball": "not installed"}, compare=cmp_,
                   workloads={wl.key: dict(title=wl.title, cause=wl.cause, notes="", guards=wl.guards,
                                           metric="m")})
    md = render_markdown(results)
    assert wl.title in md and "1.25x" in md
    path = tmp_path / "RESULTS.md"
    path.write_text("# R\n\nkeep me\n<!-- bench:begin -->\nold\n<!-- bench:end -->\ntail\n")
    write_results_section(md, str(path))
    text = path.read_text()
    assert "keep me" in text and "tail" in text and "old" not in text and wl.title in text
