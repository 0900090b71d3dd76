"""KL-Shampoo (arXiv 2509.03378; code ``yorkerlin/KL-Methods`` optim/kl_opt.py), functional core.

For one 2-D parameter with gradient G of shape m×n (d_a = m, d_b = n), KL-Shampoo fits a Kronecker
covariance S_a ⊗ S_b to the gradient second moment by minimising a KL divergence. Its fixed point couples
the two factors: each is accumulated from the gradient *whitened by the other factor's inverse*

    S_a ← β S_a + (1-β)/d_b · G S_b⁻¹ Gᵀ          S_b ← β S_b + (1-β)/d_a · Gᵀ S_a⁻¹ G

(plain Shampoo uses the raw G Gᵀ, Gᵀ G — FusionOpt's "KL-Shampoo" is that: ``Taikakim/fusion-optimiser``
fusion_optimiser/optimizer.py ``_spectral_group_step``), and the direction is preconditioned with exponent
−1/2 *per factor* (Shampoo uses −1/4):

    P = S_a^{-1/2} M S_b^{-1/2} = Q_a [ (Q_aᵀ M Q_b) ⊙ (d_a^{-1/2} d_b^{-1/2}ᵀ) ] Q_bᵀ.

No eigendecomposition runs per step. Each factor S = Q diag(D) Qᵀ is represented by a basis Q, refreshed
every ``refresh_every`` steps by one warm-started power iteration plus QR (Q ← qr(S·Q)), and eigenvalues D
tracked *every* step in that basis: D ← lerp(D, diag(Qᵀ G S_other⁻¹ Gᵀ Q)/d_other, 1-β). S⁻¹ inside the
coupled update also comes from the tracked pair (Q, D). All of this is in kl_opt.py
(``update_2d_preconditioner``, ``update_eigen_value``, ``get_orthogonal_matrix_QR``).

Deviations from kl_opt.py, each for a reason:

* **No eigh, ever.** The paper runs eigh once at initialisation; on CUDA eigh checks its convergence info
  on the host (a sync). Here the first basis is one power iteration from the identity, qr(S·I); the
  eigenvalues are set to ``init_factor`` anyway (kl_opt.py ``get_orthogonal_matrix`` discards the eigh
  values), so only the basis differs, and the periodic refresh converges it to the eigenbasis.
* **fp32 state**, not bf16 (``cast_dtype``): bf16 factors, with 8 significant bits, lose the small eigenvalues.
* **Inverse roots are floored, never zeroed.** kl_opt.py passes 1/√D through ``nan_to_num(→0)``, which
  silently *zeroes* a direction whose eigenvalue underflowed or overflowed, then clamps 1/√D ≤
  max(10, min(dim, 4000)) in absolute terms. Here D is floored *relative to the largest eigenvalue of the
  same factor*: D_eff = max(D, D_max·max(kl_damping, 1/cap²), 1e-30) with the paper's cap
  = max(10, min(dim, 4000)). That bounds each factor's amplification spread by ``cap`` exactly as the
  paper's clamp intends, but is invariant to the gradient's scale — needed because NS5 follows in
  FullFusion and throws away magnitude, so an absolute clamp would flatten the preconditioner to a
  multiple of the identity whenever gradients are small (all 1/√D hit the clamp). Stored D stays the raw
  EMA (the paper stores the clamped value back). The damping s/(1+s·ε), ε = 1e-8, of
  ``klshampoo_update`` is numerically inert and is replaced by this floor.
* **Containment.** A gradient flagged not-ok is a missing observation: every state tensor keeps its value
  (``torch.where`` on a 0-d flag — never a 0/1 multiply, 0·NaN = NaN). A non-finite value produced inside
  the update (overflow of G S⁻¹ Gᵀ, say) is contained the same way and reported as ``internal_bad``.
  A non-finite preconditioned direction is replaced by M itself (bypass) and the relative damping of that
  parameter grows ×10 (capped at 1: the preconditioner then degenerates to a scalar, i.e. plain Muon).

Call order (kl_opt.py ``step``): precondition M with the state built from *previous* gradients, then
absorb the current gradient with ``kl_shampoo_update_`` — the projection never uses the current gradient.
On a fresh state every eigenvalue equals ``init_factor`` and the bases are the identity, so the
preconditioner is M / init_factor up to rounding (a pure scale, harmless before NS5).

Batched form: ``kl_shampoo_update_`` and ``kl_shampoo_precondition`` also take a stack — every state tensor
and G (or M) with a leading dimension B, ``ok`` and the damping (B,), one step for the stack — and return
(B,) flags: the same arithmetic per matrix, in one launch per op for the stack (what the fused step runs on
CUDA, where KL-Shampoo's ~100 small ops per matrix are the host's time: ``optimizers/_kl_stacks.py``).
Up to the rounding of batched against single matrix products it is the loop's result.

No host syncs by construction: Python branches only on ``step``; flags stay 0-d device tensors. Whether
CUDA ``torch.linalg.qr`` itself is sync-free is checked by the gpu-marked test in
tests/test_kl_shampoo.py (passed on an H200, 2026-11-27).
"""
from __future__ import annotations

