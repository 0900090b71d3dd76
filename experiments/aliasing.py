"""``python -m experiments aliasing`` — the native (SF-)AdamW loop's time by where its four arrays sit
relative to each other in a 4 KiB page (issue 3).

Why it exists: the same-tensor controls of ``experiments overhead`` moved the repair/off ratio of one build
by several percent from one fresh process to the next (RESULTS.md, "overhead": 0.998–1.070 for AdamW), with
nothing changed but where the allocator put the tensors. A loop that streams p, g, m, v (SF: z) and stores
p, m, v can be slowed by *4K aliasing*: a load whose address matches an older, not yet completed store in its
low 12 bits is held behind that store, even though the full addresses differ. Whether that happens depends
on the arrays' offsets modulo 4096 — a stored array one or two cache lines ahead of a loaded one — which the
allocator decides, not the optimizer. This experiment fixes those offsets and times each layout.

Each layout is one 1M-entry fp32 tensor (default) whose parameter, gradient and two state buffers are
contiguous views placed at chosen byte offsets modulo 4096 (:data:`LAYOUTS`); one optimizer per layout,
its policy switched between "off" and "repair" between samples (same tensors); interleaved rounds; one
thread by default (the compute-bound case, where a stalled load costs most). A layout's time is the
minimum over rounds (the least disturbed sample of a shared machine: what the layout itself costs), the
repair/off ratio the median of the per-round paired ratios; each over ``--processes`` fresh processes
(median). ``--baseline JSON`` embeds an earlier run (another commit) to render beside this one.

Output: ``results/aliasing.json`` and the section between ``<!-- aliasing:begin/end -->`` in RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

import nonans_optim as no
from experiments.overhead_controls import spread, switched
from experiments.questions_io import checkout_commit, fmt, publish, read_json
from experiments.step_time import (ROOT, add_child_arguments, child_argv, inner_for, interleaved, machine_info,
                                   run_child)

__all__ = ["LAYOUTS", "page_view", "build", "run", "render", "main"]

PAGE = 4096
# name → (p, g, second state, v) byte offsets modulo PAGE; the second state is exp_avg (AdamW) or z (SFAdamW)
LAYOUTS: dict[str, tuple[int, int, int, int]] = {
    "aligned": (0, 0, 0, 0),
    "p 64 B ahead": (64, 0, 0, 0),
    "p 128 B ahead": (128, 0, 0, 0),
    "m/z 64 B ahead": (0, 0, 64, 0),
    "v 64 B ahead": (0, 0, 0, 64),
    "staggered 1 KiB": (0, 1024, 2048, 3072),
}
OPTIMIZERS = {"AdamW": no.AdamW, "SFAdamW": no.SFAdamW}
ENTRIES, QUICK_ENTRIES = 1 << 20, 1 << 12


def page_view(n: int, offset: int) -> torch.Tensor:
    """A contiguous fp32 tensor of ``n`` entries whose address is ``offset`` bytes past a page boundary
    (a view into a slightly larger buffer, which it keeps alive)."""
    if offset % 4 or not 0 <= offset < PAGE:
        raise ValueError(f"offset must be a multiple of 4 in [0, {PAGE}), got {offset}")
    buf = torch.empty(n + PAGE // 2, dtype=torch.float32)  # the start is at most 2 × (PAGE - 4) bytes in
    start = (-buf.data_ptr() % PAGE + offset) // 4
    return buf[start:start + n]


def build(cls, n: int, offsets: tuple[int, int, int, int], seed: int = 0) -> torch.optim.Optimizer:
    """``cls`` over one parameter of ``n`` entries with p, g and the two state buffers at ``offsets``
    (after one step, which creates the state, the buffers are moved into place with their values)."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(page_view(n, offsets[0]).copy_(torch.randn(n, generator=gen)))
    p.grad = page_view(n, offsets[1]).copy_(torch.randn(n, generator=gen) * 1e-2)
    opt = cls([p], lr=1e-3, impl="fused")
    opt.step()
    state = opt.state[p]
    second = "z" if "z" in state else "exp_avg"
    for key, off in ((second, offsets[2]), ("exp_avg_sq", offsets[3])):
        state[key] = page_view(n, off).copy_(state[key])
    got = [t.data_ptr() % PAGE for t in (p, p.grad, state[second], state["exp_avg_sq"])]
    if got != list(offsets):
        raise RuntimeError(f"layout not realised: wanted {offsets}, got {got}")
    return opt


