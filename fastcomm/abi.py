"""The one mirror of csrc's C ABI: constants, group and step ids, the structs, and the kernel tables.

Everything the host shares with the device is declared here and nowhere else: ``struct FcTable`` and
``struct FcError`` (csrc/common.cuh) as ctypes structures, the FC_* constants, and every ``extern "C"``
kernel of csrc/kernels.cu with its parameter types, from which launches are packed; likewise the GGUF
K-quant decode kernels' unit (csrc/kquant.cuh, kquant_mma.cuh, kquant.cu: FC_KQ_*, ``struct KqSegs``, the
KQ_* kernels). tests/test_abi.py reads the CUDA sources and checks this module against them, so a change on
one side that is not made on the other fails on the CPU, before any GPU sees it.
"""
from __future__ import annotations

import ctypes
import dataclasses

# ---- constants (FC_* in csrc/common.cuh) -----------------------------------------------------------------
MAX_WORLD = 8          # FC_MAX_WORLD
MAX_BLOCKS = 128       # FC_MAX_BLOCKS
PACKET_BYTES = 16      # FC_PACKET_BYTES: 8 data bytes + the 4-byte flag twice
PACKET_PAYLOAD = 8     # FC_PACKET_PAYLOAD
VEC_BYTES = 16         # FC_VEC_BYTES: the one-shot moves payload only, 16 bytes per store
LP_BUFFERS = 3         # FC_LP_BUFFERS: the one-shot's rotating buffers (common.cuh, "Lamport one-shot")
SENTINEL_BYTE = 0xFF   # one-shot slots start (and are put back) all ones: "not arrived" for every dtype
ALIGN = 16             # every buffer region and tensor fastcomm touches is 16-byte aligned

# Group ids (FcTable.group_id), as printed in timeout errors.
FLAT, ISLAND, PARTNER = 0, 1, 2
GROUPS = {FLAT: "all ranks", ISLAND: "island", PARTNER: "cross-island partners"}

# Steps (FC_STEP_*), named in timeout errors.
STEP_ONE_SHOT, STEP_RS, STEP_AG, STEP_FUSED = 1, 2, 3, 4
STEP_PULL, STEP_PULL_AG, STEP_FUSED_RS, STEP_FUSED_AG = 5, 6, 7, 8
STEPS = {STEP_ONE_SHOT: "one-shot exchange", STEP_RS: "two-shot reduce-scatter",
         STEP_AG: "two-shot all-gather", STEP_FUSED: "fused all-reduce + RMSNorm exchange",
         STEP_PULL: "pull exchange", STEP_PULL_AG: "pull all-gather",
         STEP_FUSED_RS: "fused two-shot all-reduce + RMSNorm reduce-scatter",
         STEP_FUSED_AG: "fused two-shot all-reduce + RMSNorm all-gather"}
# The island two-shot (FC_STEP_ISL_* in csrc/two_shot_islands.cuh).
STEP_ISL_RS, STEP_ISL_X, STEP_ISL_AG = 9, 10, 11
STEPS.update({STEP_ISL_RS: "island two-shot reduce-scatter (inside the island)",
              STEP_ISL_X: "island two-shot exchange across islands",
              STEP_ISL_AG: "island two-shot all-gather (inside the island)"})

DTYPE_SUFFIX = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}

# The fused kernel keeps its share of a row in registers: up to FUSED_THREADS threads x K packets, K one of
# the compiled variants (FC_DEFINE_FUSED in kernels.cu).
FUSED_THREADS = 1024
FUSED_VARIANTS = (1, 2, 4, 8)
FUSED_MAX_SPLITS = 32  # the kernel's shared partial-sum array
# fused_two_shot.cuh: a block holds a row's positions (16-byte vectors of every part) in registers, at most
# FTS_K per thread (FC_FTS_K), FUSED_THREADS threads.
FTS_K = 4
ONE_SHOT_THREADS = 256
TWO_SHOT_THREADS = 512
PULL_THREADS = 512     # __launch_bounds__ of fc_pull / fc_pull2


# ---- structs ---------------------------------------------------------------------------------------------

class ErrorRecord(ctypes.Structure):
    """``struct FcError``: pinned, mapped host memory, so it survives the kernel's trap."""

    _fields_ = [(n, ctypes.c_uint32) for n in ("code", "rank", "peer", "step", "epoch", "block", "group", "pad")]


_P16 = ctypes.c_uint64 * MAX_WORLD
_H2 = _P16 * 2
_H3 = _P16 * LP_BUFFERS