import torch

__all__ = [
    "STATE_KEYS", "kl_shampoo_init_state", "kl_shampoo_update_", "kl_shampoo_precondition",
    "amplification_cap", "inverse_root", "refresh_basis",
    "DEFAULT_INIT_FACTOR", "DEFAULT_DAMPING", "MAX_DAMPING", "DAMPING_GROWTH", "ABS_EIG_FLOOR",
]

STATE_KEYS = ("kl_factor_left", "kl_factor_right", "kl_basis_left", "kl_basis_right",
              "kl_eigvals_left", "kl_eigvals_right", "kl_damping")

DEFAULT_INIT_FACTOR = 0.1  # kl_opt.py ``init_factor``: every tracked eigenvalue starts here
DEFAULT_DAMPING = 1e-8     # kl_opt.py ``eps``; a relative floor, dominated by 1/cap² until escalated
DAMPING_GROWTH = 10.0      # per bypass
MAX_DAMPING = 1.0          # D_eff = D_max for all directions: preconditioner reduces to a scalar
ABS_EIG_FLOOR = 1e-30      # keeps 1/√D finite (≤ 1e15) when a whole factor has decayed to zero


def amplification_cap(dim: int, max_clamp_value: int = 4000) -> float:
    """The paper's cap on the inverse root, max(10, min(dim, 4000)) (kl_opt.py ``update_eigen_value``).

    Used here as a cap on the *spread* of one factor's inverse roots: max/min of 1/√D_eff ≤ cap."""
    return float(max(10, min(dim, max_clamp_value)))


def inverse_root(eigvals: torch.Tensor, damping: torch.Tensor, cap: float) -> torch.Tensor:
    """Return s = D_eff^{-1/2} with D_eff = max(D, D_max·max(damping, 1/cap²), ABS_EIG_FLOOR).

    Why a floor relative to D_max rather than ``nan_to_num(→0)``: a direction whose tracked eigenvalue
    decayed to 0 (it has seen no gradient for a while) must not be zeroed or amplified without bound; it
    gets the largest allowed amplification, ``cap`` times that of the dominant direction. NaN in D
    propagates (``torch.maximum`` keeps NaN) and +Inf gives s = 0, so the caller can detect a corrupt
    state from s instead of silently losing directions."""
    ratio = torch.clamp(damping.to(eigvals.dtype), min=1.0 / (cap * cap))
    if ratio.ndim:  # a stack's (B,) dampings against its (B, k) eigenvalues
        ratio = ratio.unsqueeze(-1)
    d_max = eigvals.amax(dim=-1, keepdim=True)
    d_eff = torch.maximum(eigvals, d_max * ratio).clamp_min(ABS_EIG_FLOOR)
    return torch.rsqrt(d_eff)


