"""Workspace bookkeeping without a GPU: regions never overlap, tables point where the peers write."""
import ctypes

import pytest

from fastcomm import abi
from fastcomm import layout as L
from fastcomm.abi import MAX_BLOCKS
from fastcomm.policy import pull_launch

MB = 1 << 20


def _regions(g):
    return [(g.ll_off, g.lp_off), (g.lp_off, g.rs_off), (g.rs_off, g.ag_off), (g.ag_off, g.rs_flag_off), (g.rs_flag_off, g.ag_flag_off),
            (g.ag_flag_off, g.end)]


@pytest.mark.parametrize("transport", ["p2p", "host"])
@pytest.mark.parametrize("world", [2, 3, 8])
def test_regions_are_disjoint_aligned_and_inside(transport, world):
    lay = L.plan_layout(transport, world, 8 * MB, 1 * MB, None)
    spans = [r for g in lay.groups for r in _regions(g)]
    spans.sort()
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        assert a1 <= b0
    assert all(a % 16 == 0 for a, _ in spans)
    assert lay.groups[-1].end <= lay.shared_bytes
    assert lay.local_bytes >= lay.table_off + abi.TABLE_BYTES * len(lay.groups)


def test_table_struct_matches_the_kernel_header():
    assert ctypes.sizeof(abi.FcTable) == abi.TABLE_BYTES
    from fastcomm.runtime.jit import source_dir

    assert f"sizeof(FcTable) == {abi.TABLE_BYTES}" in (source_dir() / "comm" / "common.cuh").read_text()


def _bases(world):
    return [(r + 1) << 40 for r in range(world)]


def _p2p_table(lay, g, r, bases):
    """Rank r's table of group g over P2P, every rank's memory at ``bases`` (no state, error or host memory)."""
    return L.build_table(lay, g, r, own_base=bases[r], peer_bases=bases, host_base=None, state_ptr=0, err_ptr=0,
                         timeout_ns=1)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_p2p_tables_agree_between_writer_and_reader(world):
    """Where rank a pushes for rank b must be where rank b pulls from rank a, for every pair and half."""
    lay = L.plan_layout("p2p", world, 8 * MB, 1 * MB)
    g = lay.groups[0]
    bases = _bases(world)
    t = [_p2p_table(lay, g, r, bases) for r in range(world)]
    for a in range(world):
        peers = [p for p in range(world) if p != a]
        assert t[a].n_ll_push == world - 1
        for h in range(2):
            for j, b in enumerate(peers):
                assert t[a].ll_push[h][j] == t[b].ll_pull[h][a]
                assert t[a].ag_push[h][j] == t[b].ag_pull[h][a]
                assert t[a].ag_flag_push[h][j] == t[b].ag_flag_pull[h][a]
                assert t[a].rs_push[h][b] == t[b].rs_pull[h][a]
                assert t[a].rs_flag_push[h][b] == t[b].rs_flag_pull[h][a]
            assert t[a].ll_push[0][0] != t[a].ll_push[1][0]  # two halves


@pytest.mark.parametrize("world", [2, 5, 8])
def test_host_tables_agree_and_slots_do_not_collide(world):
    lay = L.plan_layout("host", world, 2 * MB, 256 << 10)
    g = lay.groups[0]
    t = [L.build_table(lay, g, r, own_base=0, peer_bases=None, host_base=1 << 44, state_ptr=0, err_ptr=0,
                       timeout_ns=1) for r in range(world)]
    writes = set()
    for a in range(world):
        assert t[a].n_ll_push == 1 and t[a].n_ag_push == 1
        for b in range(world):
            if a == b:
                continue
            for h in range(2):
                assert t[a].ll_push[h][0] == t[b].ll_pull[h][a]
                assert t[a].rs_push[h][b] == t[b].rs_pull[h][a]
                assert t[a].rs_flag_push[h][b] == t[b].rs_flag_pull[h][a]
                assert t[a].ag_push[h][0] == t[b].ag_pull[h][a]
                writes.add((h, t[a].rs_push[h][b]))
    assert len(writes) == 2 * world * (world - 1)


