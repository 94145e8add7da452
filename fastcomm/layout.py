"""Where everything lives in the shared buffers, and the peer tables the kernels read.

Pure bookkeeping over integers (addresses are plain ints), so all of it is tested without a GPU.
The tables are ``fastcomm.abi.FcTable`` (the mirror of ``struct FcTable``).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from .abi import ALIGN, FLAG_ARRAY_BYTES, FLAT, ISLAND, LP_BUFFERS, MAX_WORLD, PARTNER, PULL_FLAG_BYTES, SCRATCH_BYTES, \
    STATE_BYTES, TABLE_BYTES, VEC_BYTES, FcTable
from .policy.launch import cdiv, ll_bytes, round_up


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """Offsets (bytes) of one group's regions inside a buffer; sizes per half-slot."""

    members: tuple[int, ...]  # global ranks, in group order
    group_id: int
    ll_slot: int              # flag-in-data packets, two halves (no kernel uses them now; see FcTable)
    lp_slot: int              # one-shot: payload only (Lamport), LP_BUFFERS rotating buffers
    seg: int                  # two-shot segment bytes (0: no two-shot in this group)
    ll_off: int
    lp_off: int
    rs_off: int
    ag_off: int
    rs_flag_off: int
    ag_flag_off: int
    end: int
    # Pull (P2P, flat group only; 0 elsewhere), in each rank's own buffer: my input copy and my reduced
    # segment, two halves each, read by the peers; then [half][source] flag arrays the peers write.
    pull_slot: int = 0        # bytes of one half of the input copy
    pull_seg: int = 0         # bytes of one half of the reduced segment (two-stage)
    pull_off: int = 0
    pull_red_off: int = 0
    pull_flag_off: int = 0
    # Partner groups of the island two-shot use only the ag slots (a slot per source for each rank's island
    # partial, two_shot_islands.cuh): no rs slots or rs flags are placed, and the table leaves them null.
    ag_only: bool = False


def pull_sizes(max_bytes: int, world: int) -> tuple[int, int]:
    """(input copy, reduced segment) bytes per half: the whole message, and one rank's segment of it, in
    16-byte vectors (policy.launch.pull_launch cuts segments the same way)."""
    nvec = cdiv(max_bytes, VEC_BYTES)
    return nvec * VEC_BYTES, cdiv(nvec, world) * VEC_BYTES


def _group_regions(members: Sequence[int], group_id: int, ll_slot: int, lp_slot: int, seg: int, start: int,
                   host: bool, pull: tuple[int, int] = (0, 0), ag_only: bool = False) -> GroupLayout:
    """P2P: each rank's buffer holds slots indexed by source. Host: one segment holds every rank's slots."""
    g = len(members)
    rs_slots = 0 if ag_only else g * g if host else g  # host: [segment][source]; P2P: [source] (segment is mine)
    off = round_up(start, ALIGN)
    ll_off = off
    off += 2 * g * ll_slot
    lp_off = off                              # [buffer][source] (P2P: receive side; host: by writer)
    off += LP_BUFFERS * g * lp_slot
    rs_off = off
    off += 2 * rs_slots * seg
    ag_off = off
    off += 2 * g * seg
    rs_flag_off = off
    off += 2 * rs_slots * FLAG_ARRAY_BYTES if seg else 0
    ag_flag_off = off
    off += 2 * g * FLAG_ARRAY_BYTES if seg else 0
    pull_slot, pull_seg = (0, 0) if host else pull
    pull_off = off
    off += 2 * pull_slot
    pull_red_off = off
    off += 2 * pull_seg
    pull_flag_off = off
    off += 2 * g * PULL_FLAG_BYTES if pull_slot else 0
    return GroupLayout(tuple(members), group_id, ll_slot, lp_slot, seg, ll_off, lp_off, rs_off, ag_off, rs_flag_off,
                       ag_flag_off, off, pull_slot, pull_seg, pull_off, pull_red_off, pull_flag_off, ag_only)


