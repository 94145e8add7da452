"""Launch shapes: grid, block and the per-kernel parameters, as pure functions of sizes and limits."""
from __future__ import annotations

import dataclasses

from ..abi import (ALIGN, FUSED_MAX_CLUSTER, FUSED_MAX_SPLITS, FUSED_THREADS, FUSED_VARIANTS, MAX_BLOCKS, ONE_SHOT_THREADS,
                   PACKET_BYTES, PACKET_PAYLOAD, PULL_THREADS, TWO_SHOT_THREADS, VEC_BYTES)


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for non-negative integers."""
    return -(-a // b)


def round_up(x: int, a: int) -> int:
    return cdiv(x, a) * a


def packets_for(nbytes: int) -> int:
    """Packets needed to carry ``nbytes`` of payload (the tail packet may be partial)."""
    return cdiv(nbytes, PACKET_PAYLOAD)


def ll_bytes(nbytes: int) -> int:
    """Bytes of flag-in-data packets (the fused op) carrying ``nbytes`` of payload."""
    return packets_for(nbytes) * PACKET_BYTES


def vectors_for(nbytes: int) -> int:
    """16-byte vectors the one-shot moves for ``nbytes`` (payload only; the tail vector is zero-padded)."""
    return cdiv(nbytes, VEC_BYTES)


@dataclasses.dataclass(frozen=True)
class Launch:
    grid: int
    block: int
    seg: int = 0     # two-shot: elements per segment; two_shot_ll and pull (two-stage): 16-byte vectors per segment
    chunk: int = 0   # two-shot: elements per block within a segment; pull: vectors per block (in a segment)
    splits: int = 0  # fused: blocks per row
    k: int = 0       # fused: packets per thread (kernel variant fc_fused_rmsnorm<k>)
    stages: int = 0  # pull: 1 (fc_pull) or 2 (fc_pull2)
    cols: int = 0    # fused two-shot: columns of every row in each rank's part


def one_shot_launch(nbytes: int, max_blocks: int) -> Launch:
    """One 16-byte vector per thread per pass; every block gets at least one vector."""
    nvec = vectors_for(nbytes)
    block = min(ONE_SHOT_THREADS, max(32, round_up(nvec, 32)))
    return Launch(num_blocks(nvec, block, max_blocks), block)


def two_shot_launch(numel: int, elem_size: int, world_size: int, max_blocks: int) -> Launch:
    """Segments and chunks are whole 16-byte vectors so every chunk starts aligned."""
    per_vec = ALIGN // elem_size
    seg = round_up(cdiv(numel, world_size), per_vec)
    grid = num_blocks(cdiv(seg, per_vec), TWO_SHOT_THREADS, min(max_blocks, MAX_BLOCKS))
    chunk = round_up(cdiv(seg, grid), per_vec)
    grid = max(1, cdiv(seg, chunk))
    return Launch(grid, TWO_SHOT_THREADS, seg, chunk)


def two_shot_ll_segment_vectors(nbytes: int, world_size: int) -> int:
    """16-byte vectors per segment of the Lamport two-shot: every segment the same, zero-padded past the
    message (two_shot_ll.cuh computes the same from nbytes)."""
    return cdiv(vectors_for(nbytes), world_size)


def two_shot_ll_slot_bytes(nbytes: int, world_size: int, host: bool) -> int:
    """Bytes of each Lamport slot one call writes: P2P, a source's copy of my segment and its reduced
    segment (2 segments); host, my copy of every segment and my reduced one (world + 1 segments)."""
    return two_shot_ll_segment_vectors(nbytes, world_size) * VEC_BYTES * ((world_size + 1) if host else 2)


def two_shot_ll_max_bytes(lp_slot: int, world_size: int, host: bool) -> int:
    """The largest message whose segments fit a Lamport slot of ``lp_slot`` bytes (the one-shot's)."""
    per_seg = (lp_slot // VEC_BYTES) // ((world_size + 1) if host else 2)
    return per_seg * world_size * VEC_BYTES


def two_shot_ll_launch(nbytes: int, world_size: int, max_blocks: int) -> Launch:
    """One thread per vector of a segment (it handles that vector of every segment); the one-shot's block."""
    sv = two_shot_ll_segment_vectors(nbytes, world_size)
    block = min(ONE_SHOT_THREADS, max(32, round_up(sv, 32)))
    return Launch(num_blocks(sv, block, max_blocks), block, seg=sv)
# The pull's one-stage reads (W-1) x S per GPU in one flag round, the two-stage 2 (W-1) S / W in two: the
# one-stage reads (W-1)(W-2)/W x S more and saves a round (~1-2 us). Equal bytes at 2 ranks, so always one
# stage there; above, one stage up to these sizes. MODELLED on vLLM's custom all-reduce (one stage below
# 512 KB up to 4 ranks, below 256 KB up to 8); the bytes model (a round ~ what NVLink moves in 1.5 us,
# ~600 KB) gives the same order: ~900 / 400 / 115 KB at 3 / 4 / 8 ranks. Not measured here.
PULL_ONE_STAGE_MAX = {3: 512 * 1024, 4: 512 * 1024, 5: 256 * 1024, 6: 256 * 1024, 7: 256 * 1024, 8: 256 * 1024}


def pull_stages(nbytes: int, world: int) -> int:
    """1 (read the whole message from every peer) or 2 (reduce-scatter by pull, then all-gather by pull)."""
    return 1 if world <= 2 or nbytes <= PULL_ONE_STAGE_MAX[world] else 2


def pull_launch(nbytes: int, world: int, max_blocks: int) -> Launch:
    """Block b owns chunk b of the message (one stage) or of every segment (two stages); about one 16-byte
    vector per thread, capped at max_blocks (all blocks co-resident: a block waits for the same block of its
    peers) and at the flag arrays' MAX_BLOCKS. Segments are cut as layout.pull_sizes cuts them."""
    nvec = vectors_for(nbytes)
    stages = pull_stages(nbytes, world)
    span = nvec if stages == 1 else cdiv(nvec, world)
    grid = num_blocks(span, PULL_THREADS, min(max_blocks, MAX_BLOCKS))
    chunk = max(1, cdiv(span, grid))
    return Launch(max(1, cdiv(span, chunk)), PULL_THREADS, seg=span if stages == 2 else 0, chunk=chunk, stages=stages)


FUSED_SPLIT_VECTORS = 128      # about one 16-byte vector per thread of a 128-thread share of the pushes


def fused_row_vectors(hidden: int, elem_size: int) -> int:
    """The most 16-byte vectors one row touches: a row not 16-byte aligned straddles one more."""
    row = hidden * elem_size
    return cdiv(row, VEC_BYTES) + (1 if row % VEC_BYTES else 0)


def fused_launch(tokens: int, hidden: int, elem_size: int, max_blocks: int, *, split_rows: bool = True) -> Launch:
    """Rows cut into `splits` chunks (one block each) so few tokens still use many SMs; whole rounds of rows.

    Every block of a row reads the whole row (fused_rmsnorm.cuh), so K x block covers a row's vectors. The
    grid is a multiple of the split count (the blocks of a row run together) and at most max_blocks (all
    co-resident, as the blocks of a row read what their siblings push). ``split_rows`` False (an output
    overlaps the residual, which every block of a row reads whole): one block per row.
    """
    span = fused_row_vectors(hidden, elem_size)
    splits = max(1, min(cdiv(span, FUSED_SPLIT_VECTORS), FUSED_MAX_SPLITS, max(1, max_blocks // max(tokens, 1)),
                        max_blocks)) if split_rows else 1
    k = next(k for k in FUSED_VARIANTS if k * FUSED_THREADS >= span)  # check_fused admits only rows that fit
    block = min(FUSED_THREADS, max(32, round_up(cdiv(span, k), 32)))
    rows_per_round = max(1, min(tokens, max_blocks // splits))
    return Launch(rows_per_round * splits, block, splits=splits, k=k)


def fused_cluster_launch(tokens: int, hidden: int, elem_size: int, max_blocks: int,
                         resident_clusters: int | None = None) -> Launch:
    """fused_cluster.cuh: a cluster of ``splits`` blocks per row, each block reading only its chunk, so a
    block needs only a chunk's vectors (about one per thread) and rows may be split whatever aliases what.

    ``splits`` (the cluster size) is at most FUSED_MAX_CLUSTER; the grid is whole rounds of rows, at most
    max_blocks and ``resident_clusters`` clusters (cuOccupancyMaxActiveClusters for this block and cluster
    size: every block must be resident, a block waits on the previous row's block for a straddling vector).
    Call it without ``resident_clusters`` for the block and cluster size to ask about.
    """
    span = fused_row_vectors(hidden, elem_size)
    splits = max(1, min(cdiv(span, FUSED_SPLIT_VECTORS), FUSED_MAX_CLUSTER, max(1, max_blocks // max(tokens, 1))))
    block = min(FUSED_THREADS, max(32, round_up(cdiv(span, splits), 32)))
    rows_per_round = max(1, min(tokens, max(1, max_blocks // splits),
                                resident_clusters if resident_clusters is not None else tokens))
    return Launch(rows_per_round * splits, block, splits=splits)


@dataclasses.dataclass(frozen=True)
class TwoShotCut:
    """How fused_two_shot.cuh cuts the rows: ``world`` parts of ``cols`` columns (a multiple of 16 bytes, the
    last part shorter), ``pv`` 16-byte vectors per part and row; a row has ``world x pv`` positions."""

    cols: int
    pv: int
    part_vectors: tuple[int, ...]  # vectors of each part in one row (the last may be fewer than pv)

    @property
    def positions(self) -> int:
        return len(self.part_vectors) * self.pv


def two_shot_cut(hidden: int, elem_size: int, world: int) -> TwoShotCut:
    """Parts of every row by hidden columns, each starting 16 bytes into its row times a whole number."""
    per_vec = VEC_BYTES // elem_size
    cols = round_up(cdiv(hidden, world), per_vec)
    widths = [max(0, min(cols, hidden - p * cols)) for p in range(world)]
    return TwoShotCut(cols, cols // per_vec, tuple(cdiv(w * elem_size, VEC_BYTES) for w in widths))


def fused_two_shot_slot_bytes(tokens: int, hidden: int, elem_size: int, world: int, host: bool) -> int:
    """Bytes of one Lamport slot a fused_two_shot call writes (what it records for the next call's clear):
    P2P, a source's copy of my part and its reduced part; host, my copy of every part and my reduced part."""
    tp = tokens * two_shot_cut(hidden, elem_size, world).pv * VEC_BYTES
    return ((world if host else 1) + 1) * tp


def fused_two_shot_launch(tokens: int, hidden: int, elem_size: int, world: int, max_blocks: int, *,
                          split_rows: bool = True) -> Launch:
    """A block per (row, split), at most max_blocks (all resident: phase 2 waits on other blocks' phase 1).

    A block covers a row's positions, at most FTS_K per thread (checks.check_fused_two_shot); ``split_rows`` as for fused_launch
    (False: one block per row, since every block of a row reads its whole residual).
    """
    cut = two_shot_cut(hidden, elem_size, world)
    npos = cut.positions
    block = min(FUSED_THREADS, max(32, round_up(npos, 32)))  # one position per thread where the row allows
    splits = max(1, min(cdiv(npos, FUSED_SPLIT_VECTORS), FUSED_MAX_SPLITS, max(1, max_blocks // max(tokens, 1)),
                        max_blocks)) if split_rows else 1
    rows_per_round = max(1, min(tokens, max_blocks // splits))
    return Launch(rows_per_round * splits, block, splits=splits, cols=cut.cols)


def num_blocks(work_items: int, threads: int, max_blocks: int) -> int:
    """Blocks for a grid-stride kernel: enough to cover the items, capped (all blocks must be co-resident)."""
    return max(1, min(cdiv(work_items, threads), max_blocks))
