"""KL-Shampoo functional core (nonans_optim/functional/kl_shampoo.py) under non-finite values: a missing
observation or an internal overflow leaves the state bit for bit unchanged, the preconditioner bypasses
(and raises its damping) on non-finite eigenvalues or output, zero eigenvalues are floored, and random
shapes, dtypes and scales stay finite. Split from tests/test_kl_shampoo.py, whose thread fixture and
helpers it imports."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nonans_optim.functional.kl_shampoo import (
    DAMPING_GROWTH, MAX_DAMPING, STATE_KEYS, _all_finite, amplification_cap, inverse_root, kl_shampoo_init_state,
    kl_shampoo_precondition, kl_shampoo_update_)
from test_kl_shampoo import TRUE, _one_thread, snapshot  # noqa: F401  (_one_thread: its autouse fixture)


BAD = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}


def assert_state_equal(state, snap):
    for k in STATE_KEYS:
        assert torch.equal(state[k], snap[k]), k


def warm_state(m, n, steps=7, seed=0, refresh_every=3):
    g = torch.Generator().manual_seed(seed)
    state = kl_shampoo_init_state((m, n), "cpu")
    for t in range(1, steps + 1):
        kl_shampoo_update_(state, torch.randn(m, n, generator=g), TRUE, t, refresh_every=refresh_every)
    return state


@pytest.mark.parametrize("value", sorted(BAD))
@pytest.mark.parametrize("pattern", ["element", "row", "tensor"])
@pytest.mark.parametrize("step", [1, 5, 6])  # init, plain step, refresh step (refresh_every = 3 → 6)
def test_missing_observation_keeps_state_bit_identical(value, pattern, step):
    m, n = 6, 4
    state = warm_state(m, n, steps=step - 1)
    G = torch.randn(m, n)
    if pattern == "element":
        G[2, 1] = BAD[value]
    elif pattern == "row":
        G[3] = BAD[value]
    else:
        G.fill_(BAD[value])
    before = snapshot(state)
    ok = torch.isfinite(G).all()
    internal_bad = kl_shampoo_update_(state, G.to(torch.bfloat16), ok, step, refresh_every=3)
    assert_state_equal(state, before)
    assert internal_bad.ndim == 0 and not internal_bad  # the cause was outside: not an internal event
    # the next clean gradient updates normally
    kl_shampoo_update_(state, torch.randn(m, n), TRUE, step + 1, refresh_every=3)
    assert not torch.equal(state["kl_factor_left"], before["kl_factor_left"])
    assert all(torch.isfinite(v).all() for v in state.values())


@pytest.mark.parametrize("step", [1, 4, 6])
def test_internal_overflow_is_contained_and_reported(step):
    m, n = 5, 3
    state = warm_state(m, n, steps=step - 1)
    before = snapshot(state)
    G = torch.full((m, n), 1e25)  # finite, but G Gᵀ ≈ 1e50 overflows fp32
    bad = kl_shampoo_update_(state, G, TRUE, step, refresh_every=3)
    assert bad
    assert_state_equal(state, before)
    # a caller that passes ok=True with a NaN gradient is caught the same way
    G[0, 0] = float("nan")
    assert kl_shampoo_update_(state, torch.randn(m, n) + G, TRUE, step, refresh_every=3)
    assert_state_equal(state, before)


def test_precondition_clean_call():
    state = warm_state(6, 4)
    damping = state["kl_damping"].clone()
    M = torch.randn(6, 4)
    P, bypassed = kl_shampoo_precondition(state, M)
    assert bypassed.ndim == 0 and not bypassed
    assert torch.isfinite(P).all() and not torch.equal(P, M)
    assert torch.equal(state["kl_damping"], damping)


@pytest.mark.parametrize("inject", ["inf_eig", "nan_eig", "huge_M", "fp16_cast"])
def test_precondition_bypass_on_nonfinite(inject):
    state = warm_state(6, 4)
    # seeded: with the global RNG, about 1 draw in 70 left the fp16 case's P under 65504 (a flaky failure)
    M = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    if inject == "inf_eig":
        state["kl_eigvals_left"][2] = float("inf")  # 1/√Inf = 0 would silently zero a direction
    elif inject == "nan_eig":
        state["kl_eigvals_right"][1] = float("nan")
    elif inject == "huge_M":
        M[0, 0] = 3e38  # amplification > 1 overflows fp32
    else:
        M = (M / M.abs().max() * 6e4).half()  # finite fp16; P (amplified) overflows 65504 on the cast
        assert torch.isfinite(M).all()
    d0 = state["kl_damping"].clone()
    P, bypassed = kl_shampoo_precondition(state, M)
    assert bypassed
    assert torch.equal(P, M) and torch.isfinite(P).all() and P.dtype == M.dtype
    torch.testing.assert_close(state["kl_damping"], d0 * DAMPING_GROWTH)


def test_zero_eigenvalue_is_floored_not_zeroed():
    """kl_opt.py's nan_to_num(→0) would drop this direction; here it gets the capped amplification."""
    state = kl_shampoo_init_state((6, 4), "cpu")
    state["kl_eigvals_left"].copy_(torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0]))
    state["kl_eigvals_right"].fill_(1.0)
    M = torch.ones(6, 4)
    P, bypassed = kl_shampoo_precondition(state, M)
    assert not bypassed
    cap = amplification_cap(6)
    torch.testing.assert_close(P[2], torch.full((4,), cap))  # amplified by exactly the cap, not 0 or ∞
    torch.testing.assert_close(P[0], torch.ones(4))