@dataclasses.dataclass(frozen=True)
class Layout:
    transport: str                      # "p2p" or "host"
    world_size: int
    max_bytes: int
    one_shot_max_bytes: int
    groups: tuple[GroupLayout, ...]     # flat first, then islands, then partner groups
    shared_bytes: int                   # per-rank device buffer (P2P) or the one host segment (host)
    local_bytes: int                    # per-rank device memory nobody else touches: states, scratch, tables
    state_off: int
    scratch_off: int
    table_off: int
    # (offset, nbytes) of the shared buffer (P2P, every rank's) or host segment that must start as 0xFF
    # bytes (abi.SENTINEL_BYTE): the one-shot's slots, "not arrived" until written. Everything else zero.
    sentinel_regions: tuple[tuple[int, int], ...] = ()


def plan_layout(transport: str, world_size: int, max_bytes: int, one_shot_max_bytes: int,
                islands: tuple[tuple[int, ...], ...] | None = None) -> Layout:
    """All groups' regions. Islands add one group per island and one per partner set (rank i of each)."""
    if not 1 <= world_size <= MAX_WORLD:
        raise ValueError(f"world size {world_size} outside 1..{MAX_WORLD}")
    host = transport == "host"
    ll_slot = round_up(ll_bytes(one_shot_max_bytes), ALIGN)
    lp_slot = round_up(one_shot_max_bytes, VEC_BYTES)
    if lp_slot >= 1 << 32:  # the kernel keeps a call's size in a 32-bit state word
        raise ValueError(f"one-shot maximum of {one_shot_max_bytes} bytes exceeds 4 GiB")
    seg = round_up(cdiv(max_bytes, world_size), ALIGN)
    # The pull serves flat messages up to max_bytes over P2P (the host transport has no peer-readable copy).
    groups = [_group_regions(range(world_size), FLAT, ll_slot, lp_slot, seg, 0, host, pull_sizes(max_bytes, world_size))]
    if islands and len(islands) > 1:
        # The island two-shot (two_shot_islands.cuh) cuts the message in island-size segments: the island
        # groups get two-shot slots of that segment (as the flat group of that world size would), the
        # partner groups ag slots of it only. Islands of one rank have no island two-shot (nothing to reduce
        # inside), so no slots. Own regions, not the flat group's: each group's halves follow its own epoch.
        size = len(islands[0])
        iseg = round_up(cdiv(max_bytes, size), ALIGN) if size > 1 else 0
        for isl in islands:
            groups.append(_group_regions(isl, ISLAND, ll_slot, lp_slot, iseg, groups[-1].end, host))
        for i in range(size):
            groups.append(_group_regions(tuple(isl[i] for isl in islands), PARTNER, ll_slot, lp_slot, iseg,
                                         groups[-1].end, host, ag_only=True))
    shared = round_up(groups[-1].end, 4096)
    state_off = 0
    scratch_off = round_up(STATE_BYTES * len(groups), 256)
    table_off = scratch_off + SCRATCH_BYTES * len(groups)
    local = table_off + TABLE_BYTES * len(groups)
    sentinel = tuple((g.lp_off, LP_BUFFERS * len(g.members) * g.lp_slot) for g in groups)
    return Layout(transport, world_size, max_bytes, one_shot_max_bytes, tuple(groups), shared, local, state_off,
                  scratch_off, table_off, sentinel)


def groups_of(layout: Layout, rank: int) -> list[GroupLayout]:
    """The groups ``rank`` belongs to (the flat one always first)."""
    return [g for g in layout.groups if rank in g.members]


