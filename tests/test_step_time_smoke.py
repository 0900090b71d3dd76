"""Smoke tests of the two performance experiments: ``--quick`` runs end to end and every arm is timed.

Each runs in a subprocess (the benchmarks set process-wide knobs: torch threads, heavyball's compile mode)
and writes its JSON to a temporary directory, never to results/ or RESULTS.md."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(command: str, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / f"{command}.json"
    proc = subprocess.run([sys.executable, "-m", "experiments", command, "--quick", "--out", str(out),
                           "--results-md", "", *extra], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_step_time_quick(tmp_path):
    data = _run("step-time", tmp_path)
    names = {r["name"] for r in data["arms"]}
    ours = {"ours AdamW (foreach, repair)", "ours AdamW (compiled, repair)", "ours SFAdamW (foreach, repair)",
            "ours SFAdamW (compiled, repair)", "ours SFNorMuon (foreach, repair)",
            "ours SFNorMuon (compiled, repair)", "ours FullFusion (foreach, repair)",
            "ours FullFusion (compiled, repair)", "ours AdamW (fused, repair)", "ours SFAdamW (fused, repair)",
            "ours SFNorMuon (fused, repair)", "ours FullFusion (fused, repair)"}
    assert ours | {"torch AdamW (foreach)", "torch AdamW (fused)"} <= names
    assert names | set(data["skipped"]) >= ours  # every arm is either measured or reported as skipped
    for r in data["arms"]:
        assert r["rounds"] == 2
        assert all(_finite_positive(r[k]) for k in ("median_ms", "mean_ms", "min_ms", "max_ms", "vs_fused_adamw")), r
        assert r["state_bytes_per_param"] > 0
    assert _finite_positive(data["matmul_gflops"]["bf16"]) and _finite_positive(data["ns5_floor_ms"]["bf16"])
    assert {t["target"].split(" ")[0] for t in data["targets"]} >= {"SFNorMuon", "AdamW"}


@pytest.mark.slow
def test_overhead_quick(tmp_path):
    from experiments.overhead_controls import CONTROLLED

    data = _run("overhead", tmp_path)
    expected = ["AdamW (foreach)", "AdamW (compiled)", "AdamW (fused)", "AdamW (fused, spike_factor=10)",
                "SFAdamW (foreach)", "SFAdamW (fused)", "SFAdamW (fused, spike_factor=10)", "SFNorMuon (foreach)",
                "SFNorMuon (compiled)", "SFNorMuon (fused)", "FullFusion (foreach)", "FullFusion (fused)",
                "Muon (foreach)", "Muon (fused)"]
    assert [r["optimizer"] for r in data["rows"]] == expected
    for r in data["rows"]:
        for part in ("step", "train_step"):
            assert all(_finite_positive(r[part][k]) for k in ("repair_ms", "off_ms", "ratio_of_medians",
                                                               "median_paired_ratio")), r
    for kind in ("step", "train_step"):
        raw = data["raw_ms"][kind]
        assert len(raw) == 2 * len(expected) and all(len(v) == 2 for v in raw.values())
    assert [r["entries"] for r in data["size_sweep"]] == [1 << 10, 1 << 12]
    for r in data["size_sweep"]:
        assert all(_finite_positive(r[k])
                   for k in ("off_ms", "repair_paired_ratio", "repair_guard_paired_ratio", "aa_paired_ratio"))
        assert r["design"] == "same tensors"
    # --render-only puts the same JSON's table into a RESULTS file, naming every arm as met or missed
    md = tmp_path / "RESULTS.md"
    proc = subprocess.run([sys.executable, "-m", "experiments", "overhead", "--render-only", "--out",
                           str(tmp_path / "overhead.json"), "--results-md", str(md)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    section = md.read_text()
    assert "<!-- overhead:begin -->" in section and "Target (CPU)" in section
    runs = set(data["auto_runs"].values())  # on CPU one impl for every class
    assert len(runs) == 1 and runs <= {"fused", "foreach"} and f'runs the "({runs.pop()})" rows' in section
    assert all(f"| {name} |" in section and f"{name} (" in section.split("Target (CPU)")[1] for name in expected)
    # the target is judged on each optimizer as constructed by default, whose guard setting is read from the library
    assert data["default_rows"] == {f"{c} ({data['auto_runs'][c]})": (None if c in ("AdamW", "SFAdamW") else 10.0)
                                    for c in ("AdamW", "SFAdamW", "SFNorMuon", "FullFusion", "Muon")}
    assert "**Each optimizer as constructed by default**" in section
    # the rows that have a control are judged on it, and say so
    target = section.split("Target (CPU)")[1].split("\n")[0]
    # (two builds whose middle half straddles 2% add "builds' quartiles a–b: not resolved", a quick run's luck)
    assert all(re.search(re.escape(name) + r" \([+-]\d+\.\d+%, controls(, builds' quartiles \d\.\d{3}–\d\.\d{3}: "
                         r"not resolved)?\)", target) for name in CONTROLLED)
    # the controls: A/A (identical "off" arms) and the same-tensor repair/off, for the AdamW family's defaults
    # and the fused spectral ones, each row in fresh processes of its own (quick: one process of two builds)
    assert [c["optimizer"] for c in data["controls"]] == list(CONTROLLED)
    assert set(CONTROLLED) == {"AdamW (fused)", "SFAdamW (fused)", "SFNorMuon (fused)", "FullFusion (fused)",
                               "Muon (fused)"}
    assert "controls_first" not in data
    for c in data["controls"]:  # over independent builds: each build's median, then theirs
        assert (c["processes"], c["builds"], len(c["per_process"]), len(c["per_build"])) == (1, 2, 1, 2)
        for k in ("aa", "same_tensors"):
            for s in (c[k], c["per_process"][0][k]):
                assert all(_finite_positive(s[q]) for q in ("median", "low", "high"))
            meds = sorted(b[k]["median"] for b in c["per_build"])
            assert (c[k]["low"], c[k]["high"]) == (meds[0], meds[-1]) and meds[0] <= c[k]["median"] <= meds[-1]
            assert all(b[k]["q1"] <= b[k]["median"] <= b[k]["q3"] for b in c["per_build"])
        assert {len(v) for v in c["raw_ms"].values()} == {2}  # a list per build
        assert {len(t) for v in c["raw_ms"].values() for t in v} == {4}  # 2 x rounds, every arm
    assert "A/A: off / off, separately built" in section and "Same-tensor check of the target" in section
    assert "1 fresh process(es) of its own" in section and "each with 2 independent builds" in section
    # each row's two arms step one optimizer (the same tensors), and the rendered text says so
    assert data["settings"]["design"] == "same tensors" and "**Design (changed 2026-11-24):**" in section
    assert "| AdamW (fused) | 1 |" in section and "| SFAdamW (fused) | all (2 builds) |" in section
    verdicts = section.split("Same-tensor check of the target")[1]
    assert len(re.findall(r"AdamW \(fused\) [+-]\d+\.\d+% (?:met|MISSED)", verdicts)) == 2  # one verdict per row
    assert "| off / off (A/A) |" in section and "every arm steps the same tensors" in section


def test_overhead_defaults_only(tmp_path):
    """--defaults: each optimizer as constructed by default and nothing else (no sweep, no controls) — the
    run a GPU-sized model has time for; the command line says so."""
    data = _run("overhead", tmp_path, "--defaults")
    assert [r["optimizer"] for r in data["rows"]] == list(data["default_rows"])
    assert len(data["rows"]) == 5 and data["size_sweep"] == [] and data["controls"] == []
    assert "--defaults" in data["command"] and data["model"]["name"] == "quick"
    assert data["model"]["params"] > 0


def test_overhead_model_flag_has_its_own_json_and_section():
    """--model gpt2-small is GPT-2 small's shape (≈124M parameters, built here on the meta device), and its
    run publishes to a JSON and a RESULTS.md section of its own, so the default model's tables stay."""
    import torch

    from experiments import render
    from experiments._models import MODELS, TinyGPT
    from experiments.overhead import _json_name, section

    with torch.device("meta"):
        n = sum(p.numel() for p in TinyGPT(MODELS["gpt2-small"]).parameters())
    assert 123e6 < n < 126e6
    gpu = {"device": "NVIDIA H100", "model": {"name": "gpt2-small"}}
    assert (section(gpu) == "overhead-gpu-gpt2-small"
            and _json_name(True, "gpt2-small") == "overhead_cuda_gpt2-small.json")
    assert render.SECTIONS[section(gpu)][0] == _json_name(True, "gpt2-small")
    for name in ("default", "quick"):  # the tables published so far keep their places
        assert section({"device": "cpu", "model": {"name": name}}) == "overhead"
        assert section({"device": "NVIDIA H100", "model": {"name": name}}) == "overhead-gpu"
    assert section({"device": "cpu", "model": {}}) == "overhead" and _json_name(False, "default") == "overhead.json"


