"""Link classes and the decisions taken over a link matrix: the worst link, islands, the P2P summary.

Pure functions over plain data (a matrix of LinkType between ranks, a matrix of P2P booleans), so they are
tested from recorded topologies. The probe (fastcomm.topology) fills the matrices; it decides nothing.
"""
from __future__ import annotations

import enum
import itertools
from typing import Iterable, Sequence


class LinkType(str, enum.Enum):
    """How two GPUs reach each other, fastest first. Values match `nvidia-smi topo -m` families."""

    NVLINK = "nvlink"              # NV#
    PCIE_SWITCH = "pcie_switch"    # PIX / PXB: through PCIe switches, no host bridge
    HOST_BRIDGE = "host_bridge"    # PHB / NODE: through the CPU's root complex, same socket
    CROSS_SOCKET = "cross_socket"  # SYS: across the inter-socket link (UPI / xGMI)
    UNKNOWN = "unknown"


# Declaration order is speed order; UNKNOWN sorts last so that a pair we could not read is never trusted.
_SLOWNESS = {lt: i for i, lt in enumerate(LinkType)}

Matrix = Sequence[Sequence[LinkType]]
BoolMatrix = Sequence[Sequence["bool | None"]]


def worst_link(link: Matrix, ranks: Iterable[int] | None = None) -> LinkType:
    """The slowest link between any two of ``ranks`` (default all); UNKNOWN when there is no pair."""
    ranks = range(len(link)) if ranks is None else tuple(ranks)
    pairs = [link[i][j] for i, j in itertools.combinations(ranks, 2)]
    return max(pairs, key=_SLOWNESS.__getitem__, default=LinkType.UNKNOWN)


def islands(link: Matrix, ranks: Sequence[int] | None = None) -> tuple[tuple[int, ...], ...]:
    """Groups for the hierarchical mode (reduce inside an island, exchange once across, broadcast back).

    Rule, kept deliberately simple: cut every link of the slowest class present among ``ranks``. The cut is
    used only if it leaves at least two groups, all of one size (rank i of each island partners rank i of the
    others) and at least two GPUs each, and every pair inside a group is faster than the cut class. Otherwise
    there is one island. So 2 sockets x 4 GPUs -> two islands of 4; NVLink everywhere or one socket of
    PHB/NODE -> one island; 4 GPUs as two PIX pairs joined by the host bridge -> two islands of 2.
    Values are the given ranks (positions in the matrix); map them through ``ranks`` for group-local ids.
    """
    ranks = tuple(range(len(link)) if ranks is None else ranks)
    whole = (tuple(sorted(ranks)),)
    worst = worst_link(link, ranks)
    if len(ranks) < 4 or worst is LinkType.UNKNOWN:
        return whole
    groups: list[list[int]] = []
    for r in ranks:  # connected components over the faster links
        joined = [g for g in groups if any(link[r][q] is not worst for q in g)]
        merged = sorted([r] + [q for g in joined for q in g])
        groups = [g for g in groups if g not in joined] + [merged]
    sizes = {len(g) for g in groups}
    if len(groups) < 2 or len(sizes) != 1 or sizes.pop() < 2:
        return whole
    if any(link[a][b] is worst for g in groups for a, b in itertools.combinations(g, 2)):
        return whole  # a chain of fast links, not a clique: the group is not internally faster
    return tuple(sorted(tuple(g) for g in groups))


def summarize(link: Matrix, p2p: BoolMatrix) -> tuple[LinkType, bool | None]:
    """(worst link among all GPUs, whether every pair can P2P-write: None if any pair could not be read)."""
    values = [v for i, row in enumerate(p2p) for j, v in enumerate(row) if i != j]
    if len(link) < 2 or any(v is None for v in values):
        return worst_link(link), None
    return worst_link(link), all(values)


def validate_islands(islands: Iterable[Iterable[int]], world_size: int) -> tuple[tuple[int, ...], ...]:
    """Islands must partition the ranks into equal-sized groups (rank i of each island is a partner)."""
    isl = tuple(tuple(sorted(i)) for i in islands)
    flat = sorted(r for i in isl for r in i)
    if flat != list(range(world_size)):
        raise ValueError(f"islands {isl} do not partition ranks 0..{world_size - 1}")
    if len({len(i) for i in isl}) != 1:
        raise ValueError(f"islands {isl} must all have the same size")
    return isl