def refresh_basis(S: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """One warm-started power iteration plus QR: Q ← qr(S·Q) (kl_opt.py ``get_orthogonal_matrix_QR``).

    S is pre-scaled by 1/max|S| (Q is invariant to the scale of S·Q) so the product cannot overflow even
    for a finite S with huge entries; a zero S gives the orthonormal Q of a zero matrix instead of 0/0.
    Repeated refreshes are subspace iteration: column k converges to the k-th eigenvector of S, at a
    rate set by the eigenvalue gaps. QR never pivots, so a basis already close to an eigenbasis keeps
    its column order and the tracked eigenvalues stay paired with their columns. fp32 throughout."""
    S = S.float()
    scale = S.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.linalg.qr((S / scale) @ Q.float()).Q


def _all_finite(*tensors: torch.Tensor, batch: bool = False) -> torch.Tensor:
    """0-d bool: every entry of every tensor is finite (device-side, no sync); with ``batch``, a (B,) bool
    per leading index of tensors stacked along dim 0.

    Why ``aminmax`` and not ``isfinite(t).all()``: min and max propagate NaN, and a ±Inf entry is the
    minimum or the maximum, so "min > -inf and max < inf" is the same verdict from one read-only
    reduction. ``isfinite`` materialises |t| and two boolean tensors first: on CPU it took 11x as long
    on a 1024² factor (0.94 vs 0.08 ms; a scratch measurement, 2026-11-23, commit 86fc26d; not in
    RESULTS.md), and these checks run on both factors every step."""
    flags = []
    for t in tensors:
        if t.numel() == 0:
            continue
        lo, hi = torch.aminmax(t.flatten(1), dim=-1) if batch else torch.aminmax(t)
        flags.append((lo > float("-inf")) & (hi < float("inf")))
    if not flags:
        shape = (tensors[0].shape[0],) if batch else ()
        return torch.ones(shape, dtype=torch.bool, device=tensors[0].device)
    return torch.stack(flags).all(0) if batch else torch.stack(flags).all()


def _widen(flag: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A stack's (B,) per-matrix flags as (B, 1[, 1]) against ``like`` (B, k[, l]); a 0-d flag as it is."""
    return flag.reshape(flag.shape + (1,) * (like.ndim - flag.ndim)) if flag.ndim else flag


def kl_shampoo_init_state(shape: tuple[int, int], device, *,
                          init_factor: float = DEFAULT_INIT_FACTOR) -> dict[str, torch.Tensor]:
    """Fresh fp32 state for an m×n parameter: zero factors, identity bases, eigenvalues = init_factor,
    relative damping ``DEFAULT_DAMPING`` (0-d). Memory: 2(m² + n²) + m + n + 1 floats."""
    m, n = (int(s) for s in shape)
    if m < 1 or n < 1:
        raise ValueError(f"KL-Shampoo needs a non-empty 2-D shape, got {tuple(shape)}")
    if not init_factor > 0:
        raise ValueError(f"init_factor must be > 0, got {init_factor}")
    f32 = dict(device=device, dtype=torch.float32)
    return {
        "kl_factor_left": torch.zeros(m, m, **f32),
        "kl_factor_right": torch.zeros(n, n, **f32),
        "kl_basis_left": torch.eye(m, **f32),
        "kl_basis_right": torch.eye(n, **f32),
        "kl_eigvals_left": torch.full((m,), float(init_factor), **f32),
        "kl_eigvals_right": torch.full((n,), float(init_factor), **f32),
        "kl_damping": torch.full((), DEFAULT_DAMPING, **f32),  # (torch.tensor(x, device=) copies: a sync)
    }


def _coupled_candidate(state: dict, G: torch.Tensor, beta: float):
    """New (S_a, S_b, D_a, D_b) from the coupled KL update, using the *old* (Q, D) pairs for S⁻¹ and for
    the eigenvalue targets, as kl_opt.py does (both diagonals are read before either D is written).

    With s = D_eff^{-1/2}: G S_b⁻¹ Gᵀ = W Wᵀ for W = G Q_b diag(s_b), and Gᵀ S_a⁻¹ G = VᵀV for
    V = diag(s_a) Q_aᵀ G; diag(Q_aᵀ G S_b⁻¹ Gᵀ Q_a)_i = Σ_j (H_ij s_b,j)² with H = Q_aᵀ G Q_b
    (and symmetrically for the right). Five matmuls: 2m²n + 3mn² multiply-adds for m ≥ n, 3m²n + 2mn² for
    m < n — H is Q_aᵀ G Q_b either way, formed from A or from B, whichever product is cheaper (for a
    256×1024 MLP projection a fifth of the update's multiply-adds)."""
    m, n = G.shape[-2:]
    Q_a, Q_b = state["kl_basis_left"], state["kl_basis_right"]
    damping = state["kl_damping"]
    s_a = inverse_root(state["kl_eigvals_left"], damping, amplification_cap(m)).unsqueeze(-1)  # a column
    s_b = inverse_root(state["kl_eigvals_right"], damping, amplification_cap(n)).unsqueeze(-2)  # a row
    A = Q_a.mT @ G            # Q_aᵀ G
    B = G @ Q_b               # G Q_b
    H = A @ Q_b if m >= n else Q_a.mT @ B  # Q_aᵀ G Q_b, from whichever product is cheaper (mn² vs m²n)
    W = B * s_b               # G Q_b D_b^{-1/2}
    V = A * s_a               # D_a^{-1/2} Q_aᵀ G
    addmm = torch.baddbmm if G.ndim == 3 else torch.addmm  # (a stack of matrices: one batched product)
    S_a = addmm(state["kl_factor_left"], W, W.mT, beta=beta, alpha=(1.0 - beta) / n)
    S_b = addmm(state["kl_factor_right"], V.mT, V, beta=beta, alpha=(1.0 - beta) / m)
    D_a = state["kl_eigvals_left"].lerp((H * s_b).square().mean(dim=-1), 1.0 - beta)
    D_b = state["kl_eigvals_right"].lerp((H * s_a).square().mean(dim=-2), 1.0 - beta)
    return S_a, S_b, D_a, D_b


def kl_shampoo_update_(state: dict, G: torch.Tensor, ok: torch.Tensor, step: int, *,
                       beta: float = 0.95, refresh_every: int = 10) -> torch.Tensor:
    """Absorb gradient G (m×n, any float dtype, may be non-finite) into the KL factors, in place.

    step == 1 (kl_opt.py's initialisation branch): S_a = (1-β)/d_b·G Gᵀ, S_b = (1-β)/d_a·GᵀG from the raw
    gradient, bases = qr(S·I) (one power iteration from the identity, no eigh), eigenvalues left at the
    ``init_factor`` they were created with. step ≥ 2: the coupled update and the eigenvalue tracking (see
    module docstring); when ``step % refresh_every == 0`` the bases are then refreshed from the new
    factors. (kl_opt.py skips the parameter update on its initialisation call and counts from 0 after it,
    so its refresh lands one gradient later than here; the cadence is the same.)

    ``ok`` (0-d bool, on the state's device) False means G is a missing observation: every state tensor
    keeps its exact previous value. A non-finite candidate with ok True (overflow inside, or a caller that
    passed ok for a non-finite G) is contained identically and reported: returns ``internal_bad``, a 0-d
    bool. If step 1 itself is missed, the state stays fresh and step 2 starts the coupled update from zero
    factors, identity bases and D = init_factor — a finite, well-defined (if cruder) start.
    """
    if step < 1:
        raise ValueError(f"step is 1-based, got {step}")
    if refresh_every < 1:
        raise ValueError(f"refresh_every must be >= 1, got {refresh_every}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    S_a_old, S_b_old = state["kl_factor_left"], state["kl_factor_right"]
    if G.ndim != S_a_old.ndim or G.shape[:-1] != S_a_old.shape[:-1] or G.shape[-1] != S_b_old.shape[-1]:
        raise ValueError(f"G has shape {tuple(G.shape)}, state is for "
                         f"{(*S_a_old.shape[:-1], S_b_old.shape[-1])}")
    batch = G.ndim == 3
    G = G.float()
    m, n = G.shape[-2:]
    D_a_old, D_b_old = state["kl_eigvals_left"], state["kl_eigvals_right"]

    if step == 1:
        S_a = (G @ G.mT) * ((1.0 - beta) / n)
        S_b = (G.mT @ G) * ((1.0 - beta) / m)
        D_a, D_b = D_a_old, D_b_old
        refresh = True
    else:
        S_a, S_b, D_a, D_b = _coupled_candidate(state, G, beta)
        refresh = step % refresh_every == 0

    finite = _all_finite(S_a, S_b, D_a, D_b, batch=batch)
    good = ok & finite
    # Select straight into the state (an elementwise op may write over the input it reads at the same
    # index): one pass per tensor instead of a select into a temporary and a copy. (A stack's (B,) flags
    # are widened to its matrices and vectors; a 0-d flag broadcasts as it is.)
    for new, old in ((S_a, S_a_old), (S_b, S_b_old), (D_a, D_a_old), (D_b, D_b_old)):
        torch.where(_widen(good, old), new, old, out=old)
    if refresh:
        Q_a_old, Q_b_old = state["kl_basis_left"], state["kl_basis_right"]
        Q_a, Q_b = refresh_basis(S_a_old, Q_a_old), refresh_basis(S_b_old, Q_b_old)
        q_finite = _all_finite(Q_a, Q_b, batch=batch)
        finite = finite & q_finite
        q_good = _widen(good & q_finite, Q_a_old)
        torch.where(q_good, Q_a, Q_a_old, out=Q_a_old)
        torch.where(q_good, Q_b, Q_b_old, out=Q_b_old)
    return ok & ~finite


def kl_shampoo_precondition(state: dict, M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (P, bypassed) with P = Q_a [(Q_aᵀ M Q_b) ⊙ (s_a s_bᵀ)] Q_bᵀ in fp32, cast to M's dtype.

    s = D_eff^{-1/2} from ``inverse_root`` (relative floor + the paper's amplification cap). The two scales
    are applied one after the other (never as the outer product) so their product cannot underflow to a
    silent zero before meeting M. The result is valid only if it is finite *after* the cast (a fp16 M can
    overflow at 65504 where fp32 did not) and both inverse roots are finite and positive (+Inf in D would
    give s = 0: a silently zeroed direction). Otherwise P = M (bypass: the step continues unpreconditioned),
    ``bypassed`` is True and ``state['kl_damping']`` grows ×10 up to ``MAX_DAMPING``. A non-finite M is
    returned as is (the caller's resolution stage keeps M finite)."""
    Q_a, Q_b = state["kl_basis_left"], state["kl_basis_right"]
    if M.ndim != Q_a.ndim or M.shape[:-1] != Q_a.shape[:-1] or M.shape[-1] != Q_b.shape[-1]:
        raise ValueError(f"M has shape {tuple(M.shape)}, state is for {(*Q_a.shape[:-1], Q_b.shape[-1])}")
    m, n = M.shape[-2:]
    damping = state["kl_damping"]
    s_a = inverse_root(state["kl_eigvals_left"], damping, amplification_cap(m))
    s_b = inverse_root(state["kl_eigvals_right"], damping, amplification_cap(n))
    H = (Q_a.mT @ M.float() @ Q_b) * s_a.unsqueeze(-1)
    P = (Q_a @ (H * s_b.unsqueeze(-2)) @ Q_b.mT).to(M.dtype)
    roots_ok = ((s_a > 0) & (s_a < float("inf"))).all(-1) & ((s_b > 0) & (s_b < float("inf"))).all(-1)
    valid = _all_finite(P, batch=M.ndim == 3) & roots_ok
    bypassed = ~valid
    damping.copy_(torch.where(bypassed, (damping * DAMPING_GROWTH).clamp(max=MAX_DAMPING), damping))
    return torch.where(_widen(valid, M), P, M), bypassed
