"""``python -m experiments kernel-static`` — what each fused kernel costs a Hopper GPU before it runs: compiled
for sm_90 on this CPU, its registers per thread, the blocks per SM those leave room for, its barriers and its
SASS instructions, "off" beside the resolution's variants.

Why, without a GPU: the resolution step's overhead on a GPU is in the gated variants of the memory-bound
kernels (RESULTS.md, "overhead-gpu-gpt2-small": the fused AdamW step took 1.76x its "off" time on an H200),
and what makes a variant slower than "off" while it moves the same bytes is visible in its compiled form —
registers (fewer resident blocks to hide memory latency), barriers (every ``tl.sum`` over a block is a
cross-warp exchange through shared memory) and instructions. These counts are exact and repeatable on any
machine with triton, so a kernel change can be judged by them before a GPU session times it
(``python -m experiments kernels``, which says what they cost in microseconds).

How: ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` (the whole NVIDIA pipeline, the
ptxas bundled in the triton wheel), then the bundled ``cuobjdump``: ``--dump-resource-usage`` for registers and
shared memory, ``-sass`` for the instructions; barriers are counted in the PTX (``bar.sync``/``barrier.sync``,
static: a barrier in a branch a clean block never takes counts too). Blocks per SM follow from an H100/H200
SM's limits: 65,536 registers, allocated per warp in units of 256 (a thread's count rounded up to 8), 2,048
threads, 32 blocks, 228 KiB of shared memory. Every kernel at the launch shape the library uses
(``kernels._elementwise.elementwise_block``; the NorMuon row kernel: 4 warps).

Output: ``results/kernel_static.json`` (or ``--out``) and its table in RESULTS.md ("kernel-static").
``--baseline``: a JSON of this command run against another commit's kernels, shown beside.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable

from experiments.questions_io import ROOT, attach_baseline, checkout_commit, publish

__all__ = ["VARIANTS", "ONE_LAUNCH_TYPES", "compile_sm90", "resources", "blocks_per_sm", "run", "render", "main"]

# An H100/H200 SM (sm_90): what bounds the blocks resident at once
_SM_REGS, _SM_THREADS, _SM_BLOCKS, _SM_SMEM = 65536, 2048, 32, 228 * 1024


def compile_sm90(fn, types: dict[str, str], constexprs: dict[str, Any], num_warps: int, **options):
    """``fn`` (a JITFunction) compiled for sm_90 on this machine; ``types``: every non-constexpr argument's
    Triton type (a pointer's alignment is not specialised: the fused kernels read addresses from tables)."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: ("constexpr" if name in constexprs else types[name]) for name in fn.arg_names}
    src = ASTSource(fn, signature, constexprs=constexprs)
    return triton_compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, **options))


def _cuobjdump() -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: this triton wheel does not bundle cuobjdump, which reads the "
                                "compiled kernels' registers and instructions")
    return str(path)


def resources(compiled) -> dict[str, int]:
    """Registers per thread, bytes of stack per thread (registers spilled: nonzero only under a register
    limit), shared memory bytes, barriers in the PTX and SASS instructions of a kernel."""
    tool = _cuobjdump()
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    regs, stack, smem = re.search(r"REG:(\d+).*?STACK:(\d+).*?SHARED:(\d+)", usage).groups()
    ptx = compiled.asm["ptx"]
    return {"regs": int(regs), "stack": int(stack), "smem": int(smem),
            "barriers": ptx.count("bar.sync") + ptx.count("barrier.sync"),
            "sass": sum(1 for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line))}


