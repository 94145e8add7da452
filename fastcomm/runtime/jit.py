"""Compile the kernels in csrc/ at first use through NVRTC and cache the cubins on disk.

The cache key is the hash of every source file, the NVRTC version, the target architecture and the
options, so a changed kernel or a new toolkit never loads a stale binary. Ranks that start together build
each cubin once: the first takes a lock on the cache entry and compiles, the others wait for it and load its
file (a wait bounded by LOCK_WAIT_S, after which a rank compiles on its own). Writes are atomic (rename), so
a rank that compiles beside another never reads half a file.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import tempfile
import time
from pathlib import Path

# Compile units, each a folder of csrc/ (and the one header both share, dtypes.cuh): the communication
# kernels, and the GGUF K-quant decode kernels (used by the GGUF serving path only, so a process that never
# serves a GGUF file never compiles them). unit: (sources as paths under csrc/, entry). NVRTC sees each file
# by its base name, the name its #include uses, so a file's folder is not part of what is compiled.
UNITS = {"comm": (("dtypes.cuh", "comm/common.cuh", "comm/one_shot.cuh", "comm/two_shot.cuh", "comm/two_shot_ll.cuh",
                   "comm/fused_rmsnorm.cuh", "comm/pull.cuh", "comm/fused_two_shot.cuh", "comm/fused_cluster.cuh",
                   "comm/p2p_check.cuh", "comm/two_shot_islands.cuh", "comm/kernels.cu"), "comm/kernels.cu"),
         "kquant": (("dtypes.cuh", "kquant/kquant.cuh", "kquant/kquant_mma.cuh", "kquant/kquant.cu"),
                    "kquant/kquant.cu")}
SOURCES, ENTRY = UNITS["comm"]
OPTIONS = ("-std=c++17", "-default-device")
# NVRTC's optimizer over a unit's functions in parallel, a thread a core (sm_90 on 2 cores: comm 45.0 -> 29.1 s,
# kquant 31.1 -> 19.2 s). The SASS, compared function by function at the commit that added it: kquant's the same;
# comm's the same but for the loads of the cold fc_fail path (global -> generic) and one setup loop of the fused
# two-shot. Added where the NVRTC in use takes it (``build_options``).
SPLIT_COMPILE = "--split-compile=0"
# How long a rank waits for another's build of the same cubin before compiling it itself: several times the
# slowest measured (a K-quant unit: 138 s on 2 cores), so a build that is only slow is never duplicated.
LOCK_WAIT_S = 900.0

logger = logging.getLogger("fastcomm")


class CompileError(RuntimeError):
    pass


def source_dir() -> Path:
    """csrc/ next to the package (editable install) or bundled as fastcomm._csrc (wheel)."""
    package = Path(__file__).resolve().parents[1]
    for cand in (package.parent / "csrc", package / "_csrc"):
        if (cand / ENTRY).is_file():
            return cand
    raise FileNotFoundError(f"fastcomm kernel sources ({ENTRY}) not found next to {package}")


def _base(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def _read_sources(unit: str = "comm") -> dict[str, str]:
    """The unit's files by the name NVRTC compiles them under (their base name)."""
    d = source_dir()
    return {_base(path): (d / path).read_text() for path in UNITS[unit][0]}


def _nvrtc():
    from cupy_backends.cuda.libs import nvrtc  # CuPy's NVRTC binding; no GPU needed to compile

    return nvrtc


# What installs CuPy (and with it NVRTC's binding), for every message that finds it missing.
CUPY_HINT = 'pip install -e ".[cuda13]" from the fastcomm checkout (".[cuda12]" for a CUDA 12 driver)'
# CuPy's wheel brings the binding, not the library: a CPU-only torch beside it leaves no libnvrtc.
NVRTC_HINT = "install a CUDA torch, the CUDA toolkit, or pip install 'nvidia-cuda-nvrtc>=13,<14' (the cuda13 extra)"


def nvrtc_library_missing(error: BaseException) -> str | None:
    """The one-line reason when ``error`` (raised by a compile) says the NVRTC library did not load, else None."""
    if not isinstance(error, (OSError, RuntimeError)) or "nvrtc" not in str(error).lower():
        return None
    return f"the NVRTC library is missing (it does not load: {str(error).splitlines()[0][:160]}): {NVRTC_HINT}"


def nvrtc_problem() -> str | None:
    """Why nothing can be compiled here (no CuPy, or CuPy without the NVRTC library), or None."""
    try:
        nvrtc = _nvrtc()
    except ImportError:
        return f"CuPy (NVRTC) is not installed: {CUPY_HINT}"
    try:
        nvrtc.getVersion()
    except (OSError, RuntimeError) as e:  # CuPy raises RuntimeError where libnvrtc.so is not found
        return nvrtc_library_missing(e) or f"NVRTC does not load: {str(e).splitlines()[0][:160]}"
    return None


