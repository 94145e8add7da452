"""The compile tests' skip reason where CuPy imports but the NVRTC library does not load (CuPy beside a CPU
torch), and the extras that bring NVRTC."""
import re
import sys
import types
from pathlib import Path

import nvrtc_probe


def test_a_missing_nvrtc_library_names_the_fix(monkeypatch):
    def missing():
        raise RuntimeError('CuPy failed to load libnvrtc.so.13: OSError: libnvrtc.so.13: cannot open shared object')

    libs = types.ModuleType("cupy_backends.cuda.libs")
    libs.nvrtc = types.SimpleNamespace(getVersion=missing)
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs", libs)
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs.nvrtc", libs.nvrtc)
    nvrtc_probe.why_no_nvrtc.cache_clear()
    try:
        why = nvrtc_probe.why_no_nvrtc()
    finally:
        nvrtc_probe.why_no_nvrtc.cache_clear()
    assert "does not load" in why and "libnvrtc.so.13" in why and "nvidia-cuda-nvrtc" in why


def test_the_cuda_extras_bring_nvrtc():
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()  # no tomllib on Python 3.10
    extras = dict(re.findall(r"^(cuda1[23]) = \[(.*)\]$", text, re.M))
    assert '"nvidia-cuda-nvrtc>=' in extras["cuda13"] and '"nvidia-cuda-nvrtc-cu12>=' in extras["cuda12"]
