"""The K-quant decode kernels' policy: pure functions over plain data (no GPU, no torch).

vllm-gguf-plugin's CUDA GEMV and MoE-GEMV kernels serve a decode step's 1-8 tokens at about a quarter of an
H200's memory bandwidth (19.7 ms for the 24.7 GB of one GLM-5-shaped step's products at 1 token: file
bench/results/2026-12-04-h200x1-kquant-kernels-3338f3d.json), and above 2 tokens its large linears switch to a
GEMM kernel that costs 3x more. For those token counts and the types a UD-Q4_K_XL file mixes (Q4_K, Q5_K, Q6_K,
Q8_0), a linear layer's product and a MoE layer's two expert products go through csrc/kquant/ instead (ops.py
launches them); everything else stays with the plugin. A multi-shard weight the plugin stores padded (shards of
different types: GLM-5's ``fused_qkv_a_proj`` is Q5_K + Q8_0) is read in place, one launch for all shards.

Forms (bench/gguf_kernels.py times each): a linear layer's product runs as ``mma`` (tensor cores, 16-row
tiles: the activations quantized by one launch, the product by another), ``staged`` (dp4a, one launch that
quantizes the activations into shared memory) or ``unstaged`` (dp4a, quantize then product); the MoE as
``grouped`` (tensor cores, each routed expert read once for all its tokens), ``pairs`` (dp4a, once per
(token, expert) pair: quantize, up, quantize-silu, down) or ``staged`` (pairs in two launches, each block
quantizing its activations into shared memory). ``linear_form`` / ``moe_form`` choose. Past 8 tokens (a
prefill) ``prefill_form`` / ``moe_prefill_form`` choose between the weights dequantized for a GEMM on the tensor cores, these kernels called
on 8 tokens at a time, and the plugin's own kernels. The launch shape (warps a tile) follows from a device's
``Limits`` (``resident_blocks``, ``mma_warps``), computed, so that emulated limits plan as the real GPU would.
"""
from __future__ import annotations

import dataclasses
import functools

from ..runtime import cubin
from . import abi

