"""Open questions 1 (MONA's payoff against scale) and 4 (depth vs width on a DiT-style model), at CPU scale.

Q1 — char-LM at widths d ∈ {32, 64, 128} (≈ 0.05–0.4 M parameters): SF-NorMuon against SF-NorMuon + MONA,
with MONA at the library default (α = 0.1 on an EMA_0.9 of gradient differences: ``nonans_optim.Fusion``)
and at α = 2 (what FusionOpt's 0.2 times its undamped sum A ← 0.9A + ΔG amounts to in EMA units:
``Taikakim/fusion-optimiser`` ``_spectral_group_step``). The question is whether the MONA
gain grows with width; three seeds at each width, same steps, same lr.

Q4 — a DiT-style denoiser (patchified 8x8 digits, adaLN-zero blocks conditioned on t, rectified-flow
velocity loss) at depth 6 / width 64, then depth 4 (×2/3 FLOPs) and width 32 (≈ ×1/4 of the matmul
FLOPs). Quality = validation velocity MSE on fixed (x0, t, ε); cost = forward FLOPs (counted from the
matmul shapes) and measured CPU latency. FusionOpt: "depth 6→4 cost 1.6 % quality for 33 % inference
savings; halving width was much worse".
"""
from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .questions_io import fmt, md_table, mean_sd
from .tasks import Task, digits_data, make_task, train

__all__ = ["run_q1", "render_q1", "run_q4", "render_q4", "TinyDiT"]

Q1_ARMS = {"SF-NorMuon": ("sfnormuon", {}),
           "+MONA α=0.1": ("fusion:ns5+normuon+sf+mona", {"weight_decay": 0.05, "momentum": 0.8}),
           "+MONA α=2": ("fusion:ns5+normuon+sf+mona", {"weight_decay": 0.05, "momentum": 0.8, "mona_alpha": 2.0})}


def run_q1(widths=(32, 64, 128), seeds: int = 3, steps: int = 100, lr: float = 3e-3, batch: int = 16) -> dict[str, Any]:
    out: dict[str, Any] = {"config": {"widths": list(widths), "seeds": seeds, "steps": steps, "lr": lr, "batch": batch},
                           "runs": []}
    for d in widths:
        for seed in range(seeds):
            for arm, (o, kw) in Q1_ARMS.items():
                task = make_task("charlm", seed, d=d, batch=batch)
                n = sum(p.numel() for p in task.model.parameters())
                r = train(task, o, seed=seed, lr=lr, steps=steps, evals=2, opt_kwargs=dict(kw))
                out["runs"].append({"width": d, "params": n, "seed": seed, "arm": arm,
                                    "val_loss": r["final"]["val_loss"], "diverged": r["diverged"]})
    return out


def render_q1(data: dict[str, Any]) -> str:
    rows = []
    for d in data["config"]["widths"]:
        rs = [r for r in data["runs"] if r["width"] == d]
        base = {r["seed"]: r["val_loss"] for r in rs if r["arm"] == "SF-NorMuon"}
        cells = [f"d={d}", fmt(rs[0]["params"])]
        for arm in Q1_ARMS:
            vals = [r["val_loss"] for r in rs if r["arm"] == arm]
            m, s = mean_sd(vals)
            cells.append(f"{fmt(m, 4)} ± {fmt(s, 2)}")
        for arm in list(Q1_ARMS)[1:]:  # paired (same seed) differences against SF-NorMuon
            diffs = [r["val_loss"] - base[r["seed"]] for r in rs if r["arm"] == arm]
            m, s = mean_sd(diffs)
            cells.append(f"{m:+.4f} ± {s:.4f}")
        rows.append(cells)
    c = data["config"]
    return (f"Char-LM, 2 layers, {c['steps']} steps, batch {c['batch']}, lr {c['lr']}, {c['seeds']} seeds.\n\n"
            + md_table(["width", "params"] + [f"{a} val loss" for a in Q1_ARMS]
                       + [f"{a} − SF-NorMuon (paired)" for a in list(Q1_ARMS)[1:]], rows))


# ------------------------------------------------------------------------------------------------ Q4
class _DiTBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d, elementwise_affine=False)
        self.ln2 = nn.LayerNorm(d, elementwise_affine=False)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.ada = nn.Linear(d, 6 * d)  # adaLN-zero: shift/scale/gate for attention and MLP
        nn.init.zeros_(self.ada.weight)
        nn.init.zeros_(self.ada.bias)
        self.heads = heads

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        s1, b1, g1, s2, b2, g2 = self.ada(F.silu(c)).unsqueeze(1).chunk(6, dim=-1)
        B, T, D = x.shape
        h = self.ln1(x) * (1 + b1) + s1
        q, k, v = self.qkv(h).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, D)
        x = x + g1 * self.proj(a)
        h = self.ln2(x) * (1 + b2) + s2
        return x + g2 * self.fc2(F.gelu(self.fc1(h)))


