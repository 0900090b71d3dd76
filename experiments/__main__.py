"""``python -m experiments <command> [args]`` — dispatch to one experiment module.

The registry is the single place that maps a command name to the module that implements it, so the CLI,
the README and the tests agree on names."""
from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("experiments.bench", "singularity benchmark: baseline vs nonans vs compare (issue 5)"),
    "step-time": ("experiments.step_time", "optimizer step time side by side with peers (issue 2)"),
    "overhead": ("experiments.overhead", "resolution 'repair' vs 'off' on clean steps (issue 3)"),
    "kernels": ("experiments.kernels", "Triton NS5 / fused kernels on a GPU (issue 4)"),
    "kernel-static": ("experiments.kernel_static", "fused kernels' registers, barriers, SASS for sm_90 (issue 4)"),
    "ablation": ("experiments.ablation", "case-study ablation on two offline tasks (issue 6)"),
    "questions": ("experiments.questions", "FusionOpt's open questions, one experiment each (issue 6)"),
    "watch-overhead": ("experiments.watch_overhead", "overhead of nonans_optim.watch() on CPU models"),
    "spikes": ("experiments.spikes", "finite gradient spikes: the spike_factor guard measured (issue 3)"),
    "spike-guards": ("experiments.spike_guards", "norm-ratio vs element-wise spike guard on AdamW (issue 3)"),
    "momentum-dtype": ("experiments.momentum_dtype", "SF-NorMuon momentum buffer in bf16 vs fp32 (issue 2)"),
    "ns5-method": ("experiments.ns5_method", "standard vs Gram Newton-Schulz on CPU (issue 2)"),
    "simd": ("experiments.simd",
             "repair overhead of (SF-)AdamW per native SIMD build: portable, AVX2, AVX-512 (issue 3)"),
    "aliasing": ("experiments.aliasing",
                 "native (SF-)AdamW loop time by the arrays' offsets mod 4096: 4K aliasing (issue 3)"),
    "bf16-cpu": ("experiments.bf16_cpu", "a bf16 model's (SF-)AdamW step on CPU: ours off/repair vs torch (issue 3)"),
    "op-count": ("experiments.op_count", "torch ops per clean step under repair vs off, eager paths (issue 3)"),
    "sync-audit": ("experiments.sync_audit", "host syncs and kernel launches of each optimizer's CUDA step (issue 3)"),
    "compile-time": ("experiments.compile_time", "first step of impl='compiled': torch.compile time, cold and warm"),
    "render": ("experiments.render", "render results/*.json into RESULTS.md and OPEN_QUESTIONS.md"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m experiments <command> [args]\n\ncommands:")
        for name, (_, doc) in COMMANDS.items():
            print(f"  {name:<10} {doc}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"unknown command {name!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
