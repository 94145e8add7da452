"""The run's NVRTC builds start in the background (tests/conftest.py, _Prebuild): the tests that declare
cubins run after every other test, and the shared cubin cache is the background builds' folder."""
from tests import conftest
from nvrtc_probe import why_no_nvrtc


def test_tests_that_compile_run_last(request):
    marked = [bool(conftest._cubins(item)) for item in request.session.items]
    assert marked == sorted(marked), "a test that reads a cubin is ordered before one that does not"


def test_the_cubin_cache_is_the_background_builds_folder(request, cubin_cache_dir):
    if not any(conftest._cubins(item) for item in request.session.items) or why_no_nvrtc() is not None:
        assert conftest._PREBUILD.dir is None  # nothing to build: nothing started
        return
    assert str(cubin_cache_dir) == conftest._PREBUILD.dir
    # Observed: the builds are under way (or done) before any test that compiles has run.
    assert conftest._PREBUILD._procs or any(cubin_cache_dir.iterdir())
