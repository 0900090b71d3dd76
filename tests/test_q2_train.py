"""Q2's training trace (experiments/questions_fp16_train.py): it sees every NS5 input of a run, changes nothing
the run computes, and its verdict follows its data."""
from __future__ import annotations

import copy

import pytest
import torch

import nonans_optim as no
from experiments import questions_verdicts as V
from experiments.questions_fp16_train import recording, run_q2_train, trace_rows
from experiments.tasks import make_task, train
from nonans_optim.optimizers import _spectral


def test_recording_sees_every_input_and_changes_nothing():
    real = _spectral.ns5
    kw = {"ns5_dtype": "fp16", "impl": "loop"}
    plain = make_task("digits", 0)
    train(plain, "sfnormuon", seed=0, lr=3e-3, steps=2, evals=1, set_loss=True, opt_kwargs=kw)
    seen = make_task("digits", 0)
    with recording() as log:
        train(seen, "sfnormuon", seed=0, lr=3e-3, steps=2, evals=1, set_loss=True, opt_kwargs=kw)
    assert _spectral.ns5 is real  # restored
    for p, q in zip(plain.model.parameters(), seen.model.parameters()):
        assert torch.equal(p, q)  # the run trained as it does unobserved
    spectral = [p for g in no.param_groups(seen.model) if g.get("path") == "spectral" for p in g["params"]]
    assert spectral
    assert len(log) == 2 * len(spectral)  # one trace per matrix and step
    assert sorted(tuple(x["shape"]) for x in log[:len(spectral)]) == sorted(
        (p.shape[0], p[0].numel()) for p in spectral)
    assert all(x["ours_finite"] and 0 <= x["ours_rel_err"] < 0.1 and x["naive_stage"] == "ok" for x in log)


def test_recording_restores_ns5_after_an_error():
    real = _spectral.ns5
    with pytest.raises(RuntimeError, match="boom"):
        with recording():
            raise RuntimeError("boom")
    assert _spectral.ns5 is real


def test_q2_training_clause_follows_its_trace():
    data = {"train": run_q2_train(tasks=("digits",), arms=("SF-NorMuon", "FullFusion"), steps=2)}
    text = V.q2_train(data["train"])
    n = sum(len(trace_rows(r)) for r in data["train"]["runs"])
    assert f"would have broken on 0/{n} NS5 inputs." in text and "were not reached" in text
    assert "non-finite on 0 inputs" in text
    broken = copy.deepcopy(data["train"])
    broken["runs"][0]["trace"]["naive_stage"][0] = "norm-overflow"
    broken["runs"][1]["trace"]["ours_finite"][0] = False
    text = V.q2_train(broken)
    assert f"would have broken on 1/{n} NS5 inputs (norm-overflow)" in text and "were not reached" not in text
    assert "non-finite on 1 inputs" in text
