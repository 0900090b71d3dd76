"""experiments/host_profile.py: the host-time breakdown the sync-audit records for every CUDA row.

CI has no GPU, so the pieces are checked where they can run: the timing and the cProfile table on a CPU step,
the Triton launch counter on the Triton (SF-)AdamW path under the interpreter (a fresh process: the
interpreter is chosen at import), and the sync-audit's rendering of the result."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nonans_optim as no
from experiments.host_profile import function_diff, host_profile, triton_summary
from experiments.overhead_controls import switched

ROOT = Path(__file__).resolve().parent.parent


def _opt():
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = no.AdamW(model.parameters(), impl="foreach")
    opt.step()
    return opt


def test_host_profile_of_a_cpu_step():
    opt = _opt()
    prof = {policy: host_profile(switched(opt, policy), steps=3, repeats=2, top=5) for policy in ("repair", "off")}
    for p in prof.values():
        assert p["host_us"] > 0 and p["steps"] == 3
        assert p["triton"] == {}  # the foreach step launches no Triton kernel
        assert 0 < len(p["functions"]) <= 5
        assert all(r["own_us"] >= 0 and r["cum_us"] >= r["own_us"] - 1e-6 for r in p["functions"])
        assert [r["own_us"] for r in p["functions"]] == sorted((r["own_us"] for r in p["functions"]), reverse=True)
    assert triton_summary(prof["off"]) == (0, 0)
    for name, a, b in function_diff(prof["repair"], prof["off"]):
        assert a > b


_SCRIPT = """
import json, torch
import nonans_optim as no
from experiments.host_profile import host_profile
from experiments.overhead_controls import switched
model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(2)])
for p in model.parameters():
    p.grad = torch.randn_like(p)
opt = no.AdamW(model.parameters(), impl="fused")
opt.step()
out = {}
for policy in ("off", "repair"):
    step = switched(opt, policy)
    step()
    out[policy] = host_profile(step, steps=2, repeats=1, top=3)["triton"]
print(json.dumps(out))
"""


def test_triton_launches_are_counted_per_kernel():
    """Under the interpreter, with the Triton path forced: "off" is the one update launch per step, and so is
    "repair" (AdamW's default: no spike guard, so the one-launch step of kernels/scalar_one.py) — what
    sync-audit counts on a GPU, here by name."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", NONANS_FUSED_BACKEND="triton", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {k: v["launches"] for k, v in out["off"].items()} == {"_update_kernel": 1.0}
    assert {k: v["launches"] for k, v in out["repair"].items()} == {"_one_launch_kernel": 1.0}
    assert all(v["us"] > 0 for policy in out.values() for v in policy.values())


def test_sync_audit_renders_the_host_table():
    from experiments.sync_audit import render

    opt = _opt()
    row = {"optimizer": "AdamW (foreach)", "first_step_syncs": {}, "later_step_syncs": {}}
    for policy in ("repair", "off"):
        row[policy] = {"launches": 0, "host": host_profile(switched(opt, policy), steps=2, repeats=1, top=6)}
    data = {"command": "python -m experiments sync-audit --defaults", "device": "cpu (test)", "torch": "x",
            "rows": [row]}
    text = render(data)
    assert "**Host time of a step**" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("| AdamW (foreach) | ") and "µs" not in ln
                and ln.count("|") == 8)
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert float(cells[1]) == pytest.approx(row["repair"]["host"]["host_us"], abs=0.5)
    assert cells[4] == "0 / 0" and cells[6] == "—"
    # without host data (audits recorded before it) the section is the launch table alone
    for policy in ("repair", "off"):
        del row[policy]["host"]
    assert "Host time" not in render(data)