def test_overhead_rows_pair_repair_and_off_on_one_optimizer():
    import torch

    from experiments.overhead import OPTIMIZERS, _step_arms

    base = torch.nn.Linear(4, 3)
    grads = [torch.ones_like(p) for p in base.parameters()]
    arms = _step_arms(base, grads, OPTIMIZERS["AdamW (fused, spike_factor=10)"])
    arms["repair"]()
    arms["off"]()
    captured = [dict(zip(f.__code__.co_freevars, (c.cell_contents for c in f.__closure__))) for f in arms.values()]
    opt = captured[0]["opt"]
    assert all(c["opt"] is opt for c in captured)  # one optimizer behind both arms
    assert opt.resolution_policy == "off" and opt.spike_factor == 10.0  # the row's guard kept under both
    assert [float(opt.state[p]["step"]) for p in opt.param_groups[0]["params"]] == [2.0, 2.0]


def test_switched_arms_step_one_optimizer_under_their_own_settings():
    """The sweep's and the controls' same-tensor arms: each sets its policy and guard, then steps the one
    optimizer they share (a guarded arm rescales a spike that an unguarded one leaves alone)."""
    import torch

    import nonans_optim as no
    from experiments.overhead_controls import switched

    p = torch.nn.Parameter(torch.ones(4))
    opt = no.AdamW([p], lr=1e-2, impl="fused")
    arms = {"off": switched(opt, "off"), "guard": switched(opt, "repair", 10.0), "repair": switched(opt, "repair")}
    for _ in range(5):  # the guard's running norm needs a history
        p.grad = torch.full((4,), 0.1)
        arms["guard"]()
    p.grad = torch.full((4,), 1e4)
    arms["guard"]()
    assert (opt.resolution_policy, opt.spike_factor) == ("repair", 10.0)
    assert [e.stage for e in opt.events] == ["spike"]
    arms["repair"]()
    assert opt.spike_factor is None and [e.stage for e in opt.events] == ["spike"]  # unguarded: no new event
    arms["off"]()
    assert opt.resolution_policy == "off" and opt.state[p]["step"].item() == 8  # all arms stepped one state