class TinyDiT(nn.Module):
    """Patchify 8x8 (patch 2 → 16 tokens), t-embedding MLP, adaLN-zero blocks, linear un-patchify."""

    def __init__(self, depth: int = 6, d: int = 64, heads: int = 4):
        super().__init__()
        self.patch_in, self.pos = nn.Linear(4, d), nn.Parameter(torch.randn(16, d) * 0.02)
        self.t_mlp = nn.Sequential(nn.Linear(16, d), nn.SiLU(), nn.Linear(d, d))
        self.blocks = nn.ModuleList(_DiTBlock(d, heads) for _ in range(depth))
        self.ln, self.out = nn.LayerNorm(d), nn.Linear(d, 4)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        B = x.shape[0]
        tok = x.view(B, 4, 2, 4, 2).permute(0, 1, 3, 2, 4).reshape(B, 16, 4)
        freqs = torch.exp(-torch.arange(8, dtype=torch.float32) * (4.0 / 8))
        c = self.t_mlp(torch.cat([torch.sin(t[:, None] * 50 * freqs), torch.cos(t[:, None] * 50 * freqs)], -1))
        h = self.patch_in(tok) + self.pos
        for blk in self.blocks:
            h = blk(h, c)
        o = self.out(self.ln(h))
        return o.view(B, 4, 4, 2, 2).permute(0, 1, 3, 2, 4).reshape(B, 1, 8, 8)


def dit_flops(depth: int, d: int, tokens: int = 16) -> int:
    """Forward multiply-adds ×2 of the per-token matmuls and attention (t-MLP/adaLN counted per sample)."""
    per_block = tokens * (3 * d * d + d * d + 8 * d * d) + 2 * tokens * tokens * d + 6 * d * d
    return 2 * (depth * per_block + tokens * (4 * d + d * 4) + 16 * d + d * d)


def _dit_task(seed: int, depth: int, d: int, batch: int = 64) -> Task:
    data = digits_data()
    torch.manual_seed(seed)
    model = TinyDiT(depth, d)
    x_tr = data["Xtr"] * 2 - 1
    gv = torch.Generator().manual_seed(4321)
    xv = data["Xva"] * 2 - 1
    tv, ev = torch.rand(len(xv), generator=gv), torch.randn(xv.shape, generator=gv)

    def flow_loss(m, xte):
        x0, t, e = xte
        xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * e
        return F.mse_loss(m(xt, t), e - x0)

    def sample(g):
        i = torch.randint(0, len(x_tr), (batch,), generator=g)
        return x_tr[i], torch.rand(batch, generator=g), torch.randn(batch, 1, 8, 8, generator=g)

    @torch.no_grad()
    def evaluate(m):
        return {"val_mse": float(flow_loss(m, (xv, tv, ev)))}

    return Task("dit", model, sample, flow_loss, evaluate, "val_mse")


Q4_CONFIGS = {"base (depth 6, width 64)": (6, 64), "depth 4 (width 64)": (4, 64), "width 32 (depth 6)": (6, 32)}


def _latency(model: nn.Module, reps: int = 20) -> float:
    x, t = torch.randn(64, 1, 8, 8), torch.rand(64)
    times = []
    with torch.no_grad():
        model(x, t)
        for _ in range(reps):
            t0 = time.perf_counter()
            model(x, t)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_q4(seeds: int = 3, steps: int = 250, lr: float = 3e-3, optimizer: str = "sfnormuon") -> dict[str, Any]:
    out: dict[str, Any] = {"config": {"seeds": seeds, "steps": steps, "lr": lr, "optimizer": optimizer}, "runs": []}
    for name, (depth, d) in Q4_CONFIGS.items():
        for seed in range(seeds):
            task = _dit_task(seed, depth, d)
            r = train(task, optimizer, seed=seed, lr=lr, steps=steps, evals=2)
            out["runs"].append({"config": name, "depth": depth, "width": d, "seed": seed,
                                "val_mse": r["final"]["val_mse"], "diverged": r["diverged"],
                                "params": sum(p.numel() for p in task.model.parameters()),
                                "flops": dit_flops(depth, d), "latency_s": _latency(task.model.eval())})
    return out


def render_q4(data: dict[str, Any]) -> str:
    rows = []
    names = list(dict.fromkeys(r["config"] for r in data["runs"]))
    base = [r for r in data["runs"] if r["config"] == names[0]]
    b_mse, b_flops = mean_sd(r["val_mse"] for r in base)[0], base[0]["flops"]
    b_lat = statistics.median(r["latency_s"] for r in base)
    for name in names:
        rs = [r for r in data["runs"] if r["config"] == name]
        m, s = mean_sd(r["val_mse"] for r in rs)
        lat = statistics.median(r["latency_s"] for r in rs)
        rows.append([name, fmt(rs[0]["params"]), f"{fmt(m, 4)} ± {fmt(s, 2)}", f"{100 * (m / b_mse - 1):+.1f}%",
                     f"{100 * (1 - rs[0]['flops'] / b_flops):.0f}%", f"{1e3 * lat:.2f}",
                     f"{100 * (1 - lat / b_lat):.0f}%"])
    c = data["config"]
    return (f"{c['optimizer']}, lr {c['lr']}, {c['steps']} steps, {c['seeds']} seeds; latency = median CPU "
            "forward time for a batch of 64 (1 thread).\n\n"
            + md_table(["model", "params", "val velocity MSE", "quality cost (Δ MSE)", "FLOPs saved",
                        "latency ms", "latency saved"], rows))