class FcTable(ctypes.Structure):
    """``struct FcTable``: one communication group's peer table, field for field."""

    _fields_ = [
        ("rank", ctypes.c_uint32), ("world", ctypes.c_uint32), ("group_id", ctypes.c_uint32),
        ("global_rank", ctypes.c_uint32), ("global_of", ctypes.c_uint32 * MAX_WORLD),
        ("timeout_ns", ctypes.c_uint64), ("err", ctypes.c_uint64), ("state", ctypes.c_uint64),
        ("scratch", ctypes.c_uint64),
        ("n_ll_push", ctypes.c_uint32), ("n_ag_push", ctypes.c_uint32),
        ("ll_push", _H2), ("ll_pull", _H2),
        ("rs_push", _H2), ("rs_pull", _H2), ("rs_flag_push", _H2), ("rs_flag_pull", _H2),
        ("ag_push", _H2), ("ag_flag_push", _H2), ("ag_pull", _H2), ("ag_flag_pull", _H2),
        ("host", ctypes.c_uint32), ("n_lp_push", ctypes.c_uint32), ("lp_push", _H3), ("lp_pull", _H3),
        ("pull_buf", _H2), ("pull_red", _H2), ("pull_flag_pull", _H2), ("pull_flag_push", _H2),
    ]


TABLE_BYTES = ctypes.sizeof(FcTable)      # static_assert'ed in common.cuh
ERROR_BYTES = ctypes.sizeof(ErrorRecord)  # static_assert'ed in common.cuh
STATE_BYTES = 16                          # per group: FcTable.state[0..3] (epoch, blocks, one-shot buffer, size)
FLAG_ARRAY_BYTES = MAX_BLOCKS * 4         # two-shot: one u32 flag per block
PULL_FLAG_BYTES = 2 * FLAG_ARRAY_BYTES    # pull: one u32 flag per (phase, block), per source
SCRATCH_BYTES = MAX_BLOCKS * 2 * PACKET_BYTES  # per group: two packets per block (fused partial sums)


# ---- kernels ---------------------------------------------------------------------------------------------

_CTYPES = {"ptr": ctypes.c_uint64, "u64": ctypes.c_uint64, "u32": ctypes.c_uint32, "f32": ctypes.c_float,
           "i32": ctypes.c_int32}


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel family of kernels.cu: ``fc_<family><variant>_<dtype suffix>`` for each dtype and variant."""

    family: str
    params: tuple[tuple[str, str], ...]   # (name, type): ptr / u64 / u32 / i32 / f32, or a struct below by value
    variants: tuple[str, ...] = ("",)
    typed: bool = True                    # one entry point per dtype (fc_<family>_<suffix>), or just fc_<family>

    def symbol(self, dtype: str | None = None, variant: str = "") -> str:
        if variant not in self.variants:
            raise ValueError(f"kernel {self.family} has no variant {variant!r} (has {self.variants})")
        return f"fc_{self.family}{variant}_{DTYPE_SUFFIX[dtype]}" if self.typed else f"fc_{self.family}{variant}"

    def symbols(self) -> list[str]:
        if not self.typed:
            return [self.symbol(None, v) for v in self.variants]
        return [self.symbol(d, v) for v in self.variants for d in DTYPE_SUFFIX]

    def pack(self, *args) -> "PackedArgs":
        """The launch's kernelParams array (and the ctypes values it points to, kept alive with it)."""
        if len(args) != len(self.params):
            names = ", ".join(n for n, _ in self.params)
            raise TypeError(f"{self.family} takes {len(self.params)} arguments ({names}), got {len(args)}")
        values = [a if t in _STRUCTS else _CTYPES[t](a) for (_, t), a in zip(self.params, args)]
        for (name, t), v in zip(self.params, values):
            if t in _STRUCTS and not isinstance(v, _STRUCTS[t]):
                raise TypeError(f"{self.family}: {name} must be a {_STRUCTS[t].__name__}, got {type(v).__name__}")
        return PackedArgs(values)


class PackedArgs:
    def __init__(self, values):
        self.values = values
        self.array = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])

    @property
    def address(self) -> int:
        return ctypes.addressof(self.array)


ONE_SHOT = Kernel("one_shot", (("t", "ptr"), ("in", "ptr"), ("out", "ptr"), ("nbytes", "u64")))
# Islands in one launch: the island's table, then the partners' table (one_shot.cuh).
ONE_SHOT_ISLANDS = Kernel("one_shot_islands", (("ti", "ptr"), ("tp", "ptr"), ("in", "ptr"), ("out", "ptr"),
                                               ("nbytes", "u64")))
