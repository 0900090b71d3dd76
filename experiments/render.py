"""``python -m experiments render [--check]`` — every RESULTS.md section and OPEN_QUESTIONS.md from the JSON
under ``results/``, without running anything.

The project's rule is that every published number goes command → JSON → render function → markdown. Each
experiment already re-renders its own section after a run; this command does all of them at once, from the
stored JSON, with the same render functions. ``--check`` writes nothing and exits 1 naming each section
whose text differs from what its JSON renders to — a number typed or edited by hand, or a render function
changed without re-rendering — which is how the test suite holds the published files to that rule
(tests/test_render.py).

A JSON whose section was never published is left alone and listed (the experiment's own run creates the
section and its heading). A *published* section whose JSON is missing (or, for the kernels section, only a
dry run, whose timings mean nothing) is left as it is when rendering, and fails ``--check``: nothing backs
its numbers any more, and a check that passed with every JSON deleted could not hold them to the rule.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from experiments.questions_io import ROOT, read_json, replace_section

__all__ = ["SECTIONS", "render_all", "main"]

# RESULTS.md section → (its JSON under results/, the "module:function" that renders it). The overhead JSON of
# a GPU run renders into its own section (experiments/overhead.py::_publish). A section is created, with its
# heading, by the experiment's own first run; this command only re-renders sections already published.
SECTIONS: dict[str, tuple[str, str]] = {
    "ablation": ("ablation.json", "experiments.ablation:render"),
    "bench": ("bench.json", "experiments.bench.report:render_markdown"),
    "step-time": ("step_time.json", "experiments.step_time:render"),
    "overhead": ("overhead.json", "experiments.overhead_render:render"),
    "overhead-gpu": ("overhead_cuda.json", "experiments.overhead_render:render"),
    "overhead-gpu-gpt2-small": ("overhead_cuda_gpt2-small.json", "experiments.overhead_render:render"),
    # the same command before a change of the defaults, kept beside the run after it
    "overhead-gpu-gpt2-small-foreach": ("overhead_cuda_gpt2-small_foreach.json", "experiments.overhead_render:render"),
    "overhead-gpu-gpt2-small-three-launch": ("overhead_cuda_gpt2-small_three_launch.json",
                                             "experiments.overhead_render:render"),
    # the default optimizers with each group's statistics and decide launches as two (NONANS_TRITON_FOLD_DECIDE=0,
    # the default until 2026-11-27), beside the folded run that made one launch the default
    "overhead-gpu-gpt2-small-unfolded": ("overhead_cuda_gpt2-small_unfolded.json",
                                         "experiments.overhead_render:render"),
    # the default optimizers under the one-launch step, beside the full table measured before it was the default
    "overhead-gpu-one-launch": ("overhead_cuda_one_launch.json", "experiments.overhead_render:render"),
    # the CPU table's command on an AMD EPYC (Zen 4), beside the Intel Xeon run: the CPU target's verdict for the
    # AdamW family is within that table's noise (a scratch run on the same CPU split it the other way: session
    # notes, 2026-11-27), so one CPU's run does not stand for another's
    "overhead-amd-epyc": ("overhead_amd_epyc.json", "experiments.overhead_render:render"),
    "watch": ("watch_overhead.json", "experiments.watch_overhead:render"),
    "compile-time": ("compile_time.json", "experiments.compile_time:render"),
    "spikes": ("spikes.json", "experiments.spikes:render"),
    "momentum-dtype": ("momentum_dtype.json", "experiments.momentum_dtype:render"),
    "ns5-method": ("ns5_method.json", "experiments.ns5_method:render"),
    "simd": ("simd.json", "experiments.simd:render"),
    "simd-avx512": ("simd_avx512.json", "experiments.simd:render"),
    "aliasing": ("aliasing.json", "experiments.aliasing:render"),
    "bf16-cpu": ("bf16_cpu.json", "experiments.bf16_cpu:render"),
    "spike-guards": ("spike_guards.json", "experiments.spike_guards:render"),
    "kernels": ("kernels.json", "experiments.kernels:render"),
    "kernel-static": ("kernel_static.json", "experiments.kernel_static:render"),
    # the same command compiled with the GPU image's Triton (experiments/kernel_static.py::GPU_IMAGE_TRITON)
    "kernel-static-triton-3.6": ("kernel_static_triton-3.6.json", "experiments.kernel_static:render"),
    "sync-audit": ("sync_audit.json", "experiments.sync_audit:render"),
    "sync-audit-three-launch": ("sync_audit_three_launch.json", "experiments.sync_audit:render"),
    "sync-audit-unfolded": ("sync_audit_unfolded.json", "experiments.sync_audit:render"),
    "op-count": ("op_count.json", "experiments.op_count:render"),
    "polyak": ("questions/q5.json", "experiments.questions:polyak_section"),
}


def _function(spec: str) -> Callable[[dict[str, Any]], str]:
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


# suffixes of a section that holds the same command's run under other defaults (a JSON does not know them) or
# on another CPU (the JSON names its CPU, but the section a run replaces is chosen by its --out)
VARIANTS = ("-foreach", "-three-launch", "-one-launch", "-unfolded", "-amd-epyc")


def _base_section(section: str) -> str:
    """The section a run's JSON would name itself (``overhead.section``), without a variant suffix."""
    for suffix in VARIANTS:
        section = section.removesuffix(suffix)
    return section