def test_damping_escalates_to_a_cap_and_damps_the_spread():
    state = warm_state(4, 3)
    state["kl_eigvals_left"][0] = float("inf")
    for _ in range(20):
        kl_shampoo_precondition(state, torch.randn(4, 3))
    assert float(state["kl_damping"]) == pytest.approx(MAX_DAMPING)
    # a larger relative damping really narrows the spread of the inverse roots (cap 4000 → floor 6e-8)
    D = torch.tensor([1.0, 1e-3, 1e-9])
    spread = [(lambda s: s.max() / s.min())(inverse_root(D, torch.tensor(d), 4000.0)).item()
              for d in (1e-8, 1e-6, 1e-4, 1e-2, 1.0)]
    assert all(a > b for a, b in zip(spread, spread[1:]))
    assert spread[-1] == pytest.approx(1.0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1, 9), n=st.integers(1, 9), steps=st.integers(1, 12),
       refresh_every=st.sampled_from([1, 3, 10]), log_scale=st.floats(-4, 4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
       seed=st.integers(0, 2 ** 16))
def test_property_finite_shape_dtype(m, n, steps, refresh_every, log_scale, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    scale = 10.0 ** log_scale
    state = kl_shampoo_init_state((m, n), "cpu")
    for t in range(1, steps + 1):
        G = (torch.randn(m, n, generator=g) * scale).to(dtype)
        bad = kl_shampoo_update_(state, G, torch.isfinite(G).all(), t, refresh_every=refresh_every)
        assert not bad
    assert all(torch.isfinite(v).all() for v in state.values())
    for side, d in (("left", m), ("right", n)):  # bases stay orthonormal
        Q = state[f"kl_basis_{side}"]
        torch.testing.assert_close(Q.T @ Q, torch.eye(d), atol=1e-4, rtol=0)
    M = (torch.randn(m, n, generator=g) * scale).to(dtype)
    P, _ = kl_shampoo_precondition(state, M)
    assert P.shape == M.shape and P.dtype == M.dtype
    assert torch.isfinite(P).all()


@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
       faults=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 10 ** 6), st.sampled_from(sorted(BAD))),
                       max_size=4),
       seed=st.integers(0, 2 ** 16))
def test_all_finite_is_isfinite_all(sizes, dtype, faults, seed):
    """The one-pass min/max verdict equals isfinite(t).all() over several tensors, whatever the mix and
    lane positions of NaN, +Inf and -Inf (a min/max that dropped NaN in some vector lane would fail)."""
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(k, generator=g).to(dtype) for k in sizes]
    for which, pos, kind in faults:
        t = tensors[which % len(tensors)]
        if t.numel():
            t[pos % t.numel()] = BAD[kind]
    expected = all(bool(torch.isfinite(t).all()) for t in tensors)
    got = _all_finite(*tensors)
    assert got.dtype == torch.bool and got.shape == () and bool(got) == expected
