"""The published files are what their JSON renders to (``python -m experiments render --check``), and every
command the experiments CLI lists can be imported (a registered command without its module used to fail
only when someone typed it)."""
from __future__ import annotations

import importlib
import shutil
import statistics
from pathlib import Path

import pytest

from experiments.__main__ import COMMANDS
from experiments.render import SECTIONS, main as render_main

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_has_a_module_with_main(name):
    module = importlib.import_module(COMMANDS[name][0])
    assert callable(getattr(module, "main", None)), f"{COMMANDS[name][0]} has no main()"


def test_every_section_renderer_exists():
    for section, (_, spec) in SECTIONS.items():
        module, fn = spec.split(":")
        assert callable(getattr(importlib.import_module(module), fn, None)), f"{section}: {spec} is missing"


def test_published_results_match_their_json(capsys):
    """RESULTS.md and OPEN_QUESTIONS.md, as committed, are byte for byte what results/*.json render to."""
    rc = render_main(["--check"])
    out = capsys.readouterr()
    assert rc == 0, out.err[-4000:]
    rendered = out.out.split(";")[0]  # "rendered from ...: a, b, c" (what follows names what was not)
    assert all(name in rendered for name in ("ablation", "overhead", "bench", "OPEN_QUESTIONS.md")), out.out


def _copies(tmp_path: Path) -> tuple[Path, Path]:
    res, oq = tmp_path / "RESULTS.md", tmp_path / "OPEN_QUESTIONS.md"
    shutil.copyfile(ROOT / "RESULTS.md", res)
    shutil.copyfile(ROOT / "OPEN_QUESTIONS.md", oq)
    return res, oq


def test_check_catches_a_number_edited_by_hand(tmp_path, capsys):
    res, oq = _copies(tmp_path)
    text = res.read_text()
    begin = text.index("<!-- overhead:begin -->")
    row = text.index("| AdamW (fused) |", begin)
    edited = text[:row] + text[row:].replace("| AdamW (fused) |", "| AdamW (fused) | 9.99 |", 1)
    res.write_text(edited)
    args = ["--results-md", str(res), "--open-questions-md", str(oq)]
    assert render_main(["--check", *args]) == 1
    assert "9.99" in capsys.readouterr().err
    assert res.read_text() == edited  # --check writes nothing
    assert render_main(args) == 0  # a render puts the JSON's numbers back
    assert res.read_text() == (ROOT / "RESULTS.md").read_text()


def test_sections_without_json_are_left_alone_and_fail_the_check(tmp_path, capsys):
    """A render leaves a published section whose JSON is gone as it is; ``--check`` fails on it (it passed
    with every JSON deleted, an audit found: nothing backed the numbers and the check said they matched)."""
    res, oq = _copies(tmp_path)
    empty = tmp_path / "results"
    empty.mkdir()
    args = ["--results-md", str(res), "--open-questions-md", str(oq), "--results-dir", str(empty)]
    assert render_main(args) == 0
    assert res.read_text() == (ROOT / "RESULTS.md").read_text()
    assert oq.read_text() == (ROOT / "OPEN_QUESTIONS.md").read_text()
    err = capsys.readouterr().err
    assert "published without a JSON" in err and "ablation" in err and "OPEN_QUESTIONS.md" in err
    assert render_main(["--check", *args]) == 1
    partial = tmp_path / "partial"  # every JSON but one: the check names that one
    shutil.copytree(ROOT / "results", partial)
    (partial / SECTIONS["spikes"][0]).unlink()
    assert render_main(["--check", "--results-md", str(res), "--open-questions-md", str(oq),
                        "--results-dir", str(partial)]) == 1
    assert "spikes" in capsys.readouterr().err.split("published without a JSON")[1].splitlines()[0]
    (empty / "questions").mkdir()  # a questions folder without a question's JSON: that one is "not run yet"
    assert render_main(args) == 0
    assert "**Not run yet.**" in oq.read_text()


def test_simd_runs_keep_one_section_per_kind_of_cpu():
    """A run of ``experiments simd`` on a CPU with AVX-512 goes to its own JSON and section, so it does not
    replace the numbers of a CPU without it (a different default build), and the other way round."""
    from experiments.questions_io import read_json
    from experiments.simd import render, section
    data = read_json(ROOT / "results" / "simd.json")
    for flags, key in ((["avx2", "fma"], "simd"), ([], "simd"), (["avx2", "avx512f", "fma"], "simd-avx512")):
        run = {**data, "cpu_flags": flags}
        assert section(run) == key
        assert f"(JSON: `results/{SECTIONS[key][0]}`)" in render(run)