def _renderable(section: str, data: dict[str, Any] | None) -> bool:
    if data is None:
        return False
    if section == "kernels":
        return not data.get("dry_run", True)  # a dry run's timings mean nothing
    if section.startswith("overhead"):
        from experiments.overhead import section as overhead_section
        return overhead_section(data) == _base_section(section)
    return True


def render_all(results_md: Path, open_questions_md: Path,
               results_dir: Path) -> tuple[list[str], list[str], list[str]]:
    """Rewrite each published section of ``results_md``, and ``open_questions_md`` whole (when the questions
    have a folder of JSON), from ``results_dir``. Returns (what was rendered, what was left because it was
    never published, what is published but has no JSON to render it from — left as it is)."""
    done, left, unbacked = [], [], []
    text = results_md.read_text() if results_md.exists() else ""
    for section, (name, spec) in SECTIONS.items():
        published, data = f"<!-- {section}:begin -->" in text, read_json(results_dir / name)
        if not _renderable(section, data):
            (unbacked if published else left).append(section)
            continue
        if not published:
            left.append(section)
            continue
        # the JSON's place in the repository, where a reader finds it: a GPU run's own "json" field names the
        # folder it was written to on the device ($OUT), not results/
        replace_section(results_md, section, _function(spec)(dict(data, json=f"results/{name}")))
        done.append(section)
    if (results_dir / "questions").is_dir():
        from experiments.questions import render_open_questions
        open_questions_md.write_text(render_open_questions(results_dir / "questions"))
        done.append(open_questions_md.name)
    else:
        (unbacked if open_questions_md.exists() else left).append(open_questions_md.name)
    return done, left, unbacked


def _stale(published: Path, rendered: Path) -> list[str]:
    old, new = published.read_text(), rendered.read_text()
    if old == new:
        return []
    return list(difflib.unified_diff(old.splitlines(), new.splitlines(), str(published), "rendered", lineterm="",
                                     n=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments render", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 if a published section differs from its JSON's rendering")
    ap.add_argument("--results-md", type=Path, default=ROOT / "RESULTS.md")
    ap.add_argument("--open-questions-md", type=Path, default=ROOT / "OPEN_QUESTIONS.md")
    ap.add_argument("--results-dir", type=Path, default=ROOT / "results")
    args = ap.parse_args(argv)
    targets = {"results": args.results_md, "questions": args.open_questions_md}
    with tempfile.TemporaryDirectory() as tmp:
        copies = {k: Path(tmp) / k / p.name for k, p in targets.items()}  # the files' own names, apart
        for k, p in targets.items():
            copies[k].parent.mkdir()
            if p.exists():
                shutil.copyfile(p, copies[k])
        done, missing, unbacked = render_all(copies["results"], copies["questions"], args.results_dir)
        if args.check:
            diffs = {k: _stale(targets[k], copies[k]) if targets[k].exists() else ["(file missing)"]
                     for k in targets}
        else:
            for k in targets:
                if copies[k].exists():  # a file neither published nor rendered stays absent
                    shutil.copyfile(copies[k], targets[k])
    print(f"rendered from {args.results_dir}: {', '.join(done) or 'nothing'}"
          + (f"; not published, left alone: {', '.join(missing)}" if missing else ""))
    if unbacked:
        print(f"published without a JSON in {args.results_dir} to render them from (left as they are): "
              f"{', '.join(unbacked)}", file=sys.stderr)
    if not args.check:
        return 0
    stale = {k: d for k, d in diffs.items() if d}
    for k, d in stale.items():
        print(f"\n{targets[k]} differs from what its JSON renders to:\n" + "\n".join(d[:80]), file=sys.stderr)
    return 1 if stale or unbacked else 0


if __name__ == "__main__":
    sys.exit(main())
