"""``python -m experiments op-count`` — the torch ops one clean ``step()`` issues, under "repair" and "off".

Why count ops on a CPU: on a GPU an eager op is a kernel launch, and an eager optimizer step of a small model
is bound by the host issuing them (RESULTS.md, "sync-audit": on an H100 the default foreach SF-NorMuon step
launched 4244 kernels under "repair" and 752 under "off", and took about 4x as long). What "repair" adds to
that count is the resolution step's GPU overhead in the making, and it can be counted anywhere: a
``TorchDispatchMode`` sees every aten op a step dispatches. Views (reshape, select, unbind...) launch
nothing and are not counted. A count is exact and repeatable — unlike a CPU timing of the same code — so a
change to the eager paths can be judged by it before a GPU session times it.

Rows: each optimizer of the library on the default GPT of ``experiments/_models.py`` with synthetic
gradients, under ``impl="foreach"`` (what ``"auto"`` ran for the spectral optimizers on CUDA until 2026-11-26,
and still runs there for groups the Triton kernels do not cover) and
``impl="fused"`` (on this CPU the native loops, few ops whatever the policy). One optimizer whose policy is
switched, as in ``experiments/overhead.py``; a step is counted after one warm-up step under its policy.

Output: ``results/op_count.json`` (or ``--out``) and its table in RESULTS.md ("op-count"). ``--baseline``: a
JSON of this command from another commit, shown beside.
"""
from __future__ import annotations

import argparse
import datetime
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from experiments._models import DEFAULT, build_gpt, synthetic_grads
from experiments.questions_io import ROOT, attach_baseline, checkout_commit, fmt, publish

__all__ = ["TorchOps", "count_ops", "ops_by_policy", "run", "render", "main"]

OPTIMIZERS = ("AdamW", "SFAdamW", "SFNorMuon", "FullFusion", "Muon")
IMPLS = ("foreach", "fused")
_FREE = {"unbind", "split", "detach", "lift_fresh", "alias"}  # views and no-ops that launch nothing


class TorchOps(TorchDispatchMode):
    """Counts the aten ops dispatched inside the block that launch a kernel (views excluded): ``.n``."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.is_view or func.overloadpacket.__name__ in _FREE):
            self.n += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], None]) -> int:
    """The ops ``fn()`` dispatches (see :class:`TorchOps`)."""
    with TorchOps() as c:
        fn()
    return c.n


def ops_by_policy(opt: torch.optim.Optimizer) -> dict[str, int]:
    """{"off": ops, "repair": ops} of one clean ``opt.step()`` under each policy (one optimizer, switched;
    each counted after a first step under its policy, which logs the switch)."""
    ops = {}
    for policy in ("off", "repair"):
        opt.resolution_policy = policy
        opt.step()
        ops[policy] = count_ops(opt.step)
    return ops


def _row(name: str, impl: str, *, kl_stacked: bool = False) -> dict[str, Any]:
    """One row; ``kl_stacked``: KL-Shampoo's batched form forced on (its default on CUDA only), so this CPU
    count shows what it saves the host of a GPU (the rest of the CPU fused step is native C either way)."""
    import nonans_optim as no
    from nonans_optim.optimizers import _kl_stacks

    model = build_gpt(DEFAULT)
    for p, g in zip(model.parameters(), synthetic_grads(model)):
        p.grad = g
    real = _kl_stacks._batch_on
    if kl_stacked:
        _kl_stacks._batch_on = lambda device: True
    try:
        opt = getattr(no, name)(model.named_parameters(), impl=impl)
        opt.step()
        ops = ops_by_policy(opt)
    finally:
        _kl_stacks._batch_on = real
    params = sum(1 for _ in model.parameters())
    label = f"{impl}, KL-Shampoo stacked (its CUDA default)" if kl_stacked else impl
    return {"optimizer": name, "impl": label, "params": params, "off": ops["off"], "repair": ops["repair"]}


def run() -> dict[str, Any]:
    torch.manual_seed(0)
    rows = [_row(name, impl) for name in OPTIMIZERS for impl in IMPLS]
    rows.insert(next(i for i, r in enumerate(rows) if r["optimizer"] == "FullFusion") + len(IMPLS),
                _row("FullFusion", "fused", kl_stacked=True))
    date = datetime.datetime.now().isoformat(timespec="seconds")
    return {"meta": {"commit": checkout_commit("nonans_optim"), "date": date, "torch": torch.__version__},
            "rows": rows}


def render(data: dict[str, Any]) -> str:
    meta, base = data["meta"], data.get("baseline")
    before = {(r["optimizer"], r["impl"]): r for r in base["rows"]} if base else {}
    lines = [f"Command: `python -m experiments op-count` (JSON: `results/op_count.json`), commit {meta['commit']}, "
             f"{meta['date']}, torch {meta['torch']}. Torch ops (a kernel launch each on a GPU; views not "
             "counted) of one clean step of the default GPT (synthetic gradients), one optimizer whose policy is "
             "switched. Extra per parameter: (repair − off) / parameters."]
    if base:
        lines.append(f"Before: the same command on commit {base['meta']['commit']} ({base['meta']['date']}), "
                     "embedded in the JSON with `--baseline`.")
    head = ["optimizer", "impl", "parameters", "ops off", "ops repair", "extra per parameter"]
    if base:
        head += ["before: ops repair", "before: extra per parameter"]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in data["rows"]:
        cells = [r["optimizer"], r["impl"], r["params"], r["off"], r["repair"],
                 fmt((r["repair"] - r["off"]) / r["params"], 3)]
        b = before.get((r["optimizer"], r["impl"]))
        if base:
            cells += ([b["repair"], fmt((b["repair"] - b["off"]) / b["params"], 3)] if b else ["—", "—"])
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments op-count", description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default=None, help="a JSON of this command from another commit, shown beside")
    ap.add_argument("--out", default=str(ROOT / "results" / "op_count.json"))
    ap.add_argument("--results-md", default=str(ROOT / "RESULTS.md"), help="'' to skip rendering")
    args = ap.parse_args(argv)
    data = attach_baseline(run(), args.baseline)
    publish(data, Path(args.out), render(data), args.results_md, "op-count",
            "Torch ops per clean step: what \"repair\" adds to the eager paths (issue 3)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