@pytest.mark.parametrize("name", sorted(set(COMMANDS) - {"render"}))
def test_every_experiment_can_skip_rendering_the_same_way(name, capsys):
    """``--results-md ''`` runs an experiment without touching RESULTS.md, in every command alike (three of
    them only knew ``--no-markdown``, and refused the flag every other one takes)."""
    module = importlib.import_module(COMMANDS[name][0])
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    assert "--results-md" in capsys.readouterr().out


def test_sync_audit_section_names_its_date_when_recorded():
    """Audits since 2026-11-25 record when they ran (launch counts change with the code); older JSON renders
    as it did."""
    import json

    from experiments.questions_io import ROOT
    from experiments.sync_audit import render

    data = json.loads((ROOT / "results" / "sync_audit.json").read_text())
    assert "measured" not in render({k: v for k, v in data.items() if k != "date"})
    assert "measured 2026-11-26T08:00:00" in render({**data, "date": "2026-11-26T08:00:00"})


def test_open_question_2b_reads_the_gpu_run_of_the_kernels_experiment():
    """Q2's GPU part is rendered from results/kernels.json's fp16 rescale arm, only from a GPU run, and its
    verdict follows the numbers (the fused rescale "pays" only where it is 5% faster than unfused)."""
    from experiments.questions_verdicts import q2_gpu

    row = dict(batch=1, m=4096, n=4096, fused_vs_unfused=1.0 / 0.98, fused_vs_plain_fp16=1.17, plain_bf16_ms=2.9,
               plain_fp16_ms=3.0, rel_err_plain_bf16=8.6e-3, rel_err_fused=1.0e-3)
    gpu = dict(device="NVIDIA H200", date="2026-11-26T01:32:19", dry_run=False, fp16_safe=[row])
    assert q2_gpu(None) == "" and q2_gpu({**gpu, "dry_run": True}) == "" and q2_gpu({**gpu, "fp16_safe": []}) == ""
    text = q2_gpu(gpu)
    assert "NVIDIA H200, 2026-11-26T01:32:19" in text and "1×4096×4096 0.98x" in text and "8.6x" in text
    assert "does not change the picture" in text and "best 0.98x" in text
    assert "pays (5% or more) at 1×4096×4096" in q2_gpu({**gpu, "fp16_safe": [{**row, "fused_vs_unfused": 1.25}]})


def test_a_command_names_the_switches_it_ran_under(monkeypatch):
    """A JSON's command repeats the run: the library's switches set in the process lead it (the one-launch
    step, the fused backend...), and nothing else from the environment does."""
    from experiments.questions_io import SWITCHES, env_prefix

    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert env_prefix() == ""
    monkeypatch.setenv("NONANS_TRITON_ONE_LAUNCH", "1")
    monkeypatch.setenv("NONANS_FUSED_BACKEND", "triton")
    monkeypatch.setenv("NONANS_CACHE_DIR", "/tmp/a b")  # where the build is cached changes no number
    assert env_prefix() == "NONANS_TRITON_ONE_LAUNCH=1 NONANS_FUSED_BACKEND=triton "


def test_every_switch_that_changes_numbers_leads_a_command():
    """Every switch nonans_optim/switches.py parses is one env_prefix names (a switch added there and not in
    SWITCHES would leave a run under it looking like a default run)."""
    import re

    from experiments.questions_io import SWITCHES

    source = (ROOT / "nonans_optim" / "switches.py").read_text()
    parsed = set(re.findall(r"\"(NONANS_\w+)\"", source)) - {"NONANS_NATIVE", "NONANS_CACHE_DIR"}
    assert parsed and parsed <= set(SWITCHES), parsed - set(SWITCHES)


