import os
import sys

import pytest
import torch
from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))  # tests/optim_infos.py, tests/interpreted.py
from interpreted import SHARD_ENV, shard_of  # noqa: E402 (found through the line above)
from interpreter_patches import share_language_patches  # noqa: E402
from mkl_vml import settle_mkl_vml  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":  # an interpreter subprocess (tests/interpreted.py)
    share_language_patches()  # up to 2x faster interpreter suites; see tests/interpreter_patches.py
# Experiments log to wandb offline whenever it is installed; the tests check results, not logging.
os.environ.setdefault("NONANS_WANDB", "0")

settle_mkl_vml()  # before any test: see tests/mkl_vml.py (a flaky ground truth otherwise)

# Hypothesis draws the same examples on every run ("deterministic", the default): a suite whose verdict
# depends on the draw is not a contract a fresh machine (or CI) can keep. To search new examples while
# developing, run with HYPOTHESIS_PROFILE=explore; a counterexample it finds goes into the test as an
# @example. Tests that set their own settings keep them, apart from what the profile sets.
settings.register_profile("deterministic", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same torch RNG state, so a failure reproduces and a pass is not luck.
    An unseeded tolerance check (fused AdamW against torch) failed CI once in ~300 draws (2026-11-25); the
    per-test seed does not loosen anything a test asserts, it only stops the suite's verdict being a draw."""
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Run a test on one torch thread (experiment smoke tests: less noise, no oversubscription)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_collection_modifyitems(config, items):
    shard = os.environ.get(SHARD_ENV)  # set by tests/interpreted.py for one shard of a suite
    if shard:
        items[:], deselected = shard_of(items, shard)
        config.hook.pytest_deselected(items=deselected)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if torch.compile failed for real anywhere in it: after the first failure every
    impl="compiled" path silently runs foreach for the rest of the process (with one warning), so later
    tests of the compiled paths would compare foreach with itself. (Tests that simulate a failure patch
    the failure list and get the original back.)"""
    from nonans_optim.optimizers import _compiled
    if _compiled._BROKEN and exitstatus == 0:
        session.exitstatus = 1
        print(f"\nFAILED: torch.compile failed during the run, compiled paths fell back: {_compiled._BROKEN[0][:300]}")
