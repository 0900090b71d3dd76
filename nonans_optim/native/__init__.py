"""The native CPU kernels behind ``impl="fused"``: built from ``scalar_step.c`` (the (SF-)AdamW step),
``record_step.c`` (the resolution counters' fold),
``spectral_pre.c`` and ``spectral_post.c`` (the elementwise work before and after NS5) with the system C
compiler on first use, cached, and loaded with ctypes.

Why C and not torch.compile: inductor (torch 2.13) turns the (SF-)AdamW + resolution graph into several passes
per tensor on CPU and takes each event count as its own reduction, which left the compiled step at 3.07x torch's
fused AdamW (RESULTS.md, "Optimizer step time": ours AdamW (compiled, repair)). A hand-written loop reads each
entry once and counts in registers, the way torch's fused CPU kernel works. Plain C with pointers, not a torch
C++ extension: it needs no torch headers and no ninja, builds in about a second, and cannot break with torch's
C++ ABI.

Build: ``$CC`` (else ``cc``/``gcc``/``clang``) with ``-O3 -march=native -fopenmp -ffp-contract=off
-fno-trapping-math``; without OpenMP it retries single-threaded (with ``-fopenmp-simd``), without
``-march=native`` generic.
``-fno-trapping-math`` changes no value (FP exceptions are never read here); it lets gcc if-convert the gated
loops' selects, which compute on both sides. Without it, on a CPU without AVX-512 masking (AVX2 only), gcc 12
left the gated (SF-)AdamW loop scalar: "repair" ran 10.6x "off" at 1M entries, 1.54x with it (a scratch script,
2026-11-24, commit 70767d0: same tensors, policy switched, 30 interleaved rounds, 2 threads; AMD EPYC without
AVX-512; ``python -m experiments simd`` measures the builds as they are now). OpenMP is linked as
``libgomp.so.1``, the soname torch's CPU wheels ship, so the kernel shares torch's thread pool rather than
starting a second one. The shared object is cached under ``$NONANS_CACHE_DIR`` (default
``~/.cache/nonans_optim``), keyed by the source, the flags, the compiler's version and the CPU's feature flags
(``-march=native`` code must not run on another CPU sharing the home directory).

Where the CPU has AVX-512 (F and DQ), ``-march=native`` also compiles in the intrinsics forms of the
(SF-)AdamW loop (``scalar_avx512.h``) and of the spectral update loop (``spectral_post.c``), which check
and count the resolution far more cheaply (``simd_avx512.h``); where it has AVX2 but not AVX-512, the
AVX2 form of the (SF-)AdamW loop (``scalar_avx2.h``); on any other CPU (aarch64, say) the generic form
(``scalar_entry.h``'s ``update_block_spec``: groups of entries tested on their inputs, then the stock
arithmetic, which gcc vectorises for that CPU). ``NONANS_NATIVE_SIMD=portable`` builds the exact portable
loops alone (the tests' reference); ``avx2`` and ``generic`` build as for a CPU with that form only
(:func:`_simd_flags`; :func:`scalar_form` says which one a build runs).

``NONANS_NATIVE=0`` disables it. When it cannot be built, :func:`library` returns None, :func:`failure`
says why, and ``impl="fused"`` warns once and runs ``impl="compiled"``.
"""
from __future__ import annotations

import array
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from .. import switches

__all__ = ["library", "failure", "scalar_form", "record_step", "record_pack", "Int64Array", "SOURCES"]

_DIR = Path(__file__).parent
SOURCES = (_DIR / "common.h", _DIR / "simd_avx512.h", _DIR / "scalar_avx512.h", _DIR / "scalar_avx2.h",
           _DIR / "scalar_bf16.h", _DIR / "scalar_avx512_bf16.h", _DIR / "scalar_avx2_bf16.h",
           _DIR / "scalar_entry.h", _DIR / "scalar_step.c", _DIR / "record_step.c", _DIR / "spectral_rows.h",
           _DIR / "spectral_pre.c", _DIR / "spectral_post.c")
