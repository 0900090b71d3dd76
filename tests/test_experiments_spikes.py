"""Smoke version of ``python -m experiments spikes`` and the decision rule, checked on real (tiny) runs."""
from __future__ import annotations

import json
import math

import pytest
import torch

from experiments import spikes

#: the default ``python -m experiments spikes`` chose (results/spikes.json, RESULTS.md "spikes" section).
CHOSEN = 10.0


pytestmark = pytest.mark.usefixtures("one_thread")


def test_spike_steps_are_fixed_by_the_seed_and_inside_the_run():
    a, b = spikes.spike_steps(200, 0), spikes.spike_steps(200, 0)
    assert a == b and len(a) == 3 and len(set(a)) == 3
    assert all(40 <= s < 160 for s in a)
    assert spikes.spike_steps(200, 1) != a
    assert len(spikes.spike_steps(10, 0)) == 1


def test_smoke_run_json_has_every_arm_and_the_guard_helps(tmp_path):
    out = tmp_path / "spikes.json"
    rc = spikes.main(["--tasks", "digits", "--optimizers", "adamw", "--factors", "none", "10",
                      "--conditions", "clean", "loss1e3", "grad1e6", "--seeds", "1", "--steps", "30",
                      "--out", str(out), "--no-markdown"])
    assert rc == 0 and out.with_suffix(".png").stat().st_size > 0
    data = json.loads(out.read_text())
    arms = {(r["condition"], r["factor"]) for r in data["runs"]}
    assert arms == {(c, f) for c in ("clean", "loss1e3", "grad1e6") for f in (None, 10.0)}
    for r in data["runs"]:
        assert all(math.isfinite(v) for v in r["final"].values()) and not r["diverged"]
        assert len(r["losses"]) == 30 and r["steps"] == 30
    by = {(r["condition"], r["factor"]): r for r in data["runs"]}
    # the guard triggers exactly on the injected spikes, never on the clean run, which stays bit-identical
    assert by[("clean", 10.0)]["triggers"] == 0 and by[("clean", 10.0)]["identical_to_unguarded"]
    assert by[("loss1e3", 10.0)]["trigger_steps"] and \
        set(by[("loss1e3", 10.0)]["trigger_steps"]) >= set(by[("loss1e3", 10.0)]["spike_steps"])
    assert by[("grad1e6", 10.0)]["trigger_steps"] == by[("grad1e6", 10.0)]["spike_steps"]
    # measured: the unguarded outlier-batch spike freezes AdamW (v jumps ~1e3x); the guard keeps it near clean
    for c in ("loss1e3", "grad1e6"):
        assert by[(c, None)]["val_gap"] > 0.05 and by[(c, 10.0)]["val_gap"] < by[(c, None)]["val_gap"] / 2
    assert by[("loss1e3", None)]["recovery_excess"] > by[("loss1e3", 10.0)]["recovery_excess"]
    assert data["decision"]["default"] == 10.0
    assert "Chosen default" in spikes.render(data)


@pytest.mark.parametrize("opt", ["adamw", "sfnormuon"])
def test_clean_tiny_run_never_triggers_at_the_chosen_factor(opt):
    for task in ("charlm", "digits"):
        rec, params = spikes.run_one(task, opt, CHOSEN, "clean", seed=0, steps=25)
        ref, ref_params = spikes.run_one(task, opt, None, "clean", seed=0, steps=25)
        assert rec["triggers"] == 0
        assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


def _fake(factor_results):
    """A measurement where each factor has (clean triggers, {condition: gap}) for one task/optimizer/seed."""
    runs = []
    for f, (fp, gaps) in factor_results.items():
        runs.append({"task": "t", "optimizer": "o", "condition": "clean", "factor": f, "seed": 0, "diverged": False,
                     "final": {"val_loss": 1.0}, "val_gap": 0.0, "recovery_excess": 0.0, "triggers": fp,
                     "identical_to_unguarded": fp == 0})
        for c, g in gaps.items():
            runs.append({"task": "t", "optimizer": "o", "condition": c, "factor": f, "seed": 0,
                         "diverged": not math.isfinite(g), "final": {"val_loss": 1.0 + g}, "val_gap": g,
                         "recovery_excess": 0.0, "triggers": 1})
    return {"config": {"factors": list(factor_results), "tolerance": 0.05}, "runs": runs}


def test_decision_rule():
    # factor 3 recovers everything but has false positives; 10 and 30 tie: the larger wins
    d = spikes.decide(_fake({None: (0, {"a": 0.5, "b": 0.0}), 3.0: (2, {"a": 0.0, "b": 0.0}),
                             10.0: (0, {"a": 0.01, "b": 0.0}), 30.0: (0, {"a": 0.04, "b": 0.0}),
                             100.0: (0, {"a": 0.3, "b": 0.0})}))
    assert d["default"] == 30.0 and not d["per_factor"]["3.0"]["admissible"]
    assert d["per_factor"]["None"]["recovered"] == 1 and d["per_factor"]["30.0"]["recovered"] == 2
    # nothing beats no guard: the default stays None
    d = spikes.decide(_fake({None: (0, {"a": 0.0}), 10.0: (0, {"a": 0.0}), 3.0: (5, {"a": 0.0})}))
    assert d["default"] is None
    # a diverged seed is never "recovered"
    d = spikes.decide(_fake({None: (0, {"a": float("inf")}), 10.0: (0, {"a": float("inf")})}))
    assert d["default"] is None and d["per_factor"]["10.0"]["recovered"] == 0


def test_spike_guards_smoke(tmp_path):
    """``python -m experiments spike-guards`` on a tiny run: every arm and condition, a pairing that makes
    the clean unguarded run's gap exactly 0, and the element-wise clip really clipping something."""
    from experiments import spike_guards
    out = tmp_path / "sg.json"
    assert spike_guards.main(["--tasks", "digits", "--seeds", "1", "--steps", "24", "--out", str(out),
                              "--results-md", ""]) == 0
    data = json.loads(out.read_text())
    assert {(r["condition"], r["arm"]) for r in data["runs"]} == \
        {(c, a) for c in spikes.CONDITIONS for a in spike_guards.ARMS}
    by = {(r["condition"], r["arm"]): r for r in data["runs"]}
    assert by[("clean", "none")]["val_gap"] == 0.0 and by[("clean", "norm k=10")]["identical_to_unguarded"]
    assert by[("grad1e6", "elementwise θ=100")]["triggers"] > 0
    assert "spiked cells recovered" in spike_guards.render(data)
