"""Ahead-of-time compile every kernel configuration for Hopper (sm_90) on this CPU-only machine.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` runs the whole NVIDIA pipeline offline
(TTIR -> TTGIR -> LLVM IR -> PTX -> cubin with the ptxas bundled in the triton wheel; verified with triton
3.9), so CI catches what the interpreter cannot: type errors in the compiled path, configs whose shared
memory would not fit an H100 (227 KiB per CTA), and a matmul that silently missed the Hopper tensor-core
instruction (``wgmma``). Speed itself is only measured on a GPU (``python -m experiments kernels``).
"""
from __future__ import annotations

import os
import re

import pytest

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="AOT compilation needs compiled (not interpreted) kernels")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
# Pointer and stride arguments that the JIT would specialise as 16-divisible for aligned shapes.
ALIGNED = {"X", "ADD", "C", "Bm", "Y", "M", "K", "N", "stride_xb", "stride_xm", "stride_cb", "stride_cm",
           "stride_bb", "stride_bm", "stride_yb", "stride_ym", "P", "G", "V", "BUF"}


def compile_for_hopper(fn, types: dict[str, str], constexprs: dict, num_warps: int = 4, num_stages: int = 3,
                       **options):
    """Compile the JITFunction ``fn`` for sm_90; ``types`` gives every non-constexpr argument's type."""
    signature = {name: ("constexpr" if name in constexprs else types[name]) for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name in ALIGNED and name not in constexprs}
    src = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=HOPPER, options=dict(num_warps=num_warps, num_stages=num_stages, **options))


def _binary_ok(compiled) -> None:
    assert {"ttgir", "ptx", "cubin"} <= set(compiled.asm), sorted(compiled.asm)
    assert len(compiled.asm["cubin"]) > 0


def _syrk_types(x: str, c: str) -> dict[str, str]:
    types = dict(X=f"*{x}", ADD=f"*{c}", C=f"*{c}", alpha="fp32", beta="fp32", in_scale="fp32")
    types.update({k: "i32" for k in ("M", "K", "BATCH", "stride_xb", "stride_xm", "stride_cb", "stride_cm")})
    return types


def _axpb_types(b: str, x: str, y: str) -> dict[str, str]:
    types = dict(Bm=f"*{b}", X=f"*{x}", Y=f"*{y}", a="fp32", in_scale="fp32", out_scale="fp32")
    types.update({k: "i32" for k in ("M", "N", "BATCH", "stride_bb", "stride_bm", "stride_xb", "stride_xm",
                                     "stride_yb", "stride_ym")})
    return types


def _syrk_flags(**kw):
    return dict(dict(HAS_ADD=False, SCALE_IN=False, EVEN_K=True, UPCAST=False, IEEE=False), **kw)


def _axpb_flags(**kw):
    return dict(dict(SCALE_IN=False, SCALE_OUT=False, EVEN_K=True, UPCAST=False, IEEE=False), **kw)


def test_syrk_every_config_bf16():
    from nonans_optim.kernels._runtime import H100_SMEM_BYTES
    from nonans_optim.kernels.ns5_gram import SYRK_CONFIGS, _syrk_kernel

    for i, cfg in enumerate(SYRK_CONFIGS):
        flags = _syrk_flags(HAS_ADD=i % 2 == 1)  # alternate gram / poly epilogues across configs
        compiled = compile_for_hopper(_syrk_kernel, _syrk_types("bf16", "bf16"), dict(cfg.kwargs, **flags),
                                      cfg.num_warps, cfg.num_stages)
        _binary_ok(compiled)
        assert compiled.metadata.shared <= H100_SMEM_BYTES, (cfg, compiled.metadata.shared)
        assert "wgmma" in compiled.asm["ptx"], f"{cfg}: no Hopper tensor-core MMA in the PTX"


def test_axpb_every_config_bf16():
    from nonans_optim.kernels._runtime import H100_SMEM_BYTES
    from nonans_optim.kernels.ns5_axpb import AXPB_CONFIGS, _axpb_kernel

    for cfg in AXPB_CONFIGS:
        compiled = compile_for_hopper(_axpb_kernel, _axpb_types("bf16", "bf16", "bf16"),
                                      dict(cfg.kwargs, **_axpb_flags()), cfg.num_warps, cfg.num_stages)
        _binary_ok(compiled)
        assert compiled.metadata.shared <= H100_SMEM_BYTES, (cfg, compiled.metadata.shared)
        assert "wgmma" in compiled.asm["ptx"], f"{cfg}: no Hopper tensor-core MMA in the PTX"