def cache_key(arch: str, sources: dict[str, str], options: tuple[str, ...], nvrtc_version: tuple[int, int]) -> str:
    h = hashlib.sha256()
    for name in sorted(sources):
        h.update(name.encode())
        h.update(b"\0")
        h.update(sources[name].encode())
        h.update(b"\0")
    h.update(repr((arch, options, nvrtc_version)).encode())
    return h.hexdigest()[:32]


@functools.lru_cache(maxsize=None)
def _takes_split_compile() -> bool:
    """Does this NVRTC take SPLIT_COMPILE? (A program of one empty kernel, compiled with it: milliseconds.)"""
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram('extern "C" __global__ void fc_probe() {}', "probe.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["--gpu-architecture=compute_80", SPLIT_COMPILE])
        return True
    except nvrtc.NVRTCError:
        return False
    finally:
        nvrtc.destroyProgram(prog)


def build_options(options: tuple[str, ...]) -> tuple[str, ...]:
    """``options`` as a build passes them to NVRTC (and keys its cache on): with SPLIT_COMPILE where taken."""
    if SPLIT_COMPILE in options or not _takes_split_compile():
        return options
    return (*options, SPLIT_COMPILE)


def compile_cubin(arch: str, options: tuple[str, ...] = OPTIONS, unit: str = "comm") -> bytes:
    """Compile a unit's entry (kernels.cu by default) for ``arch`` (e.g. 'sm_90') with NVRTC; raise
    CompileError with the log."""
    nvrtc = _nvrtc()
    options = build_options(options)
    sources = _read_sources(unit)
    paths, entry = UNITS[unit]
    entry = _base(entry)
    names_ = [_base(p) for p in paths]
    headers = [sources[n].encode() for n in names_ if n != entry]
    names = [n.encode() for n in names_ if n != entry]
    prog = nvrtc.createProgram(sources[entry], entry, headers, names)
    try:
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *options])
        except nvrtc.NVRTCError as e:
            raise CompileError(f"NVRTC failed for {arch}: {e}\n{nvrtc.getProgramLog(prog)}") from e
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


def cached_cubin(arch: str, cache_dir: Path, options: tuple[str, ...] = OPTIONS, unit: str = "comm") -> Path:
    """Path of the unit's cubin for ``arch``, compiling it on a cache miss."""
    nvrtc = _nvrtc()
    options = build_options(options)
    key = cache_key(arch, _read_sources(unit), options, tuple(nvrtc.getVersion()))
    path = Path(cache_dir) / (f"fastcomm-{arch}-{key}.cubin" if unit == "comm" else f"fastcomm-{unit}-{arch}-{key}.cubin")
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(path.with_name(path.name + ".lock"), LOCK_WAIT_S):
        if path.is_file():  # built by the rank that held the lock
            return path
        cubin = compile_cubin(arch, options, unit)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".cubin")
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        os.replace(tmp, path)
    return path


@contextlib.contextmanager
def _build_lock(lock: Path, wait_s: float):
    """Hold an exclusive lock on ``lock`` (flock: released by the kernel if its holder dies), waiting at most
    ``wait_s``; past that, or where the file system takes no locks, go on without it (the build is then only
    duplicated, never wrong: writes are atomic)."""
    try:
        import fcntl
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except (ImportError, OSError):
        yield
        return
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    logger.warning("fastcomm: another process has been building %s for %.0f s; building it here "
                                   "too", lock.name[:-len(".lock")], wait_s)
                    break
                time.sleep(0.05)
            except OSError:  # no locks on this file system
                break
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def arch_of(device_index: int) -> str:
    import cupy

    return f"sm_{cupy.cuda.Device(device_index).compute_capability}"


@functools.lru_cache(maxsize=None)
def _module(device_index: int, cache_dir: str, unit: str = "comm") -> int:
    import cupy
    from cupy_backends.cuda.api import driver

    path = cached_cubin(arch_of(device_index), Path(cache_dir), unit=unit)
    with cupy.cuda.Device(device_index):
        return driver.moduleLoadData(path.read_bytes())


def function(device_index: int, cache_dir: Path, symbol: str, unit: str = "comm") -> int:
    """The CUfunction ``symbol`` (an ``abi.Kernel.symbol``) of a unit for this device. The module is loaded
    once per process, device and unit; callers keep the handle, as each workspace does."""
    import cupy
    from cupy_backends.cuda.api import driver

    with cupy.cuda.Device(device_index):
        return driver.moduleGetFunction(_module(device_index, str(cache_dir), unit), symbol)
