"""The cluster form of the fused op (fused_cluster.cuh) on the CPU side: when the policy takes it, its
launch shape, its setting, its launch structs and the mirror of its kernel."""
import ctypes
import re

import pytest

from fastcomm import abi, cluster
from fastcomm.config import Config, ConfigError
from fastcomm.jit import source_dir
from fastcomm.policy.fused import fused_cluster_form
from fastcomm.policy.launch import fused_cluster_launch, fused_row_vectors

SOURCE = (source_dir() / "fused_cluster.cuh").read_text()


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
    assert Config().fused_cluster == "off"  # until the cluster kernel has run on a GPU
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
    assert ctypes.sizeof(cluster._LaunchAttribute) == 72
    assert cluster._LaunchAttribute.value.offset == 8
    assert [f for f, _ in cluster._LaunchConfig._fields_][-3:] == ["hStream", "attrs", "numAttrs"]
    assert cluster._LaunchConfig.hStream.offset == 32 and cluster._LaunchConfig.attrs.offset == 40
    attr = cluster._LaunchAttribute()
    cfg = cluster._config(12, 128, 6, 0, attr)
    assert (cfg.gridDimX, cfg.blockDimX, cfg.numAttrs) == (12, 128, 1)
    assert cfg.attrs.contents.id == cluster.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    assert list(cfg.attrs.contents.value[:3]) == [6, 1, 1]


def test_kernel_is_mirrored_and_guarded_for_older_gpus():
    assert abi.FUSED_CLUSTER in abi.KERNELS
    # The body only for sm_90+ (cluster registers, barrier.cluster, mapa); older targets compile a trap.
    assert re.search(r"#if defined\(__CUDA_ARCH__\) && __CUDA_ARCH__ >= 900", SOURCE)
    assert "barrier.cluster.arrive" in SOURCE and "mapa.shared::cluster" in SOURCE


def test_ops_takes_the_form_the_policy_gives_and_refuses_on_where_it_cannot(monkeypatch):
    from types import SimpleNamespace

    from fastcomm import ops
    from fastcomm.errors import FastcommError

    def ws(setting, islands=None):
        return SimpleNamespace(device_index=0, config=Config(fused_cluster=setting), plan=SimpleNamespace(islands=islands))

    monkeypatch.setattr(cluster, "device_supports_clusters", lambda i: (9, True))
    assert ops._cluster_form(ws("auto")) and ops._cluster_form(ws("on")) and not ops._cluster_form(ws("off"))
    assert not ops._cluster_form(ws("auto", islands=((0,), (1,))))
    monkeypatch.setattr(cluster, "device_supports_clusters", lambda i: (8, False))
    assert not ops._cluster_form(ws("auto"))
    with pytest.raises(FastcommError, match="FASTCOMM_FUSED_CLUSTER=on: the device cannot launch"):
        ops._cluster_form(ws("on"))
