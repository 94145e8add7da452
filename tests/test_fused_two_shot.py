"""The two-shot fused all-reduce + RMSNorm on the CPU side: the cut, the launch shape, the buffer fit, the
policy's choice between the two fused kernels, the bytes on the wire, and the mirror of its constants."""
import re

import pytest

from fastcomm import abi
from fastcomm import layout as L
from fastcomm import policy as P
from fastcomm.runtime.jit import source_dir
from fastcomm.policy import LinkType, wire_bytes
from fastcomm.policy.fused import FUSED_TWO_SHOT_MAX_TOKENS, FusedAlgo, choose_fused
from fastcomm.policy.checks import FusedRefusal, FusedWhy
from fastcomm.policy.launch import fused_two_shot_slot_bytes, two_shot_cut

KB, MB = 1024, 1 << 20
SOURCE = (source_dir() / "comm" / "fused_two_shot.cuh").read_text()


def test_kernel_constants_mirror_the_cuda_source():
    assert int(re.search(r"#define FC_FTS_K (\d+)", SOURCE).group(1)) == abi.FTS_K
    assert abi.FUSED_TWO_SHOT in abi.KERNELS  # loaded at build and compiled by test_compile


@pytest.mark.parametrize("hidden,elem,world", [(6144, 2, 8), (7168, 2, 8), (1000, 2, 8), (1001, 2, 8), (1000, 4, 3),
                                               (1001, 4, 2), (6144, 4, 4), (64, 2, 8), (17, 2, 2)])