@pytest.mark.slow
def test_ns5_method_quick(tmp_path):
    data = _run("ns5-method", tmp_path)
    assert data["command"].startswith("python -m experiments ns5-method")
    assert data["timing"] and all(_finite_positive(r["standard_ms"]) and _finite_positive(r["gram_ms"])
                                  for r in data["timing"])
    assert all(math.isfinite(r["gram_err"]) for r in data["accuracy"])


def test_momentum_dtype_tiny(tmp_path):
    out = tmp_path / "m.json"
    proc = subprocess.run([sys.executable, "-m", "experiments", "momentum-dtype", "--tasks", "digits", "--seeds",
                           "1", "--steps", "3", "--out", str(out), "--results-md", ""], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    b = data["bytes_per_param"]
    assert b["bf16"] < 8.0 < b["param"]  # the point of the option: under AdamW's two fp32 moments
    assert all(math.isfinite(x) for r in data["tasks"].values() for x in r["bf16"] + r["param"])


@pytest.mark.slow
def test_simd_quick(tmp_path):
    data = _run("simd", tmp_path)
    assert data["command"] == "python -m experiments simd --quick"
    built = [b for b in data["builds"] if b["simd_width"] is not None]
    assert built and built[0]["mode"] == "portable" and built[0]["form"] == "portable"  # the reference always builds
    assert built[1]["mode"] == "generic" and built[1]["form"] == "generic"  # as a CPU without SIMD forms has it
    assert len({b["form"] for b in built}) == len(built)  # a build that repeats another's form is left out
    assert data["default_mode"] in {b["mode"] for b in built}
    for b in built:
        assert sorted((r["optimizer"], r["dtype"], r["entries"]) for r in b["rows"]) == sorted(
            [(o, d, n) for o in ("AdamW", "SFAdamW") for d in ("fp32", "bf16") for n in (1 << 10, 1 << 12)]
            + [("SFNorMuon", d, 2 * 32 * 32) for d in ("fp32", "bf16")])  # the spectral stack, quick: 2 x 32x32
        assert all(r.get("shape") == ([2, 32, 32] if r["optimizer"] == "SFNorMuon" else None) for r in b["rows"])
        for r in b["rows"]:
            assert _finite_positive(r["off_ms"]) and _finite_positive(r["repair"]["median"])
            assert ("off_vs_torch_fused" in r) == (r["optimizer"] == "AdamW")


def test_aliasing_layouts_are_realised():
    """The aliasing experiment's premise: each layout's four arrays really sit at their offsets mod 4096
    (``build`` raises otherwise), and a page view is a contiguous view of the size asked for."""
    from experiments.aliasing import LAYOUTS, PAGE, build, page_view
    import nonans_optim as no

    for off in (0, 4, 64, PAGE - 4):
        t = page_view(37, off)
        assert t.is_contiguous() and t.numel() == 37 and t.data_ptr() % PAGE == off
    with pytest.raises(ValueError, match="multiple of 4"):
        page_view(8, 2)
    for cls in (no.AdamW, no.SFAdamW):
        for offsets in LAYOUTS.values():
            opt = build(cls, 300, offsets)
            (p,) = opt.param_groups[0]["params"]
            state = opt.state[p]
            second = state["z" if cls is no.SFAdamW else "exp_avg"]
            assert [t.data_ptr() % PAGE for t in (p, p.grad, second, state["exp_avg_sq"])] == list(offsets)


@pytest.mark.slow
def test_aliasing_quick(tmp_path):
    from experiments.aliasing import LAYOUTS, render

    data = _run("aliasing", tmp_path)
    assert data["command"] == "python -m experiments aliasing --quick"
    assert {(r["optimizer"], r["layout"]) for r in data["rows"]} == {
        (o, lay) for o in ("AdamW", "SFAdamW") for lay in LAYOUTS}
    for r in data["rows"]:
        assert _finite_positive(r["off_ms"]) and _finite_positive(r["repair_ms"])
        assert r["repair_vs_off_low"] <= r["repair_vs_off"] <= r["repair_vs_off_high"]
    data["baseline"] = {k: data[k] for k in ("command", "commit", "machine", "rows")}
    assert "before: repair / off" in render(data)


def test_interleaved_settles_switched_arms_before_each_sample(monkeypatch):
    """A switched arm's first step after a switch does the switch's work (the first "repair" step after
    "off" steps runs ``Resolution.pass_clean_steps``): ``interleaved`` runs it untimed before each sample,
    so every timed "repair" step is one a run under "repair" alone would take."""
    import torch

    import nonans_optim as no
    from experiments.overhead_controls import switched
    from experiments.step_time import interleaved
    from nonans_optim.resolution import Resolution

    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 0.1)
    opt = no.AdamW([p], lr=1e-2, impl="fused")
    log: list[str] = []
    timing: list[int] = []  # len(log) when pass_clean_steps ran
    real_step, real_pass = opt.step, Resolution.pass_clean_steps
    monkeypatch.setattr(opt, "step", lambda: (log.append(opt.resolution_policy), real_step())[1])
    monkeypatch.setattr(Resolution, "pass_clean_steps",
                        lambda self, n: (timing.append(len(log)), real_pass(self, n))[1])
    arms = {"off": switched(opt, "off"), "repair": switched(opt, "repair")}
    interleaved(arms, rounds=4, warmup=0, inner=3, device=torch.device("cpu"))
    # each sample: one settle step, then three timed steps, all under the arm's policy
    assert len(log) == 4 * 2 * 4
    samples = [log[i:i + 4] for i in range(0, len(log), 4)]
    assert all(len(set(s)) == 1 for s in samples) and {s[0] for s in samples} == {"off", "repair"}
    # the catch-up ran in a settle step (the first of a "repair" sample that follows an "off" one), never timed
    assert timing and all((n - 1) % 4 == 0 and log[n - 1] == "repair" for n in timing)

    plain = {"a": lambda: log.append("a")}  # an arm without settle: only its timed calls
    log.clear()
    interleaved(plain, rounds=2, warmup=1, inner=2, device=torch.device("cpu"))
    assert log == ["a"] * 5


@pytest.mark.slow
def test_bf16_cpu_quick(tmp_path):
    from experiments.bf16_cpu import OURS, render

    data = _run("bf16-cpu", tmp_path)
    assert data["command"] == "python -m experiments bf16-cpu --quick"
    assert data["moved"] and min(data["moved"].values()) > 0  # every timed optimizer stepped its parameters
    assert set(data["spectral"]) == {"SFNorMuon", "FullFusion"}
    assert all(r["bf16_vs_fp32"] > 0 for r in data["spectral"].values())
    arms = {f"{n} (auto, {p})" for n in OURS for p in ("off", "repair")}
    assert arms | {"AdamW (foreach, repair): the default before", "torch AdamW (fused)"} <= set(data["steps"])
    for r in data["steps"].values():
        assert _finite_positive(r["ms"]) and r["low"] <= r["vs_torch_fused"] <= r["high"]
    assert data["steps"]["torch AdamW (fused)"]["vs_torch_fused"] == 1.0
    for r in data["paired"].values():
        assert _finite_positive(r["repair"]["median"]) and _finite_positive(r["aa"]["median"])
    assert "Against the CPU target" in render(data)
