"""impl="fused" on bf16 tensors: the native (SF-)AdamW loop widens each entry to fp32, runs the fp32 step
and rounds each result once as it stores it (nonans_optim/native/scalar_step.c, scalar_bf16.h and its SIMD
forms scalar_avx512_bf16.h and scalar_avx2_bf16.h); so do the spectral loops, whose bf16 tests (the same
oracle) are in tests/test_fused_bf16_spectral.py, split from this file. It and test_native_simd.py import
the spectral fault sequence and 16 x 1 window run from here (SPECTRAL_SHAPES, _spectral_grads,
_column_window_run).

The oracle is that description. Step by step through tests/test_fused.py's fault sequence (NaN, ±Inf, a
moment overflowing, the hold rule, a spike), an fp32 twin of the bf16 optimizer — its parameters, state
and resolution counters loaded from the bf16 one before every step — takes the same gradient widened; the
bf16 step must write the twin's results rounded to bf16, bit for bit, and record the same events. Where
bf16 and fp32 part ways — a value finite in fp32 that is Inf once stored in bf16 — impl="loop" in bf16 is
the ground truth: the entry is a missing observation, or its parameter is kept, and counted so.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import nonans_optim as no
from nonans_optim import native
from optim_infos import assert_resolution_matches, event_tuples
from test_fused import SHAPES, STEPS, _grads

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native kernel unavailable: {native.failure()}")

BF16_MAX = torch.finfo(torch.bfloat16).max


def _twin(make, opt, params):
    """An fp32 optimizer (``make(params)``) holding ``opt``'s parameters, state and counters, widened (exact)."""
    twins = [p.detach().float().requires_grad_() for p in params]
    twin = make(twins)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))  # a state dict holds references: never share
    return twins, twin


def _assert_rounded(got, got_opt, ref, ref_opt):
    """bf16 parameters equal to the fp32 ones rounded, and every state tensor to the twin's in its own dtype
    (bf16 moments rounded; fp32 ones — ``step``, NorMuon's row moment — equal), NaN where NaN ("off" lets
    the faults through)."""
    for p, q in zip(got, ref):
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(p, q.to(torch.bfloat16), rtol=0, atol=0, equal_nan=True)
        for key, val in got_opt.state[p].items():
            if not torch.is_tensor(val):  # the optimizer-wide resolution record: assert_resolution_matches
                continue
            want = ref_opt.state[q][key].to(val.dtype)
            torch.testing.assert_close(val, want, rtol=0, atol=0, equal_nan=True, msg=key)


def _step_against_twin(make, opt, params, grads, *, counters: bool) -> None:
    """One step of the bf16 optimizer ``opt`` on ``grads`` and, from the second step on (the first creates
    the state), the same step of an fp32 twin (:func:`_twin`) on the widened gradients: the bf16 step must
    write the twin's results rounded (:func:`_assert_rounded`) and, where ``counters``, the same counters."""
    twins, twin = _twin(make, opt, params) if opt.state else (None, None)
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()
    if twin is None:
        return
    for q, g in zip(twins, grads):
        q.grad = g.float()
    twin.step()
    _assert_rounded(params, opt, twins, twin)
    if counters:
        assert_resolution_matches(twin, opt, ema_rtol=0)


@pytest.mark.parametrize("factor", [10.0, None], ids=["guard", "default"])
@pytest.mark.parametrize("policy", ["repair", "skip", "off"])
@pytest.mark.parametrize("cls", [no.AdamW, no.SFAdamW], ids=["AdamW", "SFAdamW"])
def test_bf16_step_is_the_fp32_step_rounded(cls, policy, factor):
    torch.manual_seed(0)
    params = [torch.randn(s).bfloat16().requires_grad_() for s in SHAPES]
    kw = {"lr": 1e-2, "weight_decay": 0.1, "spike_factor": factor, "resolution": policy, "impl": "fused"}
    opt = cls(params, **kw)
    gen = torch.Generator().manual_seed(1)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # 21000 entries: two chunks, one per thread
    try:
        for t in range(STEPS):
            _step_against_twin(lambda ps: cls(ps, **kw), opt, params, [g.bfloat16() for g in _grads(t, gen)],
                               counters=policy != "off")
    finally:
        torch.set_num_threads(before)
    if policy == "off":
        assert not all(torch.isfinite(p).all() for p in params)
        return
    assert all(torch.isfinite(p).all() for p in params)
    stages = {e[2] for e in event_tuples(opt)}
    assert ({"grad", "moment"} if factor is None else {"grad", "spike"}) <= stages, stages


