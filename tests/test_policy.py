import re

import pytest

from fastcomm import abi
from fastcomm import policy as P
from fastcomm.policy import Algo, Rule, Transport
from fastcomm.policy import LinkType

KB, MB = 1 << 10, 1 << 20


def test_packet_arithmetic():
    assert P.packets_for(0) == 0
    assert P.packets_for(1) == 1 and P.packets_for(8) == 1 and P.packets_for(9) == 2
    assert P.ll_bytes(12 * KB) == 2 * 12 * KB  # flag-in-data doubles the bytes on the wire
    assert abi.PACKET_BYTES == 2 * abi.PACKET_PAYLOAD


def test_constants_mirror_the_kernel_header():
    from fastcomm.runtime.jit import source_dir

    text = (source_dir() / "comm" / "common.cuh").read_text()
    for name, value in (("FC_MAX_WORLD", abi.MAX_WORLD), ("FC_MAX_BLOCKS", abi.MAX_BLOCKS),
                        ("FC_PACKET_BYTES", abi.PACKET_BYTES), ("FC_PACKET_PAYLOAD", abi.PACKET_PAYLOAD)):
        assert f"#define {name} {value}\n" in text, name
    kernels = (source_dir() / "comm" / "kernels.cu").read_text()
    compiled = sorted(int(k) for k in re.findall(r"FC_DEFINE_FUSED\(NAME, D, (\d+)\)", kernels))
    assert tuple(compiled) == abi.FUSED_VARIANTS


RULES = (Rule(256 * KB, Algo.ONE_SHOT), Rule(64 * MB, Algo.TWO_SHOT))


@pytest.mark.parametrize("nbytes,want", [(1, Algo.ONE_SHOT), (12 * KB, Algo.ONE_SHOT), (256 * KB, Algo.ONE_SHOT),
                                         (256 * KB + 2, Algo.TWO_SHOT), (8 * MB, Algo.TWO_SHOT),
                                         (8 * MB + 2, Algo.NCCL)])
def test_choose_by_size(nbytes, want):
    assert P.choose_algo(nbytes, RULES, one_shot_max_bytes=1 * MB, max_bytes=8 * MB) is want


def test_one_shot_capped_by_its_buffer():
    assert P.choose_algo(200 * KB, RULES, one_shot_max_bytes=128 * KB, max_bytes=8 * MB) is Algo.TWO_SHOT
    assert P.choose_algo(200 * KB, RULES, one_shot_max_bytes=128 * KB, max_bytes=8 * MB, forced="one_shot") is Algo.NCCL


def test_forced_algorithm_and_past_the_table():
    assert P.choose_algo(4, RULES, one_shot_max_bytes=MB, max_bytes=128 * MB, forced="two_shot") is Algo.TWO_SHOT
    assert P.choose_algo(100 * MB, RULES, one_shot_max_bytes=MB, max_bytes=128 * MB) is Algo.NCCL


def test_lookup_prefers_specific_rows_and_falls_back_to_unknown():
    table = {P.PolicyKey(Transport.P2P, LinkType.NVLINK, 4): (Rule(1, Algo.TWO_SHOT),),
             P.PolicyKey(Transport.P2P, LinkType.NVLINK, 0): (Rule(2, Algo.ONE_SHOT),),
             P.PolicyKey(Transport.P2P, LinkType.UNKNOWN, 0): (Rule(3, Algo.ONE_SHOT),)}
    assert P.lookup_rules(table, Transport.P2P, LinkType.NVLINK, 4)[0].max_bytes == 1
    assert P.lookup_rules(table, Transport.P2P, LinkType.NVLINK, 8)[0].max_bytes == 2
    assert P.lookup_rules(table, Transport.P2P, LinkType.CROSS_SOCKET, 8)[0].max_bytes == 3
    assert P.lookup_rules(table, Transport.HOST, LinkType.NVLINK, 8) == ()