def test_cut_covers_every_column_once_in_aligned_parts(hidden, elem, world):
    cut = two_shot_cut(hidden, elem, world)
    assert (cut.cols * elem) % 16 == 0 and cut.pv * 16 == cut.cols * elem
    # Every column in exactly one part; the parts' vectors carry exactly the row's bytes, padded per part.
    widths = [max(0, min(cut.cols, hidden - p * cut.cols)) for p in range(world)]
    assert sum(widths) == hidden and all(w > 0 for w in widths)
    assert [-(-w * elem // 16) for w in widths] == list(cut.part_vectors)
    assert max(cut.part_vectors) == cut.pv and cut.positions == world * cut.pv


def test_checks_refuse_what_the_kernel_cannot_run():
    ok = dict(tokens=64, hidden=6144, elem_size=2, world=8, host=False, slot_bytes=MB)
    assert P.check_fused_two_shot(**ok) is None
    assert "too narrow" in P.check_fused_two_shot(**{**ok, "hidden": 16})  # 8 ranks, 16 bf16: parts of 8, 2 empty
    assert "exceeds" in P.check_fused_two_shot(**{**ok, "tokens": 1, "hidden": 40000, "world": 2, "elem_size": 4})
    assert "per slot" in P.check_fused_two_shot(**{**ok, "host": True, "elem_size": 4})
    assert "at least 2" in P.check_fused_two_shot(**{**ok, "world": 1})


@pytest.mark.parametrize("host", [False, True])
def test_slot_bytes_fit_the_layouts_lamport_slots(host):
    """What a call writes per slot (and records for the next call's clear) must fit the one-shot's slot."""
    lay = L.plan_layout("host" if host else "p2p", 8, 8 * MB, MB)
    slot = lay.groups[0].lp_slot
    need = fused_two_shot_slot_bytes(64, 6144, 2, 8, host)
    cut = two_shot_cut(6144, 2, 8)
    assert need == ((8 if host else 1) + 1) * 64 * cut.pv * 16
    assert (need <= slot) == (P.check_fused_two_shot(tokens=64, hidden=6144, elem_size=2, world=8, host=host,
                                                      slot_bytes=slot) is None)
    assert need <= slot  # 64 tokens x 6144 bf16 at 8 ranks fits the default 1 MiB buffers either way


@pytest.mark.parametrize("tokens,hidden,elem,world", [(1, 6144, 2, 8), (64, 6144, 2, 8), (3, 1001, 4, 3),
                                                      (17, 7168, 2, 4), (2, 40, 2, 2)])
@pytest.mark.parametrize("split_rows", [True, False])
def test_launch_covers_every_row_position_with_resident_blocks(tokens, hidden, elem, world, split_rows):
    lc = P.fused_two_shot_launch(tokens, hidden, elem, world, 132, split_rows=split_rows)
    npos = two_shot_cut(hidden, elem, world).positions
    assert lc.block % 32 == 0 and lc.block <= abi.FUSED_THREADS and lc.block * abi.FTS_K >= npos
    assert lc.grid <= 132 and lc.grid % lc.splits == 0 and lc.grid <= tokens * lc.splits  # every block has a row
    assert lc.cols == two_shot_cut(hidden, elem, world).cols
    assert split_rows or lc.splits == 1


def _choose(tokens, world=8, hidden=6144, fused_max=32 * KB, host=False, islands=False, **kw):
    args = dict(tokens=tokens, hidden=hidden, elem_size=2, world=world, host=host, islands=islands,
                fused_max_bytes=fused_max, one_shot_max_bytes=MB, slot_bytes=MB)
    args.update(kw)
    return choose_fused(**args)


def test_policy_one_shot_in_its_range_two_shot_above_at_four_ranks_or_more():
    # 8 ranks over a PCIe switch: the one-shot's 32 KiB is two tokens of 6144 bf16.
    assert _choose(1)[0] is FusedAlgo.ONE_SHOT and _choose(2)[0] is FusedAlgo.ONE_SHOT
    for t in (3, 8, 17, 64):
        assert _choose(t) == (FusedAlgo.TWO_SHOT, None)
    algo, why = _choose(FUSED_TWO_SHOT_MAX_TOKENS + 1)
    assert algo is None and "outside the fused op's range" in why and "to 64 tokens" in why
    # 2-3 ranks: the one-shot's range only; above it all-reduce + norm.
    assert _choose(8, world=3, fused_max=64 * KB)[0] is None and _choose(4, world=2, fused_max=64 * KB)[0] is not None
    assert _choose(8, world=4)[0] is FusedAlgo.TWO_SHOT
    # Islands: the two-shot form is flat only.
    assert _choose(8, islands=True)[0] is None


def test_policy_without_the_range_runs_what_fits_and_forcing_picks_the_kernel():
    # An explicit call (within_policy=False): the policy's kernel, else whichever can run.
    assert _choose(65, within_policy=False)[0] is FusedAlgo.ONE_SHOT   # 65 x 12 KiB fits the 1 MiB buffers
    assert _choose(8, world=2, within_policy=False)[0] is FusedAlgo.ONE_SHOT
    assert _choose(100, world=4, within_policy=False)[0] is FusedAlgo.TWO_SHOT  # 1.2 MiB: one-shot cannot
    algo, why = _choose(1024, within_policy=False)
    assert algo is None and "fused two-shot" in why
    assert _choose(1, forced="two_shot")[0] is FusedAlgo.TWO_SHOT and _choose(1, world=2, forced="two_shot")[0]
    assert _choose(8, forced="one_shot")[0] is FusedAlgo.ONE_SHOT
    assert _choose(1, hidden=16, forced="two_shot")[0] is None
    with pytest.raises(ValueError):
        _choose(1, forced="nccl")


def test_policy_refusals_keep_their_messages():
    # A shape the one-shot kernel cannot take (too long a row, nothing to do) is reported as check_fused
    # words it; an input merely outside the modelled range gets the range sentence instead.
    row = _choose(1, hidden=40000, elem_size=4, world=2)
    assert row == (None, P.check_fused(tokens=1, hidden=40000, elem_size=4, one_shot_max_bytes=MB).message)
    assert row[1].startswith("a row of 40000 elements")
    assert _choose(0) == (None, "empty input") and _choose(1, hidden=0, world=2) == (None, "empty input")
    algo, why = _choose(8, world=2)
    assert algo is None and why.startswith("8 tokens x 6144 is outside the fused op's range here")
    assert _choose(128, forced="one_shot") == (None, P.check_fused(tokens=128, hidden=6144, elem_size=2,
                                                                    one_shot_max_bytes=MB).message)
    algo, why = _choose(1024, within_policy=False)
    assert why.startswith("1024 tokens x 6144 (") and "; fused two-shot: " in why


@pytest.mark.parametrize("code,range_sentence", [(FusedWhy.ROW_TOO_LONG, False), (FusedWhy.EMPTY, False),
                                                 (FusedWhy.ABOVE_LIMIT, True)])
def test_policy_branches_on_the_refusal_code_not_its_text(monkeypatch, code, range_sentence):
    # The same words under every code: only the code can steer the choice.
    from fastcomm.policy import fused

    monkeypatch.setattr(fused, "check_fused", lambda **kw: FusedRefusal(code, "some words"))
    algo, why = _choose(8, world=2)
    assert algo is None
    assert (why == "some words") is not range_sentence
    assert ("outside the fused op's range" in why) is range_sentence


def test_plan_describes_the_two_shot_range():
    from fastcomm.config import Config

    eight = P.make_plan(P.Facts(world_size=8, all_p2p=True, link=LinkType.PCIE_SWITCH), Config())
    assert "two-shot form above that to 64 tokens" in eight.describe()
    two = P.make_plan(P.Facts(world_size=2, all_p2p=True, link=LinkType.NVLINK), Config())
    assert "two-shot form" not in two.describe()


def test_wire_bytes_two_shot_form_against_the_one_shot_form():
    row = 6144 * 2
    for tokens in (1, 8, 64):
        one = wire_bytes("fused", tokens * row, 8, "p2p")
        two = wire_bytes("fused_two_shot", tokens * row, 8, "p2p", hidden=6144)
        assert one == 7 * tokens * row
        assert two == 2 * 7 * tokens * row // 8  # 6144 bf16 cuts into 8 parts of 96 whole vectors
        assert two <= 1.06 * wire_bytes("two_shot", tokens * row, 8, "p2p")  # the unfused two-shot's bytes
    # Host: my copy of the 7 other parts plus my reduced part, once each: the payload.
    assert wire_bytes("fused_two_shot", 8 * row, 8, "host", hidden=6144) == 8 * row
    # An odd row pads each part to 16 bytes: 1001 bf16 at 8 ranks, parts of 128 columns, the last 105.
    # The busiest rank owns a full part: 6 full parts and the short one out, then its part to 7 peers.
    assert wire_bytes("fused_two_shot", 1001 * 2, 8, "p2p", hidden=1001) == 6 * 256 + 14 * 16 + 7 * 256
    with pytest.raises(ValueError):
        wire_bytes("fused_two_shot", 1000, 8, "p2p", hidden=6144)
