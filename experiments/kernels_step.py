"""The optimizer-level fused (SF-)AdamW step on a GPU — part of ``python -m experiments kernels``:
``AdamW(impl="fused")`` (the multi-tensor Triton kernels) under "repair" and "off" against
``torch.optim.AdamW(fused=True)``, each arm's GPU time by kernel, and the same step at a few launch shapes.

Why the launch shapes: on an H200 (2026-11-26, RESULTS.md "kernels") ``AdamW(impl="fused")`` took about
twice as long under "repair" as under "off" on large tensors, and a gpt2-small training step took longer by
about its whole optimizer step ("overhead-gpu-gpt2-small"), while the one-tensor ``fused_adamw_`` repair
kernel streams at copy bandwidth. Compiled for sm_90, the gated update variant needs far more registers per
thread than "off" (``kernels/_multi.py``, "packed counts"), so at the one launch shape every elementwise
kernel shares (``kernels/_elementwise.py::elementwise_block``, 2048 entries x 8 warps) fewer of its blocks
fit on an SM. This sweep times the optimizer step at a few shapes, each arm's wall time beside its GPU time
by kernel (torch.profiler), so one GPU run can choose the shape from data.
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Callable
from unittest import mock

import torch

__all__ = ["CONFIGS", "gbps", "bench_fused_step", "device_time_per_step", "render_fused_step", "bench_block_sweep",
           "render_sweep", "bench_one_launch_ablation", "render_ablation", "bench_spectral_step",
           "render_spectral_step"]

# Bytes each arm of the fused step must move per fp32 entry. Until 2026-11-26 "repair" was counted at 32,
# as if the spike guard's extra read of g ran: AdamW's default has no guard (runs before then recorded no
# bytes; the render counts them at these).
BYTES_PER_ENTRY = {"repair": 28, "off": 28, "torch_fused": 28}
# (entries per block, warps): a block's counts are packed in fields sized for <= 2048 entries (_PACK_BLOCK)
CONFIGS = ((2048, 8), (2048, 4), (1024, 8), (1024, 4), (512, 4))


def _on_triton():
    """The fused optimizers on their Triton kernels for the block: what "auto" picks on CUDA, and what the
    dry run (CPU, interpreter) must be told; the environment is restored after."""
    return mock.patch.dict(os.environ, {"NONANS_FUSED_BACKEND": "triton"})


def gbps(bytes_per_entry: float, numel: int, ms: float) -> float:
    """GB/s of a pass that moves ``bytes_per_entry`` bytes for each of ``numel`` entries in ``ms``."""
    return bytes_per_entry * numel / (ms * 1e-3) / 1e9


def _with_grads(shape, tensors: int, device, scale: float = 1.0) -> list[torch.Tensor]:
    """``tensors`` fresh fp32 parameters of ``shape``, ``scale``·randn, each with a 0.01·randn gradient."""
    params = [(scale * torch.randn(shape, device=device)).requires_grad_(True) for _ in range(tensors)]
    for q in params:
        q.grad = torch.randn_like(q) * 1e-2
    return params


def _top_kernels(per: dict[str, float]) -> str:
    """The five largest entries of :func:`device_time_per_step`'s dict, as a table cell."""
    top = sorted(((k, v) for k, v in per.items() if k != "total"), key=lambda kv: -kv[1])[:5]
    return ", ".join(f"`{k[:40]}` {v:.0f}" for k, v in top)


def bench_fused_step(timer, device, numel: int, log, tensors: int = 8) -> dict[str, Any]:
    """The optimizer-level fused step (``AdamW(impl="fused")``: the multi-tensor Triton kernels of
    ``kernels/scalar_step.py``) on ``tensors`` equal fp32 tensors, "repair" and "off" — AdamW's default has
    no spike guard, so both move 28 bytes per entry (read p, g, m, v; write p, m, v) — against
    ``torch.optim.AdamW(fused=True)``. Bytes per entry are recorded; the render derives GB/s from them."""
    import nonans_optim as no

    torch.manual_seed(0)
    size = max(numel // tensors, 1)
    out: dict[str, Any] = {"numel": size * tensors, "tensors": tensors, "dtype": "fp32"}
    with _on_triton():
        for name, make in (("repair", lambda ps: no.AdamW(ps, lr=1e-3, impl="fused")),
                           ("off", lambda ps: no.AdamW(ps, lr=1e-3, impl="fused", resolution="off")),
                           ("torch_fused", lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=device.type == "cuda"))):
            opt = make(_with_grads(size, tensors, device))
            out[f"{name}_ms"] = timer(opt.step)
            if device.type == "cuda":
                out.setdefault("device_us", {})[name] = device_time_per_step(opt.step)
    out["bytes_per_entry"] = BYTES_PER_ENTRY
    for name, nbytes in BYTES_PER_ENTRY.items():
        out[f"{name}_gbps"] = gbps(nbytes, out["numel"], out[f"{name}_ms"])
    out["repair_vs_off"] = out["repair_ms"] / out["off_ms"]
    out["repair_vs_torch_fused"] = out["repair_ms"] / out["torch_fused_ms"]
    log(f"  AdamW(impl='fused') x{tensors} tensors: repair {out['repair_ms']:.3f} ms "
        f"({out['repair_gbps']:.0f} GB/s), off {out['off_ms']:.3f} ms, torch fused {out['torch_fused_ms']:.3f} ms")
    return out