def test_default_table_covers_every_transport_and_is_sorted():
    for link in LinkType:
        for t in Transport:
            rules = P.lookup_rules(P.DEFAULT_TABLE, t, link, 8)
            assert rules, (t, link)
            assert [r.max_bytes for r in rules] == sorted(r.max_bytes for r in rules)


def test_nvlink_defaults_follow_the_measured_switch_point():
    # Two H200s: the one-shot is faster through 768 KB (a 64-token decode step); above it the pull (modelled
    # from vLLM's one-stage pull, in place of the two-shot).
    two = P.lookup_rules(P.DEFAULT_TABLE, Transport.P2P, LinkType.NVLINK, 2)
    pick = lambda n, rules: P.choose_algo(n, rules, one_shot_max_bytes=MB, max_bytes=8 * MB)  # noqa: E731
    assert pick(768 * KB, two) is Algo.ONE_SHOT and pick(MB, two) is Algo.PULL
    # More ranks multiply the one-shot's bytes per GPU: the plan scales its range (7 copies at 8 ranks).
    eight = _plan(world=8).rules
    assert pick(108 * KB, eight) is Algo.ONE_SHOT and pick(112 * KB, eight) is Algo.PULL


def _plan(world, transport_ok=True, link=LinkType.NVLINK, **cfg):
    from fastcomm.config import Config

    facts = P.Facts(world_size=world, all_p2p=transport_ok, link=link)
    return P.make_plan(facts, Config(**cfg))


def test_one_shot_range_follows_bytes_per_gpu():
    # The host one-shot was measured to 512 KiB at 2 ranks; at 8 each GPU would read 7 copies from host
    # memory, so the range is cut to 512 / 7 (rounded down to 4 KiB); the fused op follows the one-shot.
    two, eight = _plan(2, False), _plan(8, False)
    assert two.algo_for(512 * KB) is Algo.ONE_SHOT and two.fused_max_bytes == 512 * KB
    assert eight.algo_for(72 * KB) is Algo.ONE_SHOT and eight.algo_for(76 * KB) is Algo.TWO_SHOT
    assert eight.fused_max_bytes == 72 * KB and "fused all-reduce + RMSNorm <= 72 KiB" in eight.describe()
    assert "8 ranks" in eight.describe() and "scaled to 7 copies" in eight.describe()
    # Islands: each GPU sends to its 3 island peers and one partner: 4 copies.
    isl = _plan(8, True, LinkType.CROSS_SOCKET, islands=((0, 1, 2, 3), (4, 5, 6, 7)))
    assert isl.algo_for(16 * KB) is Algo.ONE_SHOT and isl.algo_for(20 * KB) is not Algo.ONE_SHOT
    # Rows written for an exact world size are used as they are.
    pcie8 = _plan(8, True, LinkType.PCIE_SWITCH)
    assert pcie8.rules == P.DEFAULT_TABLE[P.PolicyKey(Transport.P2P, LinkType.PCIE_SWITCH, 8)]


def _check(**kw):
    args = dict(is_cuda=True, device_index=0, ws_device_index=0, dtype="bfloat16", contiguous=True,
                data_ptr=4096, nbytes=1024, max_bytes=MB)
    args.update(kw)
    return P.check_tensor(**args)


def test_check_tensor_reasons():
    assert _check() is None
    assert "CUDA" in _check(is_cuda=False)
    assert "cuda:1" in _check(device_index=1)
    assert "int32" in _check(dtype="int32")
    assert "contiguous" in _check(contiguous=False)
    assert "aligned" in _check(data_ptr=4098)
    assert "exceeds" in _check(nbytes=MB + 1)


