"""Per-kernel resource use read from a cubin (an NVIDIA ELF), in pure Python: no GPU, no CUDA tools at run time.

What is read, and how it was checked against `cuobjdump -res-usage` / `-elf`, `ptxas -v` and the driver's
cuFuncGetAttribute on cubins from NVRTC 13.5 (sm_80, sm_90, sm_120) and the 580 driver's JIT (sm_90):
  registers   EIATTR_REGCOUNT records of the cubin-wide `.nv.info` section, keyed by the kernel's symbol.
              (`.text.<kernel>` sh_info carries the count in its top byte only on sm_80; on sm_90 and sm_120 it
              is the bare symbol index, so it is not used.)
  shared      the size of `.nv.shared.<kernel>`. From sm_90 on, ptxas counts the 1 KB block reserve in that
              section when the kernel has one (cuobjdump prints 5120 for a 4096-byte array; ptxas -v and the
              driver say 4096); such cubins name `.nv.reservedSmem.*` symbols (sm_80's do not), and for them
              the reserve is subtracted.
  local       EIATTR_FRAME_SIZE: the per-thread stack frame, i.e. local memory for spills and local arrays
              (ptxas -v's "bytes stack frame"; cuobjdump prints it as STACK). The cubin does not say which
              part of it is spills.
  max threads EIATTR_MAX_THREADS of `.nv.info.<kernel>`, present when the kernel declares __launch_bounds__.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

# EIATTR ids, as cuobjdump -elf names them.
_EIATTR_MAX_THREADS = 0x05
_EIATTR_FRAME_SIZE = 0x11
_EIATTR_REGCOUNT = 0x2F
_EIFMT_SVAL = 0x04  # a 2-byte size and a payload follow; other formats are one 4-byte record
# The shared memory the CUDA runtime reserves per block on sm_80 and newer (programming guide, "Shared Memory"
# per compute capability; cudaDevAttrReservedSharedMemoryPerBlock is 1024 on an H200).
RESERVED_SHARED_BYTES = 1024
_SHT_SYMTAB = 2
_STT_FUNC = 2


@dataclass(frozen=True)
class KernelResources:
    name: str
    registers: int  # per thread
    shared_bytes: int  # static __shared__ per block, without the system reserve (what the driver reports)
    local_bytes: int  # per-thread stack frame: spills and local arrays
    max_threads: int | None = None  # __launch_bounds__ threads per block (x*y*z), None if not declared


@dataclass(frozen=True)
class ArchLimits:
    shared_per_block: int  # opt-in maximum per block (cudaDevAttrMaxSharedMemoryPerBlockOptin)
    shared_per_sm: int
    registers_per_sm: int  # 32-bit registers
    threads_per_sm: int


# CUDA C++ Programming Guide, "Technical Specifications per Compute Capability" (8.0, 9.0, 12.0).
# sm_90's 227 KB opt-in is also what an H200 reports.
LIMITS = {
    "sm_80": ArchLimits(163 << 10, 164 << 10, 64 << 10, 2048),
    "sm_90": ArchLimits(227 << 10, 228 << 10, 64 << 10, 2048),
    "sm_120": ArchLimits(99 << 10, 100 << 10, 64 << 10, 1536),
}


def limits_for(arch: str) -> ArchLimits | None:
    """The table row for 'sm_90' or 'sm_90a' (an arch-specific variant has its base's limits), else None."""
    return LIMITS.get(arch.rstrip("abf"))


def _sections(elf: bytes) -> list[tuple[str, int, int, int, int, int]]:
    """(name, type, offset, size, link, info) for each section header."""
    if len(elf) < 64 or elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF (a cubin)")
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    raw = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names = raw[shstrndx][4]

    def name(off: int) -> str:
        start = names + off
        return elf[start:elf.index(b"\0", start)].decode()
    return [(name(h[0]), h[1], h[4], h[5], h[6], h[7]) for h in raw]


def _records(data: bytes):
    """(attribute, payload) for each EIATTR record of an .nv.info section."""
    i = 0
    while i + 4 <= len(data):
        fmt, attr = data[i], data[i + 1]
        if fmt == _EIFMT_SVAL:
            (size,) = struct.unpack_from("<H", data, i + 2)
            yield attr, data[i + 4:i + 4 + size]
            i += 4 + size
        else:
            yield attr, data[i + 2:i + 4]
            i += 4


def resources(cubin: bytes) -> list[KernelResources]:
    """Each kernel's registers, static shared memory, stack frame and launch bound, in symbol-table order.
    Raises ValueError on bytes that are not a readable cubin.

    CuPy's getCUBIN drops the cubin's last byte (inside the program headers); only section headers are read,
    so such a cubin parses the same."""
    try:
        return _resources(cubin)
    except (struct.error, IndexError, StopIteration, KeyError, UnicodeDecodeError) as e:
        raise ValueError(f"unreadable cubin ({type(e).__name__}: {e})") from None


def _resources(cubin: bytes) -> list[KernelResources]:
    secs = _sections(cubin)
    symtab = next(i for i, s in enumerate(secs) if s[1] == _SHT_SYMTAB and s[0] == ".symtab")
    _, _, off, size, strtab, _ = secs[symtab]
    str_off = secs[strtab][2]
    symbols = {}  # symbol index -> (name, its .text section index), kernels and device functions
    reserve = 0
    for idx in range(size // 24):
        st_name, st_info, _, st_shndx, _, _ = struct.unpack_from("<IBBHQQ", cubin, off + 24 * idx)
        start = str_off + st_name
        name = cubin[start:cubin.index(b"\0", start)].decode()
        if st_info & 0xF == _STT_FUNC:
            symbols[idx] = (name, st_shndx)
        elif name.startswith(".nv.reservedSmem."):
            reserve = RESERVED_SHARED_BYTES

    regs, frame, max_threads, shared = {}, {}, {}, {}
    for name, _, off, size, link, info in secs:
        if name == ".nv.info" and link == symtab:
            for attr, p in _records(cubin[off:off + size]):
                if attr in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE) and len(p) == 8:
                    sym, value = struct.unpack("<II", p)
                    (regs if attr == _EIATTR_REGCOUNT else frame)[sym] = value
        elif name.startswith(".nv.info."):
            for attr, p in _records(cubin[off:off + size]):
                if attr == _EIATTR_MAX_THREADS and len(p) == 12:
                    x, y, z = struct.unpack("<III", p)
                    max_threads[info] = x * y * z
        elif name.startswith(".nv.shared.") and not name.startswith(".nv.shared.reserved."):
            shared[info] = max(size - reserve, 0)
    return [KernelResources(name, regs[sym], shared.get(text, 0), frame.get(sym, 0), max_threads.get(text))
            for sym, (name, text) in symbols.items() if sym in regs]


def warnings(kernels: list[KernelResources], arch: str) -> list[str]:
    """A line per kernel whose static shared memory is over ``arch``'s per-block limit (it cannot launch), and
    one line for all kernels that use local memory (each access goes through L1/L2; the table names them)."""
    lim = limits_for(arch)
    out = [f"warning: {k.name}: {k.shared_bytes} bytes of static shared memory, over {arch}'s "
           f"{lim.shared_per_block} per block" for k in kernels if lim and k.shared_bytes > lim.shared_per_block]
    local = [k for k in kernels if k.local_bytes]
    if local:
        worst = max(local, key=lambda k: k.local_bytes)
        out.append(f"warning: {len(local)} of {len(kernels)} kernels use local memory (register spills or local "
                   f"arrays), up to {worst.local_bytes} bytes per thread ({worst.name})")
    return out


def table(kernels: list[KernelResources]) -> list[str]:
    """A header and one aligned line per kernel: registers per thread, static shared bytes per block, local
    bytes per thread, __launch_bounds__ threads per block ("-": none declared)."""
    width = max([len(k.name) for k in kernels] + [6])
    rows = [f"{'kernel':<{width}} {'regs':>4} {'smem/blk':>8} {'local/thr':>9} {'bound':>5}"]
    for k in kernels:
        bound = "-" if k.max_threads is None else str(k.max_threads)
        rows.append(f"{k.name:<{width}} {k.registers:>4} {k.shared_bytes:>8} {k.local_bytes:>9} {bound:>5}")
    return rows


def limits_line(arch: str) -> str | None:
    """``arch``'s limits from LIMITS in one line, or None for an architecture not in the table."""
    lim = limits_for(arch)
    if lim is None:
        return None
    return (f"{arch} limits: {lim.shared_per_block} bytes shared memory per block (opt-in), {lim.shared_per_sm} "
            f"per SM; {lim.registers_per_sm} registers and {lim.threads_per_sm} threads per SM")
