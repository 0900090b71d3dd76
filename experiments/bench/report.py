"""Everything rendered from the benchmark JSON: derived comparisons, the RESULTS.md section, the plots.

Nothing here is typed by hand: :func:`compare` derives the per-workload comparison from the arm records,
:func:`render_markdown` turns it into a table, :func:`plot` draws the loss curves with events marked.
"""
from __future__ import annotations

import math
from pathlib import Path

from experiments.questions_io import at_commit, replace_section

__all__ = ["compare", "render_markdown", "write_results_section", "plot"]


def _fmt(x, digits: int = 3) -> str:
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "**no**"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def compare(records: dict[str, dict[str, dict]], overhead: dict[str, dict]) -> dict[str, dict]:
    """Per workload: the headline comparison derived from the arm records.

    compute recovered vs rollback (%) = (steps rollback lost − steps nonans lost) / steps rollback lost.
    continuity = max |after/before − 1| of the moment-buffer norm over the resolved steps."""
    out = {}
    for key, arms in records.items():
        base, rb, ours = arms.get("baseline"), arms.get("rollback"), arms.get("nonans")
        row = dict(baseline_completed=base and base["completed"],
                   baseline_first_nonfinite=base and base["first_nonfinite_step"],
                   baseline_nonfinite_losses=base and base.get("nonfinite_loss_steps"),
                   # failed: died, or its forward pass produced a non-finite loss (GradScaler then skips
                   # those steps; a skip from GradScaler's own scale calibration alone is not a failure)
                   baseline_failed=bool(base) and (not base["completed"] or base.get("nonfinite_loss_steps", 0) > 0),
                   clean_metric=arms.get("clean", {}).get("final_metric"),
                   baseline_metric=base and base["final_metric"],
                   rollback_completed=rb and rb["completed"], rollback_lost=rb and rb["steps_lost"],
                   nonans_completed=ours and ours["completed"], nonans_metric=ours and ours["final_metric"],
                   nonans_events=ours and ours["events_total"], nonans_lost=ours and ours["steps_lost"],
                   off_completed=arms.get("nonans_off", {}).get("completed"))
        if rb and ours and rb["steps_lost"]:
            row["compute_recovered_pct"] = 100.0 * (rb["steps_lost"] - ours["steps_lost"]) / rb["steps_lost"]
        else:
            row["compute_recovered_pct"] = None
        jumps = [abs(c["after"] / c["before"] - 1.0) for c in (ours or {}).get("continuity", [])
                 if c["before"] and math.isfinite(c["after"])]
        row["continuity_max_rel_change"] = max(jumps) if jumps else None
        row["overhead_ratio"] = overhead.get(key, {}).get("ratio")
        row["peers_completed"] = {a[len("peer_"):]: r["completed"] for a, r in arms.items() if a.startswith("peer_")}
        out[key] = row
    return out


def _outcome(row: dict, wl: dict) -> str:
    """What the row says against the workload's premise and its baseline, derived from the numbers: a
    "claimed:" hazard the stock arm survived is refuted at this size, and where the baseline completed, which
    arm ended with the better metric (lower is better) — a workload where repair ends worse is published as
    such."""
    parts = []
    if wl["cause"].startswith("claimed:") and row["baseline_completed"] and row["baseline_first_nonfinite"] is None:
        parts.append("the claim is refuted at this size: the stock arm completed without a non-finite step")
    b, n = row["baseline_metric"], row["nonans_metric"]
    if row["baseline_completed"] and isinstance(b, float) and isinstance(n, float) and math.isfinite(b) \
            and math.isfinite(n) and b > 0:
        word = "better" if n < b else "worse" if n > b else "the same"
        parts.append(f"nonans ended {word} than the completed baseline ({_fmt(n)} vs {_fmt(b)}, "
                     f"{100 * (n / b - 1):+.0f}%)")
    return f" **Outcome:** {'; '.join(parts)}." if parts else ""