def test_check_fused_limits():
    from fastcomm.policy.checks import FusedWhy

    assert P.check_fused(tokens=64, hidden=6144, elem_size=2, one_shot_max_bytes=MB) is None
    why = P.check_fused(tokens=128, hidden=6144, elem_size=2, one_shot_max_bytes=MB)
    assert why.code is FusedWhy.ABOVE_LIMIT and "above the fused op's limit" in why.message
    assert P.check_fused(tokens=1, hidden=16384, elem_size=4, one_shot_max_bytes=MB) is None
    why = P.check_fused(tokens=1, hidden=16385, elem_size=4, one_shot_max_bytes=MB)
    assert why.code is FusedWhy.ROW_TOO_LONG and "exceeds" in why.message and str(why) == why.message
    assert P.check_fused(tokens=0, hidden=6144, elem_size=2, one_shot_max_bytes=MB).code is FusedWhy.EMPTY
    assert P.check_fused(tokens=1, hidden=7, elem_size=2, one_shot_max_bytes=MB) is None  # odd hidden: row tail


@pytest.mark.parametrize("numel,elem,world", [(1, 2, 2), (6144, 2, 2), (100003, 2, 8), (8 << 20, 4, 3), (5, 4, 8)])
def test_two_shot_launch_covers_everything_aligned(numel, elem, world):
    lc = P.two_shot_launch(numel, elem, world, 128)
    assert 1 <= lc.grid <= abi.MAX_BLOCKS
    assert (lc.seg * elem) % 16 == 0 and (lc.chunk * elem) % 16 == 0
    assert lc.seg * world >= numel and lc.chunk * lc.grid >= lc.seg


def test_one_shot_and_fused_launch_shapes():
    lc = P.one_shot_launch(12 * KB, 128)
    assert lc.grid * lc.block >= P.vectors_for(12 * KB) and lc.block % 32 == 0
    # every block has a vector of its own (the host transport's clear relies on it, one_shot.cuh)
    for n in (1, 16, 17, 4096 + 16, 12 * KB, 1 << 20):
        lc = P.one_shot_launch(n, 128)
        assert (lc.grid - 1) * lc.block < P.vectors_for(n)
    assert P.one_shot_launch(1, 128).grid == 1
    f = P.fused_launch(64, 6144, 2, 32)
    assert f.grid == 32 and f.block * f.k >= 6144 * 2 // 16 and f.grid % f.splits == 0
    assert P.fused_launch(1, 6144, 2, 32, split_rows=False).splits == 1


