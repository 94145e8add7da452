"""Launches through cuLaunchKernelEx, the driver call CuPy does not wrap (ctypes): thread-block clusters
(fused_cluster.cuh) and programmatic dependent launch (the K-quant decode kernels, csrc/kquant/kquant.cu).

A cluster launch (CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION) groups a grid's blocks into clusters;
cuOccupancyMaxActiveClusters says how many such clusters fit on the device at once (the fused op needs its whole
grid resident). A dependent launch (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, sm_90+) lets a kernel
start while the kernel before it in the stream is still running, once that one's blocks have all run
`griddepcontrol.launch_dependents`; its `griddepcontrol.wait` then blocks until the earlier kernel has finished
and its writes are visible. Both are captured into CUDA graphs like any launch and act on the current context.
Struct layouts follow cuda.h (CUDA 12+).
"""
from __future__ import annotations

import ctypes
import functools

from ..errors import FastcommError

CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH = 120       # cudaDevAttrClusterLaunch
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttribute(ctypes.Structure):
    # CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union (clusterDim: three unsigned ints;
    # programmaticStreamSerializationAllowed: one int).
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint32 * 16)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


assert ctypes.sizeof(_LaunchAttribute) == 72 and ctypes.sizeof(_LaunchConfig) == 56


@functools.lru_cache(maxsize=1)
def _libcuda():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_void_p]
    lib.cuOccupancyMaxActiveClusters.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p,
                                                 ctypes.POINTER(_LaunchConfig)]
    lib.cuDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
    lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise FastcommError(f"{what} failed (CUresult {rc})")


def _config(grid: tuple[int, int], block: int, smem: int, stream: int, attr: _LaunchAttribute, attr_id: int,
            values: tuple[int, ...]) -> _LaunchConfig:
    """A launch of ``grid`` (x, y) blocks with one attribute (``attr`` must outlive the launch call)."""
    attr.id = attr_id
    for i, v in enumerate(values):
        attr.value[i] = v
    return _LaunchConfig(grid[0], grid[1], 1, block, 1, 1, smem, stream or None, ctypes.pointer(attr), 1)


def _cluster_config(grid: int, block: int, cluster: int, stream: int, attr: _LaunchAttribute) -> _LaunchConfig:
    return _config((grid, 1), block, 0, stream, attr, CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, (cluster, 1, 1))


@functools.lru_cache(maxsize=None)
def device_supports_clusters(device_index: int) -> tuple[int, bool]:
    """(compute capability major, the device's cluster-launch attribute) of CUDA device ``device_index``."""
    lib = _libcuda()
    dev, major, cl = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
    _check(lib.cuDeviceGetAttribute(ctypes.byref(major), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
           "cuDeviceGetAttribute")
    _check(lib.cuDeviceGetAttribute(ctypes.byref(cl), CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH, dev),
           "cuDeviceGetAttribute")
    return major.value, bool(cl.value)


def max_active_clusters(fn: int, block: int, cluster: int) -> int:
    """Clusters of ``cluster`` blocks of ``block`` threads of ``fn`` that can be resident at once."""
    attr = _LaunchAttribute()
    cfg = _cluster_config(cluster, block, cluster, 0, attr)
    n = ctypes.c_int()
    _check(_libcuda().cuOccupancyMaxActiveClusters(ctypes.byref(n), fn, ctypes.byref(cfg)),
           "cuOccupancyMaxActiveClusters")
    return n.value


def launch_cluster(fn: int, grid: int, block: int, cluster: int, stream: int, params_address: int) -> None:
    """``fn`` on ``grid`` blocks of ``block`` threads, in clusters of ``cluster`` blocks (grid % cluster == 0)."""
    attr = _LaunchAttribute()
    cfg = _cluster_config(grid, block, cluster, stream, attr)
    _check(_libcuda().cuLaunchKernelEx(ctypes.byref(cfg), fn, params_address, None), "cuLaunchKernelEx")


def launch_dependent(fn: int, grid: tuple[int, int], block: int, smem: int, stream: int,
                     params_address: int) -> None:
    """``fn`` on ``grid`` blocks of ``block`` threads (``smem`` bytes of dynamic shared memory each), allowed to
    start before the stream's previous kernel has finished (sm_90+: the kernel must `griddepcontrol.wait` before
    it reads what that kernel wrote)."""
    attr = _LaunchAttribute()
    cfg = _config(grid, block, smem, stream, attr, CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, (1,))
    _check(_libcuda().cuLaunchKernelEx(ctypes.byref(cfg), fn, params_address, None), "cuLaunchKernelEx")
