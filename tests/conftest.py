import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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
    # The tests that compile cubins last, so that the background builds (_Prebuild) overlap the rest of the run.
    items.sort(key=lambda item: bool(_cubins(item)))  # stable: each group keeps its order
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


def pytest_configure(config):
    config.addinivalue_line("markers", "cubins(*pairs): the (unit, arch) cubins a test compiles (conftest "
                                       "builds them in the background, one process a core)")


class _Prebuild:
    """The run's NVRTC builds, started in the background as soon as the tests are collected.

    Each unit-arch build is single-threaded NVRTC, 20-45 s on one core, and six of them were most of the test
    command's time run one after another. Here each is a `fastcomm compile` process of its own, as many at once
    as there are cores, writing into the run's shared cubin cache; the tests that need them run last, so the
    builds overlap the rest of the run. A test's own jit.cached_cubin call then finds the cubin, or waits on the
    build lock of the process building it (jit's lock: never a second build). A background build that fails
    leaves nothing: the test's own call compiles and reports the error."""

    def __init__(self):
        self.dir = None
        self._pool = None
        self._procs: list[subprocess.Popen] = []
        self._stopping = False

    def start(self, pairs: list[tuple[str, str]]) -> None:
        self.dir = tempfile.mkdtemp(prefix="fastcomm-test-cubins-")
        self._pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1)
        for unit, arch in dict.fromkeys(pairs):  # each once, in the order the tests need them
            self._pool.submit(self._build, unit, arch)

    def _build(self, unit: str, arch: str) -> None:
        if self._stopping:
            return
        p = subprocess.Popen([sys.executable, "-m", "fastcomm", "compile", "--arch", arch, "--unit", unit,
                              "--cache-dir", self.dir, "-q"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._procs.append(p)
        if self._stopping:  # stop() ran while this one started
            p.kill()
        p.wait()

    def stop(self) -> None:
        self._stopping = True
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        for p in self._procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)


_PREBUILD = _Prebuild()


def _cubins(item) -> list[tuple[str, str]]:
    return [tuple(pair) for mark in item.iter_markers("cubins") for pair in mark.args]


def pytest_collection_finish(session):
    pairs = [pair for item in session.items for pair in _cubins(item)]
    if not pairs:
        return
    from nvrtc_probe import why_no_nvrtc

    if why_no_nvrtc() is None:
        _PREBUILD.start(pairs)


def pytest_sessionfinish(session):
    _PREBUILD.stop()


@pytest.fixture(scope="session")
def cubin_cache_dir(tmp_path_factory):
    """One cubin cache directory for the whole test run: tests that need the same unit compiled for the same
    architecture share the cubin through it instead of compiling it again (and find it built in the
    background where they declare it with the cubins marker: _Prebuild)."""
    return Path(_PREBUILD.dir) if _PREBUILD.dir else tmp_path_factory.mktemp("cubins")
