import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The helper modules the suites import by bare name (gpu_workers, numerics, spawn_bodies) live in a folder of
# their own: never put tests/ itself on sys.path (see tests/__init__.py). Spawned ranks inherit sys.path.
HELPERS = os.path.join(ROOT, "tests", "helpers")
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def pytest_collection_modifyitems(config, items):
    n = gpu_count()
    skip = pytest.mark.skip(reason="needs 2+ CUDA GPUs (run on the device: bench/device_run.sh)")
    for item in items:
        if "gpu" in item.keywords and n < 2:
            item.add_marker(skip)