_BASE_FLAGS = ["-O3", "-std=c11", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]
# Tried in order: the first that compiles wins.
# Without OpenMP, -fopenmp-simd still honours the loops' `#pragma omp simd reduction` (compile-time only, no
# runtime library): a build without it summed the spectral row norms in another order, so its results
# differed from the OpenMP build's by 1e-4 after 30 steps (the determinism audit, 2026-11-26); the plain
# variants are the last resort of a compiler without the flag.
_VARIANTS = (["-march=native", "-fopenmp"], ["-fopenmp"], ["-march=native", "-fopenmp-simd"], ["-fopenmp-simd"],
             ["-march=native"], [])
_FAILURE: list[str] = []


def failure() -> str | None:
    """Why the native kernel is unavailable in this process (None while it is available or untried)."""
    return _FAILURE[0] if _FAILURE else None


def scalar_form() -> str | None:
    """The form of the fp32 (SF-)AdamW loop in the loaded build — "avx512", "avx2", "generic" or "portable"
    (``nonans_scalar_form`` in scalar_step.c) — or None when the library is unavailable."""
    lib = library()
    return None if lib is None else lib.nonans_scalar_form().decode()


def _compiler() -> str | None:
    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand and shutil.which(cand):
            return cand
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dirs() -> list[Path]:
    """Where the built library is kept: ``$NONANS_CACHE_DIR``, else ``$XDG_CACHE_HOME`` or ``~/.cache``
    (``/nonans_optim``); then a per-user folder in the temporary directory, for a read-only home."""
    root = os.environ.get("NONANS_CACHE_DIR")
    if root:
        first = Path(root)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        first = (Path(xdg) if xdg else Path.home() / ".cache") / "nonans_optim"
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return [first, Path(tempfile.gettempdir()) / f"nonans_optim-{uid}"]


# x86 only: another target's compiler refuses the flag (the avx2 modes mean nothing there)
_NO_AVX512 = ["-mno-avx512f"] if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686") else []


def _simd_flags() -> list[str]:
    """``NONANS_NATIVE_SIMD=portable`` builds the exact portable loops only (scalar_avx512.h, scalar_avx2.h
    and the tested groups of the generic form compiled out): the reference that tests/test_native_simd.py
    compares the other builds with, bit for bit. ``generic`` builds as for a CPU with neither SIMD form
    (aarch64, an x86 CPU without AVX2), whose fp32 loop tests groups of entries on their inputs and runs the
    stock arithmetic on those that pass (scalar_entry.h, ``update_block_spec``); gcc still vectorises it for
    this CPU (``-march=native``), as it would for that one.
    ``avx2`` builds as for a CPU with AVX2 and no AVX-512, so an AVX-512 machine can build, test and time
    the AVX2 form: the AVX-512 form left out, and ``-mno-avx512f`` after ``-march=native`` so that gcc does
    not auto-vectorise the rest (the portable loops, the spectral row sums) with AVX-512 either — until
    2026-11-27 it did, so that build was the AVX2 intrinsics inside AVX-512 code, which no AVX2-only CPU
    runs. ``portable-avx2`` is the portable loops built the same way: the avx2 build's bit-for-bit
    reference (a reduction auto-vectorised 16 wide sums in another order than one 8 wide)."""
    mode = switches.native_simd()
    return {"auto": [], "portable": ["-DNONANS_PORTABLE"], "avx2": ["-DNONANS_NO_AVX512", *_NO_AVX512],
            "portable-avx2": ["-DNONANS_PORTABLE", *_NO_AVX512],
            "generic": ["-DNONANS_NO_AVX512", "-DNONANS_NO_AVX2"]}[mode]