def test_fused_step_bandwidth_target_has_a_verdict():
    """The kernels section states the fused step's bandwidth target (≥ 0.80 of copy) and judges it from the
    numbers: it was printed with no verdict while the repair arm ran at 0.44 of copy (an audit, 2026-11-26)."""
    from experiments.kernels_step import render_fused_step
    # 28 bytes × 1e6 entries in 0.1 ms = 280 GB/s; copy at 300 GB/s → 0.93, at 400 GB/s → 0.70
    f = dict(numel=1_000_000, tensors=8, repair_ms=0.1, off_ms=0.1, torch_fused_ms=0.1, repair_vs_off=1.0,
             repair_vs_torch_fused=1.0)
    assert "copy bandwidth: met (0.93" in "\n".join(render_fused_step(f, 300.0))
    assert "copy bandwidth: MISSED (0.70" in "\n".join(render_fused_step(f, 400.0))


def test_runs_record_the_commit_they_measured_and_sections_name_it():
    """Every run records the checkout's commit (marked "+changes" when the measured code differs from it), and
    the sections name it, so that a table describing older code can be told from the code (an audit found
    most JSON without one: which tables were stale could not be read off them)."""
    import json

    from experiments import overhead_render, simd, step_time
    from experiments.bench import machine
    from experiments.questions_io import checkout_commit, environment

    commit = checkout_commit()
    if (ROOT / ".git").exists():  # a git checkout (CI's is); a source tarball records "unknown"
        assert commit != "unknown" and commit.split("+")[0].isalnum()
    assert environment()["commit"] == step_time.machine_info()["commit"] == machine()["commit"] == commit
    for module, name in ((overhead_render, "overhead.json"), (simd, "simd.json"), (step_time, "step_time.json")):
        data = json.loads((ROOT / "results" / name).read_text())
        data["machine"].pop("commit", None)  # as a run before 2026-11-26 recorded it
        assert " at commit " not in module.render(data)  # older JSON renders as it did
        data["machine"]["commit"] = "abc1234+changes"
        assert "at commit abc1234+changes" in module.render(data), name


def test_cpu_verdicts_judge_every_row_and_say_what_noise_does_not_resolve():
    """The simd verdict judges every size it ran, to four decimals (the 65,536-entry rows were left out, and
    1.0204 printed as a missed "1.020"); the overhead verdict says when a median under the target has an
    upper quartile over it and no fresh-process control (SF-NorMuon's +1.7% with 0.934–1.049 in the run of
    2026-11-26 00:39), and when one over it has a lower quartile under it (Muon's +2.7% with 1.004–1.043 in
    the run at 21ea8a2). Judged on the published run, whose rows the assertions read rather than pin."""
    import json

    from experiments import overhead_render, simd
    from experiments.overhead_controls import overhead_pct

    data = json.loads((ROOT / "results" / "simd_avx512.json").read_text())
    text = simd.render(data)
    default = next(b for b in data["builds"] if b["mode"] == data["default_mode"])
    over = [r for r in default["rows"] if r["repair"]["median"] > simd.TARGET]
    assert "at every size run" in text and over  # (the published run misses somewhere: the branch is not vacuous)
    for r in default["rows"]:  # every size judged, each miss to four decimals (1.0204 once printed as "1.020")
        label = f"{simd._label(r)} {r.get('dtype', 'fp32')} at {r['entries']:,} ({r['repair']['median']:.4f})"
        assert (label in text) == (r in over), label
    data = json.loads((ROOT / "results" / "overhead.json").read_text())
    text = overhead_render.render(data)
    controlled = {c["optimizer"]: c["same_tensors"]["median"] for c in data["controls"]}
    builds = {c["optimizer"]: sorted(b["same_tensors"]["median"] for b in c["per_build"]) for c in data["controls"]}
    loose = straddled = 0
    for r in data["rows"]:
        name, median = r["optimizer"], r["step"]["median_paired_ratio"]
        if name in controlled:  # judged on its controls; noted where the middle half of its builds straddles 2%
            q1, _, q3 = statistics.quantiles(builds[name], n=4, method="inclusive")
            label = f"{name} ({overhead_pct(controlled[name], 1.02)}, controls"
            if q1 <= 1.02 < q3:
                straddled += 1
                assert f"{label}, builds' quartiles {q1:.3f}–{q3:.3f}: not resolved)" in text
            else:
                assert f"{label})" in text
            continue
        lower, upper = overhead_render.paired_quartiles(data, name)
        label = f"{name} ({overhead_pct(median, 1.02)}"
        if median <= 1.02 and upper > 1.02:
            loose += 1
            assert f"{label}, upper quartile {upper:.3f}: not resolved)" in text
        elif median > 1.02 and lower <= 1.02:
            loose += 1
            assert f"{label}, lower quartile {lower:.3f}: not resolved)" in text
        else:
            assert f"{label})" in text
    # the published run has every kind of row, so no branch is vacuous
    assert loose and straddled and len(controlled) > straddled


