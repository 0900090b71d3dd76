"""``python -m experiments sync-audit`` — where a CUDA ``step()`` talks to the host, and how many launches it makes.

Issue 3 promises "nothing in ``step()`` synchronises with the host" and a resolution step that costs nothing
measurable on a GPU. Two things decide that on CUDA, and a CPU machine can see neither:

* **host syncs**: ``torch.cuda.set_sync_debug_mode("warn")`` makes torch warn at every synchronising call
  (``.item()``, a pageable host→device copy, ``nonzero``...). The warning is raised from inside the
  offending Python call, so capturing the stack there names the line in this library that caused it. The
  first step (state creation) and later steps are audited separately: both run inside ``step()``.
* **launch count**: eager optimizer code on a GPU is bound by the host issuing kernels (each ``aten`` op on
  a small tensor costs several microseconds of CPU time however little the GPU does), so the number of
  kernels ``step()`` launches — under "repair" and "off", one optimizer whose policy is switched, as in
  ``experiments/overhead.py`` — is what the resolution step's overhead on a GPU is made of.

And **host time** (``experiments/host_profile.py``): per policy, the time to issue one step, the Triton
launches' share of it, and the functions that cost the rest — what the launch count turns into.

Output: ``results/sync_audit.json`` (or ``--out``) and its table in RESULTS.md ("sync-audit"; ``--results-md
''`` skips it). Without CUDA it says so and exits 0, writing nothing.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

from experiments.host_profile import function_diff, host_profile, triton_summary
from experiments.questions_io import ROOT, at_commit, checkout_commit, env_prefix, publish

JSON_PATH = ROOT / "results" / "sync_audit.json"


def _library_frame(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame inside nonans_optim (else the innermost frame) as ``path:line function``."""
    for frame in reversed(stack):
        if "nonans_optim" in frame.filename:
            name = frame.filename[frame.filename.rfind("nonans_optim"):]
            return f"{name}:{frame.lineno} {frame.name}"
    frame = stack[-1]
    return f"{frame.filename}:{frame.lineno} {frame.name}"


def syncs_of(fn) -> collections.Counter:
    """{library frame: count} of the synchronising CUDA calls ``fn()`` makes."""
    sites: collections.Counter = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing CUDA operation" in str(message):  # (not the "prototype feature" notice)
            sites[_library_frame(traceback.extract_stack()[:-1])] += 1

    old = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = old
    return sites


