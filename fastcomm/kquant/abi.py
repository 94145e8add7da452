"""The one mirror of the K-quant decode kernels' C ABI (csrc/kquant/: kquant.cuh, kquant_mma.cuh, kquant.cu).

The FC_KQ_* constants, ``struct KqSegs`` as ctypes, and every ``extern "C"`` kernel with its parameter types,
from which launches are packed. tests/test_abi.py reads the CUDA sources and checks this module against them.
"""
from __future__ import annotations

import ctypes

from ..runtime.kernel import Kernel

# ggml type ids the kernels read (FC_KQ_<type>, gguf.GGMLQuantizationType).
KQ_Q8_0, KQ_Q4_K, KQ_Q5_K, KQ_Q6_K = 8, 12, 13, 14
KQ_CHUNK = 32            # FC_KQ_CHUNK: values per activation scale
KQ_UNIT = 256            # FC_KQ_UNIT: a super-block, the mma forms' step along a row
KQ_MAX_VECS = 8          # FC_KQ_MAX_VECS: vectors of one dense launch
KQ_MAX_SEGS = 4          # FC_KQ_MAX_SEGS: row segments of one weight
KQ_ROWS_PER_BLOCK = 4    # FC_KQ_ROWS_PER_BLOCK: dp4a forms, a warp per row
KQ_THREADS = 128         # FC_KQ_THREADS
KQ_STAGED_THREADS = 512  # FC_KQ_STAGED_THREADS (kquant.cu)
KQ_MMA_ROWS = 16         # FC_KQ_MMA_ROWS (kquant_mma.cuh): rows of a tile
KQ_MMA_COLS = 8          # FC_KQ_MMA_COLS: vectors per pass
KQ_MMA_WARPS = 8         # FC_KQ_MMA_WARPS: the most warps a tile
KQ_MMA_STAGES = 3        # FC_KQ_MMA_STAGES: units of a warp's rows in flight (its shared-memory ring)
KQ_MMA_XSTAGE = 2560     # FC_KQ_MMA_XSTAGE (kquant.cuh): a stage's activations, after its 16 rows of weights
KQ_MMA_PART = 512        # FC_KQ_MMA_PART: one warp's partial sums, ahead of the rings in dynamic shared memory
KQ_MAX_PAIRS = 256       # FC_KQ_MAX_PAIRS: (token, expert) pairs of one grouped MoE launch


class KqSeg(ctypes.Structure):
    """``struct KqSeg``: rows [row0, row0 + rows) of a launch read at w + i * row_stride as ``type``."""

    _fields_ = [("w", ctypes.c_uint64), ("row_stride", ctypes.c_uint64), ("type", ctypes.c_int32),
                ("rows", ctypes.c_int32), ("row0", ctypes.c_int32), ("out_col", ctypes.c_int32)]


class KqSegs(ctypes.Structure):
    """``struct KqSegs``, passed by value."""

    _fields_ = [("s", KqSeg * KQ_MAX_SEGS), ("nseg", ctypes.c_int32), ("total_rows", ctypes.c_int32)]


_KQ_VARIANTS = ("1", "2", "4", "8")  # FC_KQ_DEFINE_GEMV / GEMVS: vectors per launch, at most
# FC_KQ_DEFINE_MMA / FC_KQ_DEFINE_DOWN: the mma forms for any weight type ("") or built for one.
KQ_TYPE_VARIANTS = {KQ_Q4_K: "_q4k", KQ_Q5_K: "_q5k", KQ_Q6_K: "_q6k", KQ_Q8_0: "_q80"}
_KQ_MMA_VARIANTS = ("",) + tuple(KQ_TYPE_VARIANTS.values())
# mma = 1: the tensor-core forms' order (kq_mma_x_put), which only they read; 0: the dp4a forms'.
_QUANTIZE = (("x", "ptr"), ("n", "i32"), ("cols", "i32"), ("x_stride", "u64"), ("xq", "ptr"), ("xds", "ptr"),
             ("mma", "i32"))
