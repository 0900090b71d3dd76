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


def _q8_with_drift(d: dict, arm: str, like: str | None) -> dict:
    """``d`` with ``arm``'s curves replaced: by ``like``'s (the same drift as that arm) or, for None, by its
    own 1-micro-batch curves (no drift)."""
    d = copy.deepcopy(d)
    src = d["runs"][like] if like is not None else {k: d["runs"][arm]["1"] for k in d["runs"][arm]}
    for k, seeds in d["runs"][arm].items():
        for r, s in zip(seeds, src[k]):
            r["curve"] = list(s["curve"])
    return d


def test_q8_explains_only_what_its_arms_show():
    """Each clause of Q8's attribution follows the arm it rests on (the published run's own conclusion is not
    pinned: these cases set the drifts it would rest on)."""
    d = _q("q8")
    assert "**Answered.**" in V.v_q8(d) and "Against the default SF-NorMuon's drift" in V.v_q8(d)
    base = "sfnormuon"
    # the control drifts like the default: nothing is explained, no factor is named
    text = V.v_q8(_q8_with_drift(d, "sfnormuon (fp32 NS5, Polyak off)", base))
    assert "drift is not explained by bf16 NS5 or the Polyak step" in text and "So " not in text
    # fp32 NS5 removes the drift at both step sizes, Polyak off removes it and a 10x lr without Polyak keeps it
    case = _q8_with_drift(d, "sfnormuon (fp32 NS5, Polyak off)", None)
    for arm, like in (("sfnormuon (fp32 NS5)", None), ("sfnormuon (fp32 NS5, Polyak off, lr ×10)", None),
                      ("sfnormuon (Polyak off)", None), ("sfnormuon (Polyak off, lr ×10)", base)):
        case = _q8_with_drift(case, arm, like)
    text = V.v_q8(case)
    assert "fp32 NS5 alone removes it (0.00x)" in text and "bf16 NS5 is needed for it" in text
    assert "a 10x lr brings the drift back" in text and "leaves it (1.00x)" in text
    # fp32 NS5 drifts like the default: bf16 NS5 is not named; a 10x lr without Polyak removes it too
    case = _q8_with_drift(case, "sfnormuon (fp32 NS5)", base)
    case = _q8_with_drift(case, "sfnormuon (Polyak off, lr ×10)", None)
    text = V.v_q8(case)
    assert "fp32 NS5 alone leaves it (1.00x)" in text and "bf16 NS5 is needed" not in text
    assert "the Polyak step is needed for it" in text and "brings the drift back" not in text


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