def device_time_per_step(step: Callable[[], Any], steps: int = 5) -> dict[str, float]:
    """{kernel name: GPU µs per step} of ``steps`` calls (torch.profiler), and "total". Beside the timer's
    wall time per step it says whether a step is bound by the GPU (total ≈ the time) or by the host issuing
    it (total well under it) — which decides whether "repair"'s extra cost is its kernels or their launch."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per: dict[str, float] = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None)
        us = ev.cuda_time_total if us is None else us
        if us:
            per[ev.key] = per.get(ev.key, 0.0) + us / steps
    per["total"] = sum(per.values())
    return per


def _ms(x) -> str:
    return "—" if x is None else f"{x:.3f}"


def render_fused_step(f: dict[str, Any] | None, copy_gbps: float) -> list[str]:
    """The fused step's rows of the kernels section's elementwise table (GB/s from its measured ms and the
    bytes each arm moves, :data:`BYTES_PER_ENTRY`), its ratios and its GPU breakdown."""
    lines: list[str] = []
    if not f:
        return lines
    nbytes = f.get("bytes_per_entry", BYTES_PER_ENTRY)
    for arm, label in (("repair", 'AdamW(impl="fused") repair'), ("off", 'AdamW(impl="fused") off'),
                       ("torch_fused", "torch.optim.AdamW(fused=True)")):
        rate = gbps(nbytes[arm], f["numel"], f[arm + "_ms"])
        lines.append(f"| {label}, {f['tensors']} tensors, {f['numel']:,} entries | {_ms(f[arm + '_ms'])} | "
                     f"{rate:.0f} | {rate / copy_gbps:.2f} |")
    fraction = {arm: gbps(nbytes[arm], f["numel"], f[arm + "_ms"]) / copy_gbps for arm in ("repair", "off")}
    verdict = ("met" if fraction["repair"] >= 0.80 else "MISSED") + f" ({fraction['repair']:.2f}"
    verdict += f"; \"off\" reaches {fraction['off']:.2f})"
    lines.append(f"\nAdamW(impl=\"fused\") repair / off: {f['repair_vs_off']:.3f}; repair / torch fused: "
                 f"{f['repair_vs_torch_fused']:.3f}. Target: the fused elementwise kernel (\"repair\") at ≥ 0.80 of "
                 f"the copy bandwidth: {verdict}.")
    if f.get("device_us"):
        lines.append("\nGPU time per step of those arms (torch.profiler, 5 steps), by kernel, against the wall "
                     "time above — a total well under it means the step waits on the host issuing it:\n")
        lines += ["| arm | wall µs | GPU µs total | kernels (µs) |", "|---|---|---|---|"]
        for arm, per in f["device_us"].items():
            lines.append(f"| {arm} | {f[arm + '_ms'] * 1e3:.0f} | {per['total']:.0f} | {_top_kernels(per)} |")
    return lines


@contextlib.contextmanager
def _at_shape(block: int, warps: int):
    """Every launch of the (SF-)AdamW step at one shape: the layout (scalar_step) and each kernel's own BLOCK
    and warps. Until 2026-11-27 the sweep patched scalar_step's alone: the one-launch kernel (scalar_one, the
    "repair" default) then ran its own 2048 x 8 over the smaller blocks' layout — 2x or 4x the programs, the
    extra ones with no entry —, so the "repair" rows of that table at other shapes time idle programs."""
    from nonans_optim.kernels import decisions, scalar_one, scalar_step

    with contextlib.ExitStack() as stack:
        for module in (scalar_step, scalar_one, decisions):
            stack.enter_context(mock.patch.object(module, "elementwise_block", lambda: (block, warps)))
        yield


def bench_block_sweep(timer: Callable, device: torch.device, numel: int, log: Callable,
                      profile: Callable | None = None, tensors: int = 8, configs=CONFIGS) -> list[dict[str, Any]]:
    """Per launch shape: ``AdamW(impl="fused")`` on ``tensors`` equal fp32 tensors, "repair" and "off" — the
    timer's ms per step and, with ``profile`` (``kernels.device_time_per_step``), GPU µs per step."""
    import nonans_optim as no

    size = max(numel // tensors, 1)
    rows = []
    with _on_triton():
        for block, warps in configs:
            row: dict[str, Any] = {"block": block, "warps": warps, "numel": size * tensors, "tensors": tensors}
            with _at_shape(block, warps):
                for policy in ("repair", "off"):
                    torch.manual_seed(0)
                    opt = no.AdamW(_with_grads(size, tensors, device), lr=1e-3, impl="fused", resolution=policy)
                    row[f"{policy}_ms"] = timer(opt.step)
                    if profile is not None:
                        row[f"{policy}_device_us"] = profile(opt.step)["total"]
            row["repair_vs_off"] = row["repair_ms"] / row["off_ms"]
            log(f"  AdamW(impl='fused') block {block} x {warps} warps: repair {row['repair_ms']:.3f} ms, "
                f"off {row['off_ms']:.3f} ms ({row['repair_vs_off']:.2f}x)")
            rows.append(row)
    return rows


def _table(rows: list[dict[str, Any]], intro: Callable[[dict], str], columns: tuple[str, ...],
           cells: Callable[[dict], tuple[str, ...]]) -> list[str]:
    """A markdown table for the kernels section: ``intro(first row)``, then one line of ``cells(row)`` per row
    (lines; none without rows)."""
    if not rows:
        return []
    return [intro(rows[0]), f"| {' | '.join(columns)} |", "|" + "---|" * len(columns),
            *(f"| {' | '.join(cells(r))} |" for r in rows)]


def _us(value: float | None) -> str:
    return f"{value:.0f}" if value is not None else "—"


def render_sweep(rows: list[dict[str, Any]]) -> list[str]:
    """The sweep's table for the kernels section (lines; none without rows)."""
    return _table(
        rows, lambda r0: (f"\nLaunch shape of the fused AdamW step (`experiments/kernels_step.py`; {r0['tensors']} "
                          f"fp32 tensors, {r0['numel']:,} entries; the default shape is the first row; GPU µs from "
                          "torch.profiler):\n"),
        ("entries per block × warps", "repair ms", "off ms", "repair / off", "GPU µs repair", "GPU µs off"),
        lambda r: (f"{r['block']} × {r['warps']}", f"{r['repair_ms']:.3f}", f"{r['off_ms']:.3f}",
                   f"{r['repair_vs_off']:.2f}", _us(r.get("repair_device_us")), _us(r.get("off_device_us"))))


def bench_one_launch_ablation(timer: Callable, device: torch.device, numel: int, log: Callable,
                              profile: Callable | None = None, tensors: int = 8,
                              configs=((2048, 8), (1024, 8))) -> list[dict[str, Any]]:
    """The one-launch "repair" step's timing-only variants (``kernels/scalar_one.py::ABLATIONS``: the relaxed
    ticket, no hold-rule prologue, no register limit) beside "off", on ``tensors`` equal fp32 tensors at two
    launch shapes: which per-program cost makes that kernel slower than "off" on a large step (its docstring).
    A variant's results are not the step's; only its time is read. Then a candidate fix, whose results are:
    fewer programs, each looping over blocks (``programs=`` a few per SM on a GPU, two under the
    interpreter)."""
    import nonans_optim as no
    from nonans_optim.kernels import scalar_one

    size = max(numel // tensors, 1)
    real = scalar_one.scalar_step_one_
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
    arms = [("off", {})] + [(name, dict(ablate=bits, maxnreg=reg))
                            for name, (bits, reg) in scalar_one.ABLATIONS.items()]
    arms += [(f"looping programs, {k} per SM", dict(programs=k * sms if sms else 2)) for k in (3, 12)]
    rows = []
    with _on_triton():
        for block, warps in configs:
            with _at_shape(block, warps):
                for name, kw in arms:
                    torch.manual_seed(0)
                    policy = "off" if name == "off" else "repair"
                    with mock.patch.object(scalar_one, "scalar_step_one_", functools.partial(real, **kw)):
                        opt = no.AdamW(_with_grads(size, tensors, device), lr=1e-3, impl="fused", resolution=policy)
                        row = {"block": block, "warps": warps, "numel": size * tensors, "tensors": tensors,
                               "variant": name, "ms": timer(opt.step)}
                        if profile is not None:
                            row["device_us"] = profile(opt.step)["total"]
                    log(f"  one launch, {block} x {warps}, {name}: {row['ms']:.3f} ms")
                    rows.append(row)
    return rows


def render_ablation(rows: list[dict[str, Any]]) -> list[str]:
    """The ablation's table for the kernels section (lines; none without rows)."""
    return _table(
        rows, lambda r0: ("\nThe one-launch \"repair\" kernel's per-program cost, by suspect "
                          "(`kernels/scalar_one.py::ABLATIONS`, timing-only variants, each removing one, then its "
                          f"programs looping over blocks; {r0['tensors']} fp32 tensors, {r0['numel']:,} entries; GPU "
                          "µs from torch.profiler):\n"),
        ("entries per block × warps", "variant", "ms", "GPU µs"),
        lambda r: (f"{r['block']} × {r['warps']}", r["variant"], f"{r['ms']:.3f}", _us(r.get("device_us"))))


def bench_spectral_step(timer: Callable, device: torch.device, log: Callable, profile: Callable | None = None,
                        shape: tuple[int, int] = (768, 3072), matrices: int = 12) -> list[dict[str, Any]]:
    """The spectral fused step (SF-NorMuon and FullFusion, ``impl="fused"``: the Triton kernels around the
    batched NS5, KL-Shampoo stacked) on ``matrices`` fp32 parameters of one shape — by default a gpt2-small
    layer stack's MLP projections —, "repair" and "off": the timer's ms per step and, with ``profile``, the
    GPU µs per step by kernel, so a run shows where the repair's time goes (the decisions, the gated
    launches, or the host). "repair, unfolded": the statistics and decide launches as two
    (``NONANS_TRITON_FOLD_DECIDE=0``): the folded launch takes an acq_rel ticket per program, a per-program
    cost that made the one-launch AdamW kernel slower on large steps (kernels/scalar_one.py), and the fold
    became the default on gpt2-small's host-bound step, so this row is its price on a GPU-bound one."""
    import nonans_optim as no

    rows = []
    with _on_triton():
        for cls in (no.SFNorMuon, no.FullFusion):
            for arm, policy, fold in (("repair", "repair", "1"), ("off", "off", "1"),
                                      ("repair, unfolded", "repair", "0")):
                torch.manual_seed(0)
                params = _with_grads(shape, matrices, device, scale=0.02)
                with mock.patch.dict(os.environ, {"NONANS_TRITON_FOLD_DECIDE": fold}):
                    opt = cls([{"params": params, "path": "spectral"}], lr=1e-3, impl="fused", resolution=policy)
                    row: dict[str, Any] = {"optimizer": cls.__name__, "policy": arm, "shape": list(shape),
                                           "matrices": matrices, "ms": timer(opt.step)}
                    if profile is not None:
                        row["device_us"] = profile(opt.step)
                log(f"  {cls.__name__}(impl='fused') {matrices} x {shape[0]}x{shape[1]} {arm}: {row['ms']:.3f} ms")
                rows.append(row)
    return rows


def render_spectral_step(rows: list[dict[str, Any]]) -> list[str]:
    """The spectral fused step's table for the kernels section (lines; none without rows)."""
    def cells(r: dict) -> tuple[str, ...]:
        per = r.get("device_us")
        return (r["optimizer"], r["policy"], f"{r['ms']:.3f}", *((f"{per['total']:.0f}", _top_kernels(per)) if per
                                                                  else ("—", "—")))

    return _table(
        rows, lambda r0: (f"\nThe spectral fused step (`experiments/kernels_step.py`; {r0['matrices']} fp32 "
                          f"parameters of {r0['shape'][0]}×{r0['shape'][1]}, KL-Shampoo stacked): wall ms per step "
                          "and, from torch.profiler, GPU µs per step by kernel (the five largest):\n"),
        ("optimizer", "policy", "wall ms", "GPU µs total", "kernels (µs)"), cells)
