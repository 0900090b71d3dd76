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


@pytest.mark.parametrize("mode, flags", [(None, []), ("auto", []), ("portable", ["-DNONANS_PORTABLE"]),
                                         ("avx2", ["-DNONANS_NO_AVX512"])])
def test_simd_mode_selects_the_build_flags(monkeypatch, mode, flags):
    if mode is None:
        monkeypatch.delenv("NONANS_NATIVE_SIMD", raising=False)
    else:
        monkeypatch.setenv("NONANS_NATIVE_SIMD", mode)
    assert native._simd_flags() == flags


def test_unknown_simd_mode_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("NONANS_NATIVE_SIMD", "avx1024")
    with pytest.raises(ValueError, match="'auto', 'portable' or 'avx2', got 'avx1024'"):
        native._simd_flags()


def test_every_native_source_is_in_the_build_key():
    """The library is cached under a hash of ``native.SOURCES``: a C file or header missing from that list
    would be compiled (it is included or built) without changing the key, so an edit to it would keep
    loading the library built before the edit."""
    folder = native.SOURCES[0].parent
    on_disk = {p.name for p in folder.iterdir() if p.suffix in (".c", ".h")}
    assert on_disk == {p.name for p in native.SOURCES}
