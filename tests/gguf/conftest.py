"""Fixtures for the GGUF tests: the tiny GLM-5 files are written once per session (about a second)."""
import importlib.util

import pytest


def installed(module: str) -> bool:
    """A real install: find_spec alone is fooled by a namespace package, e.g. this tests/gguf folder."""
    spec = importlib.util.find_spec(module)
    return spec is not None and spec.origin is not None


needs_gguf = pytest.mark.skipif(not installed("gguf"), reason="needs the gguf package (pip install -e '.[gguf]')")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(first shard, truth, Shape) of the tiny GLM-5 GGUF with its MTP block, in 3 shards."""
    if not installed("gguf"):
        pytest.skip("needs the gguf package")
    from fastcomm_vllm.gguf import synth as tinyglm

    shape = tinyglm.Shape()
    first, truth = tinyglm.write_gguf(tmp_path_factory.mktemp("glm5"), shape)
    return first, truth, shape


@pytest.fixture(scope="session")
def tiny_no_mtp(tmp_path_factory):
    if not installed("gguf"):
        pytest.skip("needs the gguf package")
    from fastcomm_vllm.gguf import synth as tinyglm

    shape = tinyglm.Shape(mtp=False)
    first, truth = tinyglm.write_gguf(tmp_path_factory.mktemp("glm5-nomtp"), shape, shards=2)
    return first, truth, shape


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory, monkeypatch):
    # The derived config folders go to a per-session cache, never the user's.
    monkeypatch.setenv("FASTCOMM_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "fastcomm-cache"))