def test_smem_pruner_is_safe_fp32():
    """fp32 doubles the operand buffers: the autotune pruner must drop every config that would overflow.

    The pruner's estimate (stages x both operand tiles) is conservative: the fp32 "ieee" path (no wgmma)
    pipelines with one buffer fewer, so a config it drops may in fact fit — safe, merely not tried. Only the
    kept configs are compiled: nothing was asserted of a dropped one's binary, and the dropped ones were four of
    the test's ten sm_90 compiles (33 s on a cold Triton cache, 2 cores)."""
    import torch

    from nonans_optim.kernels._runtime import H100_SMEM_BYTES
    from nonans_optim.kernels.ns5_axpb import AXPB_CONFIGS, _axpb_kernel
    from nonans_optim.kernels.ns5_axpb import _prune_by_smem as prune_axpb
    from nonans_optim.kernels.ns5_gram import SYRK_CONFIGS, _syrk_kernel
    from nonans_optim.kernels.ns5_gram import _prune_by_smem as prune_syrk

    x = torch.empty(1, dtype=torch.float32)
    cases = [(_syrk_kernel, SYRK_CONFIGS, prune_syrk(SYRK_CONFIGS, {"X": x}), _syrk_types("fp32", "fp32"),
              _syrk_flags(IEEE=True, EVEN_K=False)),
             (_axpb_kernel, AXPB_CONFIGS, prune_axpb(AXPB_CONFIGS, {"Bm": x, "X": x}),
              _axpb_types("fp32", "fp32", "fp32"), _axpb_flags(IEEE=True, EVEN_K=False))]
    for fn, configs, kept, types, flags in cases:
        assert kept, "every kernel needs at least one fp32 config"
        assert set(kept) <= set(configs) and len(kept) < len(configs), "fp32 must drop a config here"
        for cfg in kept:
            try:
                shared = compile_for_hopper(fn, types, dict(cfg.kwargs, **flags), cfg.num_warps,
                                            cfg.num_stages).metadata.shared
            except Exception as exc:  # the compiler refuses a config too large for the device
                raise AssertionError(f"{cfg} kept by the pruner but does not compile: {exc}") from exc
            assert shared <= H100_SMEM_BYTES, (fn.__name__, cfg, shared)


def test_fp16_safe_variants():
    """Mixed dtypes of the fused rescale: fp32 in -> fp16 products, and fp16 products -> fp32 out."""
    from nonans_optim.kernels.ns5_axpb import AXPB_CONFIGS, _axpb_kernel
    from nonans_optim.kernels.ns5_gram import SYRK_CONFIGS, _syrk_kernel

    s, a = SYRK_CONFIGS[0], AXPB_CONFIGS[0]
    scaled_gram = _syrk_flags(SCALE_IN=True, EVEN_K=False)
    _binary_ok(compile_for_hopper(_syrk_kernel, _syrk_types("fp32", "fp16"), dict(s.kwargs, **scaled_gram),
                                  s.num_warps, s.num_stages))
    _binary_ok(compile_for_hopper(_syrk_kernel, _syrk_types("fp16", "fp16"),
                                  dict(s.kwargs, **_syrk_flags(HAS_ADD=True)), s.num_warps, s.num_stages))
    _binary_ok(compile_for_hopper(_axpb_kernel, _axpb_types("fp16", "fp32", "fp16"),
                                  dict(a.kwargs, **_axpb_flags(SCALE_IN=True)), a.num_warps, a.num_stages))
    _binary_ok(compile_for_hopper(_axpb_kernel, _axpb_types("fp16", "fp16", "fp32"),
                                  dict(a.kwargs, **_axpb_flags(SCALE_OUT=True, EVEN_K=False)), a.num_warps,
                                  a.num_stages))


