"""``python -m experiments kernel-static``: the fused kernels' static sm_90 resources, compiled on this CPU."""
from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="compiling for sm_90 needs compiled (not interpreted) kernels")

from experiments import kernel_static as ks  # noqa: E402


@pytest.mark.parametrize("regs, smem, warps, blocks", [
    (66, 0, 8, 3),        # 72 allocated x 256 threads: three blocks' 55,296 of 65,536 registers
    (108, 0, 8, 2),       # 112 x 256 = 28,672: two
    (80, 0, 8, 3),        # exactly 80: 61,440
    (81, 0, 8, 2),        # rounded up to 88: 67,584 for three, too many
    (16, 0, 8, 8),        # by threads: 2,048 / 256
    (16, 0, 1, 32),       # by the 32-block limit
    (32, 100 * 1024, 4, 2),  # by shared memory: 228 KiB / 100 KiB
])
def test_blocks_per_sm(regs, smem, warps, blocks):
    assert ks.blocks_per_sm(regs, smem, warps) == blocks


def test_reductions_show_as_barriers():
    """The update kernel "off" reduces nothing; its gated variant reduces each block's event codes once: the
    counts must see that difference (a broken barrier or register count would not)."""
    try:
        rows = {v: ks._row(k, v, b) for k, v, b in ks.VARIANTS if k == "(SF-)AdamW update" and "1024" not in v
                and v.startswith("AdamW")}
    except FileNotFoundError as err:  # a triton wheel without cuobjdump
        pytest.skip(str(err))
    off, rep = rows["AdamW, off"], rows["AdamW, repair"]
    assert off["barriers"] == 0 < rep["barriers"]
    assert 0 < off["regs"] < rep["regs"] <= 255 and off["sass"] < rep["sass"]
    assert rep["blocks_per_sm"] == ks.blocks_per_sm(rep["regs"], rep["smem"], rep["warps"]) >= 1


def test_render_with_a_baseline_marks_rows_it_lacks():
    row = dict(kernel="k", variant="v", warps=8, regs=40, stack=16, smem=0, barriers=2, sass=900, blocks_per_sm=6)
    meta = dict(commit="abc1234", date="2026-11-26T00:00:00", triton="3.9.0", target="sm_90")
    old = {k: v for k, v in row.items() if k != "stack"}  # a JSON from before the stack column
    data = {"meta": meta, "rows": [row, dict(row, variant="new"), dict(old, variant="old")],
            "baseline": {"meta": dict(meta, commit="0000000"), "rows": [dict(row, regs=48, blocks_per_sm=5)]}}
    text = ks.render(data)
    assert "(JSON: `results/kernel_static.json`)" in text and "commit 0000000" in text
    assert "| k | v | 8 | 40 | 16 | 6 | 2 | 900 | 48 | 5 | 2 | 900 |" in text
    assert "| k | new | 8 | 40 | 16 | 6 | 2 | 900 | — | — | — | — |" in text
    assert "| k | old | 8 | 40 | — | 6 | 2 | 900 | — | — | — | — |" in text
    assert "before" not in ks.render({"meta": meta, "rows": [row]})


def test_one_launch_kernel_compiles_under_its_register_limit():
    """The one-launch (SF-)AdamW step (kernels/scalar_one.py) compiles for sm_90 with its launch's register
    limit, so it holds as many resident blocks per SM as the update kernel's gated variant; what does not fit
    is spilled, which the "stack" column reports: nothing for "off" as launched, and something for "off"
    forced into 40 registers (its 66 do not fit)."""
    from nonans_optim.kernels.scalar_one import MAXNREG

    try:
        rows = {v: ks._row(k, v, b) for k, v, b in ks.VARIANTS
                if v in ("AdamW, off", "AdamW, repair", "AdamW, repair, one launch")}
        fn, types, constexprs = ks._scalar_update(False, False)
        squeezed = ks.resources(ks.compile_sm90(fn, types, dict(constexprs, BLOCK=2048), 8, maxnreg=40,
                                                  enable_fp_fusion=False))
    except FileNotFoundError as err:  # a triton wheel without cuobjdump
        pytest.skip(str(err))
    one, gated = rows["AdamW, repair, one launch"], rows["AdamW, repair"]
    assert one["regs"] <= MAXNREG and one["blocks_per_sm"] >= gated["blocks_per_sm"]
    assert rows["AdamW, off"]["stack"] == 0 < squeezed["stack"] and squeezed["regs"] <= 40


def test_attach_baseline_drops_the_baselines_own(tmp_path):
    """``--baseline`` (kernel-static, op-count): the other run is embedded, without its own baseline."""
    import json

    from experiments.questions_io import attach_baseline

    other = tmp_path / "other.json"
    other.write_text(json.dumps({"meta": {"commit": "0000000"}, "rows": [1], "baseline": {"rows": [0]}}))
    data = attach_baseline({"meta": {"commit": "abc1234"}, "rows": [2]}, str(other))
    assert data["baseline"] == {"meta": {"commit": "0000000"}, "rows": [1]}
    assert "baseline" not in attach_baseline({"rows": []}, None)


def test_a_run_with_the_gpu_images_triton_has_its_own_section():
    """Compiled with the GPU image's Triton, the command publishes beside the installed Triton's run, not over
    it: the two compilers allocate registers differently (RESULTS.md, both kernel-static sections)."""
    from experiments.render import SECTIONS

    gpu = ks.section_of(f"{ks.GPU_IMAGE_TRITON}.0")
    assert gpu == (f"kernel-static-triton-{ks.GPU_IMAGE_TRITON}", f"kernel_static_triton-{ks.GPU_IMAGE_TRITON}.json")
    assert ks.section_of("3.9.0") == ("kernel-static", "kernel_static.json")
    assert SECTIONS[gpu[0]][0] == gpu[1]