def _window_run(cls, impl: str, dtype=torch.bfloat16):
    """Two steps on 64 entries with lr = 1e36 (every entry moves by about 1e36), after which entries 0 and
    1 hold values that fp32 stores and bf16 cannot: entry 0 starts at bf16's largest value and its update
    (AdamW: p; schedule-free: z, and y) lands in (2 - 2^-8)·2^127 … FLT_MAX; entry 1's new v does (an old v
    of 2.3e36, then g = 5.81e20, whose (1-β₂)·g² is 3.376e38)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64).to(dtype))
    opt = cls([p], lr=1e36, weight_decay=0.0, impl=impl)
    p.grad = torch.full((64,), -1.0, dtype=dtype)
    opt.step()
    with torch.no_grad():
        p[0] = BF16_MAX
        st = opt.state[p]
        if cls is no.SFAdamW:
            st["z"][0] = BF16_MAX
        st["exp_avg_sq"][1] = 2.3e36
    g = torch.full((64,), -1.0, dtype=dtype)
    g[1] = torch.tensor(5.81e20).bfloat16().float()
    p.grad = g
    opt.step()
    return p, opt


@pytest.mark.parametrize("cls", [no.AdamW, no.SFAdamW], ids=["AdamW", "SFAdamW"])
def test_values_that_are_inf_in_bf16_follow_the_loop(cls):
    ref, ref_opt = _window_run(cls, "loop")
    got, got_opt = _window_run(cls, "fused")
    assert_resolution_matches(ref_opt, got_opt)
    stages = {e[2] for e in event_tuples(got_opt)}
    assert {"moment", "update"} <= stages, stages  # both windows were reached
    wide, wide_opt = _window_run(cls, "fused", torch.float32)
    assert not wide_opt.events  # in fp32 the same values are finite: nothing to resolve
    # the kept entries are the old values, exactly; the rest moved as the loop moved them (the loop rounds
    # every op to bf16, the fused step once per stored value)
    assert torch.isfinite(got).all()
    pairs = [(got_opt.state[got][k], ref_opt.state[ref][k]) for k in ref_opt.state[ref]]
    for a, b in [(got, ref), *((a, b) for a, b in pairs if torch.is_tensor(a))]:
        if a.dim() == 0:
            assert torch.equal(a, b)
            continue
        assert torch.equal(a[:2], b[:2])
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=0)


@pytest.mark.parametrize("cls", [no.AdamW, no.SFAdamW], ids=["AdamW", "SFAdamW"])
def test_an_old_v_near_the_limit_takes_the_exact_path(cls):
    """An ordinary step but for one entry: its old v at bf16's largest value and g = 3.6e19, every input of
    its group within the tested path's bound on magnitudes — only the bound on the old v (at most
    FLT_MAX / 4) sends the group to the gated loop, where the new v (3.399e38: finite in fp32, Inf in bf16)
    is a missing observation, as in the loop."""
    runs = []
    for impl, dtype in (("loop", torch.bfloat16), ("fused", torch.bfloat16), ("fused", torch.float32)):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(256).to(dtype))
        opt = cls([p], lr=1e-3, impl=impl)
        p.grad = torch.randn(256).to(dtype)
        opt.step()
        with torch.no_grad():
            opt.state[p]["exp_avg_sq"][70] = BF16_MAX
        p.grad = torch.randn(256).to(dtype)
        p.grad[70] = torch.tensor(3.6e19).bfloat16().float()
        opt.step()
        runs.append((p, opt))
    (ref, ref_opt), (got, got_opt), (_, wide_opt) = runs
    assert not wide_opt.events  # finite in fp32
    assert [(e.stage, e.inf_count) for e in got_opt.events] == [("moment", 1)]
    assert_resolution_matches(ref_opt, got_opt)
    v = got_opt.state[got]["exp_avg_sq"]
    assert torch.isfinite(v).all() and v[70] == BF16_MAX


@pytest.mark.parametrize("cls", [no.AdamW, no.SFAdamW], ids=["AdamW", "SFAdamW"])
def test_bf16_repair_equals_off_on_clean_steps(cls):
    """Under "repair" a clean bf16 step takes the tested path (scalar_bf16.h): the same bits as "off"."""
    runs = []
    for policy in ("off", "repair"):
        torch.manual_seed(0)
        params = [torch.randn(s).bfloat16().requires_grad_() for s in [*SHAPES, (33,)]]
        opt = cls(params, lr=1e-2, weight_decay=0.1, resolution=policy)
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).bfloat16()
            opt.step()
        runs.append((params, opt))
    (a, oa), (b, ob) = runs
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        for key, val in oa.state[p].items():
            if torch.is_tensor(val):
                assert torch.equal(val, ob.state[q][key]), key
    assert not ob.events


_NAN_STEP = r"""
import json, torch
import nonans_optim as no
from nonans_optim import native
out = {"simd_width": native.library().nonans_simd_width()}
for cls in (no.AdamW, no.SFAdamW):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(256).bfloat16())
    lr = torch.tensor(1e-3)  # a tensor lr is used as it is (torch.optim's convention): no validation
    opt = cls([p], lr=lr, impl="fused")
    p.grad = torch.randn(256).bfloat16()
    opt.step()
    before = p.detach().clone()
    lr.copy_(torch.tensor([0x7FFFFFFF], dtype=torch.int32).view(torch.float32)[0])
    p.grad = torch.randn(256).bfloat16()
    opt.step()
    out[cls.__name__] = [bool(torch.equal(p, before)), [(e.stage, e.nan_count) for e in opt.events]]
    opt.resolution_policy = "off"  # stock: every value NaN, stored as torch stores a NaN (0x7FC0)
    p.grad = torch.randn(256).bfloat16()
    opt.step()
    out[cls.__name__ + "/off"] = sorted({int(b) & 0xFFFF for b in p.detach().view(torch.int16).tolist()})