def test_islands_add_groups_with_their_own_tables():
    lay = L.plan_layout("p2p", 4, 8 * MB, 1 * MB, ((0, 1), (2, 3)))
    ids = [(g.group_id, g.members) for g in lay.groups]
    assert ids == [(abi.FLAT, (0, 1, 2, 3)), (abi.ISLAND, (0, 1)), (abi.ISLAND, (2, 3)), (abi.PARTNER, (0, 2)),
                   (abi.PARTNER, (1, 3))]
    mine = L.groups_of(lay, 3)
    assert [g.group_id for g in mine] == [abi.FLAT, abi.ISLAND, abi.PARTNER]
    bases = _bases(4)
    t = _p2p_table(lay, mine[2], 3, bases)
    assert (t.rank, t.world, list(t.global_of)[:2]) == (1, 2, [1, 3])
    assert t.n_ll_push == 1 and t.ll_push[0][0] // (1 << 40) == 2  # rank 1's buffer (base index 2)


def test_flag_arrays_hold_every_block():
    lay = L.plan_layout("p2p", 2, 8 * MB, 1 * MB)
    g = lay.groups[0]
    assert g.ag_flag_off - g.rs_flag_off == 2 * 2 * MAX_BLOCKS * 4


def test_p2p_check_pattern_mirrors_the_kernel():
    # The host recomputes what csrc/comm/p2p_check.cuh writes; both use the same constant and word order.
    from fastcomm import handshake
    from fastcomm.runtime.jit import source_dir

    src = " ".join((source_dir() / "comm" / "p2p_check.cuh").read_text().split())
    assert f"0x{handshake._GOLDEN:X}ull" in src and '"r"((u32)v), "r"((u32)(v >> 32)), "r"(~(u32)v)' in src
    a, b = handshake._check_pattern(7, 0, 1), handshake._check_pattern(7, 1, 0)
    assert a != b  # a write that lands in the wrong slot cannot pass as the right one
    data = handshake.expected_check_bytes(a)
    assert len(data) == handshake.CHECK_STORES * 16 and data != handshake.expected_check_bytes(b)


@pytest.mark.parametrize("world", [2, 5, 8])
def test_one_shot_p2p_slots_agree_and_rotate(world):
    """Rank a's buffer-b slot in rank c is where c reads a's data in buffer b; buffers and slots never overlap."""
    lay = L.plan_layout("p2p", world, 8 * MB, 1 * MB)
    g = lay.groups[0]
    bases = _bases(world)
    t = [_p2p_table(lay, g, r, bases) for r in range(world)]
    slots = set()
    for a in range(world):
        assert t[a].host == 0 and t[a].n_lp_push == world - 1
        peers = [p for p in range(world) if p != a]
        for b in range(abi.LP_BUFFERS):
            for j, c in enumerate(peers):
                assert t[a].lp_push[b][j] == t[c].lp_pull[b][a]
                slots.add(t[a].lp_push[b][j])
            for s_ in range(world):  # every slot lies inside the receiver's sentinel region
                p = t[a].lp_pull[b][s_] - bases[a]
                assert any(off <= p and p + g.lp_slot <= off + n for off, n in lay.sentinel_regions)
    assert len(slots) == abi.LP_BUFFERS * world * (world - 1)
    assert g.lp_slot == 1 * MB  # payload only: no flag bytes in the one-shot's slots


@pytest.mark.parametrize("world", [2, 8])
def test_one_shot_host_slots_one_writer_each(world):
    lay = L.plan_layout("host", world, 2 * MB, 256 << 10)
    g = lay.groups[0]
    host = 1 << 44
    t = [L.build_table(lay, g, r, own_base=0, peer_bases=None, host_base=host, state_ptr=0, err_ptr=0,
                       timeout_ns=1) for r in range(world)]
    for a in range(world):
        assert t[a].host == 1 and t[a].n_lp_push == 1
        for b in range(abi.LP_BUFFERS):
            assert t[a].lp_pull[b][a] == t[a].lp_push[b][0]  # the writer clears its own slot
            for c in range(world):
                assert t[c].lp_pull[b][a] == t[a].lp_push[b][0]
    own = {t[a].lp_push[b][0] for a in range(world) for b in range(abi.LP_BUFFERS)}
    assert len(own) == abi.LP_BUFFERS * world
    assert lay.sentinel_regions == ((g.lp_off, abi.LP_BUFFERS * world * g.lp_slot),)
    assert all(host + g.lp_off <= p < host + g.lp_off + abi.LP_BUFFERS * world * g.lp_slot for p in own)


def test_sentinel_regions_cover_exactly_the_one_shot_slots_of_every_group():
    lay = L.plan_layout("p2p", 8, 8 * MB, 64 << 10, ((0, 1, 2, 3), (4, 5, 6, 7)))
    assert len(lay.sentinel_regions) == len(lay.groups)
    for (off, n), g in zip(lay.sentinel_regions, lay.groups):
        assert (off, n) == (g.lp_off, g.rs_off - g.lp_off) and off % 16 == 0 and off + n <= lay.shared_bytes


