"""Bytes on the wire: what crosses each GPU's own link per call, per implementation.

Computed from the same launch shapes and slot formats the kernels use (``launch``), so a PCIe cost can be
read without PCIe GPUs (``fastcomm bench`` shows it as a column). Counted: payload and flag bytes a GPU
stores into peer memory (P2P) or host memory (host transport), and, for the pull, the payload it loads from
peers' memory (those reads are its traffic: nothing is pushed but flags). Not counted: packet headers and
read requests of the link, and the host transport's reads (its readers pull every peer's slot in over their
own link, inbound). Where ranks differ (a short last segment), the busiest rank's count, as it sets the
pace. ``wire_split`` gives (written, read); ``wire_bytes`` their sum.
"""
from __future__ import annotations

from ..abi import MAX_BLOCKS, VEC_BYTES
from .launch import cdiv, pull_launch, two_shot_cut, two_shot_launch, two_shot_ll_segment_vectors, vectors_for

FLAG_BYTES = 4  # the two-shot's per-block flag word


def wire_bytes(algo: str, nbytes: int, world: int, transport: str, islands: int = 1, *, elem_size: int = 2,
               max_blocks: int = MAX_BLOCKS, hidden: int | None = None) -> int:
    """Bytes that cross one GPU's link per call of ``algo`` on ``nbytes`` of input: ``wire_split``'s sum."""
    return sum(wire_split(algo, nbytes, world, transport, islands, elem_size=elem_size, max_blocks=max_blocks,
                          hidden=hidden))


