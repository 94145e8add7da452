"""Launch policy as pure functions over plain data.

Two questions, kept apart:
- ``check``: can this input run on fastcomm at all? (returns a reason string when not)
- ``choose_algo``: which algorithm is fastest for it? (a table lookup, never an if-chain)

Both are deterministic functions of data every rank shares (sizes, world size, the topology summary that
rank 0 decided), so every rank makes the same choice without talking.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Iterable, Sequence

from .topology import LinkType

KiB = 1 << 10
MiB = 1 << 20


class Algo(str, enum.Enum):
    ONE_SHOT = "one_shot"  # push everything to everyone (flag-in-data packets), reduce locally
    TWO_SHOT = "two_shot"  # reduce-scatter then all-gather (chunk flags)
    NCCL = "nccl"          # not served by fastcomm: the caller's fallback


class Transport(str, enum.Enum):
    P2P = "p2p"    # peer GPU memory mapped through CUDA IPC (NVLink or PCIe P2P)
    HOST = "host"  # shared pinned host memory (/dev/shm), for GPUs without P2P


# Must match FC_PACKET_PAYLOAD / FC_PACKET_BYTES in csrc/common.cuh: a 16-byte packet carries 8 data bytes
# and two copies of the 4-byte flag, so one-shot buffers need twice the message size.
PACKET_BYTES = 16
PACKET_PAYLOAD = 8
# Must match FC_MAX_WORLD and FC_MAX_BLOCKS in csrc/common.cuh.
MAX_WORLD = 8
MAX_BLOCKS = 128
ALIGN = 16
# The fused kernel holds its share of a row in registers: up to 1024 threads x K packets of 8 bytes, with K one
# of the compiled variants (fc_fused_rmsnorm<K>_<dtype> in csrc/kernels.cu).
FUSED_THREADS = 1024
FUSED_VARIANTS = (1, 2, 4, 8)
FUSED_PACKETS_PER_THREAD = max(FUSED_VARIANTS)
FUSED_MAX_ROW_BYTES = FUSED_THREADS * FUSED_PACKETS_PER_THREAD * PACKET_PAYLOAD
ONE_SHOT_THREADS = 256
TWO_SHOT_THREADS = 512
SUPPORTED_DTYPES = ("bfloat16", "float16", "float32")
DTYPE_SIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for non-negative integers."""
    return -(-a // b)


def round_up(x: int, a: int) -> int:
    return cdiv(x, a) * a


def packets_for(nbytes: int) -> int:
    """Packets needed to carry ``nbytes`` of payload (the tail packet may be partial)."""
    return cdiv(nbytes, PACKET_PAYLOAD)


def ll_bytes(nbytes: int) -> int:
    return packets_for(nbytes) * PACKET_BYTES


@dataclasses.dataclass(frozen=True)
class Rule:
    """Use ``algo`` for messages of at most ``max_bytes`` bytes."""

    max_bytes: int
    algo: Algo


@dataclasses.dataclass(frozen=True)
class PolicyKey:
    transport: Transport
    link: LinkType
    world_size: int          # 0 means any
    dtype: str = "any"       # "bfloat16" / "float16" / "float32", or "any"


# Defaults measured or modelled per (transport, link, world size); a tune file overrides entries.
# Rules are ordered by max_bytes; the first rule whose max_bytes >= size wins; past the last, NCCL.
DEFAULT_TABLE: dict[PolicyKey, tuple[Rule, ...]] = {
    # Two ranks, measured on 2 x H200 (run 5 and run 10 in bench/results/): one-shot 7.7 / 9.9 us against
    # two-shot 10.0 / 10.8 at 512 / 768 KB (12.3 / 12.8 after a GEMM at 768 KB), two-shot ahead from 1 MB
    # (11.6-11.8 against 12.0-12.2). 768 KB is also a 64-token GLM-5 decode step's all-reduce.
    PolicyKey(Transport.P2P, LinkType.NVLINK, 2): (
        Rule(768 * KiB, Algo.ONE_SHOT), Rule(64 * MiB, Algo.TWO_SHOT)),
    # 3-8 ranks (modelled: no such machine lent yet). Each rank writes (n-1) x 2 x size for the one-shot
    # and ~2 x size for the two-shot, so the one-shot's range shrinks with the world size; vLLM's
    # one-stage kernel (half the one-shot's bytes) stops at 256-512 KB there.
    PolicyKey(Transport.P2P, LinkType.NVLINK, 0): (
        Rule(256 * KiB, Algo.ONE_SHOT), Rule(64 * MiB, Algo.TWO_SHOT)),
    # PCIe (modelled, not measured: no PCIe-only GPUs lent yet). Writes are cheap and posted; one-shot has a
    # single hop but each GPU writes (n-1) x 2 x size over its own x16 link, so its range shrinks with the
    # world size (8 ranks, 32 KB: 7 x 64 KB = ~10 us of link time at ~45 GB/s).
    PolicyKey(Transport.P2P, LinkType.PCIE_SWITCH, 0): (
        Rule(128 * KiB, Algo.ONE_SHOT), Rule(64 * MiB, Algo.TWO_SHOT)),
    PolicyKey(Transport.P2P, LinkType.PCIE_SWITCH, 4): (
        Rule(64 * KiB, Algo.ONE_SHOT), Rule(64 * MiB, Algo.TWO_SHOT)),
    PolicyKey(Transport.P2P, LinkType.PCIE_SWITCH, 8): (
        Rule(32 * KiB, Algo.ONE_SHOT), Rule(64 * MiB, Algo.TWO_SHOT)),
    PolicyKey(Transport.P2P, LinkType.HOST_BRIDGE, 0): (
        Rule(128 * KiB, Algo.ONE_SHOT), Rule(64 * MiB, Algo.TWO_SHOT)),
    PolicyKey(Transport.P2P, LinkType.HOST_BRIDGE, 8): (
        Rule(32 * KiB, Algo.ONE_SHOT), Rule(64 * MiB, Algo.TWO_SHOT)),
    # Cross-socket P2P writes are slow on many boards; keep fastcomm to the small sizes there.
    PolicyKey(Transport.P2P, LinkType.CROSS_SOCKET, 0): (
        Rule(64 * KiB, Algo.ONE_SHOT), Rule(4 * MiB, Algo.TWO_SHOT)),
    PolicyKey(Transport.P2P, LinkType.UNKNOWN, 0): (
        Rule(64 * KiB, Algo.ONE_SHOT), Rule(8 * MiB, Algo.TWO_SHOT)),
    # Host memory: every byte crosses PCIe twice (write to host, read from host). Measured on 2 x H200
    # against NCCL_P2P_DISABLE=1: one-shot to 512 KB, two-shot (NCCL-like traffic) to 4 MB.
    PolicyKey(Transport.HOST, LinkType.UNKNOWN, 0): (
        Rule(512 * KiB, Algo.ONE_SHOT), Rule(4 * MiB, Algo.TWO_SHOT)),
}


def lookup_rules(table: dict[PolicyKey, tuple[Rule, ...]], transport: Transport, link: LinkType,
                 world_size: int, dtype: str = "any") -> tuple[Rule, ...]:
    """Most specific entry first: exact dtype before any dtype, exact world size before any, this link
    before the transport's UNKNOWN row."""
    for lk in (link, LinkType.UNKNOWN):
        for ws in (world_size, 0):
            for dt in ((dtype, "any") if dtype != "any" else ("any",)):
                rules = table.get(PolicyKey(transport, lk, ws, dt))
                if rules is not None:
                    return rules
    return ()


def choose_algo(nbytes: int, rules: Sequence[Rule], *, one_shot_max_bytes: int, max_bytes: int,
                forced: str = "auto") -> Algo:
    """The algorithm for one message. NCCL means 'not fastcomm': too big for the workspace or the table."""
    if nbytes > max_bytes:
        return Algo.NCCL
    if forced != "auto":
        algo = Algo(forced)
        return Algo.NCCL if algo is Algo.ONE_SHOT and nbytes > one_shot_max_bytes else algo
    for rule in rules:
        if nbytes <= rule.max_bytes:
            if rule.algo is Algo.ONE_SHOT and nbytes > one_shot_max_bytes:
                return Algo.TWO_SHOT
            return rule.algo
    return Algo.NCCL


def check_tensor(*, is_cuda: bool, device_index: int | None, ws_device_index: int, dtype: str,
                 contiguous: bool, data_ptr: int, nbytes: int, max_bytes: int) -> str | None:
    """Why this tensor cannot go through fastcomm, or None if it can."""
    if not is_cuda:
        return "tensor is not on a CUDA device"
    if device_index != ws_device_index:
        return f"tensor is on cuda:{device_index} but the workspace is on cuda:{ws_device_index}"
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} is not supported (bfloat16, float16, float32)"
    if not contiguous:
        return "tensor is not contiguous"
    if data_ptr % ALIGN:
        return f"tensor data is not {ALIGN}-byte aligned (storage offset?)"
    if nbytes > max_bytes:
        return f"message of {nbytes} bytes exceeds the workspace maximum of {max_bytes} bytes"
    return None