def build_table(layout: Layout, g: GroupLayout, rank: int, *, own_base: int, peer_bases: Sequence[int] | None,
                host_base: int | None, state_ptr: int, err_ptr: int, timeout_ns: int, scratch_ptr: int = 0) -> FcTable:
    """The table rank ``rank`` uses for group ``g``.

    ``peer_bases[r]`` is rank r's shared device buffer as mapped in this process (P2P; own rank = own_base);
    ``host_base`` is the host segment's device address (host transport).
    """
    t = FcTable()
    members = g.members
    gsz = len(members)
    me = members.index(rank)
    t.rank, t.world, t.group_id, t.global_rank = me, gsz, g.group_id, rank
    for i, r in enumerate(members):
        t.global_of[i] = r
    t.timeout_ns, t.err, t.state, t.scratch = timeout_ns, err_ptr, state_ptr, scratch_ptr
    host = layout.transport == "host"
    flag = FLAG_ARRAY_BYTES
    t.host = 1 if host else 0
    for b in range(LP_BUFFERS):
        lp = g.lp_off + b * gsz * g.lp_slot
        if host:
            t.n_lp_push = 1
            t.lp_push[b][0] = host_base + lp + me * g.lp_slot
            for p in range(gsz):
                t.lp_pull[b][p] = host_base + lp + p * g.lp_slot
        else:
            peers = [i for i in range(gsz) if i != me]
            t.n_lp_push = len(peers)
            for j, p in enumerate(peers):
                t.lp_push[b][j] = peer_bases[members[p]] + lp + me * g.lp_slot
            for p in range(gsz):
                t.lp_pull[b][p] = own_base + lp + p * g.lp_slot
    for h in range(2):
        if host:
            b = host_base
            ll = b + g.ll_off + h * gsz * g.ll_slot
            t.n_ll_push = 1
            t.ll_push[h][0] = ll + me * g.ll_slot
            for p in range(gsz):
                t.ll_pull[h][p] = ll + p * g.ll_slot
            if g.seg:
                rs = b + g.rs_off + h * gsz * gsz * g.seg        # [segment s][source p]
                rsf = b + g.rs_flag_off + h * gsz * gsz * flag
                ag = b + g.ag_off + h * gsz * g.seg              # [segment p]
                agf = b + g.ag_flag_off + h * gsz * flag
                t.n_ag_push = 1
                for s in range(gsz):
                    if not g.ag_only:
                        t.rs_push[h][s] = rs + (s * gsz + me) * g.seg
                        t.rs_flag_push[h][s] = rsf + (s * gsz + me) * flag
                        t.rs_pull[h][s] = rs + (me * gsz + s) * g.seg
                        t.rs_flag_pull[h][s] = rsf + (me * gsz + s) * flag
                    t.ag_pull[h][s] = ag + s * g.seg
                    t.ag_flag_pull[h][s] = agf + s * flag
                t.ag_push[h][0] = ag + me * g.seg
                t.ag_flag_push[h][0] = agf + me * flag
        else:
            base_of = [peer_bases[r] for r in members]
            peers = [i for i in range(gsz) if i != me]
            t.n_ll_push = len(peers)
            t.n_ag_push = len(peers) if g.seg else 0
            for j, p in enumerate(peers):
                t.ll_push[h][j] = base_of[p] + g.ll_off + (h * gsz + me) * g.ll_slot
            for p in range(gsz):
                t.ll_pull[h][p] = own_base + g.ll_off + (h * gsz + p) * g.ll_slot
            if g.seg:
                for s in range(gsz):  # the owner of segment s keeps, per source, a slot and a flag array
                    if not g.ag_only:
                        t.rs_push[h][s] = base_of[s] + g.rs_off + (h * gsz + me) * g.seg
                        t.rs_flag_push[h][s] = base_of[s] + g.rs_flag_off + (h * gsz + me) * flag
                        t.rs_pull[h][s] = own_base + g.rs_off + (h * gsz + s) * g.seg
                        t.rs_flag_pull[h][s] = own_base + g.rs_flag_off + (h * gsz + s) * flag
                    t.ag_pull[h][s] = own_base + g.ag_off + (h * gsz + s) * g.seg
                    t.ag_flag_pull[h][s] = own_base + g.ag_flag_off + (h * gsz + s) * flag
                for j, p in enumerate(peers):
                    t.ag_push[h][j] = base_of[p] + g.ag_off + (h * gsz + me) * g.seg
                    t.ag_flag_push[h][j] = base_of[p] + g.ag_flag_off + (h * gsz + me) * flag
            if g.pull_slot:
                pf = PULL_FLAG_BYTES
                for s in range(gsz):
                    t.pull_buf[h][s] = base_of[s] + g.pull_off + h * g.pull_slot
                    t.pull_red[h][s] = base_of[s] + g.pull_red_off + h * g.pull_seg
                    t.pull_flag_pull[h][s] = own_base + g.pull_flag_off + (h * gsz + s) * pf
                for p in peers:  # by group rank: the kernel skips its own
                    t.pull_flag_push[h][p] = base_of[p] + g.pull_flag_off + (h * gsz + me) * pf
    return t