@pytest.mark.parametrize("policy", [0, 1, 2])
@pytest.mark.parametrize("param", ["fp32", "bf16", "fp16"])
def test_elementwise_kernels(policy, param):
    from nonans_optim.kernels._elementwise import _count_kernel
    from nonans_optim.kernels.fused_adamw import _adamw_kernel
    from nonans_optim.kernels.momentum import _momentum_kernel

    pointer_scalars = param == "bf16"  # lr / bias corrections as device tensors on one variant
    adamw_types = dict(P=f"*{param}", G=f"*{param}", M="*fp32", V="*fp32", COUNTS="*i64", FLAG="*i64", N="i64",
                       lr="*fp32" if pointer_scalars else "fp32", beta1="fp32", beta2="fp32", eps="fp32",
                       weight_decay="fp32", bc1="*fp32" if pointer_scalars else "fp32",
                       bc2="*fp32" if pointer_scalars else "fp32")
    flags = dict(POLICY=policy, COUNT=policy != 0, HAS_FLAG=policy == 2, BLOCK=2048, EMULATE=False)
    compiled = compile_for_hopper(_adamw_kernel, adamw_types, dict(flags, LR_PTR=pointer_scalars,
                                  BC1_PTR=pointer_scalars, BC2_PTR=pointer_scalars), num_warps=8)
    _binary_ok(compiled)
    if policy != 0:
        assert "atom" in compiled.asm["ptx"], "device-side counters must use atomics"
    _binary_ok(compile_for_hopper(_momentum_kernel, dict(BUF=f"*{param}", G=f"*{param}", COUNTS="*i64",
                                                         FLAG="*i64", N="i64", beta="fp32"), flags, num_warps=8))
    _binary_ok(compile_for_hopper(_count_kernel, dict(G=f"*{param}", SCRATCH="*i64", N="i64"),
                                  {"BLOCK": 2048}, num_warps=8))


@pytest.mark.parametrize("policy", [0, 1, 2])
@pytest.mark.parametrize("param", ["fp32", "bf16", "fp16"])
def test_scalar_step_kernels(policy, param):
    """The multi-tensor (SF-)AdamW step of impl="fused" on CUDA: its three launches, every variant; the
    int64 address table must become typed global pointers, and counting variants must use atomics."""
    import triton.language as tl

    from nonans_optim.kernels.decisions import _decide_kernel, _stats_kernel
    from nonans_optim.kernels.scalar_step import _update_kernel

    ty = {"fp32": tl.float32, "bf16": tl.bfloat16, "fp16": tl.float16}[param]
    table = dict(ADDR="*i64", NUMEL="*i64", FIRST="*i64", BLOCK_TENSOR="*i32")
    if policy:
        stats = compile_for_hopper(_stats_kernel, dict(table, SS="*fp64", BAD="*i32"),
                                   dict(TY=ty, ALIGNED=True, BLOCK=2048), num_warps=8)
        _binary_ok(stats)
        assert re.search(r"ld\.global(\.\w+)*\.v[24]", stats.asm["ptx"]), "full blocks: vector loads"
        for guard, rule, lazy in ((False, False, False), (False, True, False), (True, True, False),
                                  (True, False, False), (False, True, True), (False, False, True)):
            # as decisions() passes them: a RecentRule's int64 counters (the flags slot then the int32 flags
            # scratch), or the bool flags (the counter slots then that scratch, never read); under LAZY the
            # statistics slots are that scratch too, and the decide kernel scans candidates' gradients
            hold = (dict(RECENT="*i32", STREAK="*i64", EVENTS="*i64") if rule
                    else dict(RECENT="*i1", STREAK="*i32", EVENTS="*i32"))
            stat_slots = dict(SS="*i32", BAD="*i32") if lazy else dict(SS="*fp64", BAD="*i32")
            _binary_ok(compile_for_hopper(
                _decide_kernel, dict(**stat_slots, FIRST="*i64", NUMEL="*i64", SEL="*i64", EMA="*fp32", **hold,
                                     DEC="*fp32", FLAGS_OUT="*i32", ADDR="*i64", factor="fp32", beta="fp32",
                                     window="i32"),
                dict(POLICY=policy, GUARD=guard, RULE=rule, S=6, S_PAD=8, LOSS=4, LAZY=lazy, TY=ty, ALIGNED=True,
                     RBLOCK=2048 if lazy else 1024), num_warps=8 if lazy else 1))
    update_types = dict(table, BC="*fp32", HP="*fp32", GAMMA="*fp32", SCALE="*fp32", SEL="*i64", DEC="*fp32",
                        DEC_FLAGS="*i32", EMA="*fp32", DENSE="*i64")
    for sf, decay_z in ((False, False), (True, False), (True, True)):
        compiled = compile_for_hopper(_update_kernel, update_types,
                                      dict(TY=ty, SF=sf, GATE=policy != 0, GUARD=policy != 0 and not decay_z,
                                           DECAY_Z=decay_z, ALIGNED=True, EMULATE=False, BLOCK=2048),
                                      num_warps=8, enable_fp_fusion=False)
        _binary_ok(compiled)
        assert ("atom" in compiled.asm["ptx"]) == (policy != 0), "counts: atomics exactly when gating"
        assert "fma.rn.f32" not in compiled.asm["ptx"], "no contraction: clean repair must equal off"
        assert re.search(r"st\.global(\.\w+)*\.v[24]", compiled.asm["ptx"]), "full blocks: vector stores"



