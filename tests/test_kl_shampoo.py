"""KL-Shampoo functional core (nonans_optim/functional/kl_shampoo.py; arXiv 2509.03378,
``yorkerlin/KL-Methods`` optim/kl_opt.py).

The oracle is a float64 loop written here from the formulas (not from the implementation):
    S_a ← β S_a + (1-β)/d_b · G S_b⁻¹ Gᵀ,  S_b ← β S_b + (1-β)/d_a · Gᵀ S_a⁻¹ G,
    D ← lerp(D, diag(Qᵀ G S_other⁻¹ Gᵀ Q)/d_other, 1-β),  S⁻¹ = Q diag(D_eff)⁻¹ Qᵀ,  Q ← qr(S Q).

Non-finite gradients and state (missing observations, internal overflow, the preconditioner's bypass,
floors and damping, finiteness properties) are tested in tests/test_kl_shampoo_nonfinite.py.
"""
from __future__ import annotations

import math

import pytest
import torch

import nonans_optim as no
from nonans_optim.functional.kl_shampoo import (
    ABS_EIG_FLOOR, DEFAULT_DAMPING, STATE_KEYS, kl_shampoo_init_state, kl_shampoo_precondition, kl_shampoo_update_,
    refresh_basis)

F64 = torch.float64
TRUE = torch.tensor(True)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls on a loaded 2-core box run ~1000x slower multi-threaded (spin-wait contention)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def snapshot(state):
    return {k: v.clone() for k, v in state.items()}


# ---------------------------------------------------------------- float64 reference -----------------

def ref_d_eff(D, damping, dim):
    cap = max(10, min(dim, 4000))
    floor = D.max() * max(damping, 1.0 / cap ** 2)
    return torch.clamp(torch.maximum(D, floor), min=ABS_EIG_FLOOR)


def ref_inv(Q, D, damping):
    return Q @ torch.diag(1.0 / ref_d_eff(D, damping, Q.shape[0])) @ Q.T


def ref_step(ref, G, t, beta, refresh_every):
    """One update of the float64 reference; ``ref`` holds Sa, Sb, Qa, Qb, Da, Db, damping."""
    G = G.to(F64)
    da, db = G.shape
    if t == 1:
        ref["Sa"] = (1 - beta) / db * G @ G.T
        ref["Sb"] = (1 - beta) / da * G.T @ G
        ref["Qa"] = torch.linalg.qr(ref["Sa"] @ ref["Qa"]).Q
        ref["Qb"] = torch.linalg.qr(ref["Sb"] @ ref["Qb"]).Q
        return
    Sa_inv = ref_inv(ref["Qa"], ref["Da"], ref["damping"])
    Sb_inv = ref_inv(ref["Qb"], ref["Db"], ref["damping"])
    new_Sa = beta * ref["Sa"] + (1 - beta) / db * G @ Sb_inv @ G.T
    new_Sb = beta * ref["Sb"] + (1 - beta) / da * G.T @ Sa_inv @ G
    target_a = torch.diag(ref["Qa"].T @ G @ Sb_inv @ G.T @ ref["Qa"]) / db
    target_b = torch.diag(ref["Qb"].T @ G.T @ Sa_inv @ G @ ref["Qb"]) / da
    ref["Da"] = beta * ref["Da"] + (1 - beta) * target_a
    ref["Db"] = beta * ref["Db"] + (1 - beta) * target_b
    ref["Sa"], ref["Sb"] = new_Sa, new_Sb
    if t % refresh_every == 0:
        ref["Qa"] = torch.linalg.qr(ref["Sa"] @ ref["Qa"]).Q
        ref["Qb"] = torch.linalg.qr(ref["Sb"] @ ref["Qb"]).Q


def ref_from_state(state):
    return {"Sa": state["kl_factor_left"].to(F64), "Sb": state["kl_factor_right"].to(F64),
            "Qa": state["kl_basis_left"].to(F64), "Qb": state["kl_basis_right"].to(F64),
            "Da": state["kl_eigvals_left"].to(F64), "Db": state["kl_eigvals_right"].to(F64),
            "damping": float(state["kl_damping"])}


