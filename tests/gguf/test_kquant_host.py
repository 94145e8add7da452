"""The K-quant decode kernels' chunk math (csrc/kquant/kquant.cuh) on the CPU, against gguf-py's dequantization.

kquant.cuh's decode, dot, activation quantization and tensor-core operands are plain C++ with host twins of
the few intrinsics; kquant_host.cpp builds them with g++ and sums each row as the warp does (the mma forms:
every lane's operands placed as PTX defines mma.sync's fragments). Two references:
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

from fastcomm import kquant

from conftest import needs_gguf
from kquant_data import exact_activations, weights

pytestmark = needs_gguf
HERE = Path(__file__).resolve().parent
CSRC = HERE.parents[1] / "csrc" / "kquant"
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


def run(exe, qtype: str, stored: np.ndarray, x: np.ndarray, warps: int = 0) -> np.ndarray:
    """The product as the dp4a forms make it (warps=0) or the mma forms with ``warps`` warps a tile."""
    import gguf

    rows = stored.shape[0]
    n, cols = x.shape
    header = np.array([int(gguf.GGMLQuantizationType[qtype]), rows, cols, n, warps], np.int32)
    out = subprocess.run([str(exe)], input=header.tobytes() + stored.tobytes() + x.astype(np.float32).tobytes(),
                         capture_output=True, check=True).stdout
    return np.frombuffer(out, np.float32).reshape(n, rows)


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantized_weights_are_gguf_py_s_to_the_bit(host_binary, qtype):
    """kq_dequant_chunk (fc_kq_dequant's decode, before the dtype's rounding): the same fp32 operations as ggml's
    dequantization in the same order, so every weight equals gguf-py's exactly."""
    import gguf

    rows, cols = 5, 1024
    stored, truth = weights(qtype, (rows, cols), seed=4)
    header = np.array([int(gguf.GGMLQuantizationType[qtype]), rows, cols, 1, -1], np.int32)
    out = subprocess.run([str(host_binary)], input=header.tobytes() + stored.tobytes()
                         + np.zeros(cols, np.float32).tobytes(), capture_output=True, check=True).stdout
    got = np.frombuffer(out, np.float32).reshape(rows, cols)
    assert np.isfinite(truth).all() and np.abs(truth).max() > 0
    mismatched = int((got != truth.astype(np.float32)).sum())
    assert mismatched == 0, (qtype, mismatched, float(np.abs(got - truth).max()))


@pytest.mark.parametrize("warps", [0, 1, 3, 4, 8], ids=["dp4a", "mma-1warp", "mma-3warps", "mma-4warps", "mma-8warps"])
@pytest.mark.parametrize("qtype", TYPES)
def test_decode_matches_gguf_py(host_binary, qtype, warps):
    """Rows 37 (a partial last tile of the mma forms), 8 units split over the warps unevenly at 3."""
    rng = np.random.default_rng(1)
    rows, cols = 37, 2048  # odd row count; 8 super-blocks a row, 64 chunks: two per lane
    stored, truth = weights(qtype, (rows, cols), seed=2)
    x = exact_activations(rng, 3, cols)
    got = run(host_binary, qtype, stored, x, warps).astype(np.float64)
    want = x.astype(np.float64) @ truth.T
    scale = np.abs(x).astype(np.float64) @ np.abs(truth).T  # the size of the terms, for a relative bound
    err = np.abs(got - want) / scale
    assert err.max() < 2e-6, (qtype, float(err.max()))


@pytest.mark.parametrize("warps", [0, 4], ids=["dp4a", "mma"])
@pytest.mark.parametrize("qtype", TYPES)
def test_random_activations_within_int8_error(host_binary, qtype, warps):
    rng = np.random.default_rng(3)
    rows, cols = 64, 6144
    stored, truth = weights(qtype, (rows, cols), seed=4)
    x = rng.standard_normal((8, cols)).astype(np.float32)
    got = run(host_binary, qtype, stored, x, warps).astype(np.float64)
    want = x.astype(np.float64) @ truth.T
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 1e-2, (qtype, rel)


@pytest.mark.parametrize("warps", [0, 4], ids=["dp4a", "mma"])
def test_activation_quantization_edge_cases(host_binary, warps):
    """Zeros and -0.0 give exact zeros; a NaN in a chunk makes that product NaN (never a finite lie), and only
    that vector's: the mma forms share every operand fragment between 8 vectors."""
    rows, cols = 4, 256
    stored, truth = weights("Q4_K", (rows, cols), seed=5)
    x = np.zeros((4, cols), np.float32)
    x[1] = -0.0
    x[2, 7] = np.nan
    x[3] = 1.0
    got = run(host_binary, "Q4_K", stored, x, warps)
    assert np.all(got[:2] == 0.0)
    assert np.all(np.isnan(got[2]))
    assert np.all(np.isfinite(got[3]))