TWO_SHOT = Kernel("two_shot", (("t", "ptr"), ("in", "ptr"), ("out", "ptr"), ("n", "u64"), ("seg", "u64"),
                               ("chunk", "u64")))
# The island two-shot in one launch (two_shot_islands.cuh): the island's table, then the partners'; seg and
# chunk as the flat two-shot's for a world of the island's size (policy.two_shot_launch).
TWO_SHOT_ISLANDS = Kernel("two_shot_islands", (("ti", "ptr"), ("tp", "ptr"), ("in", "ptr"), ("out", "ptr"),
                                               ("n", "u64"), ("seg", "u64"), ("chunk", "u64")))
# The Lamport two-shot (two_shot_ll.cuh): segments and launch shape from nbytes (policy.two_shot_ll_launch).
TWO_SHOT_LL = Kernel("two_shot_ll", (("t", "ptr"), ("in", "ptr"), ("out", "ptr"), ("nbytes", "u64")))
# Pull (pull.cuh): one-stage (chunk: vectors per block), and two-stage (seg: vectors per segment).
PULL = Kernel("pull", (("t", "ptr"), ("in", "ptr"), ("out", "ptr"), ("nbytes", "u64"), ("chunk", "u64")))
PULL2 = Kernel("pull2", (("t", "ptr"), ("in", "ptr"), ("out", "ptr"), ("nbytes", "u64"), ("seg", "u64"),
                         ("chunk", "u64")))
FUSED_RMSNORM = Kernel("fused_rmsnorm", (("t", "ptr"), ("in", "ptr"), ("residual", "ptr"), ("weight", "ptr"),
                                         ("out", "ptr"), ("residual_out", "ptr"), ("tokens", "u32"),
                                         ("hidden", "u32"), ("splits", "u32"), ("eps", "f32")),
                      variants=tuple(str(k) for k in FUSED_VARIANTS))
FUSED_RMSNORM_ISLANDS = Kernel("fused_rmsnorm_islands", (("ti", "ptr"), ("tp", "ptr"), ("in", "ptr"),
                                                         ("residual", "ptr"), ("weight", "ptr"), ("out", "ptr"),
                                                         ("residual_out", "ptr"), ("tokens", "u32"),
                                                         ("hidden", "u32"), ("splits", "u32"), ("eps", "f32")),
                               variants=tuple(str(k) for k in FUSED_VARIANTS))
# Two-shot shaped fused op (fused_two_shot.cuh): ``cols`` elements of every row per rank's part.
FUSED_TWO_SHOT = Kernel("fused_two_shot", (("t", "ptr"), ("in", "ptr"), ("residual", "ptr"), ("weight", "ptr"),
                                           ("out", "ptr"), ("residual_out", "ptr"), ("tokens", "u32"),
                                           ("hidden", "u32"), ("cols", "u32"), ("splits", "u32"), ("eps", "f32")))
# One thread-block cluster per row (fused_cluster.cuh, sm_90+): launched with the cluster dimension
# (splits, 1, 1); at most FUSED_MAX_CLUSTER blocks per cluster (the portable cluster size).
FUSED_CLUSTER = Kernel("fused_cluster", (("t", "ptr"), ("in", "ptr"), ("residual", "ptr"), ("weight", "ptr"),
                                         ("out", "ptr"), ("residual_out", "ptr"), ("tokens", "u32"),
                                         ("hidden", "u32"), ("splits", "u32"), ("eps", "f32")))
FUSED_MAX_CLUSTER = 8
P2P_CHECK = Kernel("p2p_check", (("dst", "ptr"), ("pattern", "u64"), ("count", "u32")), typed=False)
KERNELS = (ONE_SHOT, ONE_SHOT_ISLANDS, TWO_SHOT, TWO_SHOT_LL, PULL, PULL2, FUSED_RMSNORM, FUSED_RMSNORM_ISLANDS,
           FUSED_TWO_SHOT, FUSED_CLUSTER, P2P_CHECK, TWO_SHOT_ISLANDS)


# ---- GGUF K-quant decode kernels (the "kquant" unit: csrc/kquant.cuh, kquant_mma.cuh, kquant.cu) ------------
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


_STRUCTS = {"segs": KqSegs}

