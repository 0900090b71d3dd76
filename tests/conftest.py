import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/optim_infos.py
# Experiments log to wandb offline whenever it is installed; the tests check results, not logging.
os.environ.setdefault("NONANS_WANDB", "0")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
