"""``python -m experiments questions [q1 … q8 | claims | polyak] [--render-only] [--quick]``.

FusionOpt's eight open questions (Taikakim/fusion-optimiser docs/open_questions.md), its
three headline claims, and the Polyak instrumentation, each as one CPU-sized experiment. Each writes
``results/questions/<name>.json`` (+ a PNG); OPEN_QUESTIONS.md and the RESULTS.md Polyak section are
rendered from those files only (``--render-only`` re-renders without running anything).

q5 *is* the Polyak instrumentation: ``questions q5`` and ``questions polyak`` run the same experiment.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Callable

import torch

from . import questions_verdicts as V
from .questions_accum import render_q8, run_q8
from .questions_cache import render_q6, run_q6
from .questions_claims import render_shampoo_alone, run_shampoo_alone
from .questions_fp16_train import render_q2_all, run_q2_with_training
from .questions_io import RESULTS, ROOT, new_figure, read_json, replace_section, save_figure, write_json
from .questions_polyak import plot_polyak, render_polyak, run_polyak
from .questions_scale import render_q1, render_q4, run_q1, run_q4
from .questions_train import Q3_ARMS as V_ARMS, render_q3, render_q7, run_q3, run_q7

__all__ = ["main", "QUESTIONS", "render_open_questions"]

OUT = RESULTS / "questions"

# name -> (title, FusionOpt's question in one line, full run, quick run (tests), render)
QUESTIONS: dict[str, tuple[str, str, Callable[[], dict], Callable[[], dict], Callable[[dict], str]]] = {
    "q1": ("MONA's payoff against scale", "Does SF-NorMuon's small-scale dominance over MONA hold as models grow?",
           run_q1, lambda: run_q1(widths=(16, 32), seeds=1, steps=8, batch=4), render_q1),
    "q2": ("fp16 NS5: where it fails, and whether a rescale helps",
           "At what matrix size does fp16 NS5 NaN, and does a fused rescale change the picture?",
           run_q2_with_training,
           lambda: run_q2_with_training(sizes=(64, 128), scales=(1e-8, 1.0, 1e4), real_max=64,
                                        train={"tasks": ("digits",), "steps": 3}),
           render_q2_all),
    "q3": ("Does 'Full Fusion survives negative losses' generalise?",
           "AdamW NaNs, SF-NorMuon goes incoherent, warm Full Fusion stays structured — on another architecture?",
           run_q3, lambda: run_q3(seeds=1, steps=10, ref_steps=10, arms={k: V_ARMS[k] for k in ("AdamW", "Full")}),
           render_q3),
    "q4": ("Depth vs width shrink on a DiT-style model", "Is depth the cheaper axis to cut FLOPs?",
           run_q4, lambda: run_q4(seeds=1, steps=5), render_q4),
    "q5": ("Does the Polyak clamp saturate?", "Does γ float freely inside clamp(L̄/Ḡ, 0.1, 10)?",
           run_polyak, lambda: run_polyak(steps=20, ab_steps=5, ab_seeds=1), render_polyak),
    "q6": ("Cache invalidation under weight swaps",
           "Does a data_ptr-keyed cache notice eval()/train() swaps, external EMA weights, load_state_dict?",
           run_q6, lambda: run_q6(train_steps=2), render_q6),
    "q7": ("Muon on 4-D conv kernels by reshape", "Does reshaping (out, in, kh, kw) → (out, in·kh·kw) work?",
           run_q7, lambda: run_q7(seeds=1, steps=6, tune_steps=4, lrs=(1e-3, 1e-2), width=4), render_q7),
    "q8": ("Schedule-free under ≥16 micro-batches of gradient accumulation", "Do curves stay normal?",
           run_q8, lambda: run_q8(micro=(1, 4, 16), steps=4, seeds=(0,)), render_q8),
    "claims": ("FusionOpt's claims", "fp16 NS5 NaNs above ~256²; KL-Shampoo alone diverges; AdamW + diversity NaNs",
               run_shampoo_alone, lambda: run_shampoo_alone(steps=5, seeds=1, lrs=(3e-3,)), render_shampoo_alone),
}

ALIASES = {"polyak": "q5"}


def _command(name: str) -> str:
    return f"python -m experiments questions {name}"


def _plot(name: str, data: dict[str, Any], path: Path) -> None:
    """One PNG per question (the tables carry the numbers; the plots show their shape)."""
    if name == "q5":
        return plot_polyak(data, path)
    fig, ax = new_figure()
    a = ax[0, 0]
    if name == "q1":
        for arm in dict.fromkeys(r["arm"] for r in data["runs"]):
            rs = [r for r in data["runs"] if r["arm"] == arm]
            ws = sorted({r["width"] for r in rs})
            a.plot(ws, [sum(r["val_loss"] for r in rs if r["width"] == w) / max(1, sum(r["width"] == w for r in rs))
                        for w in ws], marker="o", label=arm)
        a.set(xscale="log", xlabel="width d", ylabel="val loss")
    elif name == "q2":
        for impl in ("naive", "fp16", "fp16_safe"):
            ok = [sum(r[impl]["stage"] == "ok" for r in data["rows"] if r["n"] == n) for n in data["sizes"]]
            a.plot(data["sizes"], ok, marker="o", label=impl)
        a.set(xscale="log", xlabel="n (n×n)", ylabel="(input, scale) cases that came out fine")
    elif name == "q4":
        for r in data["runs"]:
            a.scatter(r["flops"], r["val_mse"], label=r["config"] if r["seed"] == 0 else None)
        a.set(xlabel="forward FLOPs / sample", ylabel="val velocity MSE")
    elif name == "q8":
        for o, runs in data["runs"].items():
            for k, rs in runs.items():
                a.plot(rs[0]["curve"], label=f"{o} ×{k}", alpha=0.7)
        a.set(xlabel=f"eval point (seed {data['config']['seeds'][0]})", ylabel="val loss")
    elif name in ("q3", "q7", "claims"):
        rs = (data["runs"] if isinstance(data["runs"], list)
              else [dict(arm=k, **r) for k, v in data["runs"].items() for r in v])
        arms = list(dict.fromkeys(r["arm"] for r in rs))
        key = {"q3": "agree_ref", "claims": "value"}.get(name)
        vals = [[(r[key] if key else r["final"]["val_err"]) for r in rs if r["arm"] == arm] for arm in arms]
        a.bar(range(len(arms)), [sum(v) / len(v) for v in vals])
        a.set_xticks(range(len(arms)), arms, rotation=45, ha="right", fontsize=7)
        a.set(ylabel={"q3": "agreement with reference %", "claims": "final metric"}.get(name, "val err %"))
    elif name == "q6":
        evs = data["events"]
        for j, c in enumerate(data["caches"]):
            a.bar([i + 0.25 * j for i in range(len(evs))], [e[c]["max_abs_err"] for e in evs], width=0.25, label=c)
        a.set(ylabel="max |cached − fresh|")
    if a.get_legend_handles_labels()[0]:
        a.legend(fontsize=6)
    a.set_title(QUESTIONS[name][0], fontsize=9)
    save_figure(fig, path)


def run_one(name: str, *, quick: bool = False, out: Path = OUT) -> dict[str, Any]:
    t0 = time.perf_counter()
    data = (QUESTIONS[name][3] if quick else QUESTIONS[name][2])()
    data["wall_s"] = time.perf_counter() - t0
    data["quick"] = quick
    data["threads"] = torch.get_num_threads()
    write_json(out / f"{name}.json", data)
    _plot(name, data, out / f"{name}.png")
    print(f"[questions] {name}: {data['wall_s']:.1f} s → {out / (name + '.json')}")
    return data


def render_open_questions(out: Path = OUT) -> str:
    runs = [read_json(out / f"{name}.json") for name in QUESTIONS]
    threads = sorted({d["threads"] for d in runs if d and "threads" in d})
    scale = f"CPU scale, {'/'.join(map(str, threads))} torch thread(s)" if threads else "CPU scale"
    parts = ["# FusionOpt's open questions, measured",
             "FusionOpt (Taikakim/fusion-optimiser, docs/open_questions.md) lists eight open questions. "
             f"Below, each one as an experiment at {scale}, with the command, the numbers rendered from "
             "`results/questions/<q>.json`, and a verdict. Everything here is generated by "
             "`python -m experiments questions --render-only`."]
    for name in [f"q{i}" for i in range(1, 9)] + ["claims"]:
        title, question, *_, render = QUESTIONS[name]
        data = read_json(out / f"{name}.json")
        head = f"## {name.upper() if name != 'claims' else 'Claims'} — {title}\n\n*FusionOpt:* {question}\n\n" \
               f"Command: `{_command(name)}`" + (" (same as `questions polyak`)" if name == "q5" else "")
        if data is None:
            parts.append(head + "\n\n**Not run yet.**")
            continue
        body = render(data)
        note = f"\n\nRun took {data['wall_s']:.0f} s" + (" (quick smoke settings)" if data.get("quick") else "") + \
               f". Plot: `results/questions/{name}.png`."
        if name in V.VERDICTS:
            body += "\n\n" + V.VERDICTS[name](data)
        else:
            q2, q3 = read_json(out / "q2.json"), read_json(out / "q3.json")
            body = ("- **NS5 in fp16 NaNs above ~256×256.** " + (V.claim_ns5_fp16(q2) if q2 else "(run q2)") +
                    "\n- **AdamW with a diversity penalty NaNs.** " +
                    (V.claim_adamw_diversity(q3) if q3 else "(run q3)") +
                    "\n- **KL-Shampoo alone diverges.** " + V.claim_shampoo_alone(data) + "\n\n" + body)
        if name == "q2":  # its GPU part comes from the kernels experiment
            body += V.q2_gpu(read_json(out.parent / "kernels.json"))
        parts.append(head + "\n\n" + body + note)
    return "\n\n".join(parts) + "\n"


def polyak_section(pol: dict[str, Any]) -> str:
    """RESULTS.md's Polyak section from q5's JSON (q5 is the Polyak instrumentation)."""
    return ("Command: `python -m experiments questions polyak` (JSON `results/questions/q5.json`, plot "
            "`results/questions/q5.png`).\n\n" + render_polyak(pol) + "\n\n" + V.v_q5(pol))


def write_markdown(out: Path = OUT, results_md: Path | str = ROOT / "RESULTS.md") -> None:
    """OPEN_QUESTIONS.md (beside ``results_md``) whole, and ``results_md``'s Polyak section."""
    results_md = Path(results_md)
    (results_md.parent / "OPEN_QUESTIONS.md").write_text(render_open_questions(out))
    pol = read_json(out / "q5.json")
    if pol is not None:
        replace_section(results_md, "polyak", polyak_section(pol), title="Polyak instrumentation (issue 6)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments questions", description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", help="q1 … q8, claims, polyak (default: all)")
    ap.add_argument("--render-only", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny settings (smoke tests); results marked quick")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--results-md", default=str(ROOT / "RESULTS.md"),
                    help="RESULTS.md to update (OPEN_QUESTIONS.md beside it); '' to skip rendering")
    ap.add_argument("--no-markdown", action="store_true", help="the same as --results-md ''")
    args = ap.parse_args(argv)
    out = Path(args.out)
    names = [ALIASES.get(n, n) for n in (args.names or list(QUESTIONS))]
    unknown = [n for n in names if n not in QUESTIONS]
    if unknown:
        print(f"unknown question(s) {unknown}; choose from {list(QUESTIONS)} or polyak")
        return 2
    if not args.render_only:
        torch.set_num_threads(args.threads)
        t0 = time.perf_counter()
        for n in names:
            run_one(n, quick=args.quick, out=out)
        print(f"[questions] total {time.perf_counter() - t0:.0f} s")
    if args.results_md and not args.no_markdown:
        write_markdown(out, args.results_md)
    else:
        print(render_open_questions(out))
    return 0