KQ_QUANTIZE = Kernel("kq_quantize", _QUANTIZE)
KQ_QUANTIZE_SILU = Kernel("kq_quantize_silu", _QUANTIZE)  # cols: of the activation, half the [gate | up] row
KQ_GEMV = Kernel("kq_gemv", (("segs", KqSegs), ("xq", "ptr"), ("xds", "ptr"), ("n", "i32"), ("cols", "i32"),
                             ("out", "ptr"), ("out_stride", "u64")), variants=_KQ_VARIANTS)
KQ_GEMVS = Kernel("kq_gemvs", (("segs", KqSegs), ("x", "ptr"), ("n", "i32"), ("cols", "i32"), ("x_stride", "u64"),
                               ("out", "ptr"), ("out_stride", "u64")), variants=_KQ_VARIANTS)
KQ_MMA = Kernel("kq_mma", (("segs", KqSegs), ("xq", "ptr"), ("xs", "ptr"), ("n", "i32"), ("cols", "i32"),
                           ("out", "ptr"), ("out_stride", "u64")), variants=_KQ_MMA_VARIANTS)
_EXPERTS = (("w", "ptr"), ("expert_stride", "u64"), ("row_stride", "u64"), ("type", "i32"), ("rows", "i32"),
            ("cols", "i32"), ("topk_ids", "ptr"))
KQ_MOE_UP = Kernel("kq_moe_up", _EXPERTS + (("topk", "i32"), ("xq", "ptr"), ("xds", "ptr"), ("out", "ptr")))
KQ_MOE_DOWN = Kernel("kq_moe_down", _EXPERTS + (("topk_weights", "ptr"), ("topk", "i32"), ("xq", "ptr"),
                                                ("xds", "ptr"), ("out", "ptr")))
# The pairs form staged: each block quantizes the activations (down: silu(gate) * up when silu) into shared memory
KQ_MOE_UP_S = Kernel("kq_moe_up_s", _EXPERTS + (("topk", "i32"), ("tokens", "i32"), ("x", "ptr"), ("x_stride", "u64"),
                                                ("out", "ptr")))
KQ_MOE_DOWN_S = Kernel("kq_moe_down_s", _EXPERTS + (("topk_weights", "ptr"), ("topk", "i32"), ("tokens", "i32"),
                                                    ("a", "ptr"), ("a_stride", "u64"), ("silu", "i32"),
                                                    ("out", "ptr")))
_GROUPED = _EXPERTS + (("topk", "i32"), ("pairs", "i32"), ("experts", "i32"), ("xq", "ptr"), ("xs", "ptr"),
                       ("out", "ptr"))
KQ_MOE_MMA_UP = Kernel("kq_moe_mma_up", _GROUPED, variants=_KQ_MMA_VARIANTS)
# fp32 rows whatever the dtype
KQ_MOE_MMA_DOWN = Kernel("kq_moe_mma_down", _GROUPED, variants=_KQ_MMA_VARIANTS, typed=False)
# The grouped MoE's shared form (a block's warps share each unit's activations), built for each weight type only
KQ_MOE_MMA_UP_SHARED = Kernel("kq_moe_mma_up_shared", _GROUPED, variants=tuple(KQ_TYPE_VARIANTS.values()))
KQ_MOE_MMA_DOWN_SHARED = Kernel("kq_moe_mma_down_shared", _GROUPED, variants=tuple(KQ_TYPE_VARIANTS.values()),
                                typed=False)
KQ_MOE_SUM = Kernel("kq_moe_sum", (("y", "ptr"), ("topk_ids", "ptr"), ("topk_weights", "ptr"), ("topk", "i32"),
                                   ("experts", "i32"), ("tokens", "i32"), ("rows", "i32"), ("out", "ptr")))
KQ_DEQUANT = Kernel("kq_dequant", (("segs", KqSegs), ("cols", "i32"), ("out", "ptr")))
KQ_KERNELS = (KQ_QUANTIZE, KQ_QUANTIZE_SILU, KQ_GEMV, KQ_GEMVS, KQ_MMA, KQ_MOE_UP, KQ_MOE_DOWN, KQ_MOE_UP_S,
              KQ_MOE_DOWN_S, KQ_MOE_MMA_UP,
              KQ_MOE_MMA_DOWN, KQ_MOE_MMA_UP_SHARED, KQ_MOE_MMA_DOWN_SHARED, KQ_MOE_SUM, KQ_DEQUANT)
