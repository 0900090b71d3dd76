"""``python -m experiments compile-time``: its child times a real compiled first step, its table says what
was measured, and a bad name is refused before any process starts."""
from __future__ import annotations

import pytest
import torch

from experiments import compile_time


def test_child_times_a_compiled_first_step():
    """One Linear layer under impl="compiled": the first step (the compile) and the later ones are timed, and
    the compiled path ran (a failed compile would have warned, which the child turns into an error)."""
    from nonans_optim.optimizers._compiled import compile_available

    if not compile_available():
        pytest.skip("torch.compile failed earlier in this process")
    row = compile_time.child("toy", "AdamW", later=2, threads=torch.get_num_threads())
    assert row["tensors"] == 2
    assert row["first_s"] > 0 and row["later_ms"] > 0
    assert row["first_s"] * 1e3 > row["later_ms"]  # the first step holds the compile; the later ones do not
    assert compile_available()


def _result(rows):
    machine = {"date": "2026-11-27T00:00:00", "commit": "abc1234", "processor": "Some CPU", "cpu_count": 2,
               "torch_threads": 2, "torch": "2.13.0+cpu"}
    return {"command": "python -m experiments compile-time", "machine": machine, "settings": {"later": 5},
            "rows": rows}


def test_render_reports_every_row_and_the_per_tensor_range():
    rows = [{"model": "quick", "optimizer": "AdamW", "tensors": 16, "cold_first_s": 24.0, "warm_first_s": 4.5,
             "later_ms": 0.8},
            {"model": "quick", "optimizer": "SFNorMuon", "tensors": 16, "cold_first_s": 30.0, "warm_first_s": 5.0,
             "later_ms": 3.0},
            {"model": "default", "optimizer": "SFNorMuon", "tensors": 52, "cold_first_s": 84.0, "warm_first_s": 9.0,
             "later_ms": 12.25}]
    text = compile_time.render(_result(rows))
    assert "| quick | 16 | AdamW | 24.0 | 4.5 | 0.80 |" in text
    assert "| default | 52 | SFNorMuon | 84.0 | 9.0 | 12.25 |" in text
    # (84 - 30) / (52 - 16) for SFNorMuon; AdamW, measured on one model only, has no slope
    assert "added per tensor of the model: SFNorMuon 1.50 s (quick → default)." in text
    assert "AdamW 0" not in text and "AdamW 1" not in text
    assert "measured 2026-11-27T00:00:00 at commit abc1234 on Some CPU" in text


@pytest.mark.parametrize("argv, name", [(["--optimizers", "Adam"], "Adam"), (["--models", "gpt9"], "gpt9"),
                                        (["--later", "0"], "--later")])
def test_unknown_names_are_refused(argv, name, capsys):
    with pytest.raises(SystemExit) as exc:
        compile_time.main(argv + ["--results-md", ""])
    assert exc.value.code == 2
    assert name in capsys.readouterr().err