def test_the_watcher_reports_once_and_stops_before_release():
    # Workspace.watch's loop on a plain record: one callback when the record says timeout, and it returns as
    # soon as the stop event (set by release, before the pinned record is freed) is set.
    import threading

    from fastcomm.workspace import watch_record

    rec, stop, got = abi.ErrorRecord(), threading.Event(), []
    t = threading.Thread(target=watch_record, args=(rec, 3.0, stop, got.append, 0.01), daemon=True)
    t.start()
    rec.rank, rec.peer, rec.step, rec.code = 2, 5, abi.STEP_ONE_SHOT, 1
    t.join(5)
    assert not t.is_alive() and len(got) == 1 and "rank 2 timed out" in got[0] and "peer rank 5" in got[0]
    idle = threading.Thread(target=watch_record, args=(abi.ErrorRecord(), 3.0, stop, got.append, 10.0), daemon=True)
    idle.start()
    idle.join(0.2)
    assert idle.is_alive()  # nothing recorded: still watching
    stop.set()  # what release does first
    idle.join(2)
    assert not idle.is_alive() and len(got) == 1  # woke at once on stop, reported nothing


# ---- the pull's regions (P2P, flat group) -------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 3, 8])
def test_pull_regions_are_disjoint_aligned_and_hold_the_largest_message(world):
    lay = L.plan_layout("p2p", world, 8 * MB + 6, 1 * MB, None)
    g = lay.groups[0]
    spans = [(g.ll_off, g.lp_off), (g.lp_off, g.rs_off), (g.rs_off, g.ag_off), (g.ag_off, g.rs_flag_off),
             (g.rs_flag_off, g.ag_flag_off), (g.ag_flag_off, g.pull_off),
             (g.pull_off, g.pull_red_off), (g.pull_red_off, g.pull_flag_off), (g.pull_flag_off, g.end)]
    assert all(a <= b for a, b in spans) and all(a1 <= b0 for (_, a1), (b0, _) in zip(spans, spans[1:]))
    assert all(a % 16 == 0 for a, _ in spans) and g.end <= lay.shared_bytes
    assert g.pull_red_off - g.pull_off == 2 * g.pull_slot and g.pull_slot >= 8 * MB + 6
    assert g.pull_flag_off - g.pull_red_off == 2 * g.pull_seg
    assert g.end - g.pull_flag_off == 2 * world * abi.PULL_FLAG_BYTES
    lc = pull_launch(8 * MB + 6, world, 128)
    assert lc.seg * abi.VEC_BYTES <= g.pull_seg


@pytest.mark.parametrize("world", [2, 4, 8])
def test_pull_tables_point_at_each_ranks_own_copy_and_flags(world):
    lay = L.plan_layout("p2p", world, 8 * MB, 1 * MB)
    g = lay.groups[0]
    bases = _bases(world)
    t = [_p2p_table(lay, g, r, bases) for r in range(world)]
    for a in range(world):
        for h in range(2):
            for s in range(world):
                # Every rank reads rank s's copy where rank s wrote it: in rank s's own buffer.
                assert t[a].pull_buf[h][s] == t[s].pull_buf[h][s] and t[s].pull_buf[h][s] // (1 << 40) == s + 1
                assert t[a].pull_red[h][s] == t[s].pull_red[h][s] and t[s].pull_red[h][s] // (1 << 40) == s + 1
                assert t[a].pull_flag_pull[h][s] // (1 << 40) == a + 1  # flags land in the reader's memory
                if s != a:
                    assert t[a].pull_flag_push[h][s] == t[s].pull_flag_pull[h][a]
            assert t[a].pull_flag_push[h][a] == 0  # never written: the kernel skips its own rank
        assert t[a].pull_buf[0][a] != t[a].pull_buf[1][a] and t[a].pull_flag_pull[0][0] != t[a].pull_flag_pull[1][0]
    flags = {t[a].pull_flag_pull[h][s] for a in range(world) for h in range(2) for s in range(world)}
    assert len(flags) == 2 * world * world  # one array per (reader, half, source)