def assert_matches_ref(state, ref, rtol):
    def close(a, b, name):
        err = (a.to(F64) - b).abs().max() / b.abs().max()
        assert err < rtol, f"{name}: relative error {err:.2e}"
    close(state["kl_factor_left"], ref["Sa"], "S_a")
    close(state["kl_factor_right"], ref["Sb"], "S_b")
    close(state["kl_eigvals_left"], ref["Da"], "D_a")
    close(state["kl_eigvals_right"], ref["Db"], "D_b")
    # bases only up to column signs: compare the sign-free reconstruction Q diag(D) Qᵀ. QR of a
    # rank-deficient S·Q completes the null space from rounding noise (any orthonormal completion is
    # valid), so there only orthonormality is checked.
    for side, Q, D, S in (("left", "Qa", "Da", "Sa"), ("right", "Qb", "Db", "Sb")):
        Qi = state[f"kl_basis_{side}"].to(F64)
        torch.testing.assert_close(Qi.T @ Qi, torch.eye(Qi.shape[0], dtype=F64), atol=1e-5, rtol=0)
        w = torch.linalg.eigvalsh(ref[S])
        if w.min() > 1e-6 * w.max():
            close(Qi @ torch.diag(ref[D]) @ Qi.T, ref[Q] @ torch.diag(ref[D]) @ ref[Q].T, f"Q_{side}")


# ---------------------------------------------------------------- tests ------------------------------

def test_init_state_layout():
    state = kl_shampoo_init_state((5, 3), "cpu", init_factor=0.25)
    assert tuple(state) == STATE_KEYS
    assert all(v.dtype == torch.float32 for v in state.values())
    assert state["kl_factor_left"].shape == (5, 5) and state["kl_factor_right"].shape == (3, 3)
    assert torch.equal(state["kl_basis_left"], torch.eye(5))
    assert torch.equal(state["kl_eigvals_right"], torch.full((3,), 0.25))
    assert state["kl_damping"].ndim == 0 and float(state["kl_damping"]) == pytest.approx(DEFAULT_DAMPING)
    # a fresh state preconditions by exactly 1/init_factor (identity bases, equal eigenvalues)
    M = torch.randn(5, 3)
    P, bypassed = kl_shampoo_precondition(state, M)
    torch.testing.assert_close(P, M / 0.25)
    assert not bypassed
    with pytest.raises(ValueError):
        kl_shampoo_update_(state, torch.randn(3, 5), TRUE, 1)
    with pytest.raises(ValueError):
        kl_shampoo_update_(state, torch.randn(5, 3), TRUE, 0)


def test_coupled_update_matches_float64_reference_end_to_end():
    """Square full-rank gradients: 25 steps with refreshes every 4, fp32 vs a float64 loop."""
    g = torch.Generator().manual_seed(1)
    m = n = 5
    beta, refresh = 0.9, 4
    state = kl_shampoo_init_state((m, n), "cpu")
    ref = ref_from_state(state)
    for t in range(1, 26):
        G = torch.randn(m, n, generator=g) * 3.0
        bad = kl_shampoo_update_(state, G, TRUE, t, beta=beta, refresh_every=refresh)
        ref_step(ref, G, t, beta, refresh)
        assert not bad
    assert_matches_ref(state, ref, rtol=2e-4)
    # the run really exercised the tracking: eigenvalues moved far from init_factor and differ
    assert state["kl_eigvals_left"].std() > 0.05 and (state["kl_eigvals_left"] - 0.1).abs().min() > 0.05


@pytest.mark.parametrize("shape", [(7, 3), (3, 7), (4, 4), (1, 6)])
def test_coupled_update_matches_float64_reference_per_step(shape):
    """Each step from the implementation's own state (tall, wide, square, a row vector): rank-deficient
    factors make the QR completion of their null space rounding-dependent, so an end-to-end comparison
    across dtypes would compare two equally valid bases."""
    g = torch.Generator().manual_seed(2)
    beta, refresh = 0.95, 3
    state = kl_shampoo_init_state(shape, "cpu")
    for t in range(1, 13):
        G = torch.randn(*shape, generator=g)
        ref = ref_from_state(state)
        ref_step(ref, G, t, beta, refresh)
        kl_shampoo_update_(state, G, TRUE, t, beta=beta, refresh_every=refresh)
        assert_matches_ref(state, ref, rtol=1e-4)