@pytest.mark.parametrize("warps", [0, 4], ids=["dp4a", "mma"])
def test_a_wrong_decode_would_be_caught(host_binary, warps):
    """The exact reference is sharp: one flipped bit of a sub-block's scale is seen at once."""
    rng = np.random.default_rng(6)
    stored, truth = weights("Q4_K", (8, 256), seed=7)
    x = exact_activations(rng, 1, 256)
    flipped = stored.copy()
    flipped[:, 4] ^= 0x01  # one bit of the first sub-block's 6-bit scale
    good = run(host_binary, "Q4_K", stored, x, warps)
    bad = run(host_binary, "Q4_K", flipped, x, warps)
    want = x.astype(np.float64) @ truth.T
    assert np.allclose(good, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(bad, want, rtol=1e-3, atol=1e-4)


_LAYOUT = r"""
#include <cstdio>
#include "kquant.cuh"
int main() {  // every piece's stage offset, then each warp-wide read's 16-byte places (lane order)
  for (int j = 0; j < 8; ++j) for (int p = 0; p < 16; ++p) printf("op %d\n", kq_xstage_op(j, p));
  for (int j = 0; j < 8; ++j) for (int q = 0; q < 4; ++q) printf("float %d\n", kq_xstage_float(j, q));
  for (int i = 0; i < 4; ++i) {  // kq_xstage_ops: lane (g, t) reads piece 4t + i of slot g
    printf("read");
    for (int lane = 0; lane < 32; ++lane) printf(" %d", kq_xstage_op(lane / 4, 4 * (lane % 4) + i));
    printf("\n");
  }
  for (int q = 0; q < 4; ++q) for (int j = 0; j < 2; ++j) {  // kq_xstage_scales: lane (g, t) reads slot 2t + j
    printf("read");
    for (int lane = 0; lane < 32; ++lane) printf(" %d", kq_xstage_float(2 * (lane % 4) + j, q));
    printf("\n");
  }
  for (int k = 0; k < 4; ++k) {  // kq_mma_xcopy's operand copies: lane l, piece l % 16 of slot l / 16 + 2k
    printf("write");
    for (int lane = 0; lane < 32; ++lane) printf(" %d", kq_xstage_op(lane / 16 + 2 * k, lane % 16));
    printf("\n");
  }
  printf("write");  // its float copies: lane l, piece l % 4 of slot l / 4
  for (int lane = 0; lane < 32; ++lane) printf(" %d", kq_xstage_float(lane / 4, lane % 4));
  printf("\n");
}
"""


def _wavefronts(places: list[int], width: int = 16) -> int:
    """Shared-memory wavefronts of one warp-wide access of ``width`` bytes (16 or 8) at ``places`` (lane order):
    served 128 / width lanes at a time, each group taking as many wavefronts as the most distinct addresses in one
    width-byte bank group (the model that reproduces ncu's excess-wavefront counts of the mma kernels on an H200)."""
    lanes, total = 128 // width, 0
    for first in range(0, 32, lanes):
        groups: dict[int, set[int]] = {}
        for at in places[first:first + lanes]:
            groups.setdefault(at // width % lanes, set()).add(at)
        total += max(len(a) for a in groups.values())
    return total


def test_the_activation_stage_is_one_to_one_and_free_of_bank_conflicts(tmp_path):
    """The mma forms' ring stage (kq_xstage_op / kq_xstage_float): every operand and float piece has its own
    16 bytes inside FC_KQ_MMA_XSTAGE, each warp-wide read of the compute loop and each cp.async that fills the
    stage (kq_mma_xcopy: lane l, piece l % 16 of slot l / 16 + 2k; float piece l % 4 of slot l / 4) takes the
    least wavefronts: one per 8 lanes."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    (tmp_path / "layout.cpp").write_text(_LAYOUT)
    subprocess.run([cxx, "-std=c++17", f"-I{CSRC}", "-o", str(tmp_path / "layout"), str(tmp_path / "layout.cpp")],
                   check=True, capture_output=True)
    lines = subprocess.run([str(tmp_path / "layout")], capture_output=True, check=True, text=True).stdout.splitlines()
    places = [int(line.split()[1]) for line in lines if line.startswith(("op", "float"))]
    assert len(places) == 8 * 16 + 8 * 4 and len(set(places)) == len(places)
    assert all(p % 16 == 0 and 0 <= p < 2560 for p in places)
    accesses = [line for line in lines if line.startswith(("read", "write"))]
    assert len(accesses) == 4 + 8 + 4 + 1
    for line in accesses:
        assert _wavefronts([int(v) for v in line.split()[1:]]) == 4, line


def _k4_reads(span: int, q5: bool) -> list[list[int]]:
    """kq_unit_load's 8-byte reads of a Q4_K / Q5_K unit from the mma forms' stage (rows ``span`` apart):
    lane (g, t) reads row g (and g + 8) at qh + 8 t (Q5_K) and qs + 32 p + 8 t."""
    offsets = ([16] if q5 else []) + [(48 if q5 else 16) + 32 * p for p in range(4)]
    return [[(lane // 4 + half) * span + off + 8 * (lane % 4) for lane in range(32)]
            for off in offsets for half in (0, 8)]


@pytest.mark.parametrize("t", ["Q4_K", "Q5_K"])
def test_the_weight_stage_reads_take_the_least_wavefronts(t):
    """Every 8-byte read of a unit's quants from the stage takes 2 wavefronts (32 lanes x 8 bytes), at the
    row span the kernels use (kquant.mma_span, kq_mma_span)."""
    span = kquant.mma_span(getattr(kquant, t))
    assert all(_wavefronts(r, 8) == 2 for r in _k4_reads(span, t == "Q5_K"))


def test_the_wavefront_count_sees_the_earlier_q5k_span_conflict():
    """Q5_K's rows at the 192 bytes that hold its unit: rows g and g + 2 share banks, each read takes 4."""
    assert all(_wavefronts(r, 8) == 4 for r in _k4_reads(192, True))


def test_the_wavefront_count_sees_the_earlier_operand_layout_conflict():
    """The model behind the test above is sharp: the operand layout before (piece p of slot j at 16 (p ^ j % 4))
    takes 8 wavefronts a read, twice the least."""
    old = [256 * (lane // 4) + 16 * ((4 * (lane % 4)) ^ (lane // 4 % 4)) for lane in range(32)]
    assert _wavefronts(old) == 8
