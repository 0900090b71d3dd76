"""Workloads whose singularity comes from the objective or from the hardware.

4. diversity training under fp16 autocast: a *negative* similarity loss against a frozen reference
   (FusionOpt's docs report "AdamW + diversity penalty → NaN" in mixed-precision training): the penalty is
   unbounded below, so the optimizer grows the features away from the reference until an fp16 activation
   passes 65504. In fp32 it only diverges finitely within the budget (the benchmark's earlier fp32 version
   ended with a finite task CE of ~1.6e13 in every arm: fp32's range, 3.4e38, is never reached);
6. an RL-style policy-gradient loop whose entropy bonus is written the naive way, -Σ p·log p with
   p = softmax(z): once the policy is nearly deterministic the probability of a vanishing action underflows
   to 0, log p = -inf and 0·(-inf) = NaN;
8. hardware-style fault injection: NaN, +Inf and exponent bit flips written into gradients at a fixed
   per-step rate (the only workload that injects by design).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from .models import MLP, batch_rng, digits
from .spec import OptimSpec, Task, Workload

__all__ = ["W4_DIVERSITY", "W6_POLICY_GRADIENT", "W8_FAULTS"]

_DEEP = {"tiny": dict(hidden=32, depth=8, batch=32, steps=100),
         "default": dict(hidden=64, depth=8, batch=64, steps=200),
         "scale": dict(hidden=512, depth=12, batch=256, steps=2000)}
DIVERSITY_WEIGHT = 1.0
# AdamW's default rate at the benchmark sizes; the 100-step test version needs a faster blow-up.
DIVERSITY_LR = {"tiny": 1e-2, "default": 1e-3, "scale": 1e-3}


def _digits_batch(seed, index, batch):
    X, Y = digits()
    i = torch.randint(0, 1497, (batch,), generator=batch_rng(seed, index))
    return X[i], Y[i]


def _digits_eval(m):
    X, Y = digits()
    return float(F.cross_entropy(m(X[1497:]), Y[1497:]))


def build_diversity(size: str, seed: int, clean: bool) -> Task:
    cfg = _DEEP[size]
    model = MLP([64] + [cfg["hidden"]] * (cfg["depth"] - 1) + [10])
    reference = copy.deepcopy(model).requires_grad_(False)  # frozen: the model it must differ from
    weight = 0.0 if clean else DIVERSITY_WEIGHT

    def loss_fn(m, index):
        x, y = _digits_batch(seed, index, cfg["batch"])
        with torch.autocast("cpu", dtype=torch.float16):  # mixed precision, as in FusionOpt's report
            z, z_ref = m(x), reference(x)
        z, z_ref = z.float(), z_ref.float()  # the loss itself in fp32 (autocast's usual recipe)
        similarity = -F.mse_loss(z, z_ref)  # negative distance: higher means more similar
        return F.cross_entropy(z, y) + weight * similarity

    return Task(model, loss_fn, _digits_eval, OptimSpec("adamw", lr=DIVERSITY_LR[size]), steps=cfg["steps"],
                metric="held-out CE (task only)", amp=True)


W4_DIVERSITY = Workload(
    key="w4_diversity", title="Diversity penalty vs a frozen reference",
    cause="loss = CE - ||f(x) - f_ref(x)||^2 is unbounded below; the features grow until an fp16 activation "
          "overflows (autocast)",
    build=build_diversity, guards="clip_grad_norm_(1.0) + GradScaler",
    notes=f"penalty weight {DIVERSITY_WEIGHT}, AdamW lr {DIVERSITY_LR['default']:g}; clean run: weight 0. "
          "The task metric of both arms is meaningless once the penalty dominates: the objective itself is "
          "unbounded, so 'completes' here only means training kept going with finite numbers")


# ---------------------------------------------------------------- 6: policy gradient with -inf log-probs
_PG = {"tiny": dict(ctx=8, actions=32, hidden=64, batch=128, steps=70),
       "default": dict(ctx=8, actions=32, hidden=64, batch=128, steps=250),
       "scale": dict(ctx=64, actions=256, hidden=512, batch=1024, steps=2000)}
ENTROPY_BONUS = 0.01


def build_policy(size: str, seed: int, clean: bool) -> Task:
    cfg = _PG[size]
    model = MLP([cfg["ctx"], cfg["hidden"], cfg["actions"]])
    reward_matrix = torch.randn(cfg["actions"], cfg["ctx"], generator=batch_rng(seed, -2))

    def contexts(index, batch):
        return torch.randn(batch, cfg["ctx"], generator=batch_rng(seed, index))

    def loss_fn(m, index):
        x = contexts(index, cfg["batch"])
        probs = torch.softmax(m(x), -1)
        a = torch.multinomial(probs.detach(), 1, generator=batch_rng(seed, index + 10**7)).squeeze(-1)
        r = (x @ reward_matrix.T).gather(1, a[:, None]).squeeze(-1)
        adv = r - r.mean()
        if clean:  # the stable form: log_softmax never returns -inf for finite logits
            logp = torch.log_softmax(m(x), -1)
        else:  # the naive form (Categorical(probs=...) style): log of an underflowed probability is -inf
            logp = torch.log(probs)
        entropy = -(logp.exp() * logp).sum(-1) if clean else -(probs * logp).sum(-1)
        return -(adv * logp.gather(1, a[:, None]).squeeze(-1)).mean() - ENTROPY_BONUS * entropy.mean()

    def evaluate(m):  # regret of the greedy policy on held-out contexts
        x = contexts(10**6, 2048)
        R = x @ reward_matrix.T
        return float((R.max(-1).values - R.gather(1, m(x).argmax(-1, keepdim=True)).squeeze(-1)).mean())

    return Task(model, loss_fn, evaluate, OptimSpec("adamw", lr=0.05), steps=cfg["steps"],
                metric="greedy regret")


W6_POLICY_GRADIENT = Workload(
    key="w6_policy_gradient", title="Policy gradient, log-probs of vanishing actions",
    cause="entropy bonus -sum p*log(p): a vanishing action's p underflows to 0, log p = -inf, 0*(-inf) = NaN",
    build=build_policy, notes="REINFORCE on a contextual bandit; clean run: log_softmax")


# ---------------------------------------------------------------- 8: hardware-style fault injection
_FAULT = {"tiny": dict(hidden=64, batch=32, steps=60, rate=0.1),
          "default": dict(hidden=128, batch=64, steps=250, rate=0.03),
          "scale": dict(hidden=1024, batch=256, steps=2000, rate=0.01)}
FAULT_KINDS = ("nan", "inf", "bitflip")


def inject_fault(grads: list[torch.Tensor], seed: int, index: int, rate: float) -> str | None:
    """With probability ``rate`` (a per-step Bernoulli draw from the step's own generator), write one fault
    into one gradient entry: NaN, +Inf, or a flip of bit 30 of the fp32 word (the exponent's top bit: a
    value in (2⁻¹²⁶, 2) is multiplied by 2¹²⁸, i.e. becomes ~1e38 or Inf). Returns the fault kind."""
    g = batch_rng(seed, index + 2 * 10**7)
    if float(torch.rand((), generator=g)) >= rate:
        return None
    kind = FAULT_KINDS[int(torch.randint(0, len(FAULT_KINDS), (), generator=g))]
    target = grads[int(torch.randint(0, len(grads), (), generator=g))]
    flat = target.view(-1)
    j = int(torch.randint(0, flat.numel(), (), generator=g))
    if kind == "nan":
        flat[j] = float("nan")
    elif kind == "inf":
        flat[j] = float("inf")
    else:
        flat.view(torch.int32)[j] ^= 1 << 30
    return kind


def build_faults(size: str, seed: int, clean: bool) -> Task:
    cfg = _FAULT[size]
    model = MLP([64, cfg["hidden"], cfg["hidden"], 10])

    def loss_fn(m, index):
        x, y = _digits_batch(seed, index, cfg["batch"])
        return F.cross_entropy(m(x), y)

    def fault(m, index):
        inject_fault([p.grad for p in m.parameters() if p.grad is not None], seed, index, cfg["rate"])

    return Task(model, loss_fn, _digits_eval, OptimSpec("adamw", lr=1e-3), steps=cfg["steps"],
                metric="held-out CE", fault=None if clean else fault)


W8_FAULTS = Workload(
    key="w8_fault_injection", title="Fault injection: NaN, Inf, bit flips in gradients",
    cause="one gradient entry per faulty step becomes NaN, +Inf or has its top exponent bit flipped",
    build=build_faults, notes="injected by design (the hardware-fault model); per-step rate is per size")
