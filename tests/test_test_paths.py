"""The test tree must not shadow real packages: tests/vllm/ once made `import vllm` find the test folder
(without vLLM installed), so the vLLM suites failed instead of being skipped."""
import importlib.machinery
import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _under_tests(p: str) -> bool:
    try:
        return Path(p or os.getcwd()).resolve().is_relative_to(TESTS)
    except OSError:
        return False


def test_no_test_folder_is_importable_as_a_top_level_package():
    # Any folder of tests/ that sits directly in a sys.path entry would be importable by its bare name.
    for entry in [p for p in sys.path if _under_tests(p)]:
        for child in Path(entry or os.getcwd()).iterdir():
            if child.is_dir() and not child.name.startswith((".", "_")) and child.name not in ("data",):
                assert not any(child.glob("*.py")), f"{child} is importable as package {child.name!r}"


def test_vllm_resolves_to_the_real_package_or_nothing():
    spec = importlib.machinery.PathFinder.find_spec("vllm")
    if spec is None:
        return
    places = [spec.origin] if spec.origin else list(spec.submodule_search_locations or [])
    assert places and not any(_under_tests(p) for p in places), f"`import vllm` would load {places}"


def test_helpers_import_by_bare_name():
    import numerics
    import spawn_bodies

    assert Path(numerics.__file__).parent == Path(spawn_bodies.__file__).parent == TESTS / "helpers"
