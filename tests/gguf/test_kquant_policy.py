"""Which GGUF products fastcomm's K-quant decode kernels take, and in which form (fastcomm.kquant's
pure policy). The kernels' names, structs and constants are fastcomm.abi's, checked in tests/test_abi.py."""
import pytest

from fastcomm.kquant import abi
from fastcomm import kquant
from fastcomm.kquant import policy


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


def test_a_staged_grid_is_one_wave_where_an_sm_holds_one_block():
    """Two blocks an SM only where two fit (a second wave would stage the activations again for rows the
    first wave's warps could have taken). Registers a thread of fc_kq_gemvs<N>_bf16 as `fastcomm compile` read
    them off the cubins at 5f97c25: sm_120 64 (1 token) and 95 (2), sm_90 62 (1) and 94 (4 and 8)."""
    h100 = kquant.Limits("H100", sms=132, smem_per_block=232448, smem_per_sm=233472, regs_per_sm=65536,
                         threads_per_sm=2048, blocks_per_sm=32, major=9)
    warps = kquant.abi.KQ_STAGED_THREADS // 32
    one = kquant.stage_bytes(1, 6144)
    assert kquant.resident_blocks(kquant.SM120, warps, one, 0, 64) == 2
    assert kquant.resident_blocks(kquant.SM120, warps, kquant.stage_bytes(2, 6144), 0, 95) == 1
    assert kquant.resident_blocks(h100, warps, one, 0, 62) == 2
    assert kquant.resident_blocks(h100, warps, kquant.stage_bytes(4, 6144), 0, 94) == 1
    assert kquant.staged_grid(6144, 188, resident=1) == 188   # one wave, each warp two rows or so
    assert kquant.staged_grid(6144, 188, resident=2) == 376
    assert kquant.staged_grid(6144, 188, resident=4) == 376   # never past STAGED_BLOCKS_PER_SM
    assert kquant.staged_grid(6144, 188, resident=0) == 188   # a block that does not fit: the launch says so
    assert kquant.staged_grid(100, 188, resident=1) == 7