def _measure(args) -> dict[str, Any]:
    """One process's rows: every (optimizer, layout), off and repair interleaved on the same tensors."""
    from nonans_optim import native
    torch.set_num_threads(args.threads)
    lib = native.library()
    if lib is None:
        return {"failure": native.failure(), "rows": []}
    n = QUICK_ENTRIES if args.quick else args.entries
    rows = []
    for name, cls in OPTIMIZERS.items():
        for layout, offsets in LAYOUTS.items():
            opt = build(cls, n, offsets)
            arms = {"off": switched(opt, "off"), "repair": switched(opt, "repair")}
            inner = inner_for(arms["off"], args.sample_ms)
            t = interleaved(arms, rounds=args.rounds, warmup=args.warmup, inner=inner, device=torch.device("cpu"))
            rows.append({"optimizer": name, "layout": layout, "offsets": list(offsets), "inner": inner,
                         "off_ms": 1e3 * min(t["off"]), "repair_ms": 1e3 * min(t["repair"]),
                         "repair_vs_off": spread(t["repair"], t["off"])["median"]})
    return {"simd_width": lib.nonans_simd_width(), "rows": rows}


def _child(args) -> dict[str, Any]:
    return run_child("experiments.aliasing", child_argv(args) + ["--entries", str(args.entries)])


def run(args) -> dict[str, Any]:
    runs = [_child(args) for _ in range(args.processes)]
    if not runs[0]["rows"]:
        raise RuntimeError(f"the native library is unavailable: {runs[0]['failure']}")
    rows = []
    for i, row in enumerate(runs[0]["rows"]):
        per = [r["rows"][i] for r in runs]
        rows.append({**{k: row[k] for k in ("optimizer", "layout", "offsets")},
                     **{k: statistics.median(r[k] for r in per) for k in ("off_ms", "repair_ms", "repair_vs_off")},
                     "repair_vs_off_low": min(r["repair_vs_off"] for r in per),
                     "repair_vs_off_high": max(r["repair_vs_off"] for r in per)})
    data = {"command": "python -m experiments aliasing" + (" --quick" if args.quick else ""),
            "machine": machine_info(), "commit": checkout_commit("nonans_optim/native"),
            "simd_width": runs[0]["simd_width"],
            "entries": QUICK_ENTRIES if args.quick else args.entries, "threads": args.threads,
            "rounds": args.rounds, "processes": args.processes, "rows": rows}
    if args.baseline:
        base = read_json(Path(args.baseline))
        if base is None:
            raise FileNotFoundError(f"--baseline {args.baseline}: no such JSON")
        data["baseline"] = {k: base[k] for k in ("command", "commit", "machine", "rows")}
    return data


def _relative(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, float]]:
    """Per (optimizer, layout): off and repair time over the same optimizer's aligned layout."""
    aligned = {r["optimizer"]: r for r in rows if r["layout"] == "aligned"}
    return {(r["optimizer"], r["layout"]): {"off": r["off_ms"] / aligned[r["optimizer"]]["off_ms"],
                                            "repair": r["repair_ms"] / aligned[r["optimizer"]]["repair_ms"]}
            for r in rows}