@pytest.mark.parametrize("policy", [1, 2])
@pytest.mark.parametrize("param", ["fp32", "bf16"])
def test_stats_decide_kernel(policy, param):
    """The statistics and decide launches as one (kernels/decisions.py, the default), every
    guard and hold-rule form: the ticket an acq_rel atomic at GPU scope, the partials of other programs read
    through L2 (``ld.global.cg``), vector loads of the gradient on full blocks."""
    import triton.language as tl

    from nonans_optim.kernels.decisions import _stats_decide_kernel

    ty = {"fp32": tl.float32, "bf16": tl.bfloat16}[param]
    for guard, rule in ((False, False), (False, True), (True, False), (True, True)):
        hold = (dict(RECENT="*i32", STREAK="*i64", EVENTS="*i64") if rule
                else dict(RECENT="*i1", STREAK="*i32", EVENTS="*i32"))
        compiled = compile_for_hopper(
            _stats_decide_kernel, dict(ADDR="*i64", NUMEL="*i64", FIRST="*i64", BLOCK_TENSOR="*i32", SS="*fp64",
                                       BAD="*i32", TICKETS="*i32", SEL="*i64", EMA="*fp32", **hold, DEC="*fp32",
                                       FLAGS_OUT="*i32", factor="fp32", beta="fp32", window="i32"),
            dict(TY=ty, ALIGNED=True, BLOCK=2048, POLICY=policy, GUARD=guard, RULE=rule, S=6, S_PAD=8, LOSS=4,
                 RBLOCK=1024), num_warps=8)
        _binary_ok(compiled)
        ptx = compiled.asm["ptx"]
        assert re.search(r"atom(\.\w+)*\.gpu\.acq_rel\.add\.u32", ptx), "the ticket: acq_rel at GPU scope"
        assert re.search(r"ld\.global\.cg", ptx), "the last program reads the others' partials through L2"
        assert re.search(r"ld\.global(\.\w+)*\.v[24]", ptx), "full blocks: vector loads"


