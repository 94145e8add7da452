"""The one mirror of csrc's C ABI: constants, group and step ids, the structs, and the kernel tables.

Everything the host shares with the device is declared here and nowhere else: ``struct FcTable`` and
``struct FcError`` (csrc/comm/common.cuh) as ctypes structures, the FC_* constants, and every ``extern "C"``
kernel of csrc/comm/kernels.cu with its parameter types, from which launches are packed (the K-quant unit's
mirror is fastcomm.kquant.abi). tests/test_abi.py reads the CUDA sources and checks this module against them,
so a change on one side that is not made on the other fails on the CPU, before any GPU sees it.
"""
from __future__ import annotations

import ctypes

# The entry points' dtype suffixes are the runtime's, shared by both units; named here too as part of the ABI.
from .runtime.kernel import DTYPE_SUFFIX, Kernel

# ---- constants (FC_* in csrc/comm/common.cuh) -----------------------------------------------------------------
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
# The island two-shot (FC_STEP_ISL_* in csrc/comm/two_shot_islands.cuh).
STEP_ISL_RS, STEP_ISL_X, STEP_ISL_AG = 9, 10, 11
STEPS.update({STEP_ISL_RS: "island two-shot reduce-scatter (inside the island)",
              STEP_ISL_X: "island two-shot exchange across islands",
              STEP_ISL_AG: "island two-shot all-gather (inside the island)"})


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


# ---- kernels (packed by fastcomm.runtime.kernel) ----------------------------------------------------

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
