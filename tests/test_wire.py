"""Bytes on the wire per implementation (fastcomm.policy.wire), checked against the layout's own slots."""
import pytest

from fastcomm import layout as L
from fastcomm.policy import wire_bytes

KB = 1024


def test_one_shot_p2p_sends_the_payload_once_per_peer():
    b = wire_bytes("one_shot", 12 * KB, 8, "p2p")
    assert b == 7 * 12 * KB
    assert b <= 1.06 * 7 * 12 * KB  # the bound: within ~6 % of the payload


def test_one_shot_matches_what_the_kernel_stores():
    # The kernel writes whole 16-byte vectors into each peer's slot; the slot holds exactly that.
    lay = L.plan_layout("p2p", 4, 1 << 20, 64 * KB)
    assert wire_bytes("one_shot", 64 * KB, 4, "p2p") == 3 * lay.groups[0].lp_slot
    assert wire_bytes("one_shot", 17, 2, "p2p") == 32  # tail vector zero-padded
    assert wire_bytes("one_shot", 12 * KB, 8, "host") == 12 * KB  # one copy, into my host slot


def test_islands_cross_once():
    flat = wire_bytes("one_shot", 12 * KB, 8, "p2p")
    two = wire_bytes("one_shot", 12 * KB, 8, "p2p", islands=2)
    assert two == (3 + 1) * 12 * KB and two < flat
    with pytest.raises(ValueError):
        wire_bytes("one_shot", 12 * KB, 8, "p2p", islands=3)


def test_fused_sends_the_payload_and_two_shot_near_the_ring_bound():
    assert wire_bytes("fused", 12 * KB, 8, "p2p") == 7 * 12 * KB
    n = 1 << 20
    ts = wire_bytes("two_shot", n, 8, "p2p")
    ideal = 2 * 7 * n // 8
    assert ideal <= ts <= 1.01 * ideal  # segments + per-block flags
    assert wire_bytes("two_shot", n, 8, "host") < ts


def test_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="no wire model"):
        wire_bytes("nccl", 1, 2, "p2p")


@pytest.mark.parametrize("world", [2, 3, 8])
def test_two_shot_ll_sends_the_two_shot_payload_without_flags(world):
    from fastcomm.policy import two_shot_ll_slot_bytes

    n = 12 * KB
    ll = wire_bytes("two_shot_ll", n, world, "p2p")
    # P2P: each peer's slot for me receives exactly what the kernel records as written per slot.
    assert ll == (world - 1) * two_shot_ll_slot_bytes(n, world, host=False)
    # Host: every slot region but my own segment's copy, once.
    seg = two_shot_ll_slot_bytes(n, world, host=True) // (world + 1)
    assert wire_bytes("two_shot_ll", n, world, "host") == world * seg
    ts = wire_bytes("two_shot", n, world, "p2p")
    assert ll < ts and ll <= 1.01 * 2 * (world - 1) * n / world  # the flags are what it saves
    assert wire_bytes("two_shot_ll", 1, 8, "p2p") == 2 * 7 * 16  # one padded vector per segment
    with pytest.raises(ValueError, match="no island form"):
        wire_bytes("two_shot_ll", n, 8, "p2p", islands=2)
def test_pull_reads_the_payload_and_writes_only_flags():
    from fastcomm.policy import pull_launch, wire_split

    for n in (512 * KB, 1 << 20):
        grid = pull_launch(n, 2, 128).grid
        # Two ranks, one stage: each GPU reads its peer's whole copy and writes one flag word per block.
        assert wire_split("pull", n, 2, "p2p") == (grid * 4, n)
        # The two-shot writes the same payload (half out, half back) plus its flags, and reads nothing.
        ts = wire_split("two_shot", n, 2, "p2p")
        assert ts[1] == 0 and n <= ts[0] <= 1.01 * n
        assert wire_bytes("pull", n, 2, "p2p") == grid * 4 + n
    assert wire_split("pull", 17, 2, "p2p") == (4, 32)  # the tail vector is read whole


def test_pull_two_stage_reads_near_the_ring_bound_one_stage_every_copy():
    from fastcomm.policy import pull_launch, pull_stages, wire_split

    n = 1 << 20
    assert pull_stages(n, 8) == 2
    w, r = wire_split("pull", n, 8, "p2p")
    ideal = 2 * 7 * n // 8
    assert ideal <= r <= 1.01 * ideal and w == 2 * 7 * 4 * pull_launch(n, 8, 128).grid
    small = 128 * KB
    assert pull_stages(small, 8) == 1 and wire_split("pull", small, 8, "p2p")[1] == 7 * small
    with pytest.raises(ValueError, match="P2P"):
        wire_split("pull", n, 2, "host")


@pytest.mark.parametrize("world,islands", [(4, 2), (6, 2), (6, 3), (8, 2), (8, 4)])
def test_island_two_shot_crosses_with_one_island_segment(world, islands):
    """Each rank sends its island segment once to each other island's partner: about S / L across (L ranks
    per island), where the flat two-shot on the same box sends about 2 (W - L) / W x S."""
    from fastcomm.policy import two_shot_launch, wire_cross, wire_split

    size = world // islands
    for n in (12 * KB, 1 << 20, (1 << 20) + 6):
        lc = two_shot_launch(n // 2, 2, size, 128)
        flags = lc.grid * 4
        seg = lc.seg * 2  # the busiest rank's segment (the first ones are full)
        cross = wire_cross("two_shot_islands", n, world, islands)
        assert cross == (islands - 1) * (seg + flags)
        total, read = wire_split("two_shot_islands", n, world, "p2p", islands)
        # Inside the island: the reduce-scatter and the all-gather, each about (L - 1) / L x S.
        assert read == 0 and total == cross + 2 * (size - 1) * flags + (n - seg) + (size - 1) * seg
        flat_cross = wire_cross("two_shot", n, world, islands)
        ideal_flat = 2 * (world - size) * n // world
        assert ideal_flat <= flat_cross <= 1.02 * ideal_flat + 2 * (world - size) * flags
        assert cross <= 1.02 * (islands - 1) * n / size + (islands - 1) * flags
        if n >= 1 << 20:
            # The figure at 2 x 4: the flat two-shot sends 4x as much across.
            assert flat_cross / cross == pytest.approx(2 * (world - size) * size / world / (islands - 1), rel=0.02)
    assert wire_cross("one_shot", 12 * KB, 8, 2) == 12 * KB
    assert wire_cross("two_shot_ll", 12 * KB, 8, 2) == 2 * 4 * wire_split("two_shot_ll", 12 * KB, 8, "p2p")[0] // 14


def test_island_two_shot_wire_refusals():
    from fastcomm.policy import wire_cross

    with pytest.raises(ValueError, match="2\\+ islands of 2\\+ ranks"):
        wire_bytes("two_shot_islands", 12 * KB, 2, "p2p", islands=2)
    with pytest.raises(ValueError, match="P2P"):
        wire_bytes("two_shot_islands", 12 * KB, 8, "host", islands=2)
    with pytest.raises(ValueError, match="equal islands"):
        wire_cross("two_shot", 12 * KB, 8, 3)
    with pytest.raises(ValueError, match="no cross-island model"):
        wire_cross("pull", 12 * KB, 8, 2)
