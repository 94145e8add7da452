"""The K-quant decode kernels' chunk math (csrc/kquant.cuh) on the CPU, against gguf-py's dequantization.

kquant.cuh's decode, dot and activation quantization are plain C++ with host twins of the few intrinsics;
kquant_host.cpp builds them with g++ and sums each row as the warp does. Two references:
- activations that int8 quantization represents exactly (each 32-value chunk a scale times integers, max 127):
  the product must equal gguf-py's dequantized weights times x to fp32 rounding (a wrong bit, nibble, scale
  or sub-block in the decode shows up here);
- random activations: within the int8 activation error (as llama.cpp's and vllm-gguf-plugin's kernels).
The same header's device path is compiled by NVRTC in tests/test_compile.py and run on a GPU by
tests/gguf/test_kquant_gpu.py.
"""
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import needs_gguf
from kquant_data import exact_activations, weights

pytestmark = needs_gguf
HERE = Path(__file__).resolve().parent
CSRC = HERE.parents[1] / "csrc"
TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0")


@pytest.fixture(scope="module")
def host_binary(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path_factory.mktemp("kquant") / "kquant_host"
    subprocess.run([cxx, "-O1", "-std=c++17", f"-I{CSRC}", "-o", str(exe), str(HERE / "kquant_host.cpp")],
                   check=True, capture_output=True)
    return exe


def run(exe, qtype: str, stored: np.ndarray, x: np.ndarray) -> np.ndarray:
    import gguf

    rows = stored.shape[0]
    n, cols = x.shape
    header = np.array([int(gguf.GGMLQuantizationType[qtype]), rows, cols, n], np.int32)
    out = subprocess.run([str(exe)], input=header.tobytes() + stored.tobytes() + x.astype(np.float32).tobytes(),
                         capture_output=True, check=True).stdout
    return np.frombuffer(out, np.float32).reshape(n, rows)


@pytest.mark.parametrize("qtype", TYPES)
def test_decode_matches_gguf_py(host_binary, qtype):
    rng = np.random.default_rng(1)
    rows, cols = 37, 2048  # odd row count; 8 super-blocks a row, 64 chunks: two per lane
    stored, truth = weights(qtype, (rows, cols), seed=2)
    x = exact_activations(rng, 3, cols)
    got = run(host_binary, qtype, stored, x).astype(np.float64)
    want = x.astype(np.float64) @ truth.T
    scale = np.abs(x).astype(np.float64) @ np.abs(truth).T  # the size of the terms, for a relative bound
    err = np.abs(got - want) / scale
    assert err.max() < 2e-6, (qtype, float(err.max()))


@pytest.mark.parametrize("qtype", TYPES)
def test_random_activations_within_int8_error(host_binary, qtype):
    rng = np.random.default_rng(3)
    rows, cols = 64, 6144
    stored, truth = weights(qtype, (rows, cols), seed=4)
    x = rng.standard_normal((2, cols)).astype(np.float32)
    got = run(host_binary, qtype, stored, x).astype(np.float64)
    want = x.astype(np.float64) @ truth.T
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 1e-2, (qtype, rel)


def test_activation_quantization_edge_cases(host_binary):
    """Zeros and -0.0 give exact zeros; a NaN in a chunk makes that product NaN (never a finite lie)."""
    rows, cols = 4, 256
    stored, truth = weights("Q4_K", (rows, cols), seed=5)
    x = np.zeros((3, cols), np.float32)
    x[1] = -0.0
    x[2, 7] = np.nan
    got = run(host_binary, "Q4_K", stored, x)
    assert np.all(got[:2] == 0.0)
    assert np.all(np.isnan(got[2]))


def test_a_wrong_decode_would_be_caught(host_binary):
    """The exact reference is sharp: the Q4_K weights read as Q5_K bytes' neighbour type differ at once."""
    rng = np.random.default_rng(6)
    stored, truth = weights("Q4_K", (8, 256), seed=7)
    x = exact_activations(rng, 1, 256)
    flipped = stored.copy()
    flipped[:, 4] ^= 0x01  # one bit of the first sub-block's 6-bit scale
    good = run(host_binary, "Q4_K", stored, x)
    bad = run(host_binary, "Q4_K", flipped, x)
    want = x.astype(np.float64) @ truth.T
    assert np.allclose(good, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(bad, want, rtol=1e-3, atol=1e-4)