def test_the_mma_form_reads_whole_units_and_tiles_of_one_type():
    glm5 = kquant.plan_linear([kquant.Q5_K, kquant.Q8_0], [(0, 2048, 4224), (2048, 2624, 6528)], 6528, 6144)
    assert kquant.mma_ok(glm5, 6144)                                   # 2048 rows: the Q8_0 tiles start at 128
    assert not kquant.mma_ok(glm5, 6144 - 32)                          # not a whole 256-value unit
    assert kquant.mma_ok((kquant.Segment(kquant.Q4_K, 0, 37),), 256)   # one segment: a last partial tile is fine
    odd = (kquant.Segment(kquant.Q5_K, 0, 24), kquant.Segment(kquant.Q8_0, 24, 8))
    assert not kquant.mma_ok(odd, 256)                                 # a tile would straddle two types
    # warps a tile: enough warps on 132 SMs, no more than the units, an even split
    res = (16, 16, 5, 4, 3, 2, 2, 1)  # blocks of 1..8 warps an SM holds (registers, rings)
    assert kquant.mma_warps(6144, 164, 132, res) == 6     # fused_qkv_a: 7 fit one wave, 24 units even at 6
    assert kquant.mma_warps(2048, 1024, 132, res) == 2    # q_b: 1024 tiles fit one wave at 2 warps (16 a SM)
    assert kquant.mma_warps(16384, 384, 132, res) == 5    # o_proj: 3 blocks a SM at 5 warps; 6 would take 2 waves
    assert kquant.mma_warps(6144, 9680, 132, res) == 1    # the LM head: no split fits one wave
    assert [kquant.mma_warps(c, 3, 132, res) for c in (256, 768, 1280, 4352, 6144)] == [1, 3, 5, 6, 8]
    assert kquant.mma_warps(6144, 3, 132, (4, 2, 1, 0, 0, 0, 0, 0)) == 3  # no block of 4 warps fits an SM
    assert max(kquant.mma_warps(c, 1, 1000, res) for c in range(256, 65536, 256)) == abi.KQ_MMA_WARPS
    # the ring: KQ_MMA_STAGES units of 16 rows, each row the 16-byte span of the widest type's unit
    assert kquant.mma_ring_bytes([kquant.Q4_K]) == abi.KQ_MMA_STAGES * (16 * 160 + 2560)
    assert kquant.mma_ring_bytes([kquant.Q5_K, kquant.Q8_0]) == abi.KQ_MMA_STAGES * (16 * 288 + 2560)
    # Q5_K's 176-byte unit fits 192, which is 64 mod 128: its rows take 224 (test_kquant_host's wavefront count)
    assert [kquant.mma_span(t) for t in (kquant.Q4_K, kquant.Q5_K, kquant.Q6_K, kquant.Q8_0)] == [160, 224, 240, 288]
    assert kquant.mma_ring_bytes([kquant.Q5_K]) == abi.KQ_MMA_STAGES * (16 * 224 + 2560)
    # the shared form's block: 4 warps' weight rings, then one activation ring (Q4_K: 3 x (4 x 2560 + 2560))
    assert kquant.moe_shared_smem([kquant.Q4_K]) == abi.KQ_MMA_STAGES * (kquant.MOE_SHARED_WARPS * 16 * 160 + 2560)
    assert kquant.moe_shared_smem([kquant.Q5_K]) == 3 * (4 * 16 * 224 + 2560) < 227 * 1024 // 4
    assert kquant.moe_shared_smem([kquant.Q8_0], 8) == 3 * (8 * 16 * 288 + 2560)
    with pytest.raises(ValueError, match="1, 2, 4 or 8 warps"):  # refused before anything reaches a GPU
        kquant.ops._shared_launch(0, abi.KQ_MOE_MMA_UP_SHARED, "bfloat16", 4096, 16, kquant.Q4_K, 0, (), 3)
    # a block's dynamic shared memory: the other warps' partial sums, then a ring a warp (a one-warp block: its ring)
    ring = kquant.mma_ring_bytes([kquant.Q4_K])
    assert kquant.mma_smem(1, ring) == ring
    assert kquant.mma_smem(8, ring) == 7 * abi.KQ_MMA_PART + 8 * ring
    assert [kquant.tiles(r) for r in (1, 16, 17, 154880)] == [1, 1, 2, 9680]


def test_the_mma_entry_built_for_the_type_serves_the_moe_and_q6k_linears():
    k = kquant
    assert k.mma_variant([k.Q4_K], moe=True) == "_q4k" and k.mma_variant([k.Q5_K], moe=True) == "_q5k"
    assert k.mma_variant([k.Q6_K], moe=False) == "_q6k"                        # the LM head, dense down
    assert k.mma_variant([k.Q4_K], moe=False) == k.mma_variant([k.Q8_0], moe=False) == ""  # o_proj: its entry lost
    assert k.mma_variant([k.Q5_K, k.Q8_0], moe=False) == ""                    # fused_qkv_a: two types, the switch
    assert k.mma_variant([k.Q6_K, k.Q6_K], moe=False) == "_q6k"
    # every entry it names exists, for every dtype (and once for the untyped down kernel)
    for kernel in (abi.KQ_MMA, abi.KQ_MOE_MMA_UP, abi.KQ_MOE_MMA_DOWN):
        assert all(v in kernel.variants for v in abi.KQ_TYPE_VARIANTS.values())
    assert abi.KQ_MOE_MMA_DOWN.symbol(None, "_q5k") == "fc_kq_moe_mma_down_q5k"


def test_form_choice():
    assert kquant.linear_form(kquant.MMA_MIN_TOKENS, True, True) == "mma"
    assert kquant.linear_form(8, False, True) == "staged"
    assert kquant.linear_form(8, False, False) == "unstaged"
    if kquant.MMA_MIN_TOKENS > 1:
        assert kquant.linear_form(1, True, True) == "staged"
        assert kquant.linear_form(1, True, True, cols=2048) == "staged"


