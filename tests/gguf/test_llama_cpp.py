"""The tiny GLM-5 GGUFs the tests write are faithful GGUFs: llama.cpp (the format's reference implementation,
whose loader checks every tensor's name, type and shape against its glm-dsa architecture and refuses a
vocabulary with duplicate strings) loads them and decodes a few tokens, single file and split alike.

Needs llama.cpp's `llama-simple`: FASTCOMM_LLAMA_CPP names the folder holding it (.ci/llama_cpp.sh builds
one), else it is looked up on PATH; without it the test skips.
"""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import needs_gguf

pytestmark = needs_gguf


def _llama_simple() -> Path | None:
    folder = os.environ.get("FASTCOMM_LLAMA_CPP")
    if folder:
        path = Path(folder) / "llama-simple"
        return path if path.is_file() else None
    found = shutil.which("llama-simple")
    return Path(found) if found else None


def _decode(model: Path) -> str:
    exe = _llama_simple()
    if exe is None:
        pytest.skip("needs llama.cpp's llama-simple (FASTCOMM_LLAMA_CPP=folder; .ci/llama_cpp.sh builds it)")
    env = {**os.environ, "LD_LIBRARY_PATH": f"{exe.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    r = subprocess.run([str(exe), "-m", str(model), "-n", "4", "hello"], capture_output=True, text=True,
                       errors="replace", timeout=300, env=env)  # random weights decode to arbitrary bytes
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    return out


def test_llama_cpp_loads_and_decodes_the_tiny_split_gguf(tiny):
    first, _, shape = tiny
    out = _decode(first)
    assert "decoded 4 tokens" in out, out[-2000:]
    assert re.search(r"arch\s*=\s*glm-dsa", out)
    m = re.search(r"n_layer_all\s*=\s*(\d+)", out)  # the main layers and the MTP block
    assert m and int(m[1]) == shape.layers + 1, out[-2000:]


def test_llama_cpp_loads_a_single_file_without_mtp(tmp_path):
    from fastcomm_vllm.gguf import synth as tinyglm

    first, _ = tinyglm.write_gguf(tmp_path, tinyglm.Shape(mtp=False), shards=1)
    assert "decoded 4 tokens" in _decode(first)
