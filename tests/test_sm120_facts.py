"""The collective kernels' sm_120 facts (RTX PRO 6000 Blackwell), checked on the CPU from the comm unit's cubin:
what each kernel uses (fastcomm.runtime.cubin) against compute capability 12.0's limits (cubin.LIMITS), and the
cluster shapes the launch policy asks for. Nothing here runs a kernel: a failure means a kernel or policy change
made a kernel that sm_120 cannot launch as the launcher launches it. docs/SM120.md writes the numbers down.

The cubin is compiled once per test run (about half a minute with NVRTC) into the run's shared cubin cache
(conftest.cubin_cache_dir)."""
from __future__ import annotations

import re

import pytest

from nvrtc_probe import why_no_nvrtc

from fastcomm import abi
from fastcomm.policy.launch import fused_cluster_launch
from fastcomm.runtime import cubin, jit

ARCH = "sm_120"
pytestmark = [pytest.mark.skipif(why_no_nvrtc() is not None, reason=why_no_nvrtc() or ""),
              pytest.mark.cubins(("comm", ARCH))]
LIMITS = cubin.LIMITS[ARCH]
# The cluster size every cluster-capable GPU launches without cudaFuncAttributeNonPortableClusterSizeAllowed
# (CUDA C++ Programming Guide, "Thread Block Clusters"); sm_120 has no larger non-portable size either.
PORTABLE_CLUSTER = 8
# Registers are allocated a warp at a time in units of 256, and the warps they allow an SM are counted in fours
# (the CUDA occupancy calculator's register and warp allocation granularities, as fastcomm.kquant.policy has them).
REG_UNIT, WARP_UNIT = 256, 4
DTYPE = re.compile(r"_(?:bf16|f16|f32)$")


@pytest.fixture(scope="module")
def comm(cubin_cache_dir) -> dict[str, cubin.KernelResources]:
    path = jit.cached_cubin(ARCH, cubin_cache_dir, unit="comm")
    return {k.name: k for k in cubin.resources(path.read_bytes())}


def cluster_kernels(comm) -> list[cubin.KernelResources]:
    return [comm[s] for s in abi.FUSED_CLUSTER.symbols()]


def test_the_facts_cover_every_kernel_the_workspace_loads(comm):
    symbols = {s for kernel in abi.KERNELS for s in kernel.symbols()}
    assert symbols <= set(comm), f"not in the resource table: {sorted(symbols - set(comm))}"


def test_static_shared_memory_fits_a_block(comm):
    """Static shared memory with the runtime's per-block reserve within the opt-in per-block limit (so also
    within an SM's): none of these kernels takes dynamic shared memory, so this is all a block asks for."""
    over = {k.name: k.shared_bytes for k in comm.values()
            if k.shared_bytes + cubin.RESERVED_SHARED_BYTES > LIMITS.shared_per_block}
    assert not over, f"over {ARCH}'s {LIMITS.shared_per_block} bytes a block (with the " \
                     f"{cubin.RESERVED_SHARED_BYTES}-byte reserve): {over}"


def test_every_kernel_declares_a_launch_bound_one_sm_holds(comm):
    """A launch bound caps the registers ptxas may give a thread; without one a kernel could build with more
    than a block of the launcher's size can have. Threads and registers of one block at its bound fit an SM."""
    unbounded = sorted(k.name for k in comm.values() if k.max_threads is None)
    assert not unbounded, f"no __launch_bounds__: {unbounded}"
    for k in comm.values():
        warps = -(-k.max_threads // 32)
        per_warp = -(-k.registers * 32 // REG_UNIT) * REG_UNIT
        by_regs = LIMITS.registers_per_sm // per_warp // WARP_UNIT * WARP_UNIT
        assert k.max_threads <= LIMITS.threads_per_sm, k
        assert k.registers <= 255 and warps <= by_regs, \
            f"{k.name}: {k.registers} registers x {k.max_threads} threads, over {ARCH}'s " \
            f"{LIMITS.registers_per_sm} registers an SM"


def test_the_policy_asks_for_portable_clusters_of_blocks_the_kernel_was_built_for(comm):
    """fused_cluster_launch: splits (the cluster size) at most FUSED_MAX_CLUSTER, which is at most the portable
    size; the grid whole clusters; the block within the cluster kernel's launch bound and a whole number of
    warps, whatever the shape, the plan's max_blocks (at most MAX_BLOCKS) and the occupancy query's answer."""
    assert abi.FUSED_MAX_CLUSTER <= PORTABLE_CLUSTER, f"FUSED_MAX_CLUSTER {abi.FUSED_MAX_CLUSTER} is not portable"
    bound = min(k.max_threads for k in cluster_kernels(comm))
    assert abi.FUSED_THREADS <= bound, f"blocks of up to {abi.FUSED_THREADS} threads, built for {bound}"
    seen = set()
    for tokens in (1, 2, 3, 7, 8, 64, 512, 4096):
        for hidden in (1, 7, 64, 1000, 2048, 5120, 6144, 7168, 8192, 16384, 65536):
            for elem in (2, 4):
                for max_blocks in (1, 2, 7, 8, 16, 64, abi.MAX_BLOCKS):
                    for resident in (None, 1, 3, 188):
                        lc = fused_cluster_launch(tokens, hidden, elem, max_blocks, resident)
                        shape = (tokens, hidden, elem, max_blocks, resident, lc)
                        assert 1 <= lc.splits <= abi.FUSED_MAX_CLUSTER, shape
                        assert lc.grid % lc.splits == 0 and lc.grid <= max_blocks, shape
                        assert lc.block % 32 == 0 and 32 <= lc.block <= bound, shape
                        seen.add(lc.splits)
    assert max(seen) == abi.FUSED_MAX_CLUSTER  # the sweep reaches the largest cluster the policy asks for


def test_a_whole_cluster_of_the_cluster_kernel_fits_one_sms_shared_memory(comm):
    """The largest cluster's blocks together (static shared memory and reserve each) within one SM's shared
    memory: a sufficient bound, so shared memory never keeps a cluster from being placed, however the blocks
    share SMs. (A block of 1024 threads, the kernel's bound, is one to an SM of 1536 threads, so such a cluster
    spans FUSED_MAX_CLUSTER SMs; cuOccupancyMaxActiveClusters decides on the device, and a shape of which no
    cluster fits runs the block-per-split form instead: ops._fused_cluster.)"""
    for k in cluster_kernels(comm):
        need = (k.shared_bytes + cubin.RESERVED_SHARED_BYTES) * abi.FUSED_MAX_CLUSTER
        assert need <= LIMITS.shared_per_sm, f"{k.name}: {need} bytes for a cluster of {abi.FUSED_MAX_CLUSTER}"


def test_local_memory_is_reported(comm, capsys):
    """Not a failure: which kernel families use local memory (spills or local arrays) under sm_120, printed."""
    families: dict[str, list[int]] = {}
    for k in comm.values():
        families.setdefault(DTYPE.sub("", k.name), []).append(k.local_bytes)
    used = {f: (min(b), max(b)) for f, b in sorted(families.items()) if max(b)}
    lines = [f"{ARCH} comm: {sum(1 for k in comm.values() if k.local_bytes)} of {len(comm)} kernels use local "
             f"memory (bytes per thread, over the dtypes)"]
    lines += [f"  {f}: {lo}-{hi}" if lo != hi else f"  {f}: {hi}" for f, (lo, hi) in used.items()]
    lines += [f"  none: {', '.join(f for f, b in sorted(families.items()) if not max(b))}"]
    with capsys.disabled():
        print("\n" + "\n".join(lines))