def launches_of(fn) -> dict[str, Any]:
    """Kernels launched and host time of one ``fn()``, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    launches = memcpy = 0
    ops: collections.Counter = collections.Counter()
    for e in prof.key_averages():
        if "LaunchKernel" in e.key:
            launches += e.count
        elif "Memcpy" in e.key and e.key.startswith("cuda"):
            memcpy += e.count
        elif e.key.startswith("aten::"):
            ops[e.key] = e.count
    return {"launches": launches, "memcpy_calls": memcpy, "top_aten": ops.most_common(12)}


def run(steps: int = 3, defaults_only: bool = False, host_steps: int = 10) -> dict[str, Any]:
    from experiments._models import DEFAULT, build_gpt, synthetic_grads
    from experiments.overhead import OPTIMIZERS, auto_runs, default_rows
    from experiments.overhead_controls import build_optimizer, switched

    device = torch.device("cuda")
    base = build_gpt(DEFAULT, device=device)
    grads = synthetic_grads(base)
    rows = []
    names = default_rows(auto_runs(device)) if defaults_only else OPTIMIZERS
    for name in names:
        make = OPTIMIZERS[name]
        opt = build_optimizer(base, grads, make, "repair")
        row: dict[str, Any] = {"optimizer": name, "first_step_syncs": dict(syncs_of(opt.step))}
        for _ in range(steps):
            opt.step()
        torch.cuda.synchronize()
        row["later_step_syncs"] = dict(syncs_of(opt.step))
        for policy in ("repair", "off"):
            step = switched(opt, policy, opt.spike_factor)
            step()  # a policy change logs once: keep it out of the profile
            row[policy] = launches_of(step)
            if host_steps:
                row[policy]["host"] = host_profile(step, steps=host_steps, repeats=3, device=device)
        rows.append(row)
        print(f"{name:34s} syncs first/later {sum(row['first_step_syncs'].values()):3d} / "
              f"{sum(row['later_step_syncs'].values()):3d}   launches repair {row['repair']['launches']:5d} "
              f"off {row['off']['launches']:5d}" + (f"   host us/step repair {row['repair']['host']['host_us']:.0f} "
                                                   f"off {row['off']['host']['host_us']:.0f}" if host_steps else ""),
              flush=True)
        for site, n in sorted({**row["first_step_syncs"], **row["later_step_syncs"]}.items()):
            print(f"    sync x{n}: {site}")
    return {"command": env_prefix() + "python -m experiments sync-audit" + (" --defaults" if defaults_only else "")
            + (f" --host-steps {host_steps}" if host_steps != 10 else ""),
            "device": torch.cuda.get_device_name(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "commit": checkout_commit(), "torch": torch.__version__, "rows": rows}


def render(data: dict[str, Any]) -> str:
    """The RESULTS.md section of one audit (from its JSON; nothing typed by hand)."""
    # (the date since 2026-11-25: which code a count belongs to is in the session notes of that day)
    when = f", measured {data['date']}{at_commit(data)}" if "date" in data else ""
    lines = [f"Command: `{data['command']}` (JSON: `{data.get('json', 'results/sync_audit.json')}`) on "
             f"{data['device']}, torch "
             f"{data['torch']}{when}. "
             + ("Each optimizer as constructed by default (`impl=\"auto\"`)" if "--defaults" in data["command"] else
                "Each optimizer of the overhead experiment") + " on its GPT, synthetic gradients: host "
             "syncs that `torch.cuda.set_sync_debug_mode(\"warn\")` reports inside `step()` (the first step, "
             "which creates the state, and a later one), and the kernels one later step launches (torch.profiler) "
             "under \"repair\" and \"off\" — one optimizer whose policy is switched, as in the overhead table.",
             "", "| optimizer | syncs, first step | syncs, later step | launches repair | launches off | "
             "sync sites |", "|---|---|---|---|---|---|"]
    for r in data["rows"]:
        sites = {**r["first_step_syncs"], **r["later_step_syncs"]}
        where = "; ".join(f"`{s}` ×{n}" for s, n in sorted(sites.items())) or "—"
        lines.append(f"| {r['optimizer']} | {sum(r['first_step_syncs'].values())} | "
                     f"{sum(r['later_step_syncs'].values())} | {r['repair']['launches']} | {r['off']['launches']} "
                     f"| {where} |")
    hosted = [r for r in data["rows"] if "host" in r["repair"]]
    if hosted:
        lines += _render_host(hosted)
    return "\n".join(lines)


def _render_host(rows: list[dict[str, Any]]) -> list[str]:
    """The host-time table (experiments/host_profile.py) and, for the first row, the functions whose own
    time "repair" adds."""
    steps = rows[0]["repair"]["host"]["steps"]
    lines = ["", f"**Host time of a step** (`experiments/host_profile.py`; {steps} steps per sample, best of 3): "
             "the time to issue one step, no device sync inside the timed loop — on a host-bound step, what the "
             "step costs; Triton launches per step and the host time they take (Triton's `run`: binding, "
             "specialisation, cache lookup, driver call).", "",
             "| optimizer | host µs/step repair | host µs/step off | repair − off µs | Triton launches repair / off "
             "| Triton host µs/step repair / off | µs per Triton launch (repair) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        rep, off = r["repair"]["host"], r["off"]["host"]
        (n_r, t_r), (n_o, t_o) = triton_summary(rep), triton_summary(off)
        per = f"{t_r / n_r:.1f}" if n_r else "—"
        lines.append(f"| {r['optimizer']} | {rep['host_us']:.0f} | {off['host_us']:.0f} | "
                     f"{rep['host_us'] - off['host_us']:+.0f} | {n_r:g} / {n_o:g} | {t_r:.0f} / {t_o:.0f} | {per} |")
    first = rows[0]
    diff = function_diff(first["repair"]["host"], first["off"]["host"])
    if diff:
        lines += ["", f"Where \"repair\" adds host time in {first['optimizer']}: own time per step under cProfile "
                  "(profiled, so read the shares), the functions that grew most.", "",
                  "| function | own µs/step repair | own µs/step off |", "|---|---|---|"]
        lines += [f"| `{name}` | {a:.1f} | {b:.1f} |" for name, a, b in diff]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments sync-audit", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=JSON_PATH, help=f"JSON path (default {JSON_PATH})")
    ap.add_argument("--results-md", default=str(ROOT / "RESULTS.md"), help="'' to skip rendering")
    ap.add_argument("--defaults", action="store_true",
                    help="only each optimizer's default configuration (no torch.compile'd rows: much faster)")
    ap.add_argument("--host-steps", type=int, default=10,
                    help="steps per host-time sample (experiments/host_profile.py; 0: no host profile)")
    ap.add_argument("--render-only", action="store_true", help="re-render RESULTS.md from the JSON at --out")
    args = ap.parse_args(argv)
    if args.render_only:
        data = json.loads(args.out.read_text())
    elif not torch.cuda.is_available():
        print("sync-audit: no CUDA device here; nothing to audit.")
        return 0
    else:
        data = run(defaults_only=args.defaults, host_steps=args.host_steps)
    publish(data, args.out, render(data), args.results_md, "sync-audit", "Host syncs and launches on a GPU (issue 3)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
