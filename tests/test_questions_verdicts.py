"""OPEN_QUESTIONS.md's verdicts follow their data (experiments/questions_verdicts.py): each headline is
computed, so the same function given the opposite data says the opposite. An audit (2026-11-26) found five
headlines that were constant strings — Q5's "it saturates" and its proposal status, Q6's "it does not",
Q2's "not by a matrix size" (contradicted by its own table), Q3's untested γ claim — and Q8's explanation of
its drift stated as fact. The published JSON is the starting point; each case changes what the headline
rests on."""
from __future__ import annotations

import copy
import json
from pathlib import Path

from experiments import questions_verdicts as V

QDIR = Path(__file__).resolve().parent.parent / "results" / "questions"


def _q(name: str) -> dict:
    return json.loads((QDIR / f"{name}.json").read_text())


def test_q5_headline_and_status_follow_the_trace_and_the_ab():
    d = _q("q5")
    assert "**Answered: it saturates.**" in V.v_q5(d)  # the published data: 4/6 runs at a clamp
    free = copy.deepcopy(d)
    for t in free["trace"].values():
        t["fractions"] = {**t["fractions"], "free": 1.0}
    assert "**Answered: it does not saturate.**" in V.v_q5(free)
    assert "not recommended as a default" in V.v_q5(d)
    better = copy.deepcopy(d)
    for r in better["ab"]:
        if r["rule"] == "relative":
            r["value"] = -1.0  # lower is better: the relative rule now wins everywhere
    text = V.v_q5(better)
    assert "not recommended" not in text and "beat the plain lr on every workload" in text


def test_q6_says_whether_data_ptr_changed():
    d = _q("q6")
    assert "it does not" in V.v_q6(d)
    changed = copy.deepcopy(d)
    changed["events"][0]["data_ptr_changed"] = True
    text = V.v_q6(changed)
    assert "it does not," not in text and "it did not in every swap" in text and "changed in 1/" in text


def test_q2_names_the_families_whose_failure_depends_on_the_size():
    d = _q("q2")
    text = V.v_q2(d)
    assert "not by a matrix size" not in text  # its table: heavytail ×100 first fails at 128², not 64²
    assert "heavytail ×100 from 128²" in text
    from experiments.questions_numerics import first_failure
    failing = {k: v for k, v in first_failure(d, "naive").items() if v is not None}
    assert failing and any(v[0] != min(d["sizes"]) for v in failing.values())


def test_q3_headline_reports_whether_the_claim_reproduced():
    d = _q("q3")
    text = V.v_q3(d)
    assert text.startswith("**Not reproduced at small scale") and "0.1 floor" not in text
    nan = copy.deepcopy(d)
    for r in nan["runs"]:
        if r["arm"] == "AdamW":
            r["diverged"] = True
    assert V.v_q3(nan).startswith("**Partly reproduced at small scale")


def test_q8_explains_only_what_its_control_shows():
    d = _q("q8")
    assert "this run does not say" in V.v_q8(d)
    same = copy.deepcopy(d)  # the control drifts like the others: no claim that it isolates anything
    ctl = next(o for o in same["runs"] if "Polyak off" in o)
    other = next(o for o in same["runs"] if o != ctl)
    for m, r in same["runs"][ctl].items():
        r["curve"] = list(same["runs"][other][m]["curve"])
    text = V.v_q8(same)
    assert "drifted as much as the others" in text and "this run does not say" not in text


def test_q1_gives_the_sign_of_each_difference():
    d = _q("q1")
    text = V.v_q1(d)
    assert "lower is better" in text and "worse at 3, better at 0 of 3 widths" in text  # α=2: worse everywhere
    flipped = copy.deepcopy(d)
    for r in flipped["runs"]:
        if r["arm"] == "+MONA α=2":
            base = next(b["val_loss"] for b in d["runs"]
                        if b["arm"] == "SF-NorMuon" and b["width"] == r["width"] and b["seed"] == r["seed"])
            r["val_loss"] = 2 * base - r["val_loss"]  # the mirror image: better by as much
    assert "worse at 0, better at 3 of 3 widths" in V.v_q1(flipped)
