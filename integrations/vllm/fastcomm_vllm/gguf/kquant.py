"""fastcomm's K-quant decode kernels (csrc/kquant.cu) for vllm-gguf-plugin's layers: host side.

vllm-gguf-plugin's CUDA GEMV and MoE-GEMV kernels serve a decode step's 1-8 tokens at about a quarter of an
H200's memory bandwidth (19.6 ms for the 24.7 GB of one GLM-5-shaped step's products; bench/RESULTS.md), and
above 2 tokens its large linears switch to a GEMM kernel that costs 3x more. For those token counts and for the types a UD-Q4_K_XL file mixes (Q4_K, Q5_K, Q6_K, Q8_0), a linear layer's product and a
MoE layer's two expert products go through csrc/kquant.cu instead; everything else (prefill, other types)
stays with the plugin. A multi-shard weight the plugin stores padded (shards of different types: GLM-5's
``fused_qkv_a_proj`` is Q5_K + Q8_0) is read in place, one launch for all shards, where the plugin copies
each shard out on every call.

Layers: ``plan_linear`` / ``moe_types_ok`` / ``decode_tokens_ok`` / ``staged_grid`` are pure policy;
``linear`` / ``moe`` run the kernels on torch tensors (the current stream, so CUDA-graph capture records
them); kquant_vllm.py wires them into the plugin's layers.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools

# ggml type ids (gguf.GGMLQuantizationType) csrc/kquant.cuh reads, with (values, bytes) per block.
Q8_0, Q4_K, Q5_K, Q6_K = 8, 12, 13, 14
BLOCKS = {Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
NAMES = {Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
MAX_TOKENS = 8      # FC_KQ_MAX_VECS: a decode step's batch, an MTP verify of up to 7 drafts
MAX_SEGS = 4        # FC_KQ_MAX_SEGS
ROWS_PER_BLOCK = 4  # FC_KQ_ROWS_PER_BLOCK
THREADS = 128       # FC_KQ_THREADS
CHUNK = 32          # FC_KQ_CHUNK
GEMV_VARIANTS = (1, 2, 4, 8)
QUANTIZE_THREADS = 256
STAGED_THREADS = 512  # FC_KQ_STAGED_THREADS
STAGED_BLOCKS_PER_SM = 2
STAGE_BYTES_PER_CHUNK = 40  # two 16-byte halves and a (scale, sum) float2, per 32 values of a row
# Which form serves by default, from bench/gguf_kernels.py on an H200 (bench/RESULTS.md): the staged linear
# is faster for nearly every GLM-5 product at 1-8 tokens (it saves a launch, the small ones gain most); the
# staged MoE was slower at every token count (82 against 78 us at 1 token, 605 against 472 at 8: a warp makes
# the gate and the up row one after the other), so the MoE keeps its five launches.
LINEAR_STAGED, MOE_STAGED = True, False
DTYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
# 16-byte loads read Q4_K/Q5_K rows; Q6_K/Q8_0 blocks are only 2-byte aligned and are read by words.
ROW_ALIGN = {Q4_K: 16, Q5_K: 16, Q6_K: 2, Q8_0: 2}


# ---- policy: pure functions over plain data -------------------------------------------------------------

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
    if not types or len(types) != len(offsets) or len(types) > MAX_SEGS or cols % CHUNK:
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


def moe_types_ok(t13: int, t2: int, hidden: int, inter: int, row13: int, row2: int) -> bool:
    """Can the MoE kernels read these expert weights ([E, 2 inter, row13] and [E, hidden, row2] bytes)?"""
    for t, cols, row in ((t13, hidden, row13), (t2, inter, row2)):
        if t not in BLOCKS or cols % BLOCKS[t][0] or row != cols // BLOCKS[t][0] * BLOCKS[t][1] \
                or row % ROW_ALIGN[t]:
            return False
    return True


def stage_bytes(rows: int, cols: int) -> int:
    """Shared memory a staged kernel needs for ``rows`` activation rows of ``cols`` values."""
    return rows * (cols // CHUNK) * STAGE_BYTES_PER_CHUNK


def staged_grid(items: int, sms: int) -> int:
    """Blocks of a staged launch: enough for every item's warp, at most STAGED_BLOCKS_PER_SM per SM (each
    block quantizes the activations again, so more blocks cost L2 reads and gain nothing)."""
    warps = STAGED_THREADS // 32
    return max(1, min((items + warps - 1) // warps, sms * STAGED_BLOCKS_PER_SM))


def decode_tokens_ok(tokens: int) -> bool:
    return 1 <= tokens <= MAX_TOKENS


def gemv_variant(tokens: int) -> int:
    return next(v for v in GEMV_VARIANTS if v >= tokens)


# ---- launching ------------------------------------------------------------------------------------------

class _Seg(ctypes.Structure):
    _fields_ = [("w", ctypes.c_uint64), ("row_stride", ctypes.c_uint64), ("type", ctypes.c_int32),
                ("rows", ctypes.c_int32), ("row0", ctypes.c_int32), ("out_col", ctypes.c_int32)]


class _Segs(ctypes.Structure):
    _fields_ = [("s", _Seg * MAX_SEGS), ("nseg", ctypes.c_int32), ("total_rows", ctypes.c_int32)]


def _launch(device: int, symbol: str, grid: tuple[int, int], block: int, stream: int, values: list,
            smem: int = 0) -> None:
    from cupy_backends.cuda.api import driver

    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    driver.launchKernel(_function(device, symbol), grid[0], grid[1], 1, block, 1, 1, smem, stream,
                        ctypes.addressof(params), 0)


_MAX_DYNAMIC_SMEM_ATTR = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
STAGED_SYMBOLS = ("fc_kq_gemvs", "fc_kq_moe_up_silu_", "fc_kq_moe_down_s_")


@functools.lru_cache(maxsize=None)
def _function(device: int, symbol: str) -> int:
    from cupy_backends.cuda.api import driver

    from fastcomm import jit
    from fastcomm.config import read

    fn = jit.function(device, read("FASTCOMM_CACHE_DIR"), symbol, unit="kquant")
    if symbol.startswith(STAGED_SYMBOLS):
        driver.funcSetAttribute(fn, _MAX_DYNAMIC_SMEM_ATTR, _device(device)[1])  # staged: above 48 KB on request
    return fn


@functools.lru_cache(maxsize=None)
def _device(device: int) -> tuple[int, int]:
    """(SMs, opt-in shared memory per block) of a device."""
    import torch

    p = torch.cuda.get_device_properties(device)
    return p.multi_processor_count, int(getattr(p, "shared_memory_per_block_optin", 48 << 10))


def staged_fits(device: int, rows: int, cols: int) -> bool:
    return stage_bytes(rows, cols) <= _device(device)[1]


def _stream(t) -> int:
    import torch

    return torch.cuda.current_stream(t.device).cuda_stream


def quantize(x):
    """int8 chunks (as int32 words) and (scale, sum) pairs of ``x`` [n, cols] (rows 16-byte aligned)."""
    import torch

    n, cols = x.shape
    chunks = cols // CHUNK
    xq = torch.empty(n * chunks * 8, dtype=torch.int32, device=x.device)
    xds = torch.empty(n * chunks, 2, dtype=torch.float32, device=x.device)
    total = n * chunks
    _launch(x.device.index, f"fc_kq_quantize_{_dt(x)}",
            ((total + QUANTIZE_THREADS - 1) // QUANTIZE_THREADS, 1), QUANTIZE_THREADS, _stream(x),
            [ctypes.c_uint64(x.data_ptr()), ctypes.c_int32(n), ctypes.c_int32(cols), ctypes.c_uint64(x.stride(0)),
             ctypes.c_uint64(xq.data_ptr()), ctypes.c_uint64(xds.data_ptr())])
    return xq, xds


def _aligned(x):
    """x as rows the quantize kernel reads (contiguous, 16-byte aligned rows)."""
    if x.stride(-1) != 1 or (x.stride(0) * x.element_size()) % 16 or x.data_ptr() % 16:
        x = x.contiguous()
    return x


def _dt(x) -> str:
    return DTYPES[str(x.dtype).split(".")[-1]]


def linear(x, qweight, segments: tuple[Segment, ...], staged: bool = LINEAR_STAGED):
    """x [n, cols] (n <= 8) times the segments' rows of ``qweight`` (uint8 [rows, row_stride]): [n, sum rows].
    ``staged``: the one-launch form where its shared memory fits (else the quantize + GEMV pair)."""
    import torch

    x = _aligned(x)
    n, cols = x.shape
    dev, dt = x.device.index, _dt(x)
    total = sum(s.rows for s in segments)
    out = torch.empty(n, total, dtype=x.dtype, device=x.device)
    table = _Segs()
    col = 0
    base, stride = qweight.data_ptr(), qweight.stride(0) * qweight.element_size()
    for i, s in enumerate(segments):
        table.s[i] = _Seg(base + s.start * stride, stride, s.type, s.rows, col, col)
        col += s.rows
    table.nseg, table.total_rows = len(segments), total
    variant = gemv_variant(n)
    if staged and staged_fits(dev, n, cols):
        _launch(dev, f"fc_kq_gemvs{variant}_{dt}", (staged_grid(total, _device(dev)[0]), 1), STAGED_THREADS,
                _stream(x), [table, ctypes.c_uint64(x.data_ptr()), ctypes.c_int32(n), ctypes.c_int32(cols),
                             ctypes.c_uint64(x.stride(0)), ctypes.c_uint64(out.data_ptr()), ctypes.c_uint64(total)],
                smem=stage_bytes(n, cols))
        return out
    xq, xds = quantize(x)
    _launch(dev, f"fc_kq_gemv{variant}_{dt}", ((total + ROWS_PER_BLOCK - 1) // ROWS_PER_BLOCK, 1), THREADS,
            _stream(x), [table, ctypes.c_uint64(xq.data_ptr()), ctypes.c_uint64(xds.data_ptr()), ctypes.c_int32(n),
                         ctypes.c_int32(cols), ctypes.c_uint64(out.data_ptr()), ctypes.c_uint64(total)])
    return out


def moe(x, w13, w2, topk_weights, topk_ids, t13: int, t2: int, activation, silu: bool = False,
        staged: bool = MOE_STAGED):
    """The routed experts of 1-8 tokens: x [T, hidden], w13 [E, 2 inter, row13], w2 [E, hidden, row2] (uint8
    blocks); returns [T, hidden], each token's experts summed in their top-k order, router weights applied.
    ``activation`` maps [pairs, 2 inter] to [pairs, inter]; ``silu``: it is vLLM's silu_and_mul, which the
    staged up kernel applies itself (``staged``: two launches in all where the shared memory fits, else
    five: quantize, up, activation, quantize, down)."""
    import torch

    x = _aligned(x)
    tokens, hidden = x.shape
    topk = topk_ids.shape[1]
    pairs = tokens * topk
    ids = topk_ids.to(torch.int32).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    rows13 = w13.shape[1]
    inter = rows13 // 2
    dt, dev, stream = _dt(x), x.device.index, _stream(x)
    e13, r13 = w13.stride(0) * w13.element_size(), w13.stride(1) * w13.element_size()
    e2, r2 = w2.stride(0) * w2.element_size(), w2.stride(1) * w2.element_size()
    sms = _device(dev)[0]
    if staged and silu and staged_fits(dev, tokens, hidden):
        act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
        _launch(dev, f"fc_kq_moe_up_silu_{dt}", (staged_grid(pairs * inter, sms), 1), STAGED_THREADS, stream,
                [ctypes.c_uint64(w13.data_ptr()), ctypes.c_uint64(e13), ctypes.c_uint64(r13), ctypes.c_int32(t13),
                 ctypes.c_int32(inter), ctypes.c_int32(hidden), ctypes.c_uint64(ids.data_ptr()), ctypes.c_int32(topk),
                 ctypes.c_int32(tokens), ctypes.c_uint64(x.data_ptr()), ctypes.c_uint64(x.stride(0)),
                 ctypes.c_uint64(act.data_ptr())], smem=stage_bytes(tokens, hidden))
    else:
        xq, xds = quantize(x)
        up = torch.empty(pairs, rows13, dtype=x.dtype, device=x.device)
        _launch(dev, f"fc_kq_moe_up_{dt}", ((rows13 + ROWS_PER_BLOCK - 1) // ROWS_PER_BLOCK, pairs), THREADS,
                stream, [ctypes.c_uint64(w13.data_ptr()), ctypes.c_uint64(e13), ctypes.c_uint64(r13),
                         ctypes.c_int32(t13), ctypes.c_int32(rows13), ctypes.c_int32(hidden),
                         ctypes.c_uint64(ids.data_ptr()), ctypes.c_int32(topk), ctypes.c_uint64(xq.data_ptr()),
                         ctypes.c_uint64(xds.data_ptr()), ctypes.c_uint64(up.data_ptr())])
        act = activation(up)  # [pairs, inter]
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if staged and staged_fits(dev, pairs, inter):
        act = _aligned(act)
        _launch(dev, f"fc_kq_moe_down_s_{dt}", (staged_grid(tokens * hidden, sms), 1), STAGED_THREADS, stream,
                [ctypes.c_uint64(w2.data_ptr()), ctypes.c_uint64(e2), ctypes.c_uint64(r2), ctypes.c_int32(t2),
                 ctypes.c_int32(hidden), ctypes.c_int32(inter), ctypes.c_uint64(ids.data_ptr()),
                 ctypes.c_uint64(weights.data_ptr()), ctypes.c_int32(topk), ctypes.c_int32(tokens),
                 ctypes.c_uint64(act.data_ptr()), ctypes.c_uint64(act.stride(0)), ctypes.c_uint64(out.data_ptr())],
                smem=stage_bytes(pairs, inter))
        return out
    aq, ads = quantize(act)
    _launch(dev, f"fc_kq_moe_down_{dt}", ((hidden + ROWS_PER_BLOCK - 1) // ROWS_PER_BLOCK, tokens), THREADS, stream,
            [ctypes.c_uint64(w2.data_ptr()), ctypes.c_uint64(e2), ctypes.c_uint64(r2), ctypes.c_int32(t2),
             ctypes.c_int32(hidden), ctypes.c_int32(inter), ctypes.c_uint64(ids.data_ptr()),
             ctypes.c_uint64(weights.data_ptr()), ctypes.c_int32(topk), ctypes.c_uint64(aq.data_ptr()),
             ctypes.c_uint64(ads.data_ptr()), ctypes.c_uint64(out.data_ptr())])
    return out