@pytest.mark.parametrize("param", ["fp32", "bf16", "fp16"])
def test_one_launch_kernel(param):
    """The (SF-)AdamW "repair" step in one launch (kernels/scalar_one.py), every storage dtype and form: the
    ticket an acq_rel atomic at GPU scope, what other programs wrote read through L2 (``ld.global.cg``), no
    contraction, vector stores on full blocks, and the launch's register limit in the PTX."""
    import triton.language as tl

    from nonans_optim.kernels.record import BLOCK_P
    from nonans_optim.kernels.scalar_one import MAXNREG, _one_launch_kernel

    from experiments.kernel_static import ONE_LAUNCH_TYPES as types

    ty = {"fp32": tl.float32, "bf16": tl.bfloat16, "fp16": tl.float16}[param]
    shipped = dict(TY=ty, SF=False, DECAY_Z=False, ALIGNED=True, EMULATE=False, BLOCK=2048, S=6, S_PAD=8, LOSS=4,
                   GRAD=0, BLOCK_P=BLOCK_P, ABLATE=0, LOOP=False)
    for sf, decay_z in ((False, False), (True, False), (True, True)):
        compiled = compile_for_hopper(_one_launch_kernel, types, {**shipped, "SF": sf, "DECAY_Z": decay_z},
                                      num_warps=8, enable_fp_fusion=False, maxnreg=MAXNREG)
        _binary_ok(compiled)
        ptx = compiled.asm["ptx"]
        assert re.search(r"atom(\.\w+)*\.gpu\.acq_rel\.add\.u32", ptx), "the ticket: acq_rel at GPU scope"
        assert re.search(r"ld\.global\.cg", ptx), "the last program reads the others' writes through L2"
        assert f".maxnreg {MAXNREG}" in ptx
        assert "fma.rn.f32" not in ptx, "no contraction: clean repair must equal off"
        assert re.search(r"st\.global(\.\w+)*\.v[24]", ptx), "full blocks: vector stores"
    if param == "fp32":  # the timing-only variants (scalar_one.ABLATIONS) compile too: no fence, no prologue
        compiled = compile_for_hopper(_one_launch_kernel, types, {**shipped, "ABLATE": 3}, num_warps=8,
                                      enable_fp_fusion=False)
        _binary_ok(compiled)
        ptx = compiled.asm["ptx"]  # the ticket relaxed; (the counts' atomics, on a faulty block only, stay acq_rel)
        assert re.search(r"atom(\.\w+)*\.relaxed\.add\.u32", ptx) and not re.search(r"acq_rel\.add\.u32", ptx)
        # programs looping over blocks (scalar_step_one_(programs=...)): the same ticket, under the same limit
        compiled = compile_for_hopper(_one_launch_kernel, types, {**shipped, "LOOP": True}, num_warps=8,
                                      enable_fp_fusion=False, maxnreg=MAXNREG)
        _binary_ok(compiled)
        assert re.search(r"atom(\.\w+)*\.gpu\.acq_rel\.add\.u32", compiled.asm["ptx"])


@pytest.mark.parametrize("consume", [False, True])
def test_record_kernel(consume):
    """The one-launch resolution record (kernels/record.py): int64 counters, bool ring bits, one program;
    ``consume`` also zeroes the step's count block behind its reads."""
    from nonans_optim.kernels.record import BLOCK_P, _record_kernel

    types = dict(SC="*i64", COUNTS="*i64", EVENTS="*i64", RING_COUNTS="*i64", RING_STEP="*i64", RING_ESC="*i1",
                 RING_HELD="*i1", RING_PTR="*i64", SCALE="*fp32", STREAK="*i64", ESCALATIONS="*i64",
                 NUMEL="*i64", step="i64", P="i32", K="i32", backoff="fp32", min_scale="fp32", growth="i32",
                 window="i32")
    _binary_ok(compile_for_hopper(_record_kernel, types,
                                  dict(S=6, S_PAD=8, LOSS=4, GRAD=0, CONSUME=consume, BLOCK_P=BLOCK_P)))


