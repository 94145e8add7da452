"""The size rules: which algorithm serves a message of a given size, per (transport, link, world size).

Two questions are kept apart across the policy layer: ``checks`` says whether an input can run on fastcomm
at all; this module says which algorithm is fastest for it (a table lookup, never an if-chain). Both are
deterministic functions of data every rank shares, so every rank makes the same choice without talking.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Sequence

from ..units import KiB, MiB, format_size
from .links import LinkType


class Algo(str, enum.Enum):
    ONE_SHOT = "one_shot"  # push everything to everyone (payload only, Lamport slots), reduce locally
    TWO_SHOT = "two_shot"  # reduce-scatter then all-gather (chunk flags)
    TWO_SHOT_LL = "two_shot_ll"  # reduce-scatter then all-gather, readiness in the data (the one-shot's slots)
    PULL = "pull"          # read every peer's copy directly (P2P only; one- or two-stage by world and size)
    TWO_SHOT_ISLANDS = "two_shot_islands"  # reduce-scatter in the island, cross once with 1/island size, gather
    NCCL = "nccl"          # not served by fastcomm: the caller's fallback


class Transport(str, enum.Enum):
    P2P = "p2p"    # peer GPU memory mapped through CUDA IPC (NVLink or PCIe P2P)
    HOST = "host"  # shared pinned host memory (/dev/shm), for GPUs without P2P


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
# World size 0 rows hold 2-rank bounds; the plan scales their one-shot bound to the world size.
DEFAULT_TABLE: dict[PolicyKey, tuple[Rule, ...]] = {
    # Two ranks, measured on 2 x H200 (run 5 and run 10 in bench/results/): one-shot 7.7 / 9.9 us against
    # two-shot 10.0 / 10.8 at 512 / 768 KB (12.3 / 12.8 after a GEMM at 768 KB), two-shot ahead from 1 MB
    # (11.6-11.8 against 12.0-12.2). 768 KB is also a 64-token GLM-5 decode step's all-reduce.
    # Above the one-shot: the pull in place of the two-shot. MODELLED, not measured: vLLM's custom
    # all-reduce (a one-stage pull at 2 ranks) took 6.1 / 7.2 / 8.2 us at 512 KB / 768 KB / 1 MB on the same
    # 2 x H200 against the two-shot's 7.8 / 10.8 / 11.6 (bench/RESULTS.md). Pull reads cross NVLink at
    # about local cost; over PCIe a read is a full round trip, so the pull is in the NVLink rows only.
    PolicyKey(Transport.P2P, LinkType.NVLINK, 2): (
        Rule(768 * KiB, Algo.ONE_SHOT), Rule(64 * MiB, Algo.PULL)),
    # 3-8 ranks: the 2-rank bound, scaled by the plan's bytes-per-GPU model (policy.plan.default_rules).
    # (Each rank writes (n-1) x size for the one-shot since the Lamport slots, 2 x that when the bound was
    # measured; not yet re-measured, so kept.) The pull (modelled as above) picks one or two stages by
    # world and size (policy.launch.pull_stages).
    PolicyKey(Transport.P2P, LinkType.NVLINK, 0): (
        Rule(768 * KiB, Algo.ONE_SHOT), Rule(64 * MiB, Algo.PULL)),
    # PCIe (modelled, not measured: no PCIe-only GPUs lent yet). Writes are cheap and posted; one-shot has a
    # single hop but each GPU writes (n-1) x size over its own x16 link (policy.wire), so its range shrinks
    # with the world size. Set when it wrote twice that (8 ranks, 32 KB: 7 x 64 KB = ~10 us of link time at
    # ~45 GB/s; now 7 x 32 KB, ~5 us); kept until measured, the two-shot's fixed costs are not modelled.
    PolicyKey(Transport.P2P, LinkType.PCIE_SWITCH, 0): (
        Rule(128 * KiB, Algo.ONE_SHOT), Rule(64 * MiB, Algo.TWO_SHOT)),
    # 4 and 8 ranks over PCIe, above the one-shot: the Lamport two-shot (modelled, not measured). It writes
    # the two-shot's bytes (2 (n-1)/n of the message, policy.wire) with no flag and no fence: two link
    # crossings where the flagged two-shot needs four (data, then the flag, per phase), so the model has
    # it ahead of the two-shot wherever its slots hold the message (choose_algo sends larger ones to the
    # two-shot), and ahead of the one-shot from ~1 crossing x link rate / ((n-1) - 2 (n-1)/n): ~9-16 KB at 8
    # ranks (5.25 copies saved), ~30 KB at 4 (1.5 saved). The one-shot bounds stay as set (they also bound
    # the fused op) until measured.
    PolicyKey(Transport.P2P, LinkType.PCIE_SWITCH, 4): (
        Rule(64 * KiB, Algo.ONE_SHOT), Rule(64 * MiB, Algo.TWO_SHOT_LL)),
    PolicyKey(Transport.P2P, LinkType.PCIE_SWITCH, 8): (
        Rule(32 * KiB, Algo.ONE_SHOT), Rule(64 * MiB, Algo.TWO_SHOT_LL)),
    PolicyKey(Transport.P2P, LinkType.HOST_BRIDGE, 0): (
        Rule(128 * KiB, Algo.ONE_SHOT), Rule(64 * MiB, Algo.TWO_SHOT)),
    PolicyKey(Transport.P2P, LinkType.HOST_BRIDGE, 8): (
        Rule(32 * KiB, Algo.ONE_SHOT), Rule(64 * MiB, Algo.TWO_SHOT_LL)),
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


# With islands, the flat two-shots give way to the island two-shot (two_shot_islands.cuh). MODELLED, not
# measured (no multi-socket GPUs lent): islands exist because the link between them is the slow one, and
# there each rank sends S / L bytes across it (L ranks per island; to each of the other islands' partners)
# where the flat two-shot and the Lamport two-shot send about S (policy.wire.wire_cross: 4x at 2 x 4), for
# one more flag round (three, against two). The one-shot keeps its range (its island form also crosses
# once). Islands of one rank have nothing to reduce inside: the flat two-shot stays.
_ISLAND_FORM = {Algo.TWO_SHOT: Algo.TWO_SHOT_ISLANDS, Algo.TWO_SHOT_LL: Algo.TWO_SHOT_ISLANDS}
# Correct on a GPU (tests/gpu/test_allreduce_gpu.py::test_two_shot_islands, shared-GPU mode, 4-8 ranks), but off
# by default: bench/pcie_model.py, on issue 15's two-socket box (24 GB/s per GPU across the sockets), has it
# 3-6 us slower than the flat Lamport two-shot at 64 KB-1 MB and level only from ~4 MB: its third flagged
# phase costs more than the socket bytes it saves. A run on real two-socket GPUs decides;
# FASTCOMM_ALGO=two_shot_islands runs it meanwhile.
ISLAND_TWO_SHOT_BY_DEFAULT = False


def choose_algo(nbytes: int, rules: Sequence[Rule], *, one_shot_max_bytes: int, max_bytes: int,
                forced: str = "auto", two_shot_ll_max_bytes: int = 0, island_size: int = 0) -> Algo:
    """The algorithm for one message. NCCL means 'not fastcomm': too big for the workspace or the table.

    The one-shot and the Lamport two-shot share the one-shot's slots: past what they hold (the two limits),
    a rule naming either falls to the table's next two-shot or pull rule (else the two-shot), and forcing
    either gives NCCL. ``island_size``: ranks per island (0: no islands); from 2, what the table gives as a
    flat two-shot runs as the island two-shot (_ISLAND_FORM), which is also what forcing it needs (forcing
    "two_shot" keeps the flat one)."""
    if nbytes > max_bytes:
        return Algo.NCCL
    limit = {Algo.ONE_SHOT: one_shot_max_bytes, Algo.TWO_SHOT_LL: two_shot_ll_max_bytes,
             Algo.TWO_SHOT_ISLANDS: max_bytes if island_size >= 2 else 0}
    if forced != "auto":
        algo = Algo(forced)
        return Algo.NCCL if nbytes > limit.get(algo, max_bytes) else algo
    algo = _table_algo(nbytes, rules, limit, max_bytes)
    return _ISLAND_FORM.get(algo, algo) if island_size >= 2 and ISLAND_TWO_SHOT_BY_DEFAULT else algo


def _table_algo(nbytes: int, rules: Sequence[Rule], limit: dict, max_bytes: int) -> Algo:
    """The first rule that holds ``nbytes``, within the per-algorithm ``limit``s."""
    for i, rule in enumerate(rules):
        if nbytes <= rule.max_bytes:
            if nbytes > limit.get(rule.algo, max_bytes):
                # Past the slots the one-shot and the Lamport two-shot share: what the table uses after the
                # rule (the pull where it has one), else the two-shot.
                later = [r.algo for r in rules[i + 1:] if r.algo in (Algo.TWO_SHOT, Algo.PULL)]
                return later[0] if later else Algo.TWO_SHOT
            return rule.algo
    return Algo.NCCL


@dataclasses.dataclass(frozen=True)
class SizeRange:
    """Messages of ``min_bytes`` to ``max_bytes`` bytes (inclusive; None: no upper bound) use ``algo``."""

    min_bytes: int
    max_bytes: int | None
    algo: Algo


def size_ranges(rules: Sequence[Rule], *, one_shot_max_bytes: int, max_bytes: int,
                forced: str = "auto", two_shot_ll_max_bytes: int = 0, island_size: int = 0) -> tuple[SizeRange, ...]:
    """``choose_algo`` as ranges. It only changes at a rule bound or a workspace limit, so asking it at each
    of those bounds (and one byte past the last) finds every range exactly."""
    bounds = sorted({r.max_bytes for r in rules} | {one_shot_max_bytes, max_bytes}
                    | ({two_shot_ll_max_bytes} if two_shot_ll_max_bytes > 0 else set()))
    ranges: list[SizeRange] = []
    lo = 1
    for hi in [*bounds, None]:
        algo = choose_algo(bounds[-1] + 1 if hi is None else hi, rules, one_shot_max_bytes=one_shot_max_bytes,
                           max_bytes=max_bytes, forced=forced, two_shot_ll_max_bytes=two_shot_ll_max_bytes,
                           island_size=island_size)
        if ranges and ranges[-1].algo is algo:
            ranges[-1] = dataclasses.replace(ranges[-1], max_bytes=hi)
        else:
            ranges.append(SizeRange(lo, hi, algo))
        lo = (hi or 0) + 1
    return tuple(ranges)


def render_ranges(ranges: Sequence[SizeRange]) -> list[str]:
    """The one text form of size rules (``describe()``, ``fastcomm topo``, ``fastcomm tune``): one line each."""
    lines = []
    for r in ranges:
        if r.max_bytes is None:
            span = f"> {format_size(r.min_bytes - 1)}" if r.min_bytes > 1 else "all sizes"
        elif r.min_bytes == 1:
            span = f"<= {format_size(r.max_bytes)}"
        else:
            span = f"{format_size(r.min_bytes - 1)} < size <= {format_size(r.max_bytes)}"
        lines.append(f"{span}: {r.algo.value}" + (" (not fastcomm)" if r.algo is Algo.NCCL else ""))
    return lines