# ggml type ids csrc/kquant/kquant.cuh reads, with (values, bytes) per block.
Q8_0, Q4_K, Q5_K, Q6_K = abi.KQ_Q8_0, abi.KQ_Q4_K, abi.KQ_Q5_K, abi.KQ_Q6_K
BLOCKS = {Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
NAMES = {Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
MAX_TOKENS = abi.KQ_MAX_VECS  # a decode step's batch, an MTP verify of up to 7 drafts
GEMV_VARIANTS = tuple(int(v) for v in abi.KQ_GEMV.variants)
QUANTIZE_THREADS = 256
STAGED_BLOCKS_PER_SM = 2
STAGE_BYTES_PER_CHUNK = 40  # two 16-byte halves and a (scale, sum) float2, per 32 values of a row
FORMS_LINEAR = ("mma", "staged", "unstaged")
FORMS_MOE = ("grouped", "pairs", "shared", "staged")
PER_PAIR_FORMS = frozenset({"pairs", "staged"})  # dp4a, a warp a (pair, row): up to MAX_TOKENS a call
# The staged form spares a layer's two quantize launches (3.5 + 5.2 us of a ~40-node layer on an H100:
# bench/results/2026-12-06-h100x1-shard-tp8-profile-92412e6.json) and equals pairs bit for bit; it serves in
# place of pairs where FASTCOMM_GGUF_MOE_STAGED allows it and its stage fits a block. On an H100 (gguf_kernels,
# bench/results/2026-12-07-h100x1-kquant-kernels-{tp8-7ba2134,staged-942061b}.json): at TP 8's shapes 20.1 / 27.9
# us against pairs' 24.1 / 32.2 at 1 / 2 tokens; at TP 1's level (89.1 / 151.8 against 89.1 / 150.6).
MOE_STAGED = True
# The shared form (grouped, a block's warps sharing each unit's activations: kq_mma_tile_shared) takes this many
# warps a block, a tile each. Not the policy's form until a run shows it faster (bench/gguf_kernels.py times it).
MOE_SHARED_WARPS = 4
# Which form serves, from bench/gguf_kernels.py on an H200 (bench/RESULTS.md): the tensor-core linears win the
# per-step sum from 2 tokens since the dense mma form launches as a dependent of its quantize launch (2026-12-02
# run s10, commit d845068, its --suggest: at 2 tokens o_proj 27.2 against 34.5 us staged, dense down 34.7 / 40.5,
# though fused_qkv_a 12.8 / 10.1 and q_b 12.6 / 12.1 lose; the sum, -0.15 ms a step); at 1 token the staged dp4a
# form (no quantize launch) wins. The MoE grouped by expert wins from 4 tokens and loses at 1-2 (137 / 131 us
# at 2). 3 tokens (an MTP verify of 2 drafts) has no per-product run; end to end, grouped from 3 gave a
# 3-request step of 27.4 ms (run b3b4269) and per pair 31.9 (run 842e68a), so the MoE is grouped from 3.
# FASTCOMM_GGUF_MMA_MIN_TOKENS / _GROUPED_MIN_TOKENS move them per GPU.
MMA_MIN_TOKENS = 2          # linears: the tensor-core form from this many tokens, below it the staged dp4a
MOE_GROUPED_MIN_TOKENS = 3  # MoE: grouped by expert from this many tokens, below it per pair
# Rows this short (at most 6 units of 256 values) take the tensor-core form from 1 token: the staged form's warp
# a row has too little to read for its reduction and launch, and the mma form's 16-row tiles win by 1.9-2.5 us at
# 1 and 2 tokens (H100, TP 8's shapes: shared down, K 256, 3.49 against 5.45 us staged; dense down, K 1536, 9.36
# against 11.59; bench/results/2026-12-07-h100x1-kquant-kernels-tp8-7ba2134.json). From 2048 the staged form led
# at 1 token in every run (o_proj at TP 8, K 2048: 7.13 against 7.72).
MMA_SHORT_ROW_COLS = 1536
# The mma kernels come built for one weight type each, beside one for any type (a switch on the type, its
# registers the widest type's). Which serves, from bench/gguf_kernels.py on an H200 (bench/RESULTS.md, 2026-12-02,
# 2026-12-02 run s9): built for their type, the grouped MoE took 179 against 200 us at 8 tokens (161 / 176 at 4) and
# the Q6_K LM head 365 against 461 (346 / 381), but the Q4_K linears lost (o_proj 38.5 against 35.1 us at 8,
# dense gate_up 56.6 / 48.4), and still lost given the switch entry's warps a tile (2026-12-02 run s10: o_proj 38.2
# against 35.0), so not for their warp count; why is not known. So the MoE and Q6_K linears take their type's entry.
MMA_TYPED_LINEAR = frozenset({Q6_K})
# 16-byte loads read Q4_K/Q5_K rows; Q6_K/Q8_0 blocks are only 2-byte aligned and are read by words.
ROW_ALIGN = {Q4_K: 16, Q5_K: 16, Q6_K: 2, Q8_0: 2}


@dataclasses.dataclass(frozen=True)
class Segment:
    """Rows [start, start + rows) of a (padded) quantized weight, of one ggml type."""
    type: int
    start: int
    rows: int


def plan_linear(types: list[int], offsets: list[tuple[int, int, int]], row_stride: int,
                cols: int) -> tuple[Segment, ...] | None:
    """The segments of a linear layer's weight for the decode kernels, or None where they cannot read it
    (then the plugin's kernels serve every call). ``offsets``: per shard (start row, end row, bytes used of a
    row), in output order; ``row_stride``: bytes between rows of the stored tensor; ``cols``: input features."""
    if not types or len(types) != len(offsets) or len(types) > abi.KQ_MAX_SEGS or cols % abi.KQ_CHUNK:
        return None
    segs = []
    for t, (start, end, used) in zip(types, offsets):
        if t not in BLOCKS:
            return None
        values, nbytes = BLOCKS[t]
        if cols % values or used != cols // values * nbytes or row_stride % ROW_ALIGN[t] or end <= start:
            return None
        segs.append(Segment(t, start, end - start))
    return tuple(segs)


@functools.lru_cache(maxsize=4096)  # a per-layer fact, asked on every eager call (the LM head's)
def mma_ok(segments: tuple[Segment, ...], cols: int) -> bool:
    """Can the tensor-core form read these segments? Its step along a row is a 256-value unit, and a 16-row
    tile must lie in one segment (one type), so every segment but the last starts on a tile boundary."""
    if cols % abi.KQ_UNIT:
        return False
    out_row = 0
    for s in segments:
        if out_row % abi.KQ_MMA_ROWS:
            return False
        out_row += s.rows
    return True


def linear_form(tokens: int, mma: bool, staged_fits: bool, min_tokens: int = MMA_MIN_TOKENS,
                cols: int | None = None) -> str:
    """``mma``: the tensor-core form can read the weight and is allowed (FASTCOMM_GGUF_KERNELS=dp4a forbids it);
    ``min_tokens``: from how many tokens it serves (FASTCOMM_GGUF_MMA_MIN_TOKENS); ``cols``: the input features,
    at most MMA_SHORT_ROW_COLS of which take it from 1 token unless ``min_tokens`` is past MAX_TOKENS (never)
    (None: not known, the token rule alone)."""
    short = cols is not None and cols <= MMA_SHORT_ROW_COLS and min_tokens <= MAX_TOKENS
    if mma and (tokens >= min_tokens or short):
        return "mma"
    return "staged" if staged_fits else "unstaged"


def moe_types_ok(t13: int, t2: int, hidden: int, inter: int, row13: int, row2: int) -> bool:
    """Can the MoE kernels read these expert weights ([E, 2 inter, row13] and [E, hidden, row2] bytes)?"""
    for t, cols, row in ((t13, hidden, row13), (t2, inter, row2)):
        if t not in BLOCKS or cols % BLOCKS[t][0] or row != cols // BLOCKS[t][0] * BLOCKS[t][1] \
                or row % ROW_ALIGN[t]:
            return False
    return True


def moe_form(tokens: int, topk: int, hidden: int, inter: int, tensor_cores: bool = True,
             min_tokens: int = MOE_GROUPED_MIN_TOKENS, staged: bool = False,
             smem_per_block: int | None = None) -> str:
    """``grouped`` where allowed (from ``min_tokens``: FASTCOMM_GGUF_GROUPED_MIN_TOKENS; past MAX_TOKENS: never,
    for any number of tokens) and its tiles and route table hold the shapes, else ``staged`` where ``staged``
    (FASTCOMM_GGUF_MOE_STAGED), at most MAX_TOKENS tokens and ``moe_stage_bytes`` within ``smem_per_block`` (the
    device's; None: unbounded), else ``pairs``."""
    allowed = tensor_cores and min_tokens <= MAX_TOKENS and tokens >= min_tokens
    if allowed and moe_form_error("grouped", tokens, topk, hidden, inter) is None:
        return "grouped"
    fits = smem_per_block is None or moe_stage_bytes(tokens, topk, hidden, inter) <= smem_per_block
    return "staged" if staged and tokens <= MAX_TOKENS and fits else "pairs"


def moe_form_error(form: str, tokens: int, topk: int, hidden: int, inter: int) -> str | None:
    """Why ``form`` cannot serve these shapes, or None: the grouped form's route table and tiles bound it."""
    if form not in FORMS_MOE:
        return f"MoE form {form!r} is not one of {', '.join(FORMS_MOE)}"
    if form in PER_PAIR_FORMS:  # the staged form's shared memory: moe_stage_bytes, checked against the device
        return None
    if hidden % abi.KQ_UNIT or inter % abi.KQ_UNIT:
        return f"form {form} needs hidden and inter multiples of {abi.KQ_UNIT} (got {hidden}, {inter})"
    if tokens * topk > abi.KQ_MAX_PAIRS:
        return f"form {form} routes at most {abi.KQ_MAX_PAIRS} pairs (got {tokens} tokens x top-{topk})"
    return None


def mma_warps(cols: int, ntiles: int, sms: int, resident: tuple[int, ...]) -> int:
    """Warps splitting each of ``ntiles`` tiles' 256-value units: the most for which every tile's block is
    resident at once (one wave: a second wave of a few blocks would double the time), no more than the units
    (no idle warp), split evenly (the slowest warp sets the tile's time). ``resident[w - 1]``: blocks of w warps
    one SM holds (registers and shared memory; the CUDA occupancy calculator's answer). One warp a tile where no
    split fits in one wave (the LM head's 9680 tiles)."""
    units = max(1, cols // abi.KQ_UNIT)
    w = 1
    for warps in range(1, min(abi.KQ_MMA_WARPS, units, len(resident)) + 1):
        if ntiles <= sms * resident[warps - 1]:
            w = warps
    per = -(-units // w)
    return -(-units // per)


@dataclasses.dataclass(frozen=True)
class Limits:
    """What decides how many blocks of a kernel one SM holds, and how many SMs there are: a device's (read from
    it) or a GPU's that the tests emulate on another (FASTCOMM_TEST_DEVICE_LIMITS)."""
    name: str
    sms: int
    smem_per_block: int     # opt-in: static + dynamic shared memory one block may have
    smem_per_sm: int
    regs_per_sm: int
    threads_per_sm: int
    blocks_per_sm: int
    major: int              # compute capability: programmatic dependent launch needs 9+
    smem_reserved: int = 1024   # per block, taken by the CUDA runtime on sm_80+ (not the kernel's to use)


# The user's GPU: compute capability 12.0's limits (fastcomm.cubin.LIMITS, from the CUDA C++ Programming Guide:
# 99 KB a block, 100 KB and 48 warps an SM, 64 K registers; 32 blocks an SM) and the RTX PRO 6000 Blackwell's
# 188 SMs.
_CC12 = cubin.LIMITS["sm_120"]
SM120 = Limits("RTX PRO 6000 Blackwell (sm_120)", sms=188, smem_per_block=_CC12.shared_per_block,
               smem_per_sm=_CC12.shared_per_sm, regs_per_sm=_CC12.registers_per_sm,
               threads_per_sm=_CC12.threads_per_sm, blocks_per_sm=32, major=12)
EMULATED = {"sm_120": SM120}
REG_UNIT = 256    # registers are allocated a warp at a time, in units of 256,
WARP_UNIT = 4     # and the warps they allow an SM counted in fours (the occupancy calculator's warp granularity)
SMEM_UNIT = 128   # shared memory is allocated a block at a time, in units of 128 bytes


def resident_blocks(limits: Limits, warps: int, smem: int, static_smem: int, regs_per_thread: int) -> int:
    """Blocks of ``warps`` warps, each with ``smem`` bytes of dynamic shared memory, one SM holds (the CUDA
    occupancy calculator's rules: threads, blocks, registers a warp at a time, shared memory with its per-block
    reservation); 0 where one block does not fit at all."""
    if smem + static_smem > limits.smem_per_block or warps * 32 > limits.threads_per_sm:
        return 0
    by_threads = limits.threads_per_sm // (32 * warps)
    per_warp = -(-regs_per_thread * 32 // REG_UNIT) * REG_UNIT
    by_regs = (limits.regs_per_sm // per_warp) // WARP_UNIT * WARP_UNIT // warps if per_warp else limits.blocks_per_sm
    block_smem = -(-(smem + static_smem + limits.smem_reserved) // SMEM_UNIT) * SMEM_UNIT
    by_smem = limits.smem_per_sm // block_smem
    return max(0, min(limits.blocks_per_sm, by_threads, by_regs, by_smem))


def mma_variant(types, moe: bool) -> str:
    """The mma kernels' entry for a launch over weights of ``types`` (a MoE's, or a linear's segments): the one
    built for their type (its suffix in abi.KQ_TYPE_VARIANTS) for the MoE and MMA_TYPED_LINEAR, else the one for
    any type ("")."""
    kinds = set(types)
    if len(kinds) != 1:
        return ""
    kind = kinds.pop()
    return abi.KQ_TYPE_VARIANTS[kind] if moe or kind in MMA_TYPED_LINEAR else ""


def mma_span(t: int) -> int:
    """Bytes of a stage row of type ``t`` in the mma forms (kq_mma_span): the 16-byte-aligned span that holds
    one unit from the 16-byte boundary at or below its first byte, 32 more where that span is 64 mod 128 (Q5_K:
    192 put rows g and g + 2 of a warp's reads on the same banks)."""
    raw = (BLOCKS[t][1] * (abi.KQ_UNIT // BLOCKS[t][0]) + 30) // 16 * 16
    return raw + (32 if raw % 128 == 64 else 0)


def mma_ring_bytes(types) -> int:
    """Shared memory one warp of the mma forms holds: KQ_MMA_STAGES stages, each 16 rows of weights (a row the
    mma_span of the widest of ``types``) and the unit's activations."""
    return abi.KQ_MMA_STAGES * (abi.KQ_MMA_ROWS * max(mma_span(t) for t in types) + abi.KQ_MMA_XSTAGE)


def moe_shared_smem(types, warps: int = MOE_SHARED_WARPS) -> int:
    """Dynamic shared memory of a shared-form block of ``warps`` warps: their weight rings (KQ_MMA_STAGES stages
    of 16 rows of mma_span), then one ring of the stages' activations for all of them."""
    span = max(mma_span(t) for t in types)
    return abi.KQ_MMA_STAGES * (warps * abi.KQ_MMA_ROWS * span + abi.KQ_MMA_XSTAGE)


def mma_smem(warps: int, ring: int) -> int:
    """Dynamic shared memory of an mma block of ``warps`` warps, each with a ring of ``ring`` bytes: warps 1 ..
    warps - 1's partial sums for warp 0 to add (kq_mma_part), then the rings (kq_mma_rings)."""
    return (warps - 1) * abi.KQ_MMA_PART + warps * ring


def tiles(rows: int) -> int:
    return (rows + abi.KQ_MMA_ROWS - 1) // abi.KQ_MMA_ROWS


def stage_bytes(rows: int, cols: int) -> int:
    """Shared memory a staged kernel needs for ``rows`` activation rows of ``cols`` values."""
    return rows * (cols // abi.KQ_CHUNK) * STAGE_BYTES_PER_CHUNK


def moe_stage_bytes(tokens: int, topk: int, hidden: int, inter: int) -> int:
    """Shared memory a block of the staged MoE form needs: up's stage (the tokens' rows of ``hidden``) or
    down's (the pairs' rows of ``inter``), the larger."""
    return max(stage_bytes(tokens, hidden), stage_bytes(tokens * topk, inter))


def staged_grid(items: int, sms: int, resident: int = STAGED_BLOCKS_PER_SM) -> int:
    """Blocks of a staged launch: enough for every item's warp, at most STAGED_BLOCKS_PER_SM per SM (each
    block quantizes the activations again, so more blocks cost L2 reads and gain nothing), and no more per SM
    than ``resident`` (the kernel's blocks one SM holds: ``resident_blocks``). Past that the grid runs in two
    waves, the second staging the activations again after the first drains for the same rows an SM reads in
    one wave (its warps' grid-stride loop takes the rest): on sm_120 a 2-token launch (95 registers a thread,
    512 threads) fits once an SM, as do 4-8 tokens on an H100 (94 registers)."""
    warps = abi.KQ_STAGED_THREADS // 32
    per_sm = max(1, min(STAGED_BLOCKS_PER_SM, resident))
    return max(1, min((items + warps - 1) // warps, sms * per_sm))


def weights_aligned(*addresses: int) -> bool:
    """Can the kernels read weights stored from these addresses? Every form reads Q4_K / Q5_K rows by 16-byte
    loads (ROW_ALIGN), so a weight's base must be 16-byte aligned as its row stride is: torch's allocations
    are, a view into one may not be (an 8-byte offset faults the kernels: 2026-12-02 run s10)."""
    return all(a % 16 == 0 for a in addresses)


def decode_tokens_ok(tokens: int) -> bool:
    return 1 <= tokens <= MAX_TOKENS


# A prefill (past MAX_TOKENS) went to the plugin's kernels, whose K-quant GEMMs (MMQ, ggml_moe_a8) multiply on
# dp4a and cost 4-40x the weight-read time (8 prompts of 32 tokens: 1.31 s to their first tokens against FP8's
# 0.97 s on the same shapes; H200, 2026-12-02 run s14). Two ways past them, each with its own threshold:
# - dequant: the weight to bf16, then a GEMM on the tensor cores. Writing the weight out costs the same for 9
#   tokens as for 9000, so it pays from many tokens: with fastcomm's dequantize every linear beats the plugin's
#   from 16 tokens (2026-12-03 run s15). The MoE's form writes every expert out; it slowed 8 requests' decode in
#   the one run it had (with the plugin's dequantize), so it is off.
# - chunks: fastcomm's decode kernels on MAX_TOKENS rows at a time (the grouped MoE on up to 32 tokens of top 8
#   a call, its route table's limit), each call a read of the weights. On the GPU a linear's calls beat both
#   others to ~32 tokens (o_proj at 16: 47 us, dequantized 179, the plugin's 207), but launched eagerly, as a
#   prefill is, each call costs ~80 us of host time on the H200 machine against 6-24 us of GPU time (o_proj at
#   16: 235 us), so a linear takes chunks only where a CUDA graph records them (``host_bound`` False). A MoE
#   call's GPU time (140-350 us) hides its host time: chunks up to 256 tokens (2.8 ms a layer against the
#   plugin's 8.7), first token of 8 prompts 1052 -> 648 ms end to end (2026-12-03 run s15).
PREFILL_FORMS = ("dequant", "chunks", "plugin")
# Which kernel writes the dequantized form's bf16 weights (FASTCOMM_GGUF_DEQUANT_KERNEL): fastcomm's
# fc_kq_dequant (one launch for every segment, 16-byte stores; bit-exact with gguf-py) took half the plugin's
# ggml_dequantize time for every product on an H200 (o_proj 180 against 357 us; 2026-12-03 run s15).
DEQUANT_KERNELS = ("fastcomm", "plugin")
DEQUANT_KERNEL = "fastcomm"
# FASTCOMM_GGUF_KERNELS: auto (every form), dp4a (no tensor-core form), plugin (none of fastcomm's kernels).
KERNEL_SETTINGS = ("auto", "dp4a", "plugin")


def prefill_form(tokens: int, chunk_max: int, dequant_min: int, host_bound: bool = False) -> str:
    """How a product of ``tokens`` past the decode kernels' runs (PREFILL_FORMS): ``dequant`` from
    ``dequant_min`` (FASTCOMM_GGUF_DEQUANT_MIN_TOKENS), else ``chunks`` up to ``chunk_max``
    (FASTCOMM_GGUF_CHUNK_MAX_TOKENS) unless ``host_bound`` (a linear launched eagerly: its calls' host time
    exceeds their GPU time), else the plugin's; 0 turns either off. 1-8 tokens: ``plugin`` (the decode kernels'
    own, not a prefill's)."""
    if tokens <= MAX_TOKENS:
        return "plugin"
    if dequant_min > 0 and tokens >= dequant_min:
        return "dequant"
    return "chunks" if tokens <= chunk_max and not host_bound else "plugin"


def moe_prefill_form(tokens: int, topk: int, experts: int, chunk_max: int, dequant_per_expert: int) -> str:
    """``prefill_form`` for an MoE layer, whose dequantized form starts where its routed pairs reach
    ``dequant_per_expert`` an expert on average (FASTCOMM_GGUF_DEQUANT_MOE_MIN): it writes all ``experts`` out,
    so GLM-5's 256 experts need 16x the tokens of the 16-expert benchmark model."""
    # routed pairs >= dequant_per_expert x experts, as tokens: the fewest whose pairs reach it
    dequant_min = -(-dequant_per_expert * experts // topk) if dequant_per_expert > 0 else 0
    return prefill_form(tokens, chunk_max, dequant_min)


def chunk_rows(tokens: int, size: int = MAX_TOKENS) -> list[tuple[int, int]]:
    """(start, stop) rows of each kernel call of a chunked product: ``size`` a call, the rest last."""
    return [(i, min(i + size, tokens)) for i in range(0, tokens, size)]


def moe_call_tokens(topk: int, hidden: int, inter: int, form: str | None = None, tensor_cores: bool = True,
                    min_tokens: int = MOE_GROUPED_MIN_TOKENS) -> int:
    """The most tokens one ``moe`` call takes in ``form`` (None: the one ``moe_form`` takes for that many): the
    grouped forms' route table (KQ_MAX_PAIRS pairs: 32 tokens of top 8), as they read each routed expert once
    per 8 of its pairs whatever the tokens; the per-pair forms MAX_TOKENS. ``moe_chunks`` calls it that many at a
    time."""
    most = max(MAX_TOKENS, abi.KQ_MAX_PAIRS // topk)
    form = form or moe_form(most, topk, hidden, inter, tensor_cores, min_tokens)
    grouped = form not in PER_PAIR_FORMS and moe_form_error(form, most, topk, hidden, inter) is None
    return most if grouped else MAX_TOKENS


def gemv_variant(tokens: int) -> int:
    return next(v for v in GEMV_VARIANTS if v >= tokens)


def dependent_launch(capability_major: int, allowed: bool, prefetches: bool) -> bool:
    """Launch a kernel with programmatic dependent launch (it may start while the kernel before it runs)? It
    needs sm_90+ (griddepcontrol) and FASTCOMM_GGUF_PDL (``allowed``), and only a kernel with work to do before
    it waits gains (``prefetches``). Measured on an H200 (bench/RESULTS.md, 2026-12-02 run s10): the dense mma
    form, which fetches its first weight stages before it waits, gained 2-3 us a product at 8 tokens (o_proj
    35.3 -> 32.6 us, q_b 18.2 -> 15.9, shared down 13.2 -> 10.8; dense gate_up, 1536 tiles, lost 48.6 -> 52.1);
    dependent launches of the quantize kernels cost the grouped MoE 11-13 us (173.4 -> 184-186 at 8 tokens) and
    those of its other kernels gained nothing, so everything else launches plainly."""
    return allowed and prefetches and capability_major >= 9