def test_simd_says_when_its_avx2_rows_were_built_with_avx512_code():
    """An AVX-512 machine's "AVX2" rows measured before the avx2 build capped the ISA (``-mno-avx512f``,
    2026-11-27) are the AVX2 intrinsics inside AVX-512 code: the table says so from the build flags its JSON
    records (none recorded: before the cap), and stops saying it once they hold the cap, or on a CPU without
    AVX-512 (where that build is an AVX2 CPU's)."""
    import json

    from experiments import simd

    data = json.loads((ROOT / "results" / "simd_avx512.json").read_text())
    avx2 = next(b for b in data["builds"] if b["mode"] == "avx2")
    note = "predate the avx2 build's `-mno-avx512f`"
    for flags, said in ((None, True), (["-DNONANS_NO_AVX512"], True), (["-DNONANS_NO_AVX512", "-mno-avx512f"], False)):
        avx2.pop("cflags", None)
        if flags is not None:
            avx2["cflags"] = flags
        assert (note in simd.render(data)) == said, flags
    avx2["cflags"] = ["-DNONANS_NO_AVX512"]
    data["cpu_flags"] = [f for f in data["cpu_flags"] if not f.startswith("avx512")]
    assert note not in simd.render(data)


def test_simd_labels_its_builds_by_form():
    """Two C builds report vector width 0 since the generic form (2026-11-27): runs since then record each
    build's form and label its rows by it (the default too); older JSON, whose width-0 build is the exact
    portable one, keeps its width labels."""
    import copy
    import json

    from experiments import simd

    data = json.loads((ROOT / "results" / "simd_avx512.json").read_text())
    if all("form" not in b for b in data["builds"]):  # published before the form was recorded
        assert "| portable C | AdamW |" in simd.render(data) and "| generic C |" not in simd.render(data)
        for b in data["builds"]:
            b["form"] = {0: "portable", 256: "avx2", 512: "avx512"}[b["simd_width"]]
        generic = copy.deepcopy(next(b for b in data["builds"] if b["form"] == "portable"))
        generic.update(mode="generic", form="generic")
        data["builds"].insert(1, generic)
    text = simd.render(data)
    for label in ("portable C", "generic C", "AVX2", "AVX-512 (default)"):
        assert f"| {label} | AdamW |" in text, label
    data["default_mode"] = "generic"
    assert "| generic C (default) | AdamW |" in simd.render(data)
    assert "the default build here (generic C)" in simd.render(data)
    default = next(b for b in data["builds"] if b["mode"] == "generic")
    row = copy.deepcopy(default["rows"][0])
    row.update(optimizer="SFNorMuon", entries=8 * 256 * 256, shape=[8, 256, 256])
    row["repair"]["median"] = simd.TARGET + 0.01
    default["rows"].append(row)
    text = simd.render(data)
    assert "| generic C (default) | SFNorMuon (8 × 256×256) | fp32 | 524,288 |" in text
    assert f"SFNorMuon (8 × 256×256) fp32 at 524,288 ({simd.TARGET + 0.01:.4f})" in text  # judged as the others
    assert "(SFNorMuon: a stack of same-shape matrices" in text


def test_an_overhead_at_the_limit_shows_which_side_it_is_on():
    """A ratio of 1.0202 against the 2% target printed "+2.0% MISSED" (the overhead run of 2026-11-27): one
    decimal more where one decimal would print the limit itself; the usual one decimal elsewhere."""
    from experiments.overhead_controls import overhead_pct

    assert (overhead_pct(1.0202, 1.02), overhead_pct(1.0196, 1.02)) == ("+2.02%", "+1.96%")
    assert (overhead_pct(1.02, 1.02), overhead_pct(1.0104, 1.02), overhead_pct(0.99, 1.02)) == ("+2.0%", "+1.0%",
                                                                                                 "-1.0%")
