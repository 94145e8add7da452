"""Compile the kernels in csrc/ at first use through NVRTC and cache the cubins on disk.

The cache key is the hash of every source file, the NVRTC version, the target architecture and the
options, so a changed kernel or a new toolkit never loads a stale binary. Writes are atomic (rename),
so concurrent ranks compiling the same kernel at once do not corrupt each other's cache.
"""
from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from pathlib import Path

SOURCES = ("common.cuh", "one_shot.cuh", "two_shot.cuh", "two_shot_ll.cuh", "fused_rmsnorm.cuh", "pull.cuh",
           "fused_two_shot.cuh", "fused_cluster.cuh", "p2p_check.cuh", "two_shot_islands.cuh",
           "kernels.cu")
ENTRY = "kernels.cu"
OPTIONS = ("-std=c++17", "-default-device")


class CompileError(RuntimeError):
    pass


def source_dir() -> Path:
    """csrc/ next to the package (editable install) or bundled as fastcomm._csrc (wheel)."""
    here = Path(__file__).resolve().parent
    for cand in (here.parent / "csrc", here / "_csrc"):
        if (cand / ENTRY).is_file():
            return cand
    raise FileNotFoundError(f"fastcomm kernel sources ({ENTRY}) not found next to {here}")


def _read_sources() -> dict[str, str]:
    d = source_dir()
    return {name: (d / name).read_text() for name in SOURCES}


def _nvrtc():
    from cupy_backends.cuda.libs import nvrtc  # CuPy's NVRTC binding; no GPU needed to compile

    return nvrtc


def cache_key(arch: str, sources: dict[str, str], options: tuple[str, ...], nvrtc_version: tuple[int, int]) -> str:
    h = hashlib.sha256()
    for name in sorted(sources):
        h.update(name.encode())
        h.update(b"\0")
        h.update(sources[name].encode())
        h.update(b"\0")
    h.update(repr((arch, options, nvrtc_version)).encode())
    return h.hexdigest()[:32]


def compile_cubin(arch: str, options: tuple[str, ...] = OPTIONS) -> bytes:
    """Compile kernels.cu for ``arch`` (e.g. 'sm_90') with NVRTC; raise CompileError with the log."""
    nvrtc = _nvrtc()
    sources = _read_sources()
    headers = [sources[n].encode() for n in SOURCES if n != ENTRY]
    names = [n.encode() for n in SOURCES if n != ENTRY]
    prog = nvrtc.createProgram(sources[ENTRY], ENTRY, headers, names)
    try:
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *options])
        except nvrtc.NVRTCError as e:
            raise CompileError(f"NVRTC failed for {arch}: {e}\n{nvrtc.getProgramLog(prog)}") from e
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


def cached_cubin(arch: str, cache_dir: Path, options: tuple[str, ...] = OPTIONS) -> Path:
    """Path of the cubin for ``arch``, compiling it on a cache miss."""
    nvrtc = _nvrtc()
    key = cache_key(arch, _read_sources(), options, tuple(nvrtc.getVersion()))
    path = Path(cache_dir) / f"fastcomm-{arch}-{key}.cubin"
    if path.is_file():
        return path
    cubin = compile_cubin(arch, options)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".cubin")
    with os.fdopen(fd, "wb") as f:
        f.write(cubin)
    os.replace(tmp, path)
    return path


def arch_of(device_index: int) -> str:
    import cupy

    return f"sm_{cupy.cuda.Device(device_index).compute_capability}"


@functools.lru_cache(maxsize=None)
def _module(device_index: int, cache_dir: str) -> int:
    import cupy
    from cupy_backends.cuda.api import driver

    path = cached_cubin(arch_of(device_index), Path(cache_dir))
    with cupy.cuda.Device(device_index):
        return driver.moduleLoadData(path.read_bytes())


def function(device_index: int, cache_dir: Path, symbol: str) -> int:
    """The CUfunction ``symbol`` (an ``abi.Kernel.symbol``) for this device. The module is loaded once per
    process and device; callers keep the handle, as each workspace does."""
    import cupy
    from cupy_backends.cuda.api import driver

    with cupy.cuda.Device(device_index):
        return driver.moduleGetFunction(_module(device_index, str(cache_dir)), symbol)