def check_fused(*, tokens: int, hidden: int, elem_size: int, one_shot_max_bytes: int) -> str | None:
    """Why the fused all-reduce + RMSNorm cannot run, or None. It rides on the one-shot buffers."""
    if hidden <= 0 or tokens <= 0:
        return "empty input"
    row_bytes = packets_for(hidden * elem_size) * PACKET_PAYLOAD
    if row_bytes > FUSED_MAX_ROW_BYTES:
        return f"a row of {hidden} elements ({row_bytes} bytes) exceeds the fused kernel's {FUSED_MAX_ROW_BYTES} bytes"
    if tokens * row_bytes > one_shot_max_bytes:
        return (f"{tokens} tokens x {hidden} needs {tokens * row_bytes} bytes of one-shot buffer; "
                f"workspace has {one_shot_max_bytes}")
    return None


@dataclasses.dataclass(frozen=True)
class Launch:
    grid: int
    block: int
    seg: int = 0     # two-shot: elements per segment
    chunk: int = 0   # two-shot: elements per block within a segment
    splits: int = 0  # fused: blocks per row
    k: int = 0       # fused: packets per thread (kernel variant fc_fused_rmsnorm<k>)


def one_shot_launch(nbytes: int, max_blocks: int) -> Launch:
    npk = packets_for(nbytes)
    block = min(ONE_SHOT_THREADS, max(32, round_up(npk, 32)))
    return Launch(num_blocks(npk, block, max_blocks), block)