def render_markdown(results: dict) -> str:
    """The RESULTS.md section for a bench JSON (``results/bench.json``)."""
    m, cmp_ = results["machine"], results["compare"]
    lines = [
        "## Singularity benchmark (`python -m experiments bench`)", "",
        (f"Measured {m['date']}{at_commit(m)}. " if "date" in m else "")
        + f"Machine: {m['cpu'] + ', ' if 'cpu' in m else ''}{m['platform']}, {m['cpu_count']} CPUs, torch "
        f"{m['torch']}, size `{results['size']}`, "
        f"seed {results['seed']}, wall time {results['wall_s']:.0f} s. Peers: "
        + ", ".join(f"{k} ({v})" for k, v in results["peers"].items()) + ".", "",
        "| workload | baseline completes | baseline: 1st non-finite step / non-finite losses | clean ref | baseline "
        "| nonans completes | nonans metric | events | steps lost: rollback / nonans | compute recovered | "
        "moment-norm jump | overhead (repair/off) | peers completed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, row in cmp_.items():
        wl = results["workloads"][key]
        lines.append("| " + " | ".join([
            f"{wl['title']}", _fmt(row["baseline_completed"]),
            f"{_fmt(row['baseline_first_nonfinite'])} / {_fmt(row.get('baseline_nonfinite_losses'))}",
            _fmt(row["clean_metric"]), _fmt(row["baseline_metric"]), _fmt(row["nonans_completed"]),
            _fmt(row["nonans_metric"]), _fmt(row["nonans_events"]),
            f"{_fmt(row['rollback_lost'])} / {_fmt(row['nonans_lost'])}",
            "—" if row["compute_recovered_pct"] is None else f"{row['compute_recovered_pct']:.0f}%",
            _fmt(row["continuity_max_rel_change"], 2),
            "—" if row["overhead_ratio"] is None else f"{row['overhead_ratio']:.2f}x",
            ", ".join(f"{k} {_fmt(v)}" for k, v in row.get("peers_completed", {}).items()) or "—"]) + " |")
    lines += ["", "Metrics are lower-is-better, in fp32 on held-out data; the metric and cause per workload:", ""]
    for key, wl in results["workloads"].items():
        note = f" {wl['notes']}." if wl.get("notes") else ""
        outcome = _outcome(cmp_[key], wl) if key in cmp_ else ""
        lines.append(f"- **{wl['title']}** ({wl['metric']}; guards: {wl['guards']}): {wl['cause']}.{note}{outcome}")
    lines += ["", "Baseline = stock optimizer + guards; it *completes* when it reaches the last step with finite "
              "parameters and metric (GradScaler completes by skipping steps: those count as steps lost). "
              "Non-finite losses = steps whose forward pass itself overflowed (a GradScaler run with many of "
              "them has stopped learning even though it 'completes'; a 1st non-finite step with 0 of them is "
              "GradScaler's scale calibration). "
              "Rollback checkpoints every K steps and restores on a non-finite loss or parameter. "
              "Moment-norm jump = max |after/before − 1| of the exp_avg/momentum norm across resolved steps. "
              "Plots: `results/bench_<workload>.png`.", ""]
    return "\n".join(lines)


def write_results_section(markdown: str, path: str) -> None:
    """Replace the text between the bench markers of ``path`` (the experiments' one marker writer)."""
    replace_section(Path(path), "bench", markdown)


def plot(key: str, title: str, arms: dict[str, dict], path: str) -> None:
    """Loss curves of every arm; nonans events as dots, the baseline's first non-finite step as a cross."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, rec in arms.items():
        xs = [i for i, v in enumerate(rec["losses"]) if v is not None]
        ys = [rec["losses"][i] for i in xs]
        if ys:
            ax.plot(xs, ys, lw=1, label=f"{arm}{'' if rec['completed'] else ' (failed)'}")
        if arm == "nonans" and rec["event_steps"]:
            ev = [s for s in rec["event_steps"] if s < len(rec["losses"])]
            ax.scatter(ev, [0] * len(ev), marker="|", color="red", s=80, label="nonans events",
                       transform=ax.get_xaxis_transform(), clip_on=False)
        if arm == "baseline" and rec["first_nonfinite_step"] is not None:
            ax.axvline(rec["first_nonfinite_step"], color="black", ls=":", lw=1, label="baseline 1st non-finite")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