@pytest.mark.parametrize("shape", [(6, 6), (8, 3), (3, 8)])
def test_precondition_equals_inverse_roots_with_exact_eigenpairs(shape):
    g = torch.Generator().manual_seed(3)
    m, n = shape

    def spd(d):
        Q = torch.linalg.qr(torch.randn(d, d, dtype=F64, generator=g)).Q
        return Q @ torch.diag(torch.rand(d, dtype=F64, generator=g) * 3.5 + 0.5) @ Q.T

    Sa, Sb = spd(m), spd(n)
    state = kl_shampoo_init_state(shape, "cpu")
    for side, S in (("left", Sa), ("right", Sb)):
        w, V = torch.linalg.eigh(S)
        state[f"kl_basis_{side}"].copy_(V)
        state[f"kl_eigvals_{side}"].copy_(w)

    def power(S, e):
        w, V = torch.linalg.eigh(S)
        return V @ torch.diag(w ** e) @ V.T

    M = torch.randn(m, n, dtype=F64, generator=g)
    expected = power(Sa, -0.5) @ M @ power(Sb, -0.5)
    P, bypassed = kl_shampoo_precondition(state, M.float())
    assert not bypassed and P.dtype == torch.float32
    torch.testing.assert_close(P.to(F64), expected, rtol=1e-5, atol=1e-5)
    # the exponent is -1/2 per factor, not Shampoo's -1/4: the two differ measurably here
    shampoo = power(Sa, -0.25) @ M @ power(Sb, -0.25)
    assert (P.to(F64) - shampoo).abs().max() > 1e-2
    # bf16 M in, bf16 P out
    Pb, _ = kl_shampoo_precondition(state, M.to(torch.bfloat16))
    assert Pb.dtype == torch.bfloat16
    torch.testing.assert_close(Pb.to(F64), expected, rtol=2e-2, atol=2e-2)


def test_basis_refresh_converges_to_eigenbasis_of_fixed_factor():
    """β = 1 freezes the factors; refresh_every = 1 runs one power iteration + QR per call, which is
    subspace iteration: every leading-k subspace converges to the top-k eigenvectors."""
    g = torch.Generator().manual_seed(4)
    m, n = 8, 5
    state = kl_shampoo_init_state((m, n), "cpu")
    kl_shampoo_update_(state, torch.randn(m, n, generator=g), TRUE, 1)

    Va, Vb = (torch.linalg.qr(torch.randn(d, d, dtype=F64, generator=g)).Q for d in (m, n))
    wa, wb = (2.0 ** -torch.arange(d, dtype=F64) for d in (m, n))  # descending, gaps of 2x
    Sa, Sb = (Va * wa) @ Va.T, (Vb * wb) @ Vb.T
    state["kl_factor_left"].copy_(Sa)
    state["kl_factor_right"].copy_(Sb)
    frozen = snapshot(state)

    def worst_subspace_gap(Q, V):
        Q = Q.to(F64)
        return max(torch.linalg.matrix_norm(V[:, :k] - Q[:, :k] @ (Q[:, :k].T @ V[:, :k]), ord=2).item()
                   for k in range(1, V.shape[1]))

    gaps = []
    for t in range(2, 62):
        kl_shampoo_update_(state, 0.1 * torch.randn(m, n, generator=g), TRUE, t, beta=1.0, refresh_every=1)
        gaps.append(worst_subspace_gap(state["kl_basis_left"], Va))
    assert torch.equal(state["kl_factor_left"], frozen["kl_factor_left"])  # β = 1 really froze S
    assert gaps[0] > 1e-2  # it started far from the eigenbasis ...
    assert gaps[-1] < 1e-5  # ... and converged
    assert worst_subspace_gap(state["kl_basis_right"], Vb) < 1e-5
    # the tracked basis diagonalises S: off-diagonal mass of Qᵀ S Q is tiny
    Q = state["kl_basis_left"].to(F64)
    R = Q.T @ Sa @ Q
    assert (R - torch.diag(torch.diag(R))).abs().max() < 1e-5
    torch.testing.assert_close(torch.diag(R), wa, rtol=1e-4, atol=1e-6)
    # and the helper alone: warm start from a perturbed eigenbasis converges in a few iterations
    Q0 = torch.linalg.qr(Va + 0.1 * torch.randn(m, m, dtype=F64, generator=g)).Q.float()
    for _ in range(40):
        Q0 = refresh_basis(Sa.float(), Q0)
    assert worst_subspace_gap(Q0, Va) < 1e-5


