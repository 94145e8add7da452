"""`fastcomm compile`: compile (and cache) the kernels for GPU architectures; needs no GPU, only CuPy (NVRTC).
Builds every compile unit (the collectives, "comm", and the GGUF K-quant decode kernels, "kquant") unless
--unit names some, and prints a line per unit and architecture, then each kernel's registers, static shared
memory, local memory and launch bound, with warnings for what exceeds the architecture's limits or spills to
local memory."""
from __future__ import annotations

from pathlib import Path

from ..runtime.jit import UNITS
from .args import MIN_ARCH, arch_arg, compile_with_notice, cupy_missing, fail, writable_dir

DEFAULT_ARCHS = ("sm_80", "sm_90", "sm_120")
DEFAULT_UNITS = tuple(UNITS)  # comm, kquant
PROG = "fastcomm compile"


def add_parser(sub) -> None:
    c = sub.add_parser("compile", help="compile (and cache) the kernels for GPU architectures; no GPU needed",
                       description=__doc__)
    c.add_argument("--arch", action="append", default=None, type=arch_arg,
                   help=f"e.g. sm_90 (repeatable; sm_{MIN_ARCH} or newer; default {' '.join(DEFAULT_ARCHS)})")
    c.add_argument("--unit", action="append", default=None, choices=DEFAULT_UNITS,
                   help=f"compile unit (repeatable; default all: {' '.join(DEFAULT_UNITS)})")
    c.add_argument("--cache-dir", default=None, help="default: FASTCOMM_CACHE_DIR")
    c.add_argument("-q", "--quiet", action="store_true",
                   help="print only each cubin's line and the warnings, not the per-kernel resource table")
    c.set_defaults(func=run)


def run(args) -> int:
    from ..runtime import jit
    from ..config import ConfigError, read

    if args.cache_dir:
        cache, where = Path(args.cache_dir).expanduser(), "--cache-dir"
    else:
        try:  # only the cache directory: an unrelated bad FASTCOMM_* setting must not stop a compile
            cache, where = read("FASTCOMM_CACHE_DIR"), "FASTCOMM_CACHE_DIR"
        except ConfigError as e:
            return fail(PROG, str(e))
    why = writable_dir(cache)
    if why:
        return fail(PROG, f"{where}: {why}")
    why = cupy_missing()
    if why:
        return fail(PROG, why)
    units = list(dict.fromkeys(args.unit or DEFAULT_UNITS))  # in the order given, each once
    for arch in args.arch or DEFAULT_ARCHS:
        for unit in units:
            try:
                path, seconds = compile_with_notice(arch, cache, unit=unit)
            except jit.CompileError as e:
                lines = str(e).splitlines()
                log = f" (NVRTC log, first 40 of {len(lines) - 1} lines, follows)\n" + "\n".join(lines[1:41]) \
                    if len(lines) > 1 else ""
                return fail(PROG, f"{unit}: {lines[0]}{log}", 1)
            print(f"{arch}: {unit}: {path} ({path.stat().st_size} bytes, {seconds:.1f} s)", flush=True)
            for line in resource_lines(arch, path.read_bytes(), args.quiet):
                print(f"  {line}")
    return 0


def resource_lines(arch: str, data: bytes, quiet: bool = False) -> list[str]:
    """What a cubin's kernels use (read from its ELF, no CUDA tools) against ``arch``'s limits: the limits line
    and a row per kernel unless ``quiet``, then the warnings. A cubin the reader cannot parse says so in one
    line: the compile itself succeeded."""
    from ..runtime import cubin

    try:
        kernels = sorted(cubin.resources(data), key=lambda k: k.name)  # a family's dtypes side by side
    except ValueError as e:
        return [f"kernel resources: {e}"]
    rows = [] if quiet else [line for line in [cubin.limits_line(arch)] if line] + cubin.table(kernels)
    return rows + cubin.warnings(kernels, arch)
