"""Adam moments and the AdamW / schedule-free AdamW directions, with the resolution gate built in.

Per tensor (Kingma & Ba 2015, Alg. 1; decoupled decay: Loshchilov & Hutter 2019):

    m ← β₁ m + (1-β₁) g            v ← β₂ v + (1-β₂) g²
    d = (m / (1-β₁ᵗ)) / (sqrt(v / (1-β₂ᵗ)) + ε)

Resolution ("repair"): a non-finite g entry is a missing observation. We substitute g := m at that entry
before the lerp, which leaves m *exactly* unchanged (lerp(m, m, w) = m in IEEE arithmetic) and keeps the
Nesterov/direction input finite. Both moments are then selected with ``where`` on the finiteness of both
new values: a finite g can still overflow them — g² > fp32 max in v, and in m the difference inside
lerp(m, g, w) = m + w·(g - m) when g and m are huge and of opposite signs (g = +3e38 after m = -3e37
gives +Inf). Such an entry is a missing observation too: it keeps both previous moments (:func:`_observed`),
and the "moment" stage counts the *entries* where a moment overflowed (at most numel, like every count).
On clean entries every gate selects the stock value, so a clean step is bit-identical to ``"off"``.

Two implementations of the same math: ``*_loop`` (one tensor at a time — the readable ground truth) and
``*_foreach`` (``torch._foreach_*`` over the list). Tests check they agree.
"""
from __future__ import annotations

import torch

from ..detection import Tally, storable_mask, tally

__all__ = ["adam_moments_loop", "adam_moments_foreach", "sf_moments", "adam_direction", "gated_grad"]


def gated_grad(g: torch.Tensor, fallback: torch.Tensor) -> tuple[torch.Tensor, Tally]:
    """(g with non-finite entries replaced by ``fallback``, the :class:`~nonans_optim.detection.Tally` of g)."""
    ok, t = tally(g)
    return torch.where(ok, g, fallback), t


def _observed(v: torch.Tensor, v_new: torch.Tensor, m: torch.Tensor | None = None,
              m_new: torch.Tensor | None = None) -> torch.Tensor:
    """The entries this step observed: both new moments storable. Everywhere else — a bad gradient entry
    (its new v is non-finite), or a finite one whose g² or g - m overflowed — is a missing observation, and
    *both* moments keep their values there. Keeping only the one that overflowed was not enough: a finite
    g of 3e38 overflowed v (kept) but not m (0.9·m + 0.1·g, written), and m̂/√v̂ with the old, small v moved
    the parameter by ~1e35 (an audit, 2026-11-26; torch's AdamW leaves v at +Inf and the entry at rest)."""
    ok = storable_mask(v_new, v.dtype)  # finite *as stored*: an fp32 value near its maximum is Inf in bf16
    return ok if m is None else ok & storable_mask(m_new, m.dtype)


def _write_observed_(buf: torch.Tensor, new: torch.Tensor, ok: torch.Tensor) -> None:
    """buf ← new (rounded to buf's dtype) where ``ok`` (:func:`_observed`); the old value elsewhere."""
    torch.where(ok, new.to(buf.dtype), buf, out=buf)


