"""The RESULTS.md table of ``python -m experiments overhead`` (experiments/overhead.py measures; this renders
its JSON, for a run or for ``python -m experiments render``).

The verdict is the issue's target on the device the run used: on CPU repair ≤ +2% of the optimizer step
(paired median, or the fresh-process controls' median where a row has them), on a GPU ≤ 0.3% of a whole
training step. A median whose quartiles straddle the target is said to be unresolved beside the verdict,
never hidden behind it: a table row's quartiles over rounds, a controlled row's over its builds (since
2026-11-28: SFAdamW's builds straddle it on both CPUs published).
"""
from __future__ import annotations

from typing import Any

from experiments.overhead_controls import builds_unresolved, overhead_pct, spread
from experiments.overhead_controls import render as render_controls
from experiments.questions_io import at_commit


def paired_quartiles(data: dict[str, Any], name: str) -> tuple[float, float]:
    """First and third quartile of the per-round repair/off step ratios, from the raw timings."""
    raw = data["raw_ms"]["step"]
    s = spread(raw[f"{name} | repair"], raw[f"{name} | off"])
    return s["q1"], s["q3"]


def render(data: dict[str, Any]) -> str:
    m, s = data["machine"], data["settings"]
    gpu = data["device"] != "cpu"
    where = (f"GPU {data['device']}" if gpu else
             f"{m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads")
    json_path = data.get("json", "results/overhead.json")
    lines = [f"Command: `{data['command']}` (JSON: `{json_path}`), measured {m['date']}{at_commit(m)} on "
             f"{where}, torch {m['torch']}; load average {m['loadavg_start'][0]:.1f} → "
             f"{m['loadavg_end'][0]:.1f}.",
             f"Clean steps only. GPT-like d={data['model']['d']}, {data['model']['layers']} layers"
             + (f" ({data['model']['params'] / 1e6:.1f}M parameters)" if "params" in data["model"] else "")
             + f", batch "
             f"{data['model']['batch']}×{data['model']['ctx']} tokens; {s['warmup']} warm-up, {s['rounds']} "
             f"interleaved rounds; each sample times enough steps back to back for about {s['sample_ms']:g} ms "
             f"(optimizer step: {min(s['inner_step'].values())}–{max(s['inner_step'].values())} steps; training "
             f"step: {min(s['inner_train_step'].values())}–{max(s['inner_train_step'].values())}); the repair and "
             "off arms of an optimizer run back to back (paired ratio = median over rounds of repair/off)"
             + (". **Design (changed 2026-11-24):** each row's two arms are one optimizer (and, for the training "
                "step, one model) whose policy is switched between samples, so both step the very same tensors; "
                "until then each arm was built separately, a design whose own error the A/A control below shows."
                if s.get("design") == "same tensors" else ".")
             + (" **Changed 2026-11-26:** each sample starts with one untimed step under its arm's policy (for "
                "the training step: an optimizer step): the first \"repair\" step after \"off\" steps folds "
                "them into the counters (`Resolution.pass_clean_steps`), the switch's cost, which a run under "
                "one policy never pays; until then the repair arm's first timed step of every sample paid it."
                if s.get("settled") else ""),
             "The spread column gives the middle half (quartiles) of the per-round paired step ratios: how "
             "far one run of this table can move on this machine.",
             "", "| optimizer | step off ms | step repair ms | step ratio (paired) | paired spread | "
             "train step off ms | train ratio (paired) | step overhead / train step |",
             "|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        a, b = r["step"], r["train_step"]
        q1, q3 = paired_quartiles(data, r["optimizer"])
        lines.append(f"| {r['optimizer']} | {a['off_ms']:.2f} | {a['repair_ms']:.2f} | "
                     f"{a['ratio_of_medians']:.3f} ({a['median_paired_ratio']:.3f}) | {q1:.3f}–{q3:.3f} | "
                     f"{b['off_ms']:.1f} | "
                     f"{b['ratio_of_medians']:.3f} ({b['median_paired_ratio']:.3f}) | "
                     f"{100 * r['overhead_share_of_train_step']:+.2f}% |")
    defaults = data.get("default_rows", {})
    if gpu:
        share = {r["optimizer"]: r["overhead_share_of_train_step"] for r in data["rows"]}
        label = {n: f"{n} ({100 * x:+.2f}%)" for n, x in share.items()}
        ok = {n: x <= 0.003 for n, x in share.items()}
    else:
        # a row with a control is judged on it (fresh processes, many builds), not on its table line
        ctrl = {c["optimizer"]: c["same_tensors"]["median"] for c in data.get("controls", [])}
        ratio = {r["optimizer"]: ctrl.get(r["optimizer"], r["step"]["median_paired_ratio"]) for r in data["rows"]}
        limit = data["targets"]["cpu_step_ratio_max"]  # (as the controls' verdict below reads it)
        ok = {n: x <= limit for n, x in ratio.items()}
        # a median under the target whose upper quartile is over it — or over it with its lower quartile
        # under it —, with no fresh-process control, is a median the table's own noise does not resolve:
        # said beside the verdict, not hidden behind it (either way: until 2026-11-26 only a met one was)
        quart = {n: paired_quartiles(data, n) for n in ratio if n not in ctrl}
        loose = {n: (f", upper quartile {q3:.3f}: not resolved" if ok[n] else
                     f", lower quartile {q1:.3f}: not resolved")
                 for n, (q1, q3) in quart.items() if (q3 > limit if ok[n] else q1 <= limit)}
        # a controlled row whose builds' middle half straddles the target: said too (builds_unresolved)
        loose.update({c["optimizer"]: f", {note}" for c in data.get("controls", [])
                      if (note := builds_unresolved(c, limit))})
        label = {n: f"{n} ({overhead_pct(x, limit)}{', controls' if n in ctrl else ''}{loose.get(n, '')})"
                 for n, x in ratio.items()}

    def verdict(rows: list[dict[str, Any]]) -> str:
        miss = [label[r["optimizer"]] for r in rows if not ok[r["optimizer"]]]
        met = [label[r["optimizer"]] for r in rows if ok[r["optimizer"]]]
        # every label, also when all are met: a met median's "not resolved" note must not vanish with it
        return (f"{'met by every one: ' + ', '.join(met) if not miss else 'met by ' + (', '.join(met) or 'none')}"
                f"{'' if not miss else '; MISSED by ' + ', '.join(miss)}")

    ours = [r for r in data["rows"] if r["optimizer"] in defaults]
    rest = [r for r in data["rows"] if r["optimizer"] not in defaults]
    if gpu:
        lines.append("\nTarget (GPU): repair overhead ≤ 0.3% of a training step. "
                     + (f"**Each optimizer as constructed by default**: {verdict(ours)}."
                        + (f" Other rows: {verdict(rest)}." if rest else "") if ours else f"{verdict(data['rows'])}."))
    else:
        lines.append("\nTarget (CPU): repair ≤ +2% of the optimizer step (paired median; rows marked \"controls\": "
                     "the same-tensor controls below, over fresh processes). "
                     + (f"**Each optimizer as constructed by default** (the impl auto runs here, the default "
                        f"spike guard): {verdict(ours)}."
                        + (f" Other rows (non-default impl or guard setting): {verdict(rest)}." if rest else "")
                        if ours else f"{verdict(data['rows'])}.")
                     + " No GPU in this run: the GPU target (≤ 0.3% of a training step) was not measured.")
    if "auto_runs" in data:
        guard = ", ".join(f"{k.partition(' (')[0]}: {'None' if v is None else f'{v:g}'}"
                          for k, v in data.get("default_rows", {}).items())
        runs = data["auto_runs"]
        if not isinstance(runs, str) and len(set(runs.values())) == 1:
            runs = next(iter(runs.values()))
        which = (f"the \"({runs})\" rows" if isinstance(runs, str) else
                 "the rows " + ", ".join(f"{c} ({i})" for c, i in runs.items()))
        lines.append(f"\nThe default, `impl=\"auto\"`, runs {which} here. Each row runs "
                     f"the optimizer's default spike guard unless it names one (defaults — {guard}); the "
                     "`spike_factor=10` rows of the AdamW family price the opt-in guard's extra read of g.")
    if data.get("size_sweep"):
        b = data["bytes_per_entry"]
        same = data["size_sweep"][0].get("design") == "same tensors"
        how = (" One optimizer whose policy and guard are switched between samples, so every arm steps the "
               "same tensors; off / off is that design's A/A (its distance from 1.000 is the noise)." if same else
               " Each arm is a separately built optimizer.")
        lines += ["", "**AdamW (fused) by tensor size** — one fp32 tensor, clean steps, paired ratios against "
                  f"\"off\".{how} The step must move {b['step']} bytes per entry; the opt-in spike guard's "
                  f"pre-pass reads g once more ({b['with_guard']} bytes, ×{b['with_guard'] / b['step']:.3f}), "
                  "which costs nothing only while g is still cached when the update re-reads it.", "",
                  "| entries | p, g, m, v MiB | off ms | off / off (A/A) | repair (default) / off | "
                  "repair, spike_factor=10 / off |", "|---|---|---|---|---|---|"]
        for r in data["size_sweep"]:
            aa = f"{r['aa_paired_ratio']:.3f}" if "aa_paired_ratio" in r else "—"
            lines.append(f"| {r['entries']:,} | {r['state_mib']:.1f} | {r['off_ms']:.3f} | {aa} | "
                         f"{r['repair_paired_ratio']:.3f} | {r['repair_guard_paired_ratio']:.3f} |")
    if data.get("controls"):
        lines += render_controls(data["controls"], data["targets"]["cpu_step_ratio_max"], 2 * s["rounds"])
    return "\n".join(lines)