@pytest.mark.parametrize("policy", [0, 1, 2])
@pytest.mark.parametrize("buf, hot", [("fp32", "bf16"), ("bf16", "bf16"), ("fp32", "fp32")])
def test_spectral_step_kernels(policy, buf, hot):
    """The spectral step of impl="fused" on CUDA (kernels/spectral_step.py): its six launches, every variant
    (MONA on and off in the momentum launches), with the argument types the host passes (under "off" the
    decision slots are a float64 scratch tensor, never read). Counting variants use atomics; nothing
    contracts to an FMA (clean repair must equal off); full blocks and aligned rows use vector loads."""
    import triton.language as tl

    from nonans_optim.kernels import spectral_step as k

    tys = {"fp32": tl.float32, "bf16": tl.bfloat16}
    gate = policy != 0
    table = dict(ADDR="*i64", MONA_ADDR="*i64", NUMEL="*i64", FIRST="*i64", BLOCK_TENSOR="*i32")
    slot = (lambda ty: ty) if gate else (lambda ty: "*fp64")  # the dummy that stands in under "off"
    for guard, mona in ((False, False), (False, True), (True, False), (True, True)) if gate else \
            ((False, False), (False, True)):
        kinds = dict(NESTEROV=True, GATE=gate, GUARD=guard, MONA=mona, G_TY=tl.float32, BUF_TY=tys[buf],
                     ALIGNED=True, EMULATE=False, BLOCK=2048)
        msq = compile_for_hopper(k._msq_kernel, dict(table, HP="*fp32", DEC="*fp32" if guard else "*fp64",
                                                     MSQ="*fp64"), kinds, num_warps=8, enable_fp_fusion=False)
        _binary_ok(msq)
        assert re.search(r"ld\.global(\.\w+)*\.v[24]", msq.asm["ptx"]), "full blocks: vector loads"
        # X in the hot dtype; with MONA also fp32 M itself (FullFusion: KL-Shampoo preconditions it first)
        for x_ty in {tys[hot], tl.float32} if mona else {tys[hot]}:
            write = compile_for_hopper(k._write_kernel, dict(table, HP="*fp32", INV="*fp64", SEL=slot("*i64"),
                                                             DEC=slot("*fp32"), DEC_FLAGS=slot("*i32"),
                                                             EMA=slot("*fp32"), DENSE=slot("*i64")),
                                       dict(kinds, X_TY=x_ty), num_warps=8, enable_fp_fusion=False)
            _binary_ok(write)
            assert ("atom" in write.asm["ptx"]) == gate, "counts: atomics exactly when gating"
            assert "fma.rn.f32" not in write.asm["ptx"] + msq.asm["ptx"]
    _binary_ok(compile_for_hopper(k._norm_kernel, dict(MSQ="*fp64", FIRST="*i64", INV="*fp64"),
                                  dict(RBLOCK=1024), num_warps=1, enable_fp_fusion=False))
    # WIDE (a direction that is not NS5's output): ROW_SQ float64, the moment-overflow count an atomic
    for normuon, wide in ((False, False), (True, False), (False, True), (True, True)):
        sq = "*fp64" if wide else "*fp32"
        row_slot = slot if gate else (lambda ty: sq)  # under "off" the host passes ROW_SQ in the unused slots
        for aligned in (False, True):
            rows = compile_for_hopper(k._rows_kernel, dict(PRE="*i64", POST="*i64", ROW_FIRST="*i64",
                                                           ROW_OWNER="*i32", NCOLS="*i64", HP="*fp32",
                                                           DEC_FLAGS=row_slot("*i32"), SEL=row_slot("*i64"),
                                                           DENSE=row_slot("*i64"), ROW_INV="*fp32",
                                                           ROW_SQ=sq, ROW_SUM=row_slot("*fp32")),
                                      dict(NORMUON=normuon, GATE=gate, WIDE=wide, G_TY=tl.float32, O_TY=tys[hot],
                                           ROWS_ALIGNED=aligned, BLOCK_C=1024), num_warps=4,
                                      enable_fp_fusion=False)
            _binary_ok(rows)
            assert "fma.rn.f32" not in rows.asm["ptx"]
            assert ("atom" in rows.asm["ptx"]) == (gate and normuon and wide)
            if aligned:
                assert re.search(r"ld\.global(\.\w+)*\.v[24]", rows.asm["ptx"]), "aligned rows: vector loads"
    scale = compile_for_hopper(k._scale_kernel, dict(ROW_FIRST="*i64", TARGET="*fp32", ROW_INV="*fp32",
                                                     ROW_SQ="*fp32", ROW_SUM="*fp32", SEL=slot("*i64"),
                                                     DENSE=slot("*i64"), FACTOR="*fp32"),
                               dict(GATE=gate, RBLOCK=1024), num_warps=1, enable_fp_fusion=False)
    _binary_ok(scale)
    assert ("atom" in scale.asm["ptx"]) == gate
    for sf, decay in ((False, True), (True, False), (True, True)):
        apply = compile_for_hopper(k._apply_kernel, dict(table, POST="*i64", ROW_FIRST="*i64", NCOLS="*i64",
                                                         ROW_INV="*fp32", FACTOR="*fp32", HP="*fp32",
                                                         GAMMA="*fp32", SCALE=slot("*fp32"), SEL=slot("*i64"),
                                                         DEC_FLAGS=slot("*i32"), DENSE=slot("*i64")),
                                   dict(P_TY=tl.float32, O_TY=tys[hot], SF=sf, DECAY=decay, GATE=gate,
                                        ALIGNED=True, EMULATE=False, BLOCK=2048), num_warps=8,
                                   enable_fp_fusion=False)
        _binary_ok(apply)
        assert ("atom" in apply.asm["ptx"]) == gate
        assert "fma.rn.f32" not in apply.asm["ptx"]
        assert re.search(r"st\.global(\.\w+)*\.v[24]", apply.asm["ptx"]), "full blocks: vector stores"
