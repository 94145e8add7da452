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
    # One GPU is enough: ranks then share it (fastcomm.spawn's "shared" backend).
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device: bench/device_run.sh)")
    for item in items:
        if "gpu" in item.keywords and n < 1:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    # On the device a call has a hard time limit: print each failure as it happens, so a run cut short
    # still brings back why (FASTCOMM_INSTAFAIL=1, set by bench/device_run.sh).
    if report.failed and os.environ.get("FASTCOMM_INSTAFAIL"):
        print(f"\n=== FAILED {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n", flush=True)


@pytest.fixture(scope="session")
def cubin_cache_dir(tmp_path_factory):
    """One cubin cache directory for the whole test run: tests that need the same unit compiled for the same
    architecture (about a minute each with NVRTC) share the cubin through it instead of compiling it again."""
    return tmp_path_factory.mktemp("cubins")