def two_shot_launch(numel: int, elem_size: int, world_size: int, max_blocks: int) -> Launch:
    """Segments and chunks are whole 16-byte vectors so every chunk starts aligned."""
    per_vec = ALIGN // elem_size
    seg = round_up(cdiv(numel, world_size), per_vec)
    grid = num_blocks(cdiv(seg, per_vec), TWO_SHOT_THREADS, min(max_blocks, MAX_BLOCKS))
    chunk = round_up(cdiv(seg, grid), per_vec)
    grid = max(1, cdiv(seg, chunk))
    return Launch(grid, TWO_SHOT_THREADS, seg, chunk)


FUSED_MAX_SPLITS = 32          # blocks per row (the kernel's shared partial-sum array)
FUSED_SPLIT_PACKETS = 256      # aim for about one packet per thread of a 256-thread block, as one-shot does


def fused_launch(tokens: int, hidden: int, elem_size: int, max_blocks: int) -> Launch:
    """Rows cut into `splits` chunks (one block each) so few tokens still use many SMs; whole rounds of rows.

    The grid is a multiple of the split count (the blocks of a row run together) and at most max_blocks
    (all co-resident, as the blocks of a row wait for each other's partial sums).
    """
    row_pk = packets_for(hidden * elem_size)
    splits = max(1, min(cdiv(row_pk, FUSED_SPLIT_PACKETS), FUSED_MAX_SPLITS, max(1, max_blocks // max(tokens, 1)),
                        max_blocks))
    chunk_pk = cdiv(row_pk, splits)
    k = next(k for k in FUSED_VARIANTS if k * FUSED_THREADS >= chunk_pk)  # check_fused admits only rows that fit
    block = min(FUSED_THREADS, max(32, round_up(cdiv(chunk_pk, k), 32)))
    rows_per_round = max(1, min(tokens, max_blocks // splits))
    return Launch(rows_per_round * splits, block, splits=splits, k=k)


def num_blocks(work_items: int, threads: int, max_blocks: int) -> int:
    """Blocks for a grid-stride kernel: enough to cover the items, capped (all blocks must be co-resident)."""
    return max(1, min(cdiv(work_items, threads), max_blocks))


def validate_islands(islands: Iterable[Iterable[int]], world_size: int) -> tuple[tuple[int, ...], ...]:
    """Islands must partition the ranks into equal-sized groups (rank i of each island is a partner)."""
    isl = tuple(tuple(sorted(i)) for i in islands)
    flat = sorted(r for i in isl for r in i)
    if flat != list(range(world_size)):
        raise ValueError(f"islands {isl} do not partition ranks 0..{world_size - 1}")
    if len({len(i) for i in isl}) != 1:
        raise ValueError(f"islands {isl} must all have the same size")
    return isl