def _moment_count(g: Tally, ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The moment-stage count as (a, b), 0-d int64, overflow = a - b (``_common.record_inf`` takes the
    pair; the subtraction is done with the step's other counts): the entries not observed although the
    gradient was finite. A bad gradient entry is never observed, so that is #finite g - #observed."""
    return g.finite, torch.count_nonzero(ok)


def _commit_adam_(m: torch.Tensor, m_new: torch.Tensor, v: torch.Tensor, v_new: torch.Tensor,
                  g: Tally) -> tuple[torch.Tensor, torch.Tensor]:
    """Both new moments written where observed (:func:`_observed`), both kept elsewhere; the moment-stage
    count (:func:`_moment_count`). The loop and the foreach forms share it."""
    ok = _observed(v, v_new, m, m_new)
    _write_observed_(m, m_new, ok)
    _write_observed_(v, v_new, ok)
    return _moment_count(g, ok)


def _moments_one(g, m, v, beta1, beta2, repair):
    """Update m, v in place for one tensor; returns the Tally of g and the moment-overflow count (a, b) of
    :func:`_moment_count`."""
    if repair:
        g_in, g_counts = gated_grad(g, m)
        m_new = torch.lerp(m, g_in, 1 - beta1)
        v_new = v.mul(beta2).addcmul_(g, g, value=1 - beta2)
        return g_counts, _commit_adam_(m, m_new, v, v_new, g_counts)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    return None, None


def adam_moments_loop(grads, exp_avgs, exp_avg_sqs, *, beta1: float, beta2: float, repair: bool):
    """Loop form. Returns (list of grad-stage Tallies, list of moment-stage counts (a, b): a - b overflows)
    or (None, None)."""
    gc, mc = [], []
    for g, m, v in zip(grads, exp_avgs, exp_avg_sqs):
        a, b = _moments_one(g, m, v, beta1, beta2, repair)
        gc.append(a)
        mc.append(b)
    return (gc, mc) if repair else (None, None)


def adam_moments_foreach(grads, exp_avgs, exp_avg_sqs, *, beta1: float, beta2: float, repair: bool):
    """foreach form of :func:`adam_moments_loop` (same results, fewer kernel launches)."""
    if not repair:
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        return None, None
    gated = [gated_grad(g, m) for g, m in zip(grads, exp_avgs)]
    g_in = [x[0] for x in gated]
    g_counts = [x[1] for x in gated]
    m_new = torch._foreach_lerp(exp_avgs, g_in, 1 - beta1)
    v_new = torch._foreach_mul(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(v_new, grads, grads, value=1 - beta2)
    moment_counts = [_commit_adam_(m, mn, v, vn, gc)
                     for m, mn, v, vn, gc in zip(exp_avgs, m_new, exp_avg_sqs, v_new, g_counts)]
    return g_counts, moment_counts


def sf_moments(grads, exp_avg_sqs, *, beta2: float, repair: bool):
    """Schedule-free AdamW has no first moment: returns (direction inputs, grad counts, moment counts).

    The direction input is the gradient with missing entries set to 0 (they move nothing in z); v sees the
    raw gradient, so a missing entry makes the new v non-finite there and the gate keeps the old v. A finite
    entry whose g² overflowed v is missing too (:func:`_observed`): divided by the old v it moved z and the
    parameter by ~1e35. One detection pass per tensor (the Adam form would detect twice)."""
    if not repair:
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        return list(grads), None, None
    d_in, g_counts, m_counts = [], [], []
    v_news = torch._foreach_mul(exp_avg_sqs, beta2)  # the "off" branch's two ops, out of place
    torch._foreach_addcmul_(v_news, grads, grads, value=1 - beta2)
    for g, v, v_new in zip(grads, exp_avg_sqs, v_news):
        _, t = tally(g)
        ok = _observed(v, v_new)  # (False at a bad g entry: its new v is non-finite)
        d_in.append(torch.where(ok, g, 0.0))
        _write_observed_(v, v_new, ok)
        m_counts.append(_moment_count(t, ok))
        g_counts.append(t)
    return d_in, g_counts, m_counts


def adam_direction(m: torch.Tensor, v: torch.Tensor, step: int, beta1: float, beta2: float, eps: float,
                   *, first_moment: bool = True) -> torch.Tensor:
    """Bias-corrected Adam direction. ``first_moment=False`` gives the schedule-free form g/(sqrt(v̂)+ε),
    where ``m`` is then the (gated) raw gradient."""
    bc2 = 1 - beta2 ** step
    denom = (v / bc2).sqrt_().add_(eps)
    if first_moment:
        return (m / (1 - beta1 ** step)).div_(denom)
    return m / denom
