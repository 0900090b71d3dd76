"""The native kernels must build wherever a C compiler exists: every fused test skips when they do not,
so without this check a broken build would pass CI silently."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

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


X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
CAP = ["-mno-avx512f"] if X86 else []  # (another target's compiler refuses the flag)


@pytest.mark.parametrize("mode, flags", [(None, []), ("auto", []), ("portable", ["-DNONANS_PORTABLE"]),
                                         ("avx2", ["-DNONANS_NO_AVX512", *CAP]),
                                         ("portable-avx2", ["-DNONANS_PORTABLE", *CAP]),
                                         ("generic", ["-DNONANS_NO_AVX512", "-DNONANS_NO_AVX2"])])
def test_simd_mode_selects_the_build_flags(monkeypatch, mode, flags):
    if mode is None:
        monkeypatch.delenv("NONANS_NATIVE_SIMD", raising=False)
    else:
        monkeypatch.setenv("NONANS_NATIVE_SIMD", mode)
    assert native._simd_flags() == flags


def test_unknown_simd_mode_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("NONANS_NATIVE_SIMD", "avx1024")
    with pytest.raises(ValueError,
                       match="one of 'auto', 'portable', 'avx2', 'portable-avx2', 'generic', got 'avx1024'"):
        native._simd_flags()


_LIBRARY = "from nonans_optim import native; lib = native.library(); print(lib._name if lib else native.failure())"
_FORM = "from nonans_optim import native; print(native.scalar_form() or native.failure())"


def _in_build(mode: str, code: str) -> str:
    """The last line ``code`` prints in a fresh process built with ``NONANS_NATIVE_SIMD=mode``."""
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "NONANS_NATIVE_SIMD": mode},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip(), (mode, proc.stdout, proc.stderr[-2000:])
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(not X86 or shutil.which("objdump") is None, reason="x86 objdump needed")
def test_avx2_build_has_no_avx512_code():
    """NONANS_NATIVE_SIMD=avx2 is the build an AVX2-only CPU gets: on an AVX-512 machine it must not hold
    one AVX-512 instruction (a zmm register), where the default build there holds many — before
    2026-11-27 gcc auto-vectorised its portable loops and row sums with AVX-512 (``-march=native``), so
    the simd experiment's "AVX2" rows measured code no AVX2-only CPU runs."""
    if "avx512f" not in native._cpu_flags().split():
        pytest.skip("the CPU has no AVX-512: its default build is the AVX2 one")
    if native._compiler() is None:
        pytest.skip("no C compiler on this machine")
    zmm = {}
    for mode in ("avx2", "auto"):
        path = _in_build(mode, _LIBRARY)
        assert os.path.exists(path), (mode, path)
        dis = subprocess.run(["objdump", "-d", path], capture_output=True, text=True, check=True).stdout
        zmm[mode] = dis.count("%zmm")
    assert zmm["avx2"] == 0 and zmm["auto"] > 100, zmm


def test_each_mode_builds_its_form():
    """``native.scalar_form()`` names the fp32 (SF-)AdamW loop a build runs, which the simd experiment and
    tests/test_native_simd.py key their builds by (the vector width is 0 for both C forms): the exact loops
    under ``portable``, the tested groups under ``generic``, and by default the best form the CPU has."""
    if native.library() is None:
        pytest.skip(f"native kernel unavailable: {native.failure()}")
    flags = native._cpu_flags().split()
    best = ("avx512" if {"avx512f", "avx512dq"} <= set(flags) else "avx2" if "avx2" in flags else "generic") if X86 \
        else "generic"
    modes = {"portable": "portable", "generic": "generic", "auto": best}
    if X86 and "avx2" in flags:
        modes["avx2"] = "avx2"
    for mode, form in modes.items():
        assert _in_build(mode, _FORM) == form, mode


def test_every_native_source_is_in_the_build_key():
    """The library is cached under a hash of ``native.SOURCES``: a C file or header missing from that list
    would be compiled (it is included or built) without changing the key, so an edit to it would keep
    loading the library built before the edit."""
    folder = native.SOURCES[0].parent
    on_disk = {p.name for p in folder.iterdir() if p.suffix in (".c", ".h")}
    assert on_disk == {p.name for p in native.SOURCES}
