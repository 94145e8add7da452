"""Bytes on the wire: what each GPU writes over its own link per call, per implementation.

Computed from the same launch shapes and slot formats the kernels use (``launch``), so a PCIe cost can be
read without PCIe GPUs (``fastcomm bench`` shows it as a column). Counted: payload and flag bytes a GPU
stores into peer memory (P2P) or host memory (host transport); not counted: packet headers of the link, and
reads (the host transport's readers pull every peer's slot in over their own link, inbound). Where ranks
differ (the two-shot's short last segment), the busiest rank's count, as it sets the pace.
"""
from __future__ import annotations

from ..abi import MAX_BLOCKS, VEC_BYTES
from .launch import cdiv, two_shot_cut, two_shot_launch, vectors_for

FLAG_BYTES = 4  # the two-shot's per-block flag word


def wire_bytes(algo: str, nbytes: int, world: int, transport: str, islands: int = 1, *, elem_size: int = 2,
               max_blocks: int = MAX_BLOCKS, hidden: int | None = None) -> int:
    """Bytes one GPU sends per call of ``algo`` ("one_shot", "two_shot", "fused", "fused_two_shot") on
    ``nbytes`` of input.

    ``islands``: the number of equal islands of the hierarchical one-shot (P2P only): it sums inside the
    island, then across the islands' partners, so each GPU sends (island size - 1) + (islands - 1) copies.
    ``fused``: the fused all-reduce + RMSNorm (tokens x hidden x element size = ``nbytes``): the one-shot's
    exchange (its P2P copy into the rank's own slot stays in local memory).
    ``fused_two_shot``: its two-shot form (fused_two_shot.cuh), rows of ``hidden`` elements cut by columns:
    my copy of every other rank's part of each row, then my reduced part to every peer (host: once, into my
    own slot); each part of a row padded to 16 bytes.
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
    if algo == "two_shot":
        if islands > 1:
            raise ValueError("the two-shot has no island form")
        return _two_shot(nbytes, world, host, elem_size, max_blocks)
    if algo == "fused_two_shot":
        if islands > 1:
            raise ValueError("the fused two-shot has no island form")
        if not hidden or nbytes % (hidden * elem_size):
            raise ValueError(f"fused_two_shot needs the row length: {nbytes} bytes is not whole rows of {hidden}")
        return _fused_two_shot(nbytes // (hidden * elem_size), hidden, world, host, elem_size)
    raise ValueError(f"no wire model for algorithm {algo!r} (one_shot, two_shot, fused, fused_two_shot)")


def _fused_two_shot(tokens: int, hidden: int, world: int, host: bool, elem_size: int) -> int:
    parts = [v * VEC_BYTES * tokens for v in two_shot_cut(hidden, elem_size, world).part_vectors]
    ag_copies = 1 if host else world - 1
    return max(sum(parts) - parts[me] + ag_copies * parts[me] for me in range(world))


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