def _build(cc: str, flags: list[str], out: Path) -> str | None:
    """Compile to a temporary file and move it into place (atomic: concurrent processes may race).

    Each C file is compiled by a compiler process of its own, all at once, then linked, instead of one ``cc``
    compiling them one after another, which every user waits for on the first step: about 25 s on a 2-core
    Xeon (2026-11-26, gcc 12), of which spectral_pre.c takes 16.5 s alone; in parallel 21 s there, and
    about that one file's time on a machine with more cores."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    common = [cc, *_BASE_FLAGS, *flags, f"-I{_DIR}"]
    sources = [s for s in SOURCES if s.suffix == ".c"]
    with tempfile.TemporaryDirectory(dir=out.parent) as objdir:
        objects = [str(Path(objdir) / f"{s.stem}.o") for s in sources]
        cmds = [[*common, "-c", str(s), "-o", o] for s, o in zip(sources, objects)]
        procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in cmds]
        steps = [(c, proc.communicate()[1], proc.returncode) for c, proc in zip(cmds, procs)]
        if all(rc == 0 for *_, rc in steps):
            link = [*common, *objects, "-o", tmp, "-lm"]
            proc = subprocess.run(link, capture_output=True, text=True)
            steps.append((link, proc.stderr, proc.returncode))
    failed = next(((c, err) for c, err, rc in steps if rc != 0), None)
    if failed is not None:
        os.unlink(tmp)
        return f"{' '.join(failed[0])}: {failed[1].strip()[-400:]}"
    os.replace(tmp, out)
    return None


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    f = lib.nonans_scalar_step
    # Pointer arrays (pp) go as plain void*: ctypes arrays still convert, and so do the int64 arrays of
    # optimizers/_fused.py::pointers (about 2 us cheaper per 52-tensor list than a c_void_p array: Int64Array).
    ptr = pp = ctypes.c_void_p
    i32, i64, f32, f64 = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_double
    f.argtypes = [i64, pp, pp, pp, pp, pp, pp, ptr, ptr, f64, f64, ptr, i32, i32, i32, f32, f32, f32,
                  ptr, ptr, ptr, ptr, ptr, i64, ptr, i32, ptr, f32, f32, i64, i32]
    f.restype = ctypes.c_int
    pre, post = lib.nonans_spectral_pre, lib.nonans_spectral_post
    pre.argtypes = [i64, pp, pp, i32, pp, i32, ptr, ptr, pp, ptr, i32, pp, pp, ptr, i32, i32, f32, f32, f32,
                    ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, i32, i32, i32]
    post.argtypes = [i64, pp, i32, pp, pp, pp, ptr, ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32, ptr, ptr,
                     ptr, i32, i32]
    pre.restype = post.restype = ctypes.c_int
    lib.nonans_simd_width.argtypes, lib.nonans_simd_width.restype = [], ctypes.c_int
    lib.nonans_scalar_form.argtypes, lib.nonans_scalar_form.restype = [], ctypes.c_char_p
    r = lib.nonans_record_step
    r.argtypes = [i64, i64, ptr, i64, f32, f32, i64, i64] + [ptr] * 11
    r.restype = None
    rp = lib.nonans_record_step_packed
    rp.argtypes, rp.restype = [ptr, f32, f32, ptr, i64], None
    return lib


class Int64Array:
    """int64 values (data pointers, sizes) that ctypes passes to C as one ``void*`` (``_as_parameter_``),
    built about 2 us faster per 52 entries than a ctypes array (a scratch timing, 2026-11-24, commit
    5af042d; not in RESULTS.md). It owns the array, so it must live until the call returns (a local of the
    calling function, or a cache entry)."""

    __slots__ = ("_array", "_as_parameter_")

    def __init__(self, values: list[int]):
        self._array = array.array("q", values)
        self._as_parameter_ = ctypes.c_void_p(self._array.buffer_info()[0] if values else None)


_RECORD_KEYS = ("counts", "events", "ring_counts", "ring_step", "ring_escalated", "ring_ptr", "scale",
                "clean_streak", "escalations")
_PACK_NAMES = (*_RECORD_KEYS, "numel", "ring_held")


def record_pack(tensors: dict, *, numel, growth_interval: int, repeat_window: int,
                cache: dict | None = None) -> tuple[Int64Array, tuple] | None:
    """The counters' packed arguments of ``nonans_record_step_packed`` (P, K, growth_interval,
    repeat_window, then the nine counter pointers, the parameters' sizes ``numel`` and ``ring_held``) and
    the tensors they point into; None unless the library is available and every one is a contiguous CPU
    tensor of the expected dtype.

    ``cache`` (a dict the caller owns, one per Resolution): the result, reused while ``tensors`` still holds
    the very same tensor objects (the cache keeps them alive, so equal ids are the same objects). The checks
    and the argument conversion cost more than the C loop itself on a 52-parameter model. The counters are
    the optimizer's own, replaced (never reshaped in place) by a load or by the torch path, which the
    identity test sees."""
    if library() is None:
        return None
    args = (*map(tensors.__getitem__, _RECORD_KEYS), numel, tensors["ring_held"])
    key = (*map(id, args), growth_interval, repeat_window)
    if cache is not None and cache.get("key") == key:
        return cache["pack"], args
    expected = {"scale": torch.float32, "ring_escalated": torch.bool, "ring_held": torch.bool}
    if not all(t.is_cpu and t.is_contiguous() and t.dtype == expected.get(k, torch.int64)
               for k, t in zip(_PACK_NAMES, args)):
        return None  # e.g. counters loaded from a checkpoint in another dtype: the torch path handles them
    P, K = tensors["scale"].shape[0], tensors["ring_step"].shape[0]
    pack = Int64Array([P, K, growth_interval, repeat_window, *(t.data_ptr() for t in args)])
    if cache is not None:
        cache.clear()
        cache.update(key=key, args=args, pack=pack)
    return pack, args


def record_step(tensors: dict, step_counts, step: int, *, numel, backoff: float, min_scale: float,
                growth_interval: int, repeat_window: int, cache: dict | None = None) -> bool:
    """``Resolution.record_step`` in one C loop, in place; False (nothing done) unless :func:`record_pack`
    covers the counters and ``step_counts`` is a contiguous int64 CPU tensor."""
    packed = record_pack(tensors, numel=numel, growth_interval=growth_interval, repeat_window=repeat_window,
                         cache=cache)
    if packed is None or not (step_counts.is_cpu and step_counts.is_contiguous()
                              and step_counts.dtype == torch.int64):
        return False
    pack, args = packed
    library().nonans_record_step_packed(pack, backoff, min_scale, step_counts.data_ptr(), step)
    torch.autograd.graph.increment_version(args)  # written in place, as torch's own ops would record
    return True


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built on first call; None when it cannot be built (see :func:`failure`).

    impl="fused" warns when it is None; the default impl="auto" then runs foreach without a warning, and
    says why once on the ``nonans_optim.native`` logger (INFO), for whoever wonders where the speed went."""
    lib = _load()
    if lib is None:
        logging.getLogger(__name__).info("native kernels unavailable (impl='auto' runs foreach, impl='fused' "
                                         "compiled): %s", failure())
    return lib


