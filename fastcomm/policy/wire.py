"""Bytes on the wire: what each GPU writes over its own link per call, per implementation.

Computed from the same launch shapes and slot formats the kernels use (``launch``), so a PCIe cost can be
read without PCIe GPUs (``fastcomm bench`` shows it as a column). Counted: payload and flag bytes a GPU
stores into peer memory (P2P) or host memory (host transport); not counted: packet headers of the link, and
reads (the host transport's readers pull every peer's slot in over their own link, inbound). Where ranks
differ (the two-shot's short last segment), the busiest rank's count, as it sets the pace.
"""
from __future__ import annotations

from ..abi import MAX_BLOCKS, VEC_BYTES
from .launch import cdiv, two_shot_launch, two_shot_ll_segment_vectors, vectors_for

FLAG_BYTES = 4  # the two-shot's per-block flag word


def wire_bytes(algo: str, nbytes: int, world: int, transport: str, islands: int = 1, *, elem_size: int = 2,
               max_blocks: int = MAX_BLOCKS) -> int:
    """Bytes one GPU sends per call of ``algo`` ("one_shot", "two_shot", "two_shot_ll", "fused") on ``nbytes``.

    ``islands``: the number of equal islands of the hierarchical one-shot (P2P only): it sums inside the
    island, then across the islands' partners, so each GPU sends (island size - 1) + (islands - 1) copies.
    ``fused``: the fused all-reduce + RMSNorm (tokens x hidden x element size = ``nbytes``): the one-shot's
    exchange (its P2P copy into the rank's own slot stays in local memory).
    """
    if transport not in ("p2p", "host"):
        raise ValueError(f"transport must be 'p2p' or 'host', not {transport!r}")
    if world < 1 or islands < 1 or world % islands:
        raise ValueError(f"{world} ranks cannot form {islands} equal islands")
    if islands > 1 and transport == "host":
        raise ValueError("islands need the P2P transport")
    if nbytes <= 0 or world == 1:
        return 0
    host = transport == "host"
    if algo in ("one_shot", "fused"):
        per_copy = vectors_for(nbytes) * VEC_BYTES  # both use the Lamport slots: payload only
        if host:
            return per_copy  # one copy into my own slot of the host segment
        return per_copy * ((world // islands - 1) + (islands - 1))
    if algo in ("two_shot", "two_shot_ll") and islands > 1:
        raise ValueError(f"the {algo.replace('_', '-')} has no island form")
    if algo == "two_shot":
        return _two_shot(nbytes, world, host, elem_size, max_blocks)
    if algo == "two_shot_ll":
        # Payload only, every segment padded to the same whole vectors: my copy of each other segment, then
        # my reduced segment to every peer (P2P) or once into my host slot.
        seg = two_shot_ll_segment_vectors(nbytes, world) * VEC_BYTES
        return (world - 1) * seg + (1 if host else world - 1) * seg
    raise ValueError(f"no wire model for algorithm {algo!r} (one_shot, two_shot, two_shot_ll, fused)")


def _two_shot(nbytes: int, world: int, host: bool, elem_size: int, max_blocks: int) -> int:
    numel = cdiv(nbytes, elem_size)
    lc = two_shot_launch(numel, elem_size, world, max_blocks)
    seg_bytes = [max(0, min(lc.seg, numel - s * lc.seg)) * elem_size for s in range(world)]
    flags = lc.grid * FLAG_BYTES

    def sends(me: int) -> int:
        rs = sum(b for s, b in enumerate(seg_bytes) if s != me) + (world - 1) * flags  # my copy of each segment
        ag_copies = 1 if host else world - 1                                            # my reduced segment
        return rs + ag_copies * (seg_bytes[me] + flags)

    return max(sends(me) for me in range(world))
