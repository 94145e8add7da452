"""The cluster form of the fused op (fused_cluster.cuh) on the CPU side: when the policy takes it, its
launch shape, its setting, its launch structs and the mirror of its kernel."""
import ctypes
import re

import pytest

from fastcomm import abi
from fastcomm.runtime import launch_ex
from fastcomm.config import Config, ConfigError
from fastcomm.runtime.jit import source_dir
from fastcomm.policy.fused import fused_cluster_form
from fastcomm.policy.launch import fused_cluster_launch, fused_row_vectors

SOURCE = (source_dir() / "comm" / "fused_cluster.cuh").read_text()


def _form(setting="auto", cc=9, can=True, islands=False):
    return fused_cluster_form(setting=setting, cc_major=cc, cluster_launch=can, islands=islands)


def test_policy_takes_clusters_where_the_device_launches_them():
    assert _form() == (True, None) and _form(cc=10) == (True, None) and _form(cc=12) == (True, None)
    # sm_80, or a device that reports no cluster launch, or islands: today's form, silently under auto...
    assert _form(cc=8) == (False, None) and _form(can=False) == (False, None) and _form(islands=True) == (False, None)
    # ...and a one-line reason when forced on; off never takes it.
    assert _form("on") == (True, None)
    use, why = _form("on", cc=8)
    assert not use and "cannot launch thread-block clusters" in why and "8.x" in why
    assert not _form("on", islands=True)[0] and "island" in _form("on", islands=True)[1]
    assert _form("off") == (False, None)
    with pytest.raises(ValueError):
        _form("yes")


def test_setting_is_read_validated_and_agreed():
    assert Config().fused_cluster == "auto" and Config.from_env({}).fused_cluster == "auto"
    assert Config.from_env({"FASTCOMM_FUSED_CLUSTER": "off"}).fused_cluster == "off"
    assert Config.from_env({}, fused_cluster="on").fused_cluster == "on"
    with pytest.raises(ConfigError, match="FASTCOMM_FUSED_CLUSTER"):
        Config.from_env({"FASTCOMM_FUSED_CLUSTER": "maybe"})
    with pytest.raises(ConfigError, match="fused_cluster"):
        Config(fused_cluster="maybe")
    # The form decides the sum-of-squares order: ranks with different settings must not build a workspace.
    assert Config(fused_cluster="on").agreed() != Config(fused_cluster="off").agreed()


@pytest.mark.parametrize("tokens,hidden,elem", [(1, 6144, 2), (8, 6144, 2), (3, 4099, 2), (5, 7, 2), (1, 1, 4),
                                                (2, 16384, 2), (1, 16384, 4), (64, 6144, 2), (2, 1001, 4)])
@pytest.mark.parametrize("max_blocks", [132, 16, 1])
def test_launch_spreads_each_chunk_over_its_block(tokens, hidden, elem, max_blocks):
    lc = fused_cluster_launch(tokens, hidden, elem, max_blocks)
    assert 1 <= lc.splits <= abi.FUSED_MAX_CLUSTER and lc.grid % lc.splits == 0
    assert lc.block % 32 == 0 and lc.block <= abi.FUSED_THREADS
    assert lc.grid <= max(max_blocks, lc.splits) and lc.grid <= tokens * lc.splits  # every cluster has a row
    row = hidden * elem
    for r in range(min(tokens, 16)):  # the kernel's chunks, every row alignment that occurs
        lo, hi = r * row // 16, -(-((r + 1) * row) // 16)
        assert hi - lo <= fused_row_vectors(hidden, elem)
        # The chunk: one vector per thread at most, unless the block is as large as it goes (the kernel's
        # loop is grid-strided over the chunk either way; this is about spreading, not coverage).
        assert -(-(hi - lo) // lc.splits) <= lc.block or lc.block == abi.FUSED_THREADS
    # The residency cap: never more clusters in flight than the device says fit.
    for resident in (1, 2, 3):
        capped = fused_cluster_launch(tokens, hidden, elem, max_blocks, resident)
        assert capped.grid // capped.splits <= resident and (capped.splits, capped.block) == (lc.splits, lc.block)


def test_launch_structs_match_cuda_h():
    # cuda.h: CUlaunchAttribute = {id, pad to 8, 64-byte value}; CUlaunchConfig = 7 uints, stream, attrs, count.
    assert ctypes.sizeof(launch_ex._LaunchAttribute) == 72
    assert launch_ex._LaunchAttribute.value.offset == 8
    assert [f for f, _ in launch_ex._LaunchConfig._fields_][-3:] == ["hStream", "attrs", "numAttrs"]
    assert launch_ex._LaunchConfig.hStream.offset == 32 and launch_ex._LaunchConfig.attrs.offset == 40
    attr = launch_ex._LaunchAttribute()
    cfg = launch_ex._cluster_config(12, 128, 6, 0, attr)
    assert (cfg.gridDimX, cfg.gridDimY, cfg.blockDimX, cfg.numAttrs) == (12, 1, 128, 1)
    assert cfg.attrs.contents.id == launch_ex.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    assert list(cfg.attrs.contents.value[:3]) == [6, 1, 1]


def test_kernel_is_mirrored_and_guarded_for_older_gpus():
    assert abi.FUSED_CLUSTER in abi.KERNELS
    # The body only for sm_90+ (cluster registers, barrier.cluster, mapa); older targets compile a trap.
    assert re.search(r"#if defined\(__CUDA_ARCH__\) && __CUDA_ARCH__ >= 900", SOURCE)
    assert "barrier.cluster.arrive" in SOURCE and "mapa.shared::cluster" in SOURCE


def test_the_plan_decides_the_form_from_every_ranks_devices_and_refuses_on_where_it_cannot():
    from fastcomm import policy as P
    from fastcomm.errors import FastcommError
    from fastcomm.policy import LinkType

    def plan(setting, cc=9, can=True, **cfg):
        facts = P.Facts(world_size=4, all_p2p=True, link=LinkType.PCIE_SWITCH, cc_major=cc, cluster_launch=can)
        return P.make_plan(facts, Config(fused_cluster=setting, **cfg))

    assert plan("auto").fused_cluster and plan("on").fused_cluster and not plan("off").fused_cluster
    assert "cluster per row" in plan("auto").describe() and "cluster" not in plan("off").describe()
    assert not plan("auto", islands=((0, 1), (2, 3))).fused_cluster
    # The facts are the ranks' lowest capability and "all ranks launch clusters": one older or unable rank
    # keeps every rank on the block-per-split form (the two forms sum a row's squares in different orders).
    assert not plan("auto", cc=8).fused_cluster and not plan("auto", can=False).fused_cluster
    with pytest.raises(FastcommError, match="FASTCOMM_FUSED_CLUSTER=on: the device cannot launch"):
        plan("on", cc=8, can=False)
    with pytest.raises(FastcommError, match="FASTCOMM_FUSED_CLUSTER=on: the cluster form of the fused op has no"):
        plan("on", islands=((0, 1), (2, 3)))
    # Facts gathered without the probe (older callers, CPU) never pick it.
    assert not P.make_plan(P.Facts(world_size=4, all_p2p=True, link=LinkType.PCIE_SWITCH),
                           Config(fused_cluster="auto")).fused_cluster