def wire_split(algo: str, nbytes: int, world: int, transport: str, islands: int = 1, *, elem_size: int = 2,
               max_blocks: int = MAX_BLOCKS, hidden: int | None = None) -> tuple[int, int]:
    """(bytes one GPU writes, bytes it reads) over its link per call of ``algo`` ("one_shot", "two_shot",
    "two_shot_ll", "fused", "fused_two_shot", "pull") on ``nbytes`` of input. Only the pull reads.

    ``islands``: the number of equal islands of the hierarchical one-shot (P2P only): it sums inside the
    island, then across the islands' partners, so each GPU sends (island size - 1) + (islands - 1) copies.
    ``fused``: the fused all-reduce + RMSNorm (tokens x hidden x element size = ``nbytes``): the one-shot's
    exchange (its P2P copy into the rank's own slot stays in local memory).
    ``fused_two_shot``: its two-shot form (fused_two_shot.cuh), rows of ``hidden`` elements cut by columns:
    my copy of every other rank's part of each row, then my reduced part to every peer (host: once, into my
    own slot); each part of a row padded to 16 bytes.
    ``two_shot_islands``: the island two-shot (two_shot_islands.cuh; ``islands`` equal islands of 2+ ranks):
    my copy of each other island segment, my island partial to every other island's partner, my finished
    segment to every island peer, each with a flag per block.
    """
    if transport not in ("p2p", "host"):
        raise ValueError(f"transport must be 'p2p' or 'host', not {transport!r}")
    if world < 1 or islands < 1 or world % islands:
        raise ValueError(f"{world} ranks cannot form {islands} equal islands")
    if islands > 1 and transport == "host":
        raise ValueError("islands need the P2P transport")
    if nbytes <= 0 or world == 1:
        return 0, 0
    host = transport == "host"
    if algo in ("one_shot", "fused"):
        per_copy = vectors_for(nbytes) * VEC_BYTES  # both use the Lamport slots: payload only
        if host:
            return per_copy, 0  # one copy into my own slot of the host segment
        return per_copy * ((world // islands - 1) + (islands - 1)), 0
    if algo == "two_shot_islands":
        return _two_shot_islands(nbytes, world, islands, elem_size, max_blocks)[0], 0
    if algo in ("two_shot", "two_shot_ll", "fused_two_shot", "pull") and islands > 1:
        raise ValueError(f"the {algo.replace('_', ' ')} has no island form")
    if algo == "two_shot":
        return _two_shot(nbytes, world, host, elem_size, max_blocks), 0
    if algo == "two_shot_ll":
        # Payload only, every segment padded to the same whole vectors: my copy of each other segment, then
        # my reduced segment to every peer (P2P) or once into my host slot.
        seg = two_shot_ll_segment_vectors(nbytes, world) * VEC_BYTES
        return (world - 1) * seg + (1 if host else world - 1) * seg, 0
    if algo == "fused_two_shot":
        if not hidden or nbytes % (hidden * elem_size):
            raise ValueError(f"fused_two_shot needs the row length: {nbytes} bytes is not whole rows of {hidden}")
        return _fused_two_shot(nbytes // (hidden * elem_size), hidden, world, host, elem_size), 0
    if algo == "pull":
        if host:
            raise ValueError("the pull needs the P2P transport")
        return _pull(nbytes, world, max_blocks)
    raise ValueError(f"no wire model for algorithm {algo!r} (one_shot, two_shot, two_shot_ll, fused, fused_two_shot, "
                     "pull, two_shot_islands)")


def wire_cross(algo: str, nbytes: int, world: int, islands: int, *, elem_size: int = 2,
               max_blocks: int = MAX_BLOCKS) -> int:
    """Bytes one GPU writes to GPUs outside its island per call (P2P), on a box of ``islands`` equal islands
    of consecutive ranks (what the probe finds on a two-socket box): the traffic of the slow link. The
    island forms ("one_shot", "fused": one copy to each other island's partner; "two_shot_islands": one
    island segment to each) and the flat two-shots run over that box ("two_shot", "two_shot_ll": every peer
    outside my island gets what the flat algorithm sends it). The busiest rank's count."""
    if islands < 2 or world % islands:
        raise ValueError(f"{world} ranks cannot form {islands} equal islands (2 or more)")
    if nbytes <= 0:
        return 0
    size = world // islands
    if algo in ("one_shot", "fused"):
        return vectors_for(nbytes) * VEC_BYTES * (islands - 1)
    if algo == "two_shot_islands":
        return _two_shot_islands(nbytes, world, islands, elem_size, max_blocks)[1]
    if algo == "two_shot":
        seg_bytes, flags = _segments(nbytes, world, elem_size, max_blocks)

        def outside(me: int) -> int:
            away = [s for s in range(world) if s // size != me // size]
            return sum(seg_bytes[s] + flags for s in away) + len(away) * (seg_bytes[me] + flags)

        return max(outside(me) for me in range(world))
    if algo == "two_shot_ll":
        seg = two_shot_ll_segment_vectors(nbytes, world) * VEC_BYTES
        return 2 * (world - size) * seg
    raise ValueError(f"no cross-island model for algorithm {algo!r} (one_shot, fused, two_shot, two_shot_ll, "
                     "two_shot_islands)")


def nccl_ring_bytes(nbytes: int, world: int) -> int:
    """NCCL's ring all-reduce: each GPU sends 2 (n-1)/n of the message (its schedule, for comparison)."""
    return 2 * (world - 1) * nbytes // world


def _two_shot_islands(nbytes: int, world: int, islands: int, elem_size: int, max_blocks: int) -> tuple[int, int]:
    """(all bytes, bytes to other islands) the busiest rank writes: segments cut for a world of the island's
    size (as ops launches it), a flag word per block and destination in each of the three phases."""
    size = world // islands
    if islands < 2 or size < 2:
        raise ValueError(f"the island two-shot needs 2+ islands of 2+ ranks, not {islands} of {size}")
    seg_bytes, flags = _segments(nbytes, size, elem_size, max_blocks)

    def sends(me: int) -> tuple[int, int]:
        rs = sum(b for s, b in enumerate(seg_bytes) if s != me) + (size - 1) * flags
        cross = (islands - 1) * (seg_bytes[me] + flags)
        ag = (size - 1) * (seg_bytes[me] + flags)
        return rs + cross + ag, cross

    return max((sends(me) for me in range(size)), key=lambda t: t[0])


def _fused_two_shot(tokens: int, hidden: int, world: int, host: bool, elem_size: int) -> int:
    parts = [v * VEC_BYTES * tokens for v in two_shot_cut(hidden, elem_size, world).part_vectors]
    ag_copies = 1 if host else world - 1
    return max(sum(parts) - parts[me] + ag_copies * parts[me] for me in range(world))


def _pull(nbytes: int, world: int, max_blocks: int) -> tuple[int, int]:
    """Written: one flag word per (peer, block, stage). Read: the block's whole vectors from every peer's
    copy (one stage), or my segment from every peer and then every other reduced segment (two stages)."""
    lc = pull_launch(nbytes, world, max_blocks)
    flags = (world - 1) * lc.grid * FLAG_BYTES * lc.stages
    nvec = vectors_for(nbytes)
    if lc.stages == 1:
        return flags, (world - 1) * nvec * VEC_BYTES
    seg_vecs = [max(0, min(lc.seg, nvec - s * lc.seg)) for s in range(world)]

    def reads(me: int) -> int:  # my segment from each peer, then each other segment once
        return ((world - 1) * seg_vecs[me] + sum(v for s, v in enumerate(seg_vecs) if s != me)) * VEC_BYTES

    return flags, max(reads(me) for me in range(world))


def _segments(nbytes: int, world: int, elem_size: int, max_blocks: int) -> tuple[list[int], int]:
    """The two-shot's cut of a message over ``world`` ranks, as ops launches it: each segment's bytes, and
    the flag bytes one phase writes to one destination (a word per block)."""
    numel = cdiv(nbytes, elem_size)
    lc = two_shot_launch(numel, elem_size, world, max_blocks)
    return [max(0, min(lc.seg, numel - s * lc.seg)) * elem_size for s in range(world)], lc.grid * FLAG_BYTES


def _two_shot(nbytes: int, world: int, host: bool, elem_size: int, max_blocks: int) -> int:
    seg_bytes, flags = _segments(nbytes, world, elem_size, max_blocks)

    def sends(me: int) -> int:
        rs = sum(b for s, b in enumerate(seg_bytes) if s != me) + (world - 1) * flags  # my copy of each segment
        ag_copies = 1 if host else world - 1                                            # my reduced segment
        return rs + ag_copies * (seg_bytes[me] + flags)

    return max(sends(me) for me in range(world))
