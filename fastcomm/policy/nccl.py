"""NCCL settings for the all-reduces that stay on NCCL (those above fastcomm's range), from the topology."""
from __future__ import annotations

from .links import LinkType


def nccl_env(worst: LinkType, all_p2p: bool | None) -> list[tuple[str, str, str]]:
    """(variable, value, why) to set for NCCL; nothing when NCCL's defaults are right.

    NCCL's default refuses P2P through Intel (and ARM) root complexes and then stages its all-reduces through
    host shared memory: two PCIe crossings and a copy instead of one direct write. Where every pair has
    working P2P and the slowest link crosses one root complex (PHB/NODE), allow it. Not across sockets,
    where P2P is often slower than host memory.
    """
    if worst is LinkType.HOST_BRIDGE and all_p2p:
        return [("NCCL_P2P_LEVEL", "PHB", "P2P works across the CPU root complex (probe); NCCL's default "
                 "would stage its all-reduces through host memory")]
    return []
