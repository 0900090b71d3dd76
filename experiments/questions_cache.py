"""Open question 6 — does a ``data_ptr``-keyed inference cache notice weight swaps?

FusionOpt's ``TimeConditioningCache`` (not part of this library) memoises adaLN-zero modulation vectors per
timestep and invalidates "by checking ``data_ptr()`` of the first trainable 2-D parameter"
(Taikakim/fusion-optimiser docs/open_questions.md, Q6). Its docs assume the schedule-free
``eval()``/``train()`` swap changes ``data_ptr``. It does not: the swap is an in-place ``lerp_`` (ours,
``nonans_optim/functional/schedule_free.py``; FusionOpt's too: ``FusionOpt.eval``/``train`` in
fusion_optimiser/optimizer.py copy into ``p.data``), and so are
``load_state_dict`` and the usual ``ema_p.copy_`` — storage is reused, only the values change.

This module rebuilds such a cache (:class:`DataPtrCache`, memoising ``modulation(t) = W·emb(t) + b`` of a
small adaLN-style layer, keyed on ``(data_ptr(W), t)``) and the fix (:class:`VersionedCache`, keyed on
``(data_ptr, W._version)`` — torch bumps a tensor's version counter on every in-place op, which is what
autograd uses to detect stale saved tensors). It also shows the fix's blind spot: writes through
``p.data`` get a fresh version counter and are invisible to it; :class:`FingerprintCache` (a cheap
checksum of W added to the key) catches those at the cost of one reduction per lookup.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

import nonans_optim as no

__all__ = ["DataPtrCache", "VersionedCache", "FingerprintCache", "AdaLNMod", "run_q6", "render_q6"]


class AdaLNMod(nn.Module):
    """A DiT-style conditioning path: sinusoidal t-embedding → Linear → (shift, scale, gate) vectors."""

    def __init__(self, d: int = 16, emb: int = 8):
        super().__init__()
        self.emb = emb
        self.lin = nn.Linear(emb, 3 * d)

    def embed(self, t: float) -> torch.Tensor:
        freqs = torch.exp(-torch.arange(self.emb // 2, dtype=torch.float32) / (self.emb // 2))
        return torch.cat([torch.sin(t * freqs), torch.cos(t * freqs)])

    def forward(self, t: float) -> torch.Tensor:
        return self.lin(self.embed(t))


class DataPtrCache:
    """FusionOpt-style: key = (data_ptr of the first trainable 2-D parameter, t)."""

    def __init__(self, model: nn.Module, fn: Callable[[float], torch.Tensor]):
        self.fn, self.store, self.hits = fn, {}, 0
        self.anchor = next(p for p in model.parameters() if p.requires_grad and p.ndim == 2)

    def key(self, t: float) -> tuple:
        return (self.anchor.data_ptr(), t)

    @torch.no_grad()
    def __call__(self, t: float) -> torch.Tensor:
        k = self.key(t)
        if k in self.store:
            self.hits += 1
            return self.store[k]
        self.store[k] = self.fn(t).clone()
        return self.store[k]


class VersionedCache(DataPtrCache):
    """The fix: add the tensor's in-place version counter to the key."""

    def key(self, t: float) -> tuple:
        return (self.anchor.data_ptr(), self.anchor._version, t)


class FingerprintCache(VersionedCache):
    """Belt and braces: also a checksum (sum and sum of squares in fp64) — catches ``p.data`` writes."""

    def key(self, t: float) -> tuple:
        a = self.anchor.detach().double()
        return super().key(t) + (float(a.sum()), float((a * a).sum()))


def _stale(cache: DataPtrCache, model: AdaLNMod, ts: list[float]) -> dict[str, Any]:
    """Look every t up; compare to a fresh computation. Stale = any cached vector differs."""
    with torch.no_grad():
        errs = [float((cache(t) - model(t)).abs().max()) for t in ts]
    return {"max_abs_err": max(errs), "stale": max(errs) > 0}


def run_q6(seed: int = 0, train_steps: int = 5) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = AdaLNMod()
    ema = AdaLNMod()
    ema.load_state_dict(model.state_dict())
    opt = no.SFNorMuon(no.param_groups(model), lr=1e-2)
    ts = [0.0, 0.25, 0.5, 1.0]
    for _ in range(train_steps):  # make y, x and the EMA differ
        loss = sum(model(t).pow(2).sum() for t in ts) + model(0.3).sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for pe, p in zip(ema.parameters(), model.parameters()):
                pe.lerp_(p, 0.5)
    W = model.lin.weight
    caches = {"data_ptr (FusionOpt)": DataPtrCache(model, model),
              "data_ptr + _version (fix)": VersionedCache(model, model),
              "+ fingerprint": FingerprintCache(model, model)}
    ema_state = {k: v.clone() for k, v in ema.state_dict().items()}
    train_state = {k: v.clone() for k, v in model.state_dict().items()}

    def data_write():
        with torch.no_grad():
            for p, q in zip(model.parameters(), ema.parameters()):
                p.data.copy_(q.data * 0.9)

    def ema_copy():
        with torch.no_grad():
            for p, q in zip(model.parameters(), ema.parameters()):
                p.copy_(q)

    events = [("optimizer.eval() (schedule-free y → x)", opt.eval),
              ("optimizer.train() (x → y)", opt.train),
              ("external EMA copied in (p.copy_)", ema_copy),
              ("model.load_state_dict(train weights)", lambda: model.load_state_dict(train_state)),
              ("model.load_state_dict(EMA weights)", lambda: model.load_state_dict(ema_state)),
              ("write through p.data.copy_", data_write)]
    for c in caches.values():  # warm every cache with the current weights
        _stale(c, model, ts)
    rows = []
    for name, action in events:
        ptr, ver = W.data_ptr(), W._version
        action()
        row = {"event": name, "data_ptr_changed": W.data_ptr() != ptr, "version_bumped": W._version != ver}
        for cname, c in caches.items():
            row[cname] = _stale(c, model, ts)
        rows.append(row)
    return {"events": rows, "caches": list(caches), "ts": ts}


def render_q6(data: dict[str, Any]) -> str:
    from .questions_io import md_table
    header = ["event", "data_ptr changed", "_version bumped"] + [f"{c}: stale? (max err)" for c in data["caches"]]
    rows = [[r["event"], r["data_ptr_changed"], r["version_bumped"]]
            + [f"{'STALE' if r[c]['stale'] else 'fresh'} ({r[c]['max_abs_err']:.2e})" for c in data["caches"]]
            for r in data["events"]]
    return md_table(header, rows)
