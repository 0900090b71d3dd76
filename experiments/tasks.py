"""Small offline tasks shared by the ablation and the open-question experiments.

Two real tasks that run on any machine without a download:

* ``charlm`` — a character-level causal transformer LM on the Python standard library's own ``.py`` files
  (``os.path.dirname(os.__file__)``, read in sorted order, so every machine with the same Python has the
  same corpus). The last 10 % of the characters are held out for validation. Metric: validation loss in
  nats/char (lower is better).
* ``digits`` — a small CNN on scikit-learn's 8x8 ``load_digits`` (1,797 images; a fixed 22 % validation
  split). Metric: validation error in % (lower is better); validation cross-entropy is kept too.

:func:`make_optimizer` builds every optimizer of the ablation from one lr, with the library's defaults for
everything else (spectral updates are RMS-matched to AdamW, README.md "One learning rate"), and
:func:`train` runs a fixed step budget or a fixed wall-clock budget with the schedule-free eval()/train()
swap around every evaluation.
"""
from __future__ import annotations

import glob
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import nonans_optim as no

__all__ = ["OPTIMIZERS", "TASKS", "make_task", "make_optimizer", "train", "Task", "CharLM", "DigitsCNN",
           "load_corpus"]

# ----------------------------------------------------------------------------------------------- data
_ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))  # 96 symbols + 1 "other" bucket
_INDEX = {ch: i for i, ch in enumerate(_ALPHABET)}


def load_corpus(max_chars: int = 2_000_000) -> torch.Tensor:
    """The stdlib ``.py`` files concatenated in sorted order, as int64 symbol ids (cached per process)."""
    key = max_chars
    if key in _CORPUS_CACHE:
        return _CORPUS_CACHE[key]
    root = os.path.dirname(os.__file__)
    parts, total = [], 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    text = "".join(parts)[:max_chars]
    other = len(_ALPHABET)
    ids = torch.tensor([_INDEX.get(ch, other) for ch in text], dtype=torch.int64)
    _CORPUS_CACHE[key] = ids
    return ids


_CORPUS_CACHE: dict[int, torch.Tensor] = {}
VOCAB = len(_ALPHABET) + 1