def render(data: dict[str, Any]) -> str:
    m, base = data["machine"], data.get("baseline")
    width = {0: "portable C", 256: "AVX2", 512: "AVX-512"}.get(data["simd_width"], str(data["simd_width"]))
    lines = [f"Command: `{data['command']}` (JSON: `results/aliasing.json`), commit {data['commit']}, measured "
             f"{m['date']} on {m['cpu']}, {data['threads']} torch thread(s), torch {m['torch']}; native build: "
             f"{width}. One fp32 tensor of {data['entries']:,} entries per layout; p, g, the second state (AdamW: "
             "exp_avg, SFAdamW: z) and exp_avg_sq placed at fixed byte offsets modulo 4096; off and repair "
             f"switched on the same tensors, {data['rounds']} interleaved rounds, {data['processes']} fresh "
             "process(es). Times: the minimum over rounds (median over processes); ratio to aligned: the same "
             "policy's time on the aligned layout; repair / off: median of the paired per-round ratios (median "
             "over processes, lowest–highest)."]
    if base:
        lines.append(f"Before: the same command on commit {base['commit']} (measured {base['machine']['date']}), "
                     "embedded in the JSON with `--baseline`.")
    head = ("| optimizer | layout (p, g, m/z, v bytes) | off ms | off / aligned | repair ms | repair / aligned "
            "| repair / off |")
    rule = "|---|---|---|---|---|---|---|"
    if base:
        head += " before: off / aligned | before: repair / aligned | before: repair / off |"
        rule += "---|---|---|"
    lines += ["", head, rule]
    now = _relative(data["rows"])
    before = _relative(base["rows"]) if base else {}
    old = {(r["optimizer"], r["layout"]): r for r in base["rows"]} if base else {}
    for r in data["rows"]:
        key = (r["optimizer"], r["layout"])
        cells = [r["optimizer"], f"{r['layout']} ({', '.join(map(str, r['offsets']))})", fmt(r["off_ms"], 3),
                 fmt(now[key]["off"], 3), fmt(r["repair_ms"], 3), fmt(now[key]["repair"], 3),
                 f"{fmt(r['repair_vs_off'], 3)} ({fmt(r['repair_vs_off_low'], 3)}–{fmt(r['repair_vs_off_high'], 3)})"]
        if base:
            cells += [fmt(before[key]["off"], 3) if key in before else "—",
                      fmt(before[key]["repair"], 3) if key in before else "—",
                      fmt(old[key]["repair_vs_off"], 3) if key in old else "—"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for name in OPTIMIZERS:
        rel = {lay: v for (o, lay), v in now.items() if o == name}
        ratios = [r["repair_vs_off"] for r in data["rows"] if r["optimizer"] == name]
        if not rel:
            continue
        worst_off, worst_rep = max(rel, key=lambda k: rel[k]["off"]), max(rel, key=lambda k: rel[k]["repair"])
        text = (f"{name}: slowest layout {rel[worst_off]['off']:.3f}× aligned under off ({worst_off}), "
                f"{rel[worst_rep]['repair']:.3f}× under repair ({worst_rep}); repair / off "
                f"{min(ratios):.3f}–{max(ratios):.3f} across layouts")
        if base:
            brel = {lay: v for (o, lay), v in before.items() if o == name}
            bratios = [r["repair_vs_off"] for r in base["rows"] if r["optimizer"] == name]
            text += (f" (before: slowest {max(v['off'] for v in brel.values()):.3f}× under off, "
                     f"{max(v['repair'] for v in brel.values()):.3f}× under repair; repair / off "
                     f"{min(bratios):.3f}–{max(bratios):.3f})")
        lines.append(text + ".")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments aliasing", description=__doc__.split("\n")[0])
    add_child_arguments(ap, quick_help="4096 entries, 2 rounds, one process", sample_ms=20.0, threads=1,
                        processes_help="fresh processes")
    ap.add_argument("--entries", type=int, default=ENTRIES)
    ap.add_argument("--baseline", default=None, help="a JSON of this command from another commit, shown beside")
    ap.add_argument("--out", default=str(ROOT / "results" / "aliasing.json"))
    ap.add_argument("--results-md", default=str(ROOT / "RESULTS.md"), help="'' to skip rendering")
    args = ap.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 30)
    args.processes = args.processes or (1 if args.quick else 3)
    if args.child:
        print(json.dumps(_measure(args)))
        return 0
    data = run(args)
    publish(data, Path(args.out), render(data), args.results_md, "aliasing",
            "Native loop time by array offsets: 4K aliasing (issue 3)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