@pytest.mark.parametrize("hidden,elem", [(1, 2), (7, 2), (6144, 2), (32767, 2), (32768, 2), (16384, 4), (4097, 4)])
def test_fused_launch_covers_every_row_vector(hidden, elem):
    """Each block reads the whole row: K x block must reach every vector of the worst-aligned row."""
    from fastcomm.policy.launch import fused_row_vectors

    if P.check_fused(tokens=1, hidden=hidden, elem_size=elem, one_shot_max_bytes=1 << 30):
        pytest.skip("not a fused input")
    row = hidden * elem
    worst = max(-(-((r + 1) * row) // 16) - (r * row) // 16 for r in range(16))
    assert fused_row_vectors(hidden, elem) >= worst
    for tokens in (1, 3, 64):
        f = P.fused_launch(tokens, hidden, elem, 128)
        assert f.k * f.block >= worst and f.block <= abi.FUSED_THREADS and f.k in abi.FUSED_VARIANTS
        assert f.grid % f.splits == 0 and f.grid <= 128


def test_islands_validation():
    assert P.validate_islands([[1, 0], [3, 2]], 4) == ((0, 1), (2, 3))
    with pytest.raises(ValueError):
        P.validate_islands([[0, 1], [2]], 3)
    with pytest.raises(ValueError):
        P.validate_islands([[0, 1], [1, 2]], 3)


def test_lookup_by_dtype():
    table = {P.PolicyKey(Transport.P2P, LinkType.NVLINK, 0, "float32"): (Rule(5, Algo.ONE_SHOT),),
             P.PolicyKey(Transport.P2P, LinkType.NVLINK, 0): (Rule(6, Algo.ONE_SHOT),)}
    assert P.lookup_rules(table, Transport.P2P, LinkType.NVLINK, 2, "float32")[0].max_bytes == 5
    assert P.lookup_rules(table, Transport.P2P, LinkType.NVLINK, 2, "bfloat16")[0].max_bytes == 6
    assert P.lookup_rules(table, Transport.P2P, LinkType.NVLINK, 2)[0].max_bytes == 6


def test_one_shot_block_fits_the_kernels_launch_bounds():
    from fastcomm.runtime.jit import source_dir

    text = (source_dir() / "comm" / "kernels.cu").read_text()
    bound = int(text.split(") fc_one_shot_")[0].rsplit("__launch_bounds__(", 1)[1])
    assert abi.ONE_SHOT_THREADS <= bound
    assert P.one_shot_launch(64 << 20, 128).block <= abi.ONE_SHOT_THREADS


def test_two_shot_blocks_fit_the_kernels_launch_bounds():
    from fastcomm.runtime.jit import source_dir

    text = (source_dir() / "comm" / "kernels.cu").read_text()
    bound = lambda name: int(text.split(f") {name}_##NAME")[0].rsplit("__launch_bounds__(", 1)[1])  # noqa: E731
    assert P.two_shot_launch(8 << 20, 2, 2, 128).block <= bound("fc_two_shot")
    for n in (1, 12 * KB, 4 << 20):
        assert P.two_shot_ll_launch(n, 2, 128).block <= bound("fc_two_shot_ll")


@pytest.mark.parametrize("nbytes,world", [(1, 2), (2, 8), (17, 3), (12 * KB, 8), (12 * KB + 2, 7), (1 << 20, 5)])
def test_two_shot_ll_launch_gives_every_vector_of_a_segment_a_thread(nbytes, world):
    lc = P.two_shot_ll_launch(nbytes, world, 128)
    assert lc.seg * world * 16 >= nbytes and (lc.seg - 1) * world * 16 < nbytes  # padded to whole segments
    assert lc.grid * lc.block >= lc.seg and lc.block % 32 == 0 and lc.grid <= 128
    assert (lc.grid - 1) * lc.block < lc.seg  # every block has a vector (the host clear's fast path)


def test_two_shot_ll_capped_by_the_one_shot_slots():
    rules = (Rule(32 * KB, Algo.ONE_SHOT), Rule(64 * MB, Algo.TWO_SHOT_LL))
    pick = lambda n, **kw: P.choose_algo(n, rules, one_shot_max_bytes=MB, max_bytes=8 * MB,  # noqa: E731
                                         two_shot_ll_max_bytes=4 * MB, **kw)
    assert pick(32 * KB) is Algo.ONE_SHOT and pick(32 * KB + 2) is Algo.TWO_SHOT_LL
    assert pick(4 * MB) is Algo.TWO_SHOT_LL and pick(4 * MB + 2) is Algo.TWO_SHOT  # past its slots
    assert pick(4 * MB + 2, forced="two_shot_ll") is Algo.NCCL and pick(2, forced="two_shot_ll") is Algo.TWO_SHOT_LL
    ranges = P.size_ranges(rules, one_shot_max_bytes=MB, max_bytes=8 * MB, two_shot_ll_max_bytes=4 * MB)
    assert [(r.min_bytes, r.max_bytes, r.algo) for r in ranges] == [
        (1, 32 * KB, Algo.ONE_SHOT), (32 * KB + 1, 4 * MB, Algo.TWO_SHOT_LL), (4 * MB + 1, 8 * MB, Algo.TWO_SHOT),
        (8 * MB + 1, None, Algo.NCCL)]


@pytest.mark.parametrize("world,host", [(2, False), (3, False), (8, False), (2, True), (5, True), (8, True)])
def test_two_shot_ll_limit_is_what_the_layout_slot_holds(world, host):
    from fastcomm import layout as L

    lay = L.plan_layout("host" if host else "p2p", world, 8 * MB, 100 * KB + 3)
    slot = lay.groups[0].lp_slot
    cap = P.two_shot_ll_max_bytes(slot, world, host)
    assert P.two_shot_ll_slot_bytes(cap, world, host) <= slot < P.two_shot_ll_slot_bytes(cap + 1, world, host)
    plan = _plan(world, not host, LinkType.PCIE_SWITCH, one_shot_max_bytes=100 * KB + 3)
    assert plan.two_shot_ll_max_bytes == cap
    assert plan.algo_for(cap, "two_shot_ll") is Algo.TWO_SHOT_LL and plan.algo_for(cap + 1, "two_shot_ll") is Algo.NCCL


def test_default_policy_picks_the_lamport_two_shot_only_where_modelled():
    # PCIe at 4 and 8 ranks: one-shot to its bound, then the Lamport two-shot as far as the one-shot's slots
    # hold it (1 MiB slots: 4 MiB at 8 ranks, 2 MiB at 4), then the flagged two-shot.
    eight = _plan(8, True, LinkType.PCIE_SWITCH)
    assert [eight.algo_for(n) for n in (12 * KB, 32 * KB, 32 * KB + 2, 64 * KB, 4 * MB, 4 * MB + 2)] == [
        Algo.ONE_SHOT, Algo.ONE_SHOT, Algo.TWO_SHOT_LL, Algo.TWO_SHOT_LL, Algo.TWO_SHOT_LL, Algo.TWO_SHOT]
    assert "two_shot_ll" in eight.describe()
    four = _plan(4, True, LinkType.PCIE_SWITCH)
    assert four.algo_for(64 * KB + 2) is Algo.TWO_SHOT_LL and four.algo_for(2 * MB + 2) is Algo.TWO_SHOT
    assert _plan(8, True, LinkType.HOST_BRIDGE).algo_for(64 * KB) is Algo.TWO_SHOT_LL
    # Nowhere else by default: 2 ranks, NVLink, the host transport, other world sizes on PCIe.
    for plan in (_plan(2, True, LinkType.PCIE_SWITCH), _plan(8), _plan(4), _plan(8, False), _plan(4, False),
                 _plan(6, True, LinkType.PCIE_SWITCH), _plan(8, True, LinkType.CROSS_SOCKET)):
        assert all(r.algo is not Algo.TWO_SHOT_LL for r in plan.ranges()), plan.describe()
    # Forced, it serves any size its slots hold, on any plan.
    assert _plan(2, algo="two_shot_ll").algo_for(12 * KB) is Algo.TWO_SHOT_LL
# ---- the pull (NVLink only by default) ---------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("link", list(LinkType))
@pytest.mark.parametrize("p2p", [True, False])
def test_pull_is_chosen_by_default_only_on_nvlink(world, link, p2p):
    plan = _plan(world, p2p, link)
    ranges = plan.ranges()
    served = [r.algo for r in ranges if r.algo is not Algo.NCCL]
    if p2p and link is LinkType.NVLINK:
        # Right after the one-shot's range, in place of the two-shot, up to the workspace's limit.
        assert served == [Algo.ONE_SHOT, Algo.PULL], ranges
        pull = next(r for r in ranges if r.algo is Algo.PULL)
        one = next(r for r in ranges if r.algo is Algo.ONE_SHOT)
        assert pull.min_bytes == one.max_bytes + 1 and pull.max_bytes == plan.max_bytes
        assert plan.algo_for(MB) is Algo.PULL and plan.algo_for(plan.max_bytes) is Algo.PULL
        assert "pull" in plan.describe()
    else:
        assert Algo.PULL not in served, ranges
        assert all(plan.algo_for(n) is not Algo.PULL for n in (4 * KB, 600 * KB, MB, plan.max_bytes))


def test_pull_takes_over_where_the_one_shot_buffer_ends():
    # A one-shot buffer smaller than the one-shot rule: the sizes in between go to the table's next algorithm.
    nv = _plan(2, one_shot_max_bytes=256 * KB)
    assert nv.algo_for(256 * KB) is Algo.ONE_SHOT and nv.algo_for(256 * KB + 16) is Algo.PULL
    pcie = _plan(2, link=LinkType.PCIE_SWITCH, one_shot_max_bytes=64 * KB)
    assert pcie.algo_for(64 * KB + 16) is Algo.TWO_SHOT


def test_forced_pull_needs_p2p():
    from fastcomm.errors import FastcommError

    forced = _plan(4, True, LinkType.PCIE_SWITCH, algo="pull")  # forcing works on any P2P link
    assert forced.algo_for(4) is Algo.PULL and forced.algo_for(8 * MB + 16) is Algo.NCCL
    with pytest.raises(FastcommError, match="FASTCOMM_ALGO=pull needs the P2P transport"):
        _plan(2, False, algo="pull")
    with pytest.raises(FastcommError, match="FASTCOMM_ALGO=pull"):
        _plan(2, True, transport="host", algo="pull")
    host = _plan(2, False)
    assert host.algo_for(MB, "pull") is Algo.NCCL  # per call: 'not served', never a host launch


def test_tuned_pull_rules_never_reach_the_host_transport():
    from fastcomm.config import Config

    tuned = (Rule(64 * KB, Algo.ONE_SHOT), Rule(4 * MB, Algo.PULL))
    facts = P.Facts(world_size=2, all_p2p=False, link=LinkType.NVLINK, tuned_rules=tuned, rules_source="tuned")
    host = P.make_plan(facts, Config())
    assert [r.algo for r in host.rules] == [Algo.ONE_SHOT, Algo.TWO_SHOT] and host.algo_for(MB) is Algo.TWO_SHOT
    p2p = P.make_plan(P.Facts(world_size=2, all_p2p=True, link=LinkType.NVLINK, tuned_rules=tuned,
                              rules_source="tuned"), Config())
    assert p2p.algo_for(MB) is Algo.PULL


def test_pull_stages_by_world_and_size():
    assert all(P.pull_stages(n, 2) == 1 for n in (1, MB, 64 * MB))  # equal reads at 2 ranks: one stage
    for world in range(3, 9):
        bound = P.launch.PULL_ONE_STAGE_MAX[world]
        assert P.pull_stages(bound, world) == 1 and P.pull_stages(bound + 16, world) == 2
    assert P.pull_stages(300 * KB, 4) == 1 and P.pull_stages(300 * KB, 8) == 2


@pytest.mark.parametrize("world", [2, 3, 4, 7, 8])
@pytest.mark.parametrize("nbytes", [2, 16, 4 * KB + 6, 300 * KB + 2, 512 * KB, MB - 2, 8 * MB])
@pytest.mark.parametrize("max_blocks", [1, 5, 128, 132])
def test_pull_launch_covers_every_vector_once(world, nbytes, max_blocks):
    from fastcomm import layout as L

    lc = P.pull_launch(nbytes, world, max_blocks)
    nvec = P.vectors_for(nbytes)
    assert 1 <= lc.grid <= min(max_blocks, abi.MAX_BLOCKS) and lc.block == abi.PULL_THREADS
    assert lc.stages == P.pull_stages(nbytes, world)
    if lc.stages == 1:  # block b: [b*chunk, (b+1)*chunk) of the message
        spans = [(b * lc.chunk, min((b + 1) * lc.chunk, nvec)) for b in range(lc.grid)]
        assert lc.seg == 0
    else:               # block b: [b*chunk, (b+1)*chunk) of every segment of seg vectors
        assert lc.seg * world >= nvec > lc.seg * (world - 1) - world
        spans = [(s * lc.seg + b * lc.chunk, min(s * lc.seg + min((b + 1) * lc.chunk, lc.seg), nvec))
                 for s in range(world) for b in range(lc.grid)]
        assert lc.seg * abi.VEC_BYTES <= L.pull_sizes(8 * MB, world)[1]  # fits the reduced-segment half
    covered = sorted(v for a, b in spans for v in range(a, b))
    assert covered == list(range(nvec))
    assert all(a < b for a, b in spans)  # no idle block (each one publishes and waits)


def test_pull_blocks_fit_the_kernels_launch_bounds():
    from fastcomm.runtime.jit import source_dir

    text = (source_dir() / "comm" / "kernels.cu").read_text()
    for sym in (") fc_pull_##NAME", "fc_pull2_##NAME"):
        bound = int(text.split(sym)[0].rsplit("__launch_bounds__(", 1)[1].split(")")[0])
        assert abi.PULL_THREADS == bound, sym


ISLANDS_2X4 = ((0, 1, 2, 3), (4, 5, 6, 7))


@pytest.mark.parametrize("link,world,islands", [(LinkType.CROSS_SOCKET, 8, ISLANDS_2X4),
                                                (LinkType.PCIE_SWITCH, 8, ISLANDS_2X4),
                                                (LinkType.PCIE_SWITCH, 4, ((0, 1), (2, 3))),
                                                (LinkType.UNKNOWN, 6, ((0, 1, 2), (3, 4, 5))),
                                                (LinkType.UNKNOWN, 6, ((0, 1), (2, 3), (4, 5)))])
def test_islands_take_the_island_two_shot_above_the_one_shot(link, world, islands, monkeypatch):
    """With the island two-shot on, every size the flat plan gives a two-shot (flagged or Lamport) goes to
    it; the one-shot's range and everything else stay as the flat plan has them."""
    monkeypatch.setattr(P.rules, "ISLAND_TWO_SHOT_BY_DEFAULT", True)
    isl = _plan(world, True, link, islands=islands)
    flat = _plan(world, True, link)
    sizes = sorted({1, 4 * KB, 12 * KB, 20 * KB, 64 * KB, 100 * KB, MB, 4 * MB, 8 * MB, 8 * MB + 2}
                   | {r.max_bytes + d for r in flat.rules for d in (0, 1)})
    island_copies = P.plan.one_shot_copies(world, islands)
    two_shots = {Algo.TWO_SHOT, Algo.TWO_SHOT_LL}
    seen = set()
    for n in sizes:
        a, f = isl.algo_for(n), flat.algo_for(n)
        if a is Algo.ONE_SHOT:
            assert n <= isl.one_shot_max_bytes
        elif a is Algo.TWO_SHOT_ISLANDS:
            assert f in two_shots or f is Algo.ONE_SHOT  # the island one-shot's range is the narrower one
        else:
            assert a is f and a not in two_shots, (n, a, f)
        seen.add(a)
    assert Algo.TWO_SHOT_ISLANDS in seen and Algo.TWO_SHOT not in seen and Algo.TWO_SHOT_LL not in seen
    assert island_copies < world - 1
    assert "two_shot_islands" in isl.describe() and "two_shot_islands" not in flat.describe()
    # Forcing the flat two-shot still gives it (the comparison the tests make).
    assert isl.algo_for(MB, "two_shot") is Algo.TWO_SHOT and isl.algo_for(MB, "two_shot_islands") is \
        Algo.TWO_SHOT_ISLANDS
    assert isl.algo_for(8 * MB + 2, "two_shot_islands") is Algo.NCCL  # past the workspace


def test_island_two_shot_needs_islands_of_two_ranks():
    from fastcomm.errors import FastcommError

    ones = _plan(2, True, LinkType.CROSS_SOCKET, islands=((0,), (1,)))
    assert ones.island_size == 1
    # Nothing to reduce inside an island of one: the flat two-shot stays, and forcing the island one is
    # "not served" per call, an error at build.
    assert ones.algo_for(4 * MB) is Algo.TWO_SHOT and ones.algo_for(MB, "two_shot_islands") is Algo.NCCL
    assert _plan(4, True, LinkType.PCIE_SWITCH).algo_for(MB, "two_shot_islands") is Algo.NCCL
    with pytest.raises(FastcommError, match="FASTCOMM_ALGO=two_shot_islands needs islands"):
        _plan(4, True, LinkType.PCIE_SWITCH, algo="two_shot_islands")
    forced = _plan(4, True, LinkType.PCIE_SWITCH, algo="two_shot_islands", islands=((0, 1), (2, 3)))
    assert forced.algo_for(4) is Algo.TWO_SHOT_ISLANDS and forced.algo_for(8 * MB) is Algo.TWO_SHOT_ISLANDS


def test_island_two_shot_is_off_by_default_where_the_model_has_it_slower():
    # bench/pcie_model.py has the flat Lamport two-shot ahead on two sockets to ~4 MB: "auto" keeps the flat
    # two-shots with islands (test_pcie_model checks the model still says so).
    isl = _plan(8, True, LinkType.CROSS_SOCKET, islands=ISLANDS_2X4)
    flat = _plan(8, True, LinkType.CROSS_SOCKET)
    for n in (20 * KB, 64 * KB, MB, 4 * MB):
        assert isl.algo_for(n) is not Algo.TWO_SHOT_ISLANDS
        assert isl.algo_for(n) is flat.algo_for(n) or isl.algo_for(n) is Algo.ONE_SHOT
    assert "two_shot_islands" not in isl.describe()
    assert isl.algo_for(MB, "two_shot_islands") is Algo.TWO_SHOT_ISLANDS  # forcing it runs it


def test_choose_algo_maps_only_with_islands_of_two(monkeypatch):
    monkeypatch.setattr(P.rules, "ISLAND_TWO_SHOT_BY_DEFAULT", True)
    rules = (Rule(64 * KB, Algo.ONE_SHOT), Rule(MB, Algo.TWO_SHOT_LL), Rule(8 * MB, Algo.TWO_SHOT))
    kw = dict(one_shot_max_bytes=64 * KB, max_bytes=8 * MB, two_shot_ll_max_bytes=MB)
    for size in (0, 1):
        assert [P.choose_algo(n, rules, island_size=size, **kw) for n in (KB, 512 * KB, 4 * MB)] == \
            [Algo.ONE_SHOT, Algo.TWO_SHOT_LL, Algo.TWO_SHOT]
    assert [P.choose_algo(n, rules, island_size=2, **kw) for n in (KB, 512 * KB, 4 * MB, 9 * MB)] == \
        [Algo.ONE_SHOT, Algo.TWO_SHOT_ISLANDS, Algo.TWO_SHOT_ISLANDS, Algo.NCCL]
    # Past the one-shot slots a one-shot rule falls to the two-shot: the island form, with islands.
    small = dict(kw, one_shot_max_bytes=16 * KB)
    assert P.choose_algo(32 * KB, rules, island_size=4, **small) is Algo.TWO_SHOT_ISLANDS
    ranges = P.size_ranges(rules, island_size=2, **kw)
    assert [r.algo for r in ranges] == [Algo.ONE_SHOT, Algo.TWO_SHOT_ISLANDS, Algo.NCCL]


def test_island_two_shot_block_fits_the_kernels_launch_bounds():
    from fastcomm.runtime.jit import source_dir

    text = (source_dir() / "comm" / "kernels.cu").read_text()
    bound = int(re.search(r"__launch_bounds__\((\d+)\)[\s\\]*fc_two_shot_islands_##NAME", text).group(1))
    for world in (2, 3, 4):
        assert P.two_shot_launch(8 << 20, 2, world, 128).block <= bound
