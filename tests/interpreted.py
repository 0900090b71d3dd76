"""Run a kernel test file again under ``TRITON_INTERPRET=1`` in a fresh process.

Triton reads the variable when its modules are imported, so it cannot be switched on inside the shared
pytest process; each kernel test file re-runs itself this way on machines without CUDA."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# Triton 3.6's interpreter (the version the GPU image ships, with torch 2.11) turns a scalar tl.load into a
# one-element array, and range() over such a bound raises "only 0-dimensional arrays can be converted to
# Python scalars" in kernels that compile fine for sm_90 under 3.6 (tests/test_kernels_aot.py passes there).
# 3.7, 3.8 and 3.9 interpret every suite here (checked by running them against each of those wheels).
MIN_INTERPRETER = (3, 7)


# Set in the subprocess to "i/n" to run the i-th of n shards of a suite (tests/conftest.py reads it).
SHARD_ENV = "NONANS_TEST_SHARD"


def shard_of(items: list, shard: str) -> tuple[list, list]:
    """Split collected ``items`` for ``shard`` ("i/n"): the i-th shard keeps every n-th item from i, so the
    n shards are disjoint and together are the whole suite, and each shard gets every parametrisation's
    cases in turn (the slow cases of one test do not all land in one shard)."""
    i, n = (int(x) for x in shard.split("/"))
    if not 0 <= i < n:
        raise ValueError(f"{SHARD_ENV}={shard!r}: want 'i/n' with 0 <= i < n")
    return [x for k, x in enumerate(items) if k % n == i], [x for k, x in enumerate(items) if k % n != i]


def assert_interpreted_suite_passes(test_file: str, *, timeout: int, shard: tuple[int, int] | None = None) -> None:
    """Every case of ``test_file`` (or of its ``shard`` = (i, n)) passes under the interpreter, and none is
    skipped there. A suite that runs for minutes is split into shards, one outer test each, so the two CI
    workers share it instead of one of them running it alone at the end of the run (the spectral suite ran
    379 s, the last ~5 minutes of CI, against a 600 s timeout)."""
    import pytest
    import triton

    version = tuple(int(x) for x in triton.__version__.split(".")[:2])
    if version < MIN_INTERPRETER:
        pytest.skip(f"triton {triton.__version__}'s interpreter cannot run these kernels (needs "
                    f"{'.'.join(map(str, MIN_INTERPRETER))}+); the compiled kernels are unaffected")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop(SHARD_ENV, None)
    if shard is not None:
        env[SHARD_ENV] = f"{shard[0]}/{shard[1]}"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(Path(test_file).resolve())], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"interpreter suite failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
    summary = [line for line in proc.stdout.splitlines() if line.strip()][-1]
    assert " passed" in summary and "skipped" not in summary, summary
    if shard is not None:
        assert " deselected" in summary or shard[1] == 1, f"shard {shard} ran the whole suite: {summary}"


def _gpu_copy_marks() -> tuple:
    import pytest
    import torch
    return (pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))


#: The marks of a two-faced file's ``gpu`` copies (``_define("cuda", marks=GPU_COPY)``): the ``gpu`` marker,
#: and a skip where there is no CUDA device.
GPU_COPY = _gpu_copy_marks()


def marker(marks=()):
    """A decorator that applies every mark in ``marks``: how a file's cases become their ``gpu`` copies."""
    def mark(fn):
        for m in marks:
            fn = m(fn)
        return fn
    return mark