def blocks_per_sm(regs: int, smem: int, warps: int) -> int:
    """Blocks of ``warps`` warps one sm_90 SM holds at once, by registers, threads, blocks and shared memory."""
    alloc = 8 * math.ceil(regs / 8)  # per thread, as allocated (256 registers per warp at a time)
    by_regs = _SM_REGS // (alloc * 32 * warps) if alloc else _SM_BLOCKS
    by_smem = _SM_SMEM // smem if smem else _SM_BLOCKS
    return min(by_regs, _SM_THREADS // (32 * warps), _SM_BLOCKS, by_smem)


def _scalar_update(sf: bool, gate: bool) -> tuple[Callable, dict, dict]:
    import triton.language as tl
    from nonans_optim.kernels import scalar_step as k

    types = dict(ADDR="*i64", NUMEL="*i64", FIRST="*i64", BLOCK_TENSOR="*i32", BC="*fp32", HP="*fp32",
                 GAMMA="*fp32", SCALE="*fp32", SEL="*i64", DEC="*fp32", DEC_FLAGS="*i32", EMA="*fp32", DENSE="*i64")
    return k._update_kernel, types, dict(TY=tl.float32, SF=sf, GATE=gate, GUARD=False, DECAY_Z=False,
                                         ALIGNED=True, EMULATE=False)


# The one-launch step's arguments as its launch (kernels/scalar_one.py) passes them: the storage dtype is the
# TY constexpr, so one signature serves fp32, bf16 and fp16 (tests/test_kernels_aot.py compiles all three).
ONE_LAUNCH_TYPES = dict(
    ADDR="*i64", NUMEL="*i64", FIRST="*i64", BLOCK_TENSOR="*i32", BC="*fp32", HP="*fp32", GAMMA="*fp32",
    SCALE="*fp32", SEL="*i64", DENSE="*i64", STREAK="*i64", EVENTS="*i64", window="i32", SCRATCH="*i32", n="i32",
    nblocks="i32", nprog="i32", COUNTS="*i64", RING_COUNTS="*i64", RING_STEP="*i64", RING_ESC="*i1",
    RING_HELD="*i1", RING_PTR="*i64", ESCALATIONS="*i64", RES_NUMEL="*i64", step="i32", P="i32", K="i32",
    backoff="fp32", min_scale="fp32", growth="i32")


def _scalar_one(sf: bool, loop: bool = False) -> tuple[Callable, dict, dict, dict]:
    """The one-launch "repair" step (kernels/scalar_one.py): decisions, update and record in one kernel, with
    its launch's compile options; ``loop``: its programs looping over blocks."""
    import triton.language as tl
    from nonans_optim.kernels import scalar_one as k
    from nonans_optim.kernels.record import BLOCK_P
    from nonans_optim.resolution import STAGE_INDEX

    constexprs = dict(TY=tl.float32, SF=sf, DECAY_Z=False, ALIGNED=True, EMULATE=False, S=k._S, S_PAD=k._S_PAD,
                      LOSS=STAGE_INDEX["loss"], GRAD=STAGE_INDEX["grad"], BLOCK_P=BLOCK_P, ABLATE=0,
                      LOOP=loop)
    return k._one_launch_kernel, dict(ONE_LAUNCH_TYPES), constexprs, dict(maxnreg=k.MAXNREG)


_DECISION_TYPES = dict(ADDR="*i64", NUMEL="*i64", FIRST="*i64", BLOCK_TENSOR="*i32", SS="*fp64", BAD="*i32")


def _statistics() -> tuple[Callable, dict, dict]:
    """The gradient statistics of the two-launch decisions (kernels/decisions.py; the decide kernel after it
    runs one program per tensor)."""
    import triton.language as tl
    from nonans_optim.kernels import decisions as k

    return k._stats_kernel, dict(_DECISION_TYPES), dict(TY=tl.float32, ALIGNED=True)


def _statistics_decide(guard: bool) -> tuple[Callable, dict, dict]:
    """The statistics and the decisions in one launch (NONANS_TRITON_FOLD_DECIDE=1): the hold rule from the
    counters, as impl="fused" passes it; "repair" with the guard, or "skip" without it."""
    import triton.language as tl
    from nonans_optim.kernels import decisions as k
    from nonans_optim.resolution import STAGE_INDEX

    types = dict(_DECISION_TYPES, TICKETS="*i32", SEL="*i64", EMA="*fp32", RECENT="*i32", STREAK="*i64",
                 EVENTS="*i64", DEC="*fp32", FLAGS_OUT="*i32", factor="fp32", beta="fp32", window="i32")
    constexprs = dict(TY=tl.float32, ALIGNED=True, POLICY=1 if guard else 2, GUARD=guard, RULE=True, S=k._S,
                      S_PAD=k._S_PAD, LOSS=STAGE_INDEX["loss"], RBLOCK=k._RBLOCK)
    return k._stats_decide_kernel, types, constexprs


def _spectral_write(gate: bool, guard: bool, mona: bool) -> tuple[Callable, dict, dict]:
    import triton.language as tl
    from nonans_optim.kernels import spectral_step as k

    slot = "*fp32" if gate else "*fp64"  # never dereferenced under "off"
    types = dict(ADDR="*i64", MONA_ADDR="*i64", NUMEL="*i64", FIRST="*i64", BLOCK_TENSOR="*i32", HP="*fp32",
                 INV="*fp64", SEL="*i64" if gate else slot, DEC=slot, DEC_FLAGS="*i32" if gate else slot, EMA=slot,
                 DENSE="*i64" if gate else slot)
    return k._write_kernel, types, dict(NESTEROV=True, GATE=gate, GUARD=guard, MONA=mona, G_TY=tl.float32,
                                        BUF_TY=tl.bfloat16, X_TY=tl.bfloat16, ALIGNED=True, EMULATE=False)


def _spectral_msq(gate: bool, guard: bool) -> tuple[Callable, dict, dict]:
    import triton.language as tl
    from nonans_optim.kernels import spectral_step as k

    types = dict(ADDR="*i64", MONA_ADDR="*i64", NUMEL="*i64", FIRST="*i64", BLOCK_TENSOR="*i32", HP="*fp32",
                 DEC="*fp32" if guard else "*fp64", MSQ="*fp64")
    return k._msq_kernel, types, dict(NESTEROV=True, GATE=gate, GUARD=guard, MONA=False, G_TY=tl.float32,
                                      BUF_TY=tl.bfloat16, ALIGNED=True, EMULATE=False)


def _spectral_rows(gate: bool) -> tuple[Callable, dict, dict]:
    import triton.language as tl
    from nonans_optim.kernels import _spectral_post as k
    from nonans_optim.kernels.spectral_step import _BLOCK_C

    slot = (lambda ty: ty) if gate else (lambda ty: "*fp32")  # under "off" the host passes ROW_SQ there
    types = dict(PRE="*i64", POST="*i64", ROW_FIRST="*i64", ROW_OWNER="*i32", NCOLS="*i64", HP="*fp32",
                 DEC_FLAGS=slot("*i32"), SEL=slot("*i64"), DENSE=slot("*i64"), ROW_INV="*fp32", ROW_SQ="*fp32",
                 ROW_SUM="*fp32")
    return k._rows_kernel, types, dict(NORMUON=True, GATE=gate, WIDE=False, G_TY=tl.float32, O_TY=tl.bfloat16,
                                       ROWS_ALIGNED=True, BLOCK_C=_BLOCK_C)


def _spectral_apply(sf: bool, gate: bool) -> tuple[Callable, dict, dict]:
    import triton.language as tl
    from nonans_optim.kernels import _spectral_post as k

    slot = (lambda ty: ty) if gate else (lambda ty: "*fp64")
    types = dict(POST="*i64", NUMEL="*i64", FIRST="*i64", BLOCK_TENSOR="*i32", ROW_FIRST="*i64", NCOLS="*i64",
                 ROW_INV="*fp32", FACTOR="*fp32", HP="*fp32", GAMMA="*fp32", SCALE=slot("*fp32"), SEL=slot("*i64"),
                 DEC_FLAGS=slot("*i32"), DENSE=slot("*i64"))
    return k._apply_kernel, types, dict(P_TY=tl.float32, O_TY=tl.bfloat16, SF=sf, DECAY=True, GATE=gate,
                                        ALIGNED=True, EMULATE=False)


# (kernel, variant, builder): "off" first, then the gated variants the optimizers' defaults run. Elementwise
# kernels take the library's (BLOCK, warps) unless the variant names a shape; the row kernel its own 4 warps
# and column chunk.
VARIANTS: list[tuple[str, str, Callable[[], tuple]]] = [
    ("(SF-)AdamW update", "AdamW, off", lambda: _scalar_update(False, False)),
    ("(SF-)AdamW update", "AdamW, repair", lambda: _scalar_update(False, True)),
    ("(SF-)AdamW update", "SFAdamW, off", lambda: _scalar_update(True, False)),
    ("(SF-)AdamW update", "SFAdamW, repair", lambda: _scalar_update(True, True)),
    # decisions, update and record in one launch (the default "repair" step; NONANS_TRITON_ONE_LAUNCH=0: three)
    ("(SF-)AdamW update", "AdamW, repair, one launch", lambda: _scalar_one(False)),
    ("(SF-)AdamW update", "SFAdamW, repair, one launch", lambda: _scalar_one(True)),
    # its programs looping over blocks (scalar_step_one_(programs=...); timed by python -m experiments kernels)
    ("(SF-)AdamW update", "AdamW, repair, one launch, looping programs", lambda: _scalar_one(False, True)),
    # the launch shape python -m experiments kernels sweeps: 1024 x 8 warps holds 4 entries per thread, not 8
    ("(SF-)AdamW update", "AdamW, off, 1024 x 8", lambda: _scalar_update(False, False)),
    ("(SF-)AdamW update", "AdamW, repair, 1024 x 8", lambda: _scalar_update(False, True)),
    # the gradient statistics before the decisions (with the guard, or under "skip"); the opt-in fold
    # (NONANS_TRITON_FOLD_DECIDE=1) decides in each tensor's last block of the same launch
    ("decisions", "statistics", _statistics),
    ("decisions", "statistics + decide, guard, one launch", lambda: _statistics_decide(True)),
    ("decisions", "statistics + decide, skip, one launch", lambda: _statistics_decide(False)),
    ("spectral norm", "off", lambda: _spectral_msq(False, False)),
    ("spectral norm", "repair, guard (SFNorMuon, Muon)", lambda: _spectral_msq(True, True)),
    ("spectral write", "off", lambda: _spectral_write(False, False, False)),
    ("spectral write", "repair, no guard", lambda: _spectral_write(True, False, False)),
    ("spectral write", "repair, guard (SFNorMuon, Muon)", lambda: _spectral_write(True, True, False)),
    ("spectral write", "off, MONA (FullFusion)", lambda: _spectral_write(False, False, True)),
    ("spectral write", "repair, guard, MONA (FullFusion)", lambda: _spectral_write(True, True, True)),
    ("NorMuon rows", "off", lambda: _spectral_rows(False)),
    ("NorMuon rows", "repair", lambda: _spectral_rows(True)),
    ("spectral apply", "plain, off", lambda: _spectral_apply(False, False)),
    ("spectral apply", "plain, repair", lambda: _spectral_apply(False, True)),
    ("spectral apply", "schedule-free, off", lambda: _spectral_apply(True, False)),
    ("spectral apply", "schedule-free, repair", lambda: _spectral_apply(True, True)),
]
_ROW_WARPS = 4  # kernels/spectral_step.py launches the row kernel with 4 warps


def _row(kernel: str, variant: str, build: Callable[[], tuple]) -> dict[str, Any]:
    from nonans_optim.kernels._elementwise import elementwise_block

    fn, types, constexprs, *options = build()  # (a builder may add compile options: the launch's own)
    block, warps = (1024, 8) if variant.endswith("1024 x 8") else elementwise_block()
    if kernel == "NorMuon rows":
        warps = _ROW_WARPS
    else:
        constexprs = dict(constexprs, BLOCK=block)
    r = resources(compile_sm90(fn, types, constexprs, warps, enable_fp_fusion=False,
                               **(options[0] if options else {})))
    return {"kernel": kernel, "variant": variant, "warps": warps, **r,
            "blocks_per_sm": blocks_per_sm(r["regs"], r["smem"], warps)}


def run(only: list[str] | None = None) -> dict[str, Any]:
    """Every row of :data:`VARIANTS` (``only``: the kernels named there)."""
    import triton

    rows = [_row(*v) for v in VARIANTS if only is None or v[0] in only]
    date = datetime.datetime.now().isoformat(timespec="seconds")
    return {"meta": {"commit": checkout_commit("kernels"), "date": date, "triton": triton.__version__,
                     "target": "sm_90"}, "rows": rows}


def render(data: dict[str, Any]) -> str:
    meta, base = data["meta"], data.get("baseline")
    before = {(r["kernel"], r["variant"]): r for r in base["rows"]} if base else {}
    json_path = data.get("json", "results/kernel_static.json")
    lines = [f"Command: `python -m experiments kernel-static` (JSON: `{json_path}`), kernels at commit "
             f"{meta['commit']}, {meta['date']}, triton {meta['triton']}, compiled for {meta['target']} on a CPU "
             "(no GPU involved). Per kernel variant: registers per thread; stack bytes per thread (registers spilled "
             "to memory, under a launch's register limit); the blocks one H100/H200 SM holds at once (by registers "
             "as allocated, threads, shared memory); barriers in the PTX (static: one in a branch a clean block "
             "skips counts too); SASS instructions in the compiled kernel (static)."]
    if base:
        lines.append(f"Before: the same command against the kernels of commit {base['meta']['commit']} "
                     f"({base['meta']['date']}), embedded in the JSON with `--baseline`.")
    head = ["kernel", "variant", "warps", "registers", "stack bytes", "blocks / SM", "barriers", "SASS"]
    if base:
        head += ["before: registers", "before: blocks / SM", "before: barriers", "before: SASS"]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in data["rows"]:
        cells = [r["kernel"], r["variant"], r["warps"], r["regs"], r.get("stack", "—"), r["blocks_per_sm"],
                 r["barriers"], r["sass"]]
        if base:
            b = before.get((r["kernel"], r["variant"]))
            cells += [b["regs"], b["blocks_per_sm"], b["barriers"], b["sass"]] if b else ["—"] * 4
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


# The Triton of the GPU image the GPU tables were measured with (RESULTS.md "kernels": triton 3.6.0). Its
# compiler allocates registers differently from later versions, so a run with it on the path (``pip install
# --target DIR triton==3.6.0``, then ``PYTHONPATH=DIR python -m experiments kernel-static``) publishes into a
# section and JSON of its own, beside the run with the installed Triton.
GPU_IMAGE_TRITON = "3.6"


def section_of(triton_version: str) -> tuple[str, str]:
    """(RESULTS.md section, JSON under results/) of a run compiled with ``triton_version``."""
    if triton_version.split(".")[:2] == GPU_IMAGE_TRITON.split("."):
        return f"kernel-static-triton-{GPU_IMAGE_TRITON}", f"kernel_static_triton-{GPU_IMAGE_TRITON}.json"
    return "kernel-static", "kernel_static.json"


def main(argv: list[str] | None = None) -> int:
    import triton

    key, name = section_of(triton.__version__)
    ap = argparse.ArgumentParser(prog="python -m experiments kernel-static", description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default=None, help="a JSON of this command from another commit, shown beside")
    ap.add_argument("--out", default=str(ROOT / "results" / name))
    ap.add_argument("--results-md", default=str(ROOT / "RESULTS.md"), help="'' to skip rendering")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("TRITON_INTERPRET=1 replaces the compiler with the interpreter: unset it to compile for sm_90")
    data = dict(attach_baseline(run(), args.baseline), json=f"results/{name}")
    publish(data, Path(args.out), render(data), args.results_md, key,
            f"Static sm_90 resources of the fused kernels, triton {GPU_IMAGE_TRITON} (the GPU image's) (issue 4)"
            if key != "kernel-static" else "Static sm_90 resources of the fused kernels (issue 4)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