def test_pull_has_no_regions_on_the_host_transport_or_in_island_groups():
    host = L.plan_layout("host", 4, 8 * MB, 1 * MB)
    assert all(g.pull_slot == 0 and g.pull_seg == 0 and g.end == g.pull_flag_off for g in host.groups)
    t = L.build_table(host, host.groups[0], 1, own_base=0, peer_bases=None, host_base=1 << 44, state_ptr=0,
                      err_ptr=0, timeout_ns=1)
    assert all(t.pull_buf[h][s] == 0 and t.pull_flag_push[h][s] == 0 for h in range(2) for s in range(4))
    isl = L.plan_layout("p2p", 4, 8 * MB, 1 * MB, ((0, 1), (2, 3)))
    assert isl.groups[0].pull_slot and all(g.pull_slot == 0 for g in isl.groups[1:])


# The island two-shot (two_shot_islands.cuh): island groups carry two-shot slots of an island cut, partner
# groups ag slots of it only.
ISLAND_SHAPES = [(4, ((0, 1), (2, 3))), (6, ((0, 1, 2), (3, 4, 5))), (6, ((0, 1), (2, 3), (4, 5))),
                 (8, ((0, 1, 2, 3), (4, 5, 6, 7))), (8, ((0, 1), (2, 3), (4, 5), (6, 7))), (4, ((0, 2), (1, 3)))]


@pytest.mark.parametrize("world,islands", ISLAND_SHAPES)
@pytest.mark.parametrize("transport", ["p2p", "host"])
def test_island_two_shot_regions_are_disjoint_and_hold_every_cut(world, islands, transport):
    from fastcomm.policy import two_shot_launch

    max_bytes = 8 * MB + 6  # not a multiple of the island size or of 16
    lay = L.plan_layout(transport, world, max_bytes, 1 * MB, islands)
    spans = sorted(r for g in lay.groups for r in _regions(g) if r[1] > r[0])
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        assert a1 <= b0
    assert lay.groups[-1].end <= lay.shared_bytes
    size = len(islands[0])
    for g in lay.groups[1:]:
        assert g.seg > 0 and g.ag_only == (g.group_id == abi.PARTNER)
        if g.ag_only:  # no rs slots or flags placed
            assert g.rs_off == g.ag_off and g.rs_flag_off == g.ag_flag_off
        # Every segment the launch cuts for a message the workspace takes fits a slot, for every dtype.
        for es in (2, 4):
            for numel in (max_bytes // es, max_bytes // es - 1, 1, 17):
                lc = two_shot_launch(numel, es, size, MAX_BLOCKS)
                assert lc.seg * es <= g.seg and lc.grid <= MAX_BLOCKS


@pytest.mark.parametrize("world,islands", ISLAND_SHAPES)
def test_island_two_shot_tables_agree_between_writer_and_reader(world, islands):
    """Island groups: rs and ag slots pair up as in the flat group. Partner groups: my ag slot in partner q is
    where q reads my partial, and no rs pointer is set (the kernel must not use one)."""
    lay = L.plan_layout("p2p", world, 8 * MB, 1 * MB, islands)
    bases = _bases(world)
    for g in lay.groups[1:]:
        n = len(g.members)
        t = {r: _p2p_table(lay, g, r, bases) for r in g.members}
        tabs = [t[r] for r in g.members]
        written = set()
        for a in range(n):
            peers = [p for p in range(n) if p != a]
            assert tabs[a].n_ag_push == n - 1
            for h in range(2):
                for j, b in enumerate(peers):
                    assert tabs[a].ag_push[h][j] == tabs[b].ag_pull[h][a]
                    assert tabs[a].ag_flag_push[h][j] == tabs[b].ag_flag_pull[h][a]
                    assert tabs[a].ag_push[h][j] // (1 << 40) == g.members[b] + 1  # in the reader's buffer
                    written.add(tabs[a].ag_push[h][j])
                    if g.ag_only:
                        assert tabs[a].rs_push[h][b] == 0 and tabs[a].rs_flag_pull[h][b] == 0
                    else:
                        assert tabs[a].rs_push[h][b] == tabs[b].rs_pull[h][a]
                        assert tabs[a].rs_flag_push[h][b] == tabs[b].rs_flag_pull[h][a]
                        written.add(tabs[a].rs_push[h][b])
        # Distinct slots per (writer, reader, half, phase).
        assert len(written) == 2 * n * (n - 1) * (1 if g.ag_only else 2)


def test_islands_of_one_rank_get_no_two_shot_slots():
    lay = L.plan_layout("p2p", 2, 8 * MB, 1 * MB, ((0,), (1,)))
    assert all(g.seg == 0 for g in lay.groups[1:])