def test_short_rows_take_mma_from_one_token():
    """TP 8's shared down (K 256) and dense down (K 1536) read rows too short for the staged form's warp a row:
    the tensor-core form serves them from 1 token, where it can read them and is allowed."""
    short = policy.MMA_SHORT_ROW_COLS
    assert kquant.linear_form(1, True, True, cols=256) == "mma"
    assert kquant.linear_form(1, True, True, cols=short) == "mma"
    assert kquant.linear_form(1, True, True, cols=short + 256) == ("mma" if kquant.MMA_MIN_TOKENS <= 1 else "staged")
    assert kquant.linear_form(1, False, True, cols=256) == "staged"      # FASTCOMM_GGUF_KERNELS=dp4a, or unreadable
    assert kquant.linear_form(1, False, False, cols=256) == "unstaged"
    assert kquant.linear_form(1, True, True, min_tokens=4, cols=256) == "mma"  # the token threshold: long rows
    assert kquant.linear_form(8, True, True, min_tokens=9, cols=256) == "staged"  # 9: never, short rows too
    assert kquant.moe_form(8, 8, 6144, 2048) == "grouped"
    assert kquant.moe_form(8, 8, 6144, 2048 + 32) == "pairs"           # the grouped tiles step 256 values
    assert kquant.moe_form(8, abi.KQ_MAX_PAIRS // 8 + 1, 6144, 2048) == "pairs"  # more pairs than its route table
    assert kquant.moe_form(8, 8, 6144, 2048, tensor_cores=False) == "pairs"  # FASTCOMM_GGUF_KERNELS=dp4a
    assert set(kquant.FORMS_LINEAR) == {"mma", "staged", "unstaged"}
    assert set(kquant.FORMS_MOE) == {"grouped", "pairs", "shared", "staged"}
    # the shared form is timed beside the others, never the policy's choice until a run says so
    assert {kquant.moe_form(n, 8, 6144, 2048) for n in range(1, 9)} <= {"grouped", "pairs"}
    # the staged form takes the per-pair form's place where allowed and its stage fits (staged=True), never the
    # grouped form's
    assert kquant.moe_form(1, 8, 6144, 2048, staged=True) == "staged"
    assert kquant.moe_form(8, 8, 6144, 2048, staged=True) == "grouped"
    assert kquant.moe_form(8, 8, 6144, 2048, tensor_cores=False, staged=True) == "staged"
    # ... and keeps pairs where its stage exceeds the device's block (8 tokens of 8 pairs at 2048: 160 KB against
    # sm_120's 99 KB) or the tokens exceed a per-pair call's
    stage = kquant.moe_stage_bytes(8, 8, 6144, 2048)
    assert kquant.moe_form(8, 8, 6144, 2048, tensor_cores=False, staged=True,
                           smem_per_block=kquant.SM120.smem_per_block) == "pairs"
    assert kquant.moe_form(8, 8, 6144, 2048, tensor_cores=False, staged=True, smem_per_block=stage) == "staged"
    assert kquant.moe_form(8, 8, 6144, 2048, tensor_cores=False, staged=True, smem_per_block=stage - 1) == "pairs"
    assert kquant.moe_form(kquant.MAX_TOKENS + 1, 8, 6144, 2048, tensor_cores=False, staged=True) == "pairs"


def test_a_prefill_dequantizes_from_its_threshold_else_chunks_up_to_its_limit_else_the_plugin():
    form = kquant.prefill_form
    assert set(kquant.PREFILL_FORMS) == {"dequant", "chunks", "plugin"}
    # the decode kernels' own 1-8 tokens are never a prefill's, whatever the settings
    assert {form(n, 4096, 1) for n in range(1, kquant.MAX_TOKENS + 1)} == {"plugin"}
    assert [form(n, 0, 0) for n in (9, 64, 4096)] == ["plugin"] * 3  # both off
    assert [form(n, 0, 64) for n in (9, 63, 64, 4096)] == ["plugin", "plugin", "dequant", "dequant"]
    assert [form(n, 32, 0) for n in (9, 32, 33)] == ["chunks", "chunks", "plugin"]
    # dequant first: chunks only where the dequantized form does not take the product
    assert [form(n, 256, 64) for n in (9, 63, 64, 256, 257)] == ["chunks", "chunks", "dequant", "dequant", "dequant"]
    # launched eagerly (host-bound), a linear never takes the chunks: the plugin's, or dequant from its threshold
    assert [form(n, 256, 16, host_bound=True) for n in (9, 15, 16)] == ["plugin", "plugin", "dequant"]
    assert [form(n, 256, 0, host_bound=True) for n in (9, 256)] == ["plugin", "plugin"]
    # MoE: dequant by routed tokens an expert; 256 tokens of top 8 are 128 an expert of 16, 8 an expert of 256
    moe = kquant.moe_prefill_form
    assert moe(256, 8, 16, 0, 32) == "dequant" and moe(256, 8, 256, 0, 32) == "plugin"
    assert moe(1024, 8, 256, 0, 32) == "dequant" and moe(1023, 8, 256, 0, 32) == "plugin"
    assert moe(1023, 8, 256, 1023, 32) == "chunks" and moe(4096, 8, 16, 4096, 0) == "chunks"
    assert moe(kquant.MAX_TOKENS, 8, 1, 4096, 1) == "plugin"
    # the settings' defaults, resolved from an empty environment, on GLM-5's MoE and the benchmark's: chunks
    # from 9 tokens to 256, the MoE never dequantized; a linear from 16 tokens dequantized, in a graph capture
    # the chunks below that
    from fastcomm.kquant.settings import Settings

    d = Settings.from_env({})
    assert [moe(n, 8, e, d.chunk_max_tokens, d.dequant_moe_min) for n, e in ((9, 256), (256, 16), (257, 16))] \
        == ["chunks", "chunks", "plugin"]
    assert [form(n, d.chunk_max_tokens, d.dequant_min_tokens) for n in (9, 16)] == ["chunks", "dequant"]
    assert d.dequant_kernel == kquant.DEQUANT_KERNEL == "fastcomm"


def test_chunks_cover_every_row_once_in_decode_sized_calls():
    for tokens in (1, 8, 9, 16, 19, 64, 257):
        rows = kquant.chunk_rows(tokens)
        assert rows[0][0] == 0 and rows[-1][1] == tokens
        assert all(b == c for (_, b), (c, _) in zip(rows, rows[1:]))  # contiguous, no overlap
        assert all(1 <= b - a <= kquant.MAX_TOKENS for a, b in rows)
        assert len(rows) == -(-tokens // kquant.MAX_TOKENS)  # the fewest calls


def test_a_moe_form_asked_for_says_why_it_cannot_serve():
    ok = dict(tokens=8, topk=8, hidden=6144, inter=2048)
    assert all(kquant.moe_form_error(f, **ok) is None for f in kquant.FORMS_MOE)
    assert "not one of" in kquant.moe_form_error("dense", **ok)
    assert "multiples of 256" in kquant.moe_form_error("grouped", **{**ok, "inter": 2048 + 32})
    assert kquant.moe_form_error("pairs", **{**ok, "inter": 2048 + 32}) is None
    many = {**ok, "topk": abi.KQ_MAX_PAIRS // 8 + 1}
    assert "at most 256 pairs" in kquant.moe_form_error("grouped", **many)
    assert kquant.moe_form_error("grouped", **{**ok, "topk": 32}) is None      # 256 pairs: the route table's all
    assert kquant.moe_form(4, 33, 6144, 2048) == "grouped"                      # 132 pairs
    assert kquant.moe_form(8, 33, 6144, 2048) == "pairs"                        # 264 pairs
    assert kquant.moe_form(1, 8, 6144, 2048, min_tokens=2) == "pairs"           # below the token threshold
    # the policy never picks a form that cannot serve
    for tokens, topk, inter in ((8, 8, 2048), (8, 33, 2048), (3, 8, 2048 + 32), (4, 33, 2048)):
        form = kquant.moe_form(tokens, topk, 6144, inter)
        assert kquant.moe_form_error(form, tokens, topk, 6144, inter) is None


def test_segment_tables_are_built_once_per_weight():
    segs = (kquant.Segment(kquant.Q5_K, 0, 2048), kquant.Segment(kquant.Q8_0, 2048, 576))
    table = kquant.ops._segs_table(1 << 20, 6528, segs)
    assert kquant.ops._segs_table(1 << 20, 6528, segs) is table
    assert (table.nseg, table.total_rows) == (2, 2624)
    assert (table.s[1].w, table.s[1].row0, table.s[1].out_col, table.s[1].type) == ((1 << 20) + 2048 * 6528, 2048,
                                                                                    2048, kquant.Q8_0)


def test_dependent_launch_for_a_kernel_that_prefetches_where_the_gpu_has_it_and_the_setting_allows():
    assert kquant.dependent_launch(9, True, True) and kquant.dependent_launch(12, True, True)  # H200, sm_120
    assert not kquant.dependent_launch(8, True, True)      # sm_80: no griddepcontrol
    assert not kquant.dependent_launch(9, False, True)     # FASTCOMM_GGUF_PDL=0
    assert not kquant.dependent_launch(9, True, False)     # quantize, dp4a, grouped MoE: measured no gain (or loss)


def _bodies(text: str) -> dict[str, str]:
    """Each function defined in ``text``, by name: its body's text (braces matched)."""
    import re

    out = {}
    for m in re.finditer(r"\b(kq_\w+)\([^;{]*\)\s*\{", text):
        depth, i = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        out.setdefault(m.group(1), text[m.end():i - 1])
    return out


def test_every_kernel_lets_the_next_launch_and_waits_before_it_reads():
    """A dependent launch is only correct if every kernel waits (kq_grid_wait) before it reads what a kernel
    before it wrote: each extern "C" entry of kquant.cu calls a device function that starts with kq_grid_enter
    (or, the dense mma form, lets the next launch first and waits in kq_mma_tile after its first weight copies).
    Only weights may be asked for before the wait: the staged dense form's L2 prefetch of its first row."""
    import pathlib
    import re

    csrc = pathlib.Path(__file__).resolve().parents[2] / "csrc" / "kquant"
    launch = (csrc / "kquant.cu").read_text()
    bodies = _bodies(launch + (csrc / "kquant_mma.cuh").read_text())
    entries = re.findall(r'extern "C" __global__ void[^{]*\{[\s\\]*(kq_\w+)<', launch)
    # quantize, gemv, gemv_s, moe_up/down, moe_up_s/down_s, mma_gemv/moe, sum, dequant
    assert len(set(entries)) == 11, sorted(set(entries))
    for name in set(entries):
        body = bodies[name]
        assert "kq_grid_" in body, f"{name} neither lets the next kernel launch nor waits"
        first = body.index("kq_grid_")
        reads = [body.find(s) for s in ("__ldg", "kq_route", "kq_stage", "kq_row_s", "kq_row_any", "kq_row<",
                                         "kq_mma_tile", "y[", "x +", "topk_ids", "kq_dequant_chunk")]
        assert all(r < 0 or r > first for r in reads), name
        before = re.sub(r"//[^\n]*", "", body[:first])  # code only
        if "kq_prefetch_row" in before:  # a weight row (the segment table's address), nothing a kernel wrote
            assert name == "kq_gemv_s" and "sg.w +" in before and not re.search(r"(?<![.\w])(x|out)\b", before), name
        if "kq_grid_enter();" not in body:
            assert "kq_grid_launch_dependents();" in body and "kq_mma_tile_any" in body, name
    tile = bodies["kq_mma_tile"]
    assert tile.index("kq_grid_wait();") < tile.index("kq_mma_xcopy<")  # activations only after the wait
    assert "griddepcontrol.wait" in (csrc / "kquant.cuh").read_text()


def test_only_16_byte_aligned_weights_reach_the_kernels():
    # every form reads Q4_K / Q5_K rows by 16 bytes; the vLLM wiring sends any other weight to the plugin
    assert kquant.weights_aligned(0x7F0000000000, 0x7F0000000010)
    assert not kquant.weights_aligned(0x7F0000000000, 0x7F0000000008)
    assert all(kquant.ROW_ALIGN[t] == 16 for t in (kquant.Q4_K, kquant.Q5_K))


def test_the_staged_moe_form_stages_the_larger_of_up_and_down():
    # GLM-5 at TP 8 (hidden 6144, 256 of inter a rank, top 8): up's 2 tokens of 6144 outweigh down's 16 pairs
    assert kquant.moe_stage_bytes(2, 8, 6144, 256) == kquant.stage_bytes(2, 6144) == 2 * 192 * 40
    # at TP 1 (inter 2048), 8 tokens: down's 64 pairs of 2048 values, 160 KB, past sm_120's 99 KB a block
    assert kquant.moe_stage_bytes(8, 8, 6144, 2048) == kquant.stage_bytes(64, 2048) == 163840
    assert kquant.moe_stage_bytes(8, 8, 6144, 2048) > kquant.EMULATED["sm_120"].smem_per_block


def test_a_moe_call_takes_what_the_grouped_route_table_holds_and_the_pairs_form_8():
    calls = kquant.moe_call_tokens
    assert calls(8, 6144, 2048) == abi.KQ_MAX_PAIRS // 8 == 32  # GLM-5: 32 tokens of top 8 a call
    assert calls(4, 6144, 2048) == 64 and calls(8, 6144, 2048, form="shared") == 32
    assert calls(64, 6144, 2048) == kquant.MAX_TOKENS  # never fewer than the decode kernels' 8
    assert calls(8, 6144, 2048, form="pairs") == calls(8, 6144, 2048, form="staged") == kquant.MAX_TOKENS
    assert calls(8, 6144, 2048, tensor_cores=False) == kquant.MAX_TOKENS  # FASTCOMM_GGUF_KERNELS=dp4a
    assert calls(8, 6144, 2048, min_tokens=9) == kquant.MAX_TOKENS  # FASTCOMM_GGUF_GROUPED_MIN_TOKENS=9
    assert calls(8, 6144, 2000) == kquant.MAX_TOKENS  # shapes the grouped tiles cannot read
    assert kquant.chunk_rows(70, 32) == [(0, 32), (32, 64), (64, 70)]


def test_a_decode_call_past_8_tokens_is_refused_before_any_launch():
    # The kernels hold at most MAX_TOKENS activation vectors: more must go through the chunked calls, never
    # silently through a kernel that would read only the first 8.
    torch = pytest.importorskip("torch")
    n = kquant.MAX_TOKENS + 1
    w = torch.zeros(16, 144, dtype=torch.uint8)
    with pytest.raises(ValueError, match="linear_chunks takes any"):
        kquant.linear(torch.zeros(n, 256), w, (kquant.Segment(kquant.Q4_K, 0, 16),))
    w13, w2 = torch.zeros(2, 32, 144, dtype=torch.uint8), torch.zeros(2, 256, 144, dtype=torch.uint8)
    ids, wts = torch.zeros(n, 2, dtype=torch.int32), torch.ones(n, 2)
    with pytest.raises(ValueError, match="moe_chunks takes any"):  # these shapes leave it the pairs form
        kquant.moe(torch.zeros(n, 256), w13, w2, wts, ids, kquant.Q4_K, kquant.Q4_K, None, silu=True)
    # the grouped form takes up to its route table's pairs in a call, and no more
    w13 = torch.zeros(2, 512, 144, dtype=torch.uint8)
    big = abi.KQ_MAX_PAIRS // 2 + 1
    with pytest.raises(ValueError, match=r"routes at most .* \(moe_chunks takes any number of tokens\)"):
        kquant.moe(torch.zeros(big, 256), w13, w2, torch.ones(big, 2), torch.zeros(big, 2, dtype=torch.int32),
                   kquant.Q4_K, kquant.Q4_K, None, silu=True, form="grouped")


H200 = kquant.Limits("H200", sms=132, smem_per_block=227 << 10, smem_per_sm=228 << 10, regs_per_sm=64 << 10,
                     threads_per_sm=2048, blocks_per_sm=32, major=9)


def test_resident_blocks_by_each_limit():
    sm120 = kquant.SM120
    q8 = kquant.mma_ring_bytes([kquant.Q8_0])
    # shared memory: one 4-warp Q8_0 block (87.5 KB + 1 KB reserved) an SM of 100 KB; 5 warps exceed 99 KB a block
    assert kquant.resident_blocks(sm120, 4, kquant.mma_smem(4, q8), 0, 64) == 1
    assert kquant.resident_blocks(sm120, 5, kquant.mma_smem(5, q8), 0, 64) == 0
    assert kquant.resident_blocks(H200, 8, kquant.mma_smem(8, q8), 0, 64) == 1
    # the same block's static shared memory counts against the cap
    assert kquant.resident_blocks(sm120, 4, kquant.mma_smem(4, q8), 14 << 10, 64) == 0
    # registers a warp at a time in units of 256: 72 a thread take 2304 a warp, 28 warps of 64 K: 3 blocks of 8
    assert kquant.resident_blocks(H200, 8, 0, 0, 72) == 3
    # ... and those warps counted in fours: 200 a thread allow 10 warps, taken as 8 (as an H200's driver answers
    # for fc_kq_moe_mma_up_q6k_bf16: 8, 4, 2, 2, 1 blocks of 1-5 warps)
    assert [kquant.resident_blocks(H200, w, 0, 0, 200) for w in range(1, 6)] == [8, 4, 2, 2, 1]
    # threads: sm_120 holds 48 warps an SM, H200 64; and the blocks-per-SM cap
    assert kquant.resident_blocks(sm120, 8, 0, 0, 32) == 6 and kquant.resident_blocks(H200, 8, 0, 0, 32) == 8
    assert kquant.resident_blocks(sm120, 1, 0, 0, 32) == 32


def test_warps_sm120_gets_at_glm5_tp8_shapes():
    """The warp choice from sm_120's limits (188 SMs, 99 KB a block): a tile's warps never exceed what fits."""
    def resident(t, regs=96):
        ring = kquant.mma_ring_bytes([t])
        return tuple(kquant.resident_blocks(kquant.SM120, w, kquant.mma_smem(w, ring), 0, regs)
                     for w in range(1, abi.KQ_MMA_WARPS + 1))
    q8, q4 = resident(kquant.Q8_0), resident(kquant.Q4_K)
    assert q8[3] == 1 and q8[4:] == (0, 0, 0, 0)       # Q8_0: at most 4 warps a block fit 99 KB
    assert q4[5] == 1 and q4[6:] == (0, 0)             # Q4_K: at most 6
    for cols, ntiles in ((6144, 164), (2048, 1024), (2048, 384), (6144, 1210)):
        for res in (q8, q4):
            w = kquant.mma_warps(cols, ntiles, kquant.SM120.sms, res)
            assert res[w - 1] > 0 or w == 1, (cols, ntiles, w)
    assert kquant.mma_warps(6144, 3, kquant.SM120.sms, q8) == 4   # 24 units: 8 warps on an H200, 4 here