def test_preconditioned_descent_beats_best_gradient_descent():
    """Least squares ½‖XW − Y‖²/N, W 32×16, design columns scaled over 2.5 decades (κ(XᵀX) ≈ 1e5).
    W* has equal loss in every eigendirection of XᵀX, so the slow directions matter. Plain GD is
    computed exactly in the eigenbasis (checked against a real loop), at the best of 40 fixed lrs up
    to 2/(λ_max+λ_min) (the optimal fixed step for a quadratic). KL-preconditioned descent uses
    the paper's order: precondition with the previous state, then absorb the gradient."""
    g = torch.Generator().manual_seed(0)
    N, m, n = 256, 32, 16
    X = torch.randn(N, m, dtype=F64, generator=g) * torch.logspace(0, -2.5, m, dtype=F64)
    lam, U = torch.linalg.eigh(X.T @ X / N)
    W_star = (U * lam.rsqrt()) @ U.T @ torch.randn(m, n, dtype=F64, generator=g)
    Y = X @ W_star

    def loss(W):
        return 0.5 * ((X @ W - Y) ** 2).sum().item() / N

    def grad(W):
        return X.T @ (X @ W - Y) / N

    L0, tol = loss(torch.zeros(m, n, dtype=F64)), 0.1
    c2 = ((U.T @ W_star) ** 2).sum(1)

    def gd_loss(lr, t):  # error component along eigenvector i shrinks by (1 − lr λ_i) per step
        return 0.5 * (lam * (1 - lr * lam) ** (2 * t) * c2).sum().item()

    W = torch.zeros(m, n, dtype=F64)  # the closed form is the loop
    for _ in range(300):
        W -= (1.0 / lam.max()) * grad(W)
    assert loss(W) == pytest.approx(gd_loss(1.0 / lam.max(), 300), rel=1e-9)

    def gd_steps(lr):
        lo, hi = 0, 10 ** 7
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if gd_loss(lr, mid) <= tol * L0 else (mid, hi)
        return hi

    best_gd = min(gd_steps(f * 2 / (lam.max() + lam.min()).item()) for f in torch.linspace(0.05, 1, 40))

    def kl_steps(lr, cap=2000):
        W = torch.zeros(m, n, dtype=F64)
        state = kl_shampoo_init_state((m, n), "cpu")
        for t in range(1, cap + 1):
            G = grad(W).float()
            P, bypassed = kl_shampoo_precondition(state, G)
            assert not bypassed
            kl_shampoo_update_(state, G, TRUE, t)
            W -= lr * P.to(F64)
            if loss(W) <= tol * L0:
                return t
        return math.inf

    best_kl = min(kl_steps(lr) for lr in (0.3, 1.0))
    assert best_gd > 3000  # the problem really is ill-conditioned for GD (measured 6399)
    assert best_gd / best_kl > 8, (best_gd, best_kl)  # measured 6399 / 391 ≈ 16


