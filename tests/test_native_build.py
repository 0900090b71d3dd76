"""The native kernels must build wherever a C compiler exists: every fused test skips when they do not,
so without this check a broken build would pass CI silently."""
from __future__ import annotations

import os

import pytest

from nonans_optim import native


def test_native_library_builds_where_a_c_compiler_exists():
    if os.environ.get("NONANS_NATIVE") == "0":
        pytest.skip("disabled by NONANS_NATIVE=0")
    if native._compiler() is None:
        pytest.skip("no C compiler on this machine")
    assert native.library() is not None, native.failure()
    for name in ("nonans_scalar_step", "nonans_spectral_pre", "nonans_spectral_post", "nonans_record_step",
                 "nonans_record_step_packed"):
        assert hasattr(native.library(), name)
