"""The environment switches (nonans_optim/switches.py): each parsed in one place, and all of them checked
when an optimizer is constructed, so that a bad value is refused before any state exists instead of part
way through a step (after the step count moved and earlier parameter groups were updated)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import nonans_optim as no
from nonans_optim import switches

PACKAGE = Path(no.__file__).resolve().parent
BAD = [("NONANS_FUSED_BACKEND", "cuda"), ("NONANS_TRITON_ONE_LAUNCH", "yes"), ("NONANS_TRITON_FOLD_DECIDE", "on"),
       ("NONANS_NS5_BACKEND", "cublas"),
       ("NONANS_NS5_TRITON_MIN_DIM", "-1"), ("NONANS_NS5_METHOD", "fast"), ("NONANS_NATIVE_SIMD", "avx"),
       ("NONANS_NS5_TRITON_MIN_DIM", "4k")]


@pytest.fixture
def clean_env(monkeypatch):
    for name in {n for n, _ in BAD}:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_defaults(clean_env):
    assert (switches.fused_backend(), switches.one_launch(), switches.fold_decide(), switches.ns5_backend(),
            switches.ns5_method(), switches.native_simd(),
            switches.ns5_triton_min_dim(4096)) == ("auto", True, True, "auto", "auto", "auto", 4096)
    switches.check_all()
    for name in ("NONANS_NS5_BACKEND", "NONANS_NS5_METHOD", "NONANS_NS5_TRITON_MIN_DIM"):
        clean_env.setenv(name, "")  # an exported empty variable means unset for these (a shell's VAR= idiom)
    assert (switches.ns5_backend(), switches.ns5_method(), switches.ns5_triton_min_dim(7)) == ("auto", "auto", 7)


@pytest.mark.parametrize("name, value", BAD, ids=[f"{n}={v}" for n, v in BAD])
@pytest.mark.parametrize("cls", [no.AdamW, no.FullFusion], ids=["AdamW", "FullFusion"])
def test_a_bad_switch_is_refused_at_construction(clean_env, cls, name, value):
    clean_env.setenv(name, value)
    p = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match=rf"{name} must be .*got '{re.escape(value)}'"):
        cls([p], lr=1e-3)


def test_a_switch_made_bad_later_is_refused_by_its_reader(clean_env):
    """Changed after construction, the value is still refused by name (where the step reads it)."""
    clean_env.setenv("NONANS_NS5_METHOD", "fast")
    with pytest.raises(ValueError, match="NONANS_NS5_METHOD must be one of 'auto', 'standard', 'gram', got 'fast'"):
        no.ns5(torch.randn(8, 8))


def test_every_validated_switch_the_package_reads_is_checked_here():
    """A new ``NONANS_*`` switch read with os.environ must be parsed in switches.py (and so checked at
    construction), unless it is one of those that take any value."""
    free = {"NONANS_NATIVE", "NONANS_CACHE_DIR"}
    read = set()
    for path in PACKAGE.rglob("*.py"):
        read |= set(re.findall(r"os\.environ(?:\.get)?[\[(]\"(NONANS_\w+)\"", path.read_text()))
    source = (PACKAGE / "switches.py").read_text()
    assert read - free <= {n for n, _ in BAD}, read - free
    assert all(f'"{name}"' in source for name in {n for n, _ in BAD})