print(json.dumps(out))
"""


@pytest.mark.parametrize("simd", ["auto", "avx2", "portable"])
def test_a_nan_step_size_whose_payload_would_round_to_zero(simd):
    """A NaN step size with the payload 0x7FFFFFFF (a tensor lr) makes every new y (and z) a NaN with that
    payload, which the tested path's NaN-free rounding carries into the sign bit: stored as -0 and counted
    as nothing, where the gated loop keeps p and counts every entry; under "off" every value is NaN, which
    torch stores as 0x7FC0. A non-finite hyperparameter sends the block to the portable loop (scalar_bf16.h,
    finite_hyper_) — in the default build (scalar_avx512_bf16.h or scalar_avx2_bf16.h, by the CPU) and the
    portable one (scalar_bf16.h's tested groups)."""
    env = {**os.environ, "NONANS_NATIVE_SIMD": simd}
    proc = subprocess.run([sys.executable, "-c", _NAN_STEP], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert (out["simd_width"] == 0) == (simd == "portable") or simd == "avx2"  # no AVX2: that build is portable
    for name, per_entry in (("AdamW", 1), ("SFAdamW", 2)):  # schedule-free: y and z
        kept, events = out[name]
        assert kept, name
        assert events == [["update", 256 * per_entry]], (name, events)
        assert out[name + "/off"] == [0x7FC0], name


@settings(max_examples=20, deadline=None)
@given(cls=st.sampled_from([no.AdamW, no.SFAdamW]), policy=st.sampled_from(["repair", "skip"]),
       value=st.sampled_from([float("nan"), float("inf"), float("-inf"), 3e38, -3e38]),
       pattern=st.sampled_from(["element", "tensor"]), where=st.integers(0, 2799), step=st.integers(1, 3),
       seed=st.integers(0, 2 ** 16))
def test_bf16_invariant_and_moments_under_injection(cls, policy, value, pattern, where, step, seed):
    """The resolution contract on the bf16 loop, for a random fault (NaN, ±Inf, or a finite giant whose
    square overflows) on one entry or a whole tensor, at a random step: parameters and state stay finite, a
    non-finite gradient entry leaves both moments exactly as they were, and the event counts what was
    injected. 40 x 70 entries: 43 tested groups of 64 and a tail; the fault lands in any of them."""
    torch.manual_seed(seed)
    shapes = [(40, 70), (33,)]
    params = [torch.randn(s).bfloat16().requires_grad_() for s in shapes]
    opt = cls(params, lr=1e-2, weight_decay=0.1, resolution=policy, spike_factor=None)
    second = "z" if cls is no.SFAdamW else "exp_avg"
    bad = value != value or abs(value) == float("inf")
    for t in range(4):
        for p in params:
            p.grad = torch.randn(p.shape).bfloat16()
        flat = params[0].grad.view(-1)
        if t == step:
            if pattern == "element":
                flat[where] = value
            else:
                flat.fill_(value)
            before = {k: opt.state[params[0]][k].clone() for k in ("exp_avg_sq", second)}
        opt.step()
        if t == step and bad:
            after = opt.state[params[0]]
            hit = torch.zeros(flat.numel(), dtype=torch.bool)
            hit[where if pattern == "element" else slice(None)] = True
            assert torch.equal(after["exp_avg_sq"].view(-1)[hit], before["exp_avg_sq"].view(-1)[hit])
            if cls is no.AdamW:  # (z moves with the direction, which is 0 at a missing entry, and decays)
                assert torch.equal(after["exp_avg"].view(-1)[hit], before["exp_avg"].view(-1)[hit])
    assert all(torch.isfinite(p).all() for p in params)
    assert all(torch.isfinite(v).all() for p in params for v in opt.state[p].values() if torch.is_tensor(v))
    grad_events = [e for e in opt.events if e.stage == "grad"]
    if bad:
        n = 1 if pattern == "element" else 40 * 70
        assert [(e.step, e.param) for e in grad_events] == [(step + 1, 0)]
        assert grad_events[0].nan_count + grad_events[0].inf_count == n
        assert (grad_events[0].nan_count == n) == (value != value)
    else:  # finite: its square overflows v, a missing observation counted in the moment stage
        assert not grad_events and [(e.step, e.stage) for e in opt.events] == [(step + 1, "moment")]


SPECTRAL_SHAPES = [(64, 200), (64, 200), (300, 40), (33, 17)]  # tests/test_fused_spectral.py's


def _spectral_grads(t: int, gen) -> list[torch.Tensor]:
    """test_fused_spectral.py's fault sequence (a NaN and an Inf; a whole matrix lost twice: the hold rule;
    a finite giant whose momentum lerp overflows; a spike the guard rescales), in bf16."""
    gs = [torch.randn(s, generator=gen) for s in SPECTRAL_SHAPES]
    if t == 1:
        gs[0][0, 3], gs[0][5, 5] = float("nan"), float("inf")
    if t in (2, 3):
        gs[3].fill_(float("nan"))
        gs[1][3, 7] = -3.3e38 if t == 2 else 3.3e38
    if t == 4:
        gs[2] *= 1e4
    return [g.bfloat16() for g in gs]


def _column_window_run(cls, impl: str, dtype, sign: float, lr: float, p00: float):
    """A 16 x 1 matrix (one entry per row: spectral_post.c tests a bf16 row's new values by a sum over the
    row, so no other entry's value can overflow that sum and hide what the test itself sees), two steps of
    size ``lr`` (the schedule-free weight c is then 0.5), entry [0, 0] set to ``sign`` · ``p00`` and z's to
    ``sign`` · bf16's largest value before the second."""
    torch.manual_seed(0)
    p = torch.nn.Parameter((0.1 * torch.randn(16, 1)).to(dtype))
    opt = cls([{"params": [p], "path": "spectral"}], lr=lr, weight_decay=0.0, impl=impl)
    p.grad = torch.randn(16, 1).to(dtype)
    opt.step()
    with torch.no_grad():
        p[0, 0] = sign * p00
        if "z" in opt.state[p]:
            opt.state[p]["z"][0, 0] = sign * BF16_MAX
    p.grad = torch.randn(16, 1).to(dtype)
    opt.step()
    return p, opt