# --------------------------------------------------------------------------------------------- models
class Block(nn.Module):
    """Pre-LN transformer block (shared by the ablation tasks and the singularity benchmark)."""

    def __init__(self, d: int, heads: int, *, bias: bool = True):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=bias), nn.Linear(d, d, bias=bias)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d, bias=bias), nn.Linear(4 * d, d, bias=bias)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class CharLM(nn.Module):
    """Pre-LN causal transformer; ``embed``/``pos_embed``/``head`` take the scalar path by name."""

    def __init__(self, d: int = 64, layers: int = 2, heads: int = 4, context: int = 64):
        super().__init__()
        self.embed, self.pos_embed = nn.Embedding(VOCAB, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos_embed(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


class DigitsCNN(nn.Module):
    """Three 3x3 convs and an MLP head on 8x8 digits; no normalisation layers, so gradient accumulation is
    exactly equivalent to a large batch (open question 8)."""

    def __init__(self, width: int = 16):
        super().__init__()
        w = width
        self.conv1, self.conv2 = nn.Conv2d(1, w, 3, padding=1), nn.Conv2d(w, 2 * w, 3, padding=1)
        self.conv3 = nn.Conv2d(2 * w, 2 * w, 3, padding=1)
        self.fc = nn.Linear(2 * w * 16, 64)
        self.head = nn.Linear(64, 10)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        x = F.relu(self.conv3(F.max_pool2d(x, 2)))
        return F.relu(self.fc(x.flatten(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


# ---------------------------------------------------------------------------------------------- tasks
@dataclass
class Task:
    """A model, a batch sampler, a loss and a validation metric (lower is better)."""
    name: str
    model: nn.Module
    sample: Callable[[torch.Generator], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    evaluate: Callable[[nn.Module], dict[str, float]]
    metric: str
    extra: dict[str, Any] = field(default_factory=dict)


def _charlm(seed: int, *, d: int = 64, layers: int = 2, context: int = 64, batch: int = 32,
            corpus_chars: int = 1_000_000, val_windows: int = 64) -> Task:
    ids = load_corpus(corpus_chars)
    split = int(0.9 * len(ids))
    train_ids, val_ids = ids[:split], ids[split:]
    g_val = torch.Generator().manual_seed(1234)  # the same validation windows for every run
    starts = torch.randint(0, len(val_ids) - context - 1, (val_windows,), generator=g_val)
    val = torch.stack([val_ids[s:s + context + 1] for s in starts.tolist()])
    torch.manual_seed(seed)
    model = CharLM(d=d, layers=layers, heads=max(1, d // 16), context=context)

    def sample(g: torch.Generator):
        s = torch.randint(0, len(train_ids) - context - 1, (batch,), generator=g)
        return torch.stack([train_ids[i:i + context + 1] for i in s.tolist()])

    def loss(m: nn.Module, xy: torch.Tensor) -> torch.Tensor:
        logits = m(xy[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), xy[:, 1:].reshape(-1))

    @torch.no_grad()
    def evaluate(m: nn.Module) -> dict[str, float]:
        return {"val_loss": float(loss(m, val))}

    return Task("charlm", model, sample, loss, evaluate, "val_loss", {"batch": batch, "context": context})


_DIGITS: dict[str, torch.Tensor] = {}


def digits_data() -> dict[str, torch.Tensor]:
    """sklearn digits scaled to [0, 1], split 1,400 / 397 by a fixed permutation."""
    if not _DIGITS:
        from sklearn.datasets import load_digits
        d = load_digits()
        X = torch.tensor(d.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
        y = torch.tensor(d.target, dtype=torch.int64)
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
        tr, va = perm[:1400], perm[1400:]
        _DIGITS.update(Xtr=X[tr], ytr=y[tr], Xva=X[va], yva=y[va])
    return _DIGITS


def _digits(seed: int, *, width: int = 16, batch: int = 64) -> Task:
    data = digits_data()
    torch.manual_seed(seed)
    model = DigitsCNN(width)

    def sample(g: torch.Generator):
        i = torch.randint(0, len(data["ytr"]), (batch,), generator=g)
        return data["Xtr"][i], data["ytr"][i]

    def loss(m: nn.Module, xy) -> torch.Tensor:
        return F.cross_entropy(m(xy[0]), xy[1])

    @torch.no_grad()
    def evaluate(m: nn.Module) -> dict[str, float]:
        logits = m(data["Xva"])
        err = (logits.argmax(-1) != data["yva"]).float().mean()
        return {"val_err": 100.0 * float(err), "val_loss": float(F.cross_entropy(logits, data["yva"]))}

    return Task("digits", model, sample, loss, evaluate, "val_err", {"batch": batch})


TASKS = {"charlm": _charlm, "digits": _digits}


def make_task(name: str, seed: int, **kwargs) -> Task:
    return TASKS[name](seed, **kwargs)


# ----------------------------------------------------------------------------------------- optimizers
OPTIMIZERS: dict[str, str] = {
    "adamw": "AdamW",
    "sfadamw": "SF-AdamW",
    "muon": "Muon",
    "muon_mona": "Muon + MONA",
    "sfnormuon": "SF-NorMuon",
    "fullfusion": "FullFusion",
}


def make_optimizer(name: str, model: nn.Module, lr: float, **kwargs) -> no._base.NonansOptimizer:
    """One of :data:`OPTIMIZERS` on ``param_groups(model)`` (embeddings/heads/1-D on the scalar path, no
    decay on 1-D), lr as given, every other hyper-parameter the library default unless in ``kwargs``.
    ``kwargs["groups"]``, when given, replaces the parameter groups (routing experiments)."""
    groups = kwargs.pop("groups", None) or no.param_groups(model)
    if name == "adamw":
        return no.AdamW(groups, lr=lr, **kwargs)
    if name == "sfadamw":
        return no.SFAdamW(groups, lr=lr, **kwargs)
    if name == "muon":
        return no.Muon(groups, lr=lr, **kwargs)
    if name == "muon_mona":
        kwargs.setdefault("polyak", False)
        return no.Fusion(groups, components=("ns5", "mona"), lr=lr, **kwargs)
    if name == "sfnormuon":
        return no.SFNorMuon(groups, lr=lr, **kwargs)
    if name == "fullfusion":
        return no.FullFusion(groups, lr=lr, **kwargs)
    if name.startswith("fusion:"):  # fusion:ns5+normuon+sf+mona — any component subset
        return no.Fusion(groups, components=tuple(name.split(":", 1)[1].split("+")), lr=lr, **kwargs)
    raise ValueError(f"unknown optimizer {name!r}; choose from {sorted(OPTIMIZERS)} or fusion:<a+b>")


# ------------------------------------------------------------------------------------------- training
def _evaluate(task: Task, opt) -> dict[str, float]:
    opt.eval()
    task.model.eval()
    out = task.evaluate(task.model)
    task.model.train()
    opt.train()
    return out


def train(task: Task, opt_name: str, *, seed: int, lr: float, steps: int | None = None,
          seconds: float | None = None, evals: int = 8, set_loss: bool = False, loss_scale: float = 1.0,
          opt_kwargs: dict | None = None, on_step: Callable[[int, Any, torch.Tensor], None] | None = None,
          loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
          pre_step: Callable[[int, Any, torch.Tensor], None] | None = None) -> dict[str, Any]:
    """Train ``task.model`` for ``steps`` steps or until ``seconds`` of *training* time have passed.

    Evaluation time is excluded from the clock (it/s measures optimizer + model steps only). ``set_loss``
    feeds the (scaled) loss to the Polyak step; ``loss_scale`` multiplies the training loss (open question
    5). A non-finite training loss ends the run and marks it ``diverged``. ``on_step(step, opt, loss)`` is
    called after each step (instrumentation); ``pre_step(step, opt, loss)`` just before ``opt.step()``
    (external step-size rules)."""
    if (steps is None) == (seconds is None):
        raise ValueError("give exactly one of steps / seconds")
    opt = make_optimizer(opt_name, task.model, lr, **(opt_kwargs or {}))
    loss_fn = loss_fn or task.loss
    g = torch.Generator().manual_seed(10_000 + seed)
    eval_at = set(range(0, steps + 1, max(1, steps // evals))) | {steps} if steps else set()
    curve, train_curve = [], []
    train_time, step, diverged = 0.0, 0, False
    if steps is None:
        next_eval_t, eval_dt = 0.0, seconds / evals
    while True:
        due = (step in eval_at) if steps else (train_time >= next_eval_t)
        if due:
            curve.append({"step": step, "time": train_time, **_evaluate(task, opt)})
            if not steps:
                next_eval_t += eval_dt
        if (steps and step >= steps) or (seconds is not None and train_time >= seconds) or diverged:
            break
        batch = task.sample(g)
        t0 = time.perf_counter()
        loss = loss_fn(task.model, batch) * loss_scale
        loss.backward()
        if set_loss:
            opt.set_loss(loss.detach())
        if pre_step is not None:
            pre_step(step, opt, loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        train_time += time.perf_counter() - t0
        step += 1
        lv = float(loss.detach())
        if step % 10 == 0 or step <= 10:
            train_curve.append((step, lv))
        if on_step is not None:
            on_step(step, opt, loss)
        if not math.isfinite(lv):
            diverged = True
    if not curve or curve[-1]["step"] != step:
        curve.append({"step": step, "time": train_time, **_evaluate(task, opt)})
    final = curve[-1]
    finite = all(math.isfinite(v) for v in final.values())
    return {"optimizer": opt_name, "seed": seed, "lr": lr, "steps": step, "train_time_s": train_time,
            "it_s": step / train_time if train_time > 0 else float("nan"), "final": final,
            "curve": curve, "train_curve": train_curve, "diverged": diverged or not finite,
            "events": len(opt.events) if hasattr(opt, "events") else 0}
