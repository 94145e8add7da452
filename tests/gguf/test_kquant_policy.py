"""Which GGUF products fastcomm's K-quant decode kernels take (fastcomm_vllm.gguf.kquant's pure policy), and
that the names the host launches are the entries csrc/kquant.cu defines."""
import ctypes
import re
from pathlib import Path

from fastcomm_vllm.gguf import kquant

CSRC = Path(__file__).resolve().parents[2] / "csrc"


def test_glm5_fused_qkv_a_as_the_plugin_stores_it():
    # q_a Q5_K (2048 rows, 4224 B) then kv_a Q8_0 (576 rows, 6528 B), padded to 6528 B rows
    segs = kquant.plan_linear([kquant.Q5_K, kquant.Q8_0], [(0, 2048, 4224), (2048, 2624, 6528)], 6528, 6144)
    assert segs == (kquant.Segment(kquant.Q5_K, 0, 2048), kquant.Segment(kquant.Q8_0, 2048, 576))


def test_what_the_kernels_refuse():
    ok = [(0, 8, 144)]
    assert kquant.plan_linear([kquant.Q4_K], ok, 144, 256) is not None
    assert kquant.plan_linear([2], ok, 144, 256) is None                       # Q4_0: not read here
    assert kquant.plan_linear([kquant.Q4_K], ok, 144, 300) is None             # columns not whole blocks
    assert kquant.plan_linear([kquant.Q4_K], [(0, 8, 140)], 144, 256) is None  # bytes used != the type's
    assert kquant.plan_linear([kquant.Q4_K], ok, 160, 256) is not None         # padded rows, 16-byte aligned
    assert kquant.plan_linear([kquant.Q4_K], ok, 148, 256) is None             # 16-byte loads need alignment
    assert kquant.plan_linear([kquant.Q6_K], [(0, 8, 210)], 210, 256) is not None  # Q6_K is read by words
    assert kquant.plan_linear([kquant.Q4_K] * 5, [(i, i + 1, 144) for i in range(5)], 144, 256) is None
    assert kquant.moe_types_ok(kquant.Q4_K, kquant.Q5_K, 6144, 2048, 3456, 1408)
    assert not kquant.moe_types_ok(kquant.Q4_K, 3, 6144, 2048, 3456, 1408)


def test_token_counts_and_variants():
    assert [kquant.decode_tokens_ok(t) for t in (0, 1, 8, 9)] == [False, True, True, False]
    assert [kquant.gemv_variant(t) for t in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]


def test_staged_launch_shape():
    # GLM-5 at one token: o_proj's 16384 inputs take 20 KB; 8 tokens' MoE down (64 pairs x 2048) 160 KB
    assert kquant.stage_bytes(1, 16384) == 512 * 40
    assert kquant.stage_bytes(64, 2048) == 64 * 64 * 40
    assert kquant.staged_grid(6144, 132) == 264   # two blocks an SM
    assert kquant.staged_grid(100, 132) == 7      # one warp per row, no empty blocks
    assert kquant.staged_grid(0, 132) == 1


def test_constants_mirror_the_cuda_side():
    text = (CSRC / "kquant.cuh").read_text()
    defines = dict(re.findall(r"#define (FC_KQ_\w+) (\d+)", text))
    assert int(defines["FC_KQ_MAX_VECS"]) == kquant.MAX_TOKENS
    assert int(defines["FC_KQ_MAX_SEGS"]) == kquant.MAX_SEGS
    assert int(defines["FC_KQ_ROWS_PER_BLOCK"]) == kquant.ROWS_PER_BLOCK
    assert int(defines["FC_KQ_CHUNK"]) == kquant.CHUNK
    launch_defines = dict(re.findall(r"#define (FC_KQ_\w+) (\d+)", (CSRC / "kquant.cu").read_text()))
    assert int(launch_defines["FC_KQ_STAGED_THREADS"]) == kquant.STAGED_THREADS
    for name, value in kquant.NAMES.items():
        assert int(defines[f"FC_KQ_{value}"]) == name
    launch = (CSRC / "kquant.cu").read_text()
    assert set(kquant.GEMV_VARIANTS) == {int(v) for v in re.findall(r"FC_KQ_DEFINE_GEMV\(NAME, D, (\d+)\)", launch)}
    assert set(kquant.DTYPES.values()) == set(re.findall(r"FC_KQ_DEFINE\((\w+), Fc", launch))
    # struct KqSegs as the kernels take it by value: 4 x (pointer, u64, 4 ints) then two ints
    assert ctypes.sizeof(kquant._Seg) == 32 and ctypes.sizeof(kquant._Segs) == kquant.MAX_SEGS * 32 + 8