@pytest.mark.gpu
def test_no_host_sync_on_cuda():
    dev = torch.device("cuda")
    state = kl_shampoo_init_state((64, 32), dev)
    Gs = [torch.randn(64, 32, device=dev) for _ in range(12)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for t, G in enumerate(Gs, start=1):
            P, bypassed = kl_shampoo_precondition(state, G)
            ok = torch.isfinite(G).all()
            bad = kl_shampoo_update_(state, G, ok, t, refresh_every=5)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(P).all() and not bypassed and not bad


@pytest.mark.parametrize("step", [1, 2, 10])  # the first step, a coupled update, one with a basis refresh
def test_batched_form_is_the_per_matrix_form(step):
    """A stack of three states through the batched form: each matrix's new state, its preconditioned M and
    its flags those of the per-matrix calls (up to batched-product rounding) — with a missing observation
    (ok False: that matrix's state bit for bit unchanged), a bypass (an infinite eigenvalue: that matrix's
    preconditioner bypassed, its update's candidate not finite) and an internal overflow (a huge finite G)
    in the stack. Square at the first step: a rank-deficient factor's QR basis is arbitrary in its null
    space, and batched and single QR need not pick the same one there."""
    torch.manual_seed(0)
    m, n, B = (5, 5, 4) if step == 1 else (6, 4, 4)
    states = [kl_shampoo_init_state((m, n), "cpu") for _ in range(B)]
    for st_ in states:  # a few clean steps first, so the factors and bases are not trivial
        for s in range(1, step):
            kl_shampoo_update_(st_, torch.randn(m, n), torch.tensor(True), s, refresh_every=10)
    states[2]["kl_eigvals_left"][1] = float("inf")  # its preconditioner bypasses
    G, M = torch.randn(B, m, n), torch.randn(B, m, n)
    G[3, 0, 0] = 3e38  # finite: the update overflows inside (from step 2; step 1's G Gᵀ overflows too)
    ok = torch.tensor([True, False, True, True])
    loop = [{k: v.clone() for k, v in st_.items()} for st_ in states]
    stacked = {k: torch.stack([st_[k] for st_ in states]) for k in STATE_KEYS}
    P, bypassed = kl_shampoo_precondition(stacked, M)
    internal = kl_shampoo_update_(stacked, G, ok, step, refresh_every=10)
    for b in range(B):
        P_b, bypassed_b = kl_shampoo_precondition(loop[b], M[b])
        internal_b = kl_shampoo_update_(loop[b], G[b], ok[b], step, refresh_every=10)
        # rtol 1e-4: on an Intel Xeon (AVX-512, AMX) the batched products differed by 2.2e-5 relative at
        # step 2 (one entry of 24; 2026-11-26), within 1e-5 on an AMD EPYC
        torch.testing.assert_close(P[b], P_b, rtol=1e-4, atol=1e-5)
        assert bool(bypassed[b]) == bool(bypassed_b) and bool(internal[b]) == bool(internal_b)
        for k in STATE_KEYS:
            torch.testing.assert_close(stacked[k][b], loop[b][k], rtol=1e-5, atol=1e-6, equal_nan=True)
    assert bypassed.tolist() == [False, False, True, False] and internal.tolist() == [False, False, True, True]
    for k in STATE_KEYS:  # the missing observation: untouched, bit for bit
        if k != "kl_damping":
            assert torch.equal(stacked[k][1], states[1][k]), k


@pytest.mark.parametrize("impl", ["loop", "foreach", "fused"])
def test_a_held_parameter_keeps_its_kl_damping(impl):
    """A held parameter (no finite gradient entry, an event within the repeat window) keeps its value and
    its whole state. Its stale momentum still went through the preconditioner, whose bypass raised the
    damping x10 — for good, so repeated holds pushed the preconditioner towards a plain scalar (the fuzz
    audit, 2026-11-26). tests/test_kernels_spectral_step.py runs it on the Triton path."""
    check_held_keeps_kl_damping("cpu", impl)


def check_held_keeps_kl_damping(device, impl: str, shape=(2, 2)) -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(shape, device=device))
    opt = no.FullFusion([("w", w)], lr=1e-3, momentum=0.0, spike_factor=None, impl=impl)
    big = torch.tensor([[3.4e38, -1e38], [2e38, 3e38]], device=device).repeat(shape[0] // 2, shape[1] // 2)
    w.grad = big  # finite, but the factor update overflows: an event
    opt.step()
    before = {k: v.clone() for k, v in opt.state[w].items() if torch.is_tensor(v) and k != "step"}
    w.grad = torch.full(shape, float("nan"), device=device)  # the whole tensor lost one step after an event
    opt.step()
    assert [e.action for e in opt.events if e.step == 2 and e.stage == "grad"] == ["held"]
    changed = [k for k, v in before.items() if not torch.equal(v, opt.state[w][k])]
    assert changed == [], changed