_KQ_VARIANTS = ("1", "2", "4", "8")  # FC_KQ_DEFINE_GEMV / GEMVS: vectors per launch, at most
# FC_KQ_DEFINE_MMA / FC_KQ_DEFINE_DOWN: the mma forms for any weight type ("") or built for one.
KQ_TYPE_VARIANTS = {KQ_Q4_K: "_q4k", KQ_Q5_K: "_q5k", KQ_Q6_K: "_q6k", KQ_Q8_0: "_q80"}
_KQ_MMA_VARIANTS = ("",) + tuple(KQ_TYPE_VARIANTS.values())
# mma = 1: the tensor-core forms' order (kq_mma_x_put), which only they read; 0: the dp4a forms'.
_QUANTIZE = (("x", "ptr"), ("n", "i32"), ("cols", "i32"), ("x_stride", "u64"), ("xq", "ptr"), ("xds", "ptr"),
             ("mma", "i32"))
KQ_QUANTIZE = Kernel("kq_quantize", _QUANTIZE)
KQ_QUANTIZE_SILU = Kernel("kq_quantize_silu", _QUANTIZE)  # cols: of the activation, half the [gate | up] row
KQ_GEMV = Kernel("kq_gemv", (("segs", "segs"), ("xq", "ptr"), ("xds", "ptr"), ("n", "i32"), ("cols", "i32"),
                             ("out", "ptr"), ("out_stride", "u64")), variants=_KQ_VARIANTS)
KQ_GEMVS = Kernel("kq_gemvs", (("segs", "segs"), ("x", "ptr"), ("n", "i32"), ("cols", "i32"), ("x_stride", "u64"),
                               ("out", "ptr"), ("out_stride", "u64")), variants=_KQ_VARIANTS)
KQ_MMA = Kernel("kq_mma", (("segs", "segs"), ("xq", "ptr"), ("xs", "ptr"), ("n", "i32"), ("cols", "i32"),
                           ("out", "ptr"), ("out_stride", "u64")), variants=_KQ_MMA_VARIANTS)
_EXPERTS = (("w", "ptr"), ("expert_stride", "u64"), ("row_stride", "u64"), ("type", "i32"), ("rows", "i32"),
            ("cols", "i32"), ("topk_ids", "ptr"))
KQ_MOE_UP = Kernel("kq_moe_up", _EXPERTS + (("topk", "i32"), ("xq", "ptr"), ("xds", "ptr"), ("out", "ptr")))
KQ_MOE_DOWN = Kernel("kq_moe_down", _EXPERTS + (("topk_weights", "ptr"), ("topk", "i32"), ("xq", "ptr"),
                                                ("xds", "ptr"), ("out", "ptr")))
_GROUPED = _EXPERTS + (("topk", "i32"), ("pairs", "i32"), ("xq", "ptr"), ("xs", "ptr"), ("out", "ptr"))
KQ_MOE_MMA_UP = Kernel("kq_moe_mma_up", _GROUPED, variants=_KQ_MMA_VARIANTS)
# fp32 rows whatever the dtype
KQ_MOE_MMA_DOWN = Kernel("kq_moe_mma_down", _GROUPED, variants=_KQ_MMA_VARIANTS, typed=False)
# The grouped MoE's shared form (a block's warps share each unit's activations), built for each weight type only
KQ_MOE_MMA_UP_SHARED = Kernel("kq_moe_mma_up_shared", _GROUPED, variants=tuple(KQ_TYPE_VARIANTS.values()))
KQ_MOE_MMA_DOWN_SHARED = Kernel("kq_moe_mma_down_shared", _GROUPED, variants=tuple(KQ_TYPE_VARIANTS.values()),
                                typed=False)
KQ_MOE_SUM = Kernel("kq_moe_sum", (("y", "ptr"), ("topk_ids", "ptr"), ("topk_weights", "ptr"), ("topk", "i32"),
                                   ("experts", "i32"), ("tokens", "i32"), ("rows", "i32"), ("out", "ptr")))
KQ_DEQUANT = Kernel("kq_dequant", (("segs", "segs"), ("cols", "i32"), ("out", "ptr")))
KQ_KERNELS = (KQ_QUANTIZE, KQ_QUANTIZE_SILU, KQ_GEMV, KQ_GEMVS, KQ_MMA, KQ_MOE_UP, KQ_MOE_DOWN, KQ_MOE_MMA_UP,
              KQ_MOE_MMA_DOWN, KQ_MOE_MMA_UP_SHARED, KQ_MOE_MMA_DOWN_SHARED, KQ_MOE_SUM, KQ_DEQUANT)