def _load() -> ctypes.CDLL | None:
    if os.environ.get("NONANS_NATIVE", "1") == "0":
        _FAILURE.append("disabled by NONANS_NATIVE=0")
        return None
    cc = _compiler()
    if cc is None:
        _FAILURE.append("no C compiler found (set $CC)")
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    except OSError as err:
        _FAILURE.append(f"{cc} --version: {type(err).__name__}: {err}")
        return None
    sources = [s.read_text() for s in SOURCES]
    errors = []
    for variant in _VARIANTS:
        flags = [*variant, *_simd_flags()]
        key = hashlib.sha256("\0".join([*sources, cc, version, _cpu_flags(), platform.machine(), *_BASE_FLAGS,
                                        *flags]).encode()).hexdigest()[:20]
        for folder in _cache_dirs():
            out = folder / f"nonans_native-{key}.so"
            try:
                err = None if out.exists() else _build(cc, flags, out)
                if err is None:
                    return _declare(ctypes.CDLL(str(out)))
            except OSError as os_err:  # an unwritable cache folder, a library that does not load: next folder
                errors.append(f"{out}: {type(os_err).__name__}: {os_err}")
                continue
            errors.append(err)
            break  # the compiler rejected these flags: the folder is not the problem
    _FAILURE.append("the C compiler failed: " + errors[0] if errors else "no variant could be built")
    return None
