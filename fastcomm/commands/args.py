"""What the command-line verbs share: argument types (argparse reports their errors in one line, exit 2), the
GPU count with the reason when it is short, output paths checked before a run, the kernel compile line."""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from ..runtime.jit import CUPY_HINT
from ..units import parse_size

TRANSPORTS = ("p2p", "host")
# The kernels use sm_80 features (bf16 arithmetic, cp.async-era memory model); older GPUs fail in ptxas.
MIN_ARCH = 80
_ARCH = re.compile(r"sm_(\d+)([a-z]?)")


def parse_size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_size_arg(text: str) -> int:
    n = parse_size_arg(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size here must be at least 1 byte")
    return n


def positive_int_arg(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return n


def positive_float_arg(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number > 0")
    return v


def transports_arg(text: str) -> list[str]:
    got = [t.strip().lower() for t in text.split(",") if t.strip()]
    bad = [t for t in got if t not in TRANSPORTS]
    if bad or not got:
        raise argparse.ArgumentTypeError(f"{text!r}: transports are a comma list of {', '.join(TRANSPORTS)}")
    return got


def arch_arg(text: str) -> str:
    """'sm_90' (also sm_90a, sm_120); refuses other spellings and GPUs older than sm_80."""
    m = _ARCH.fullmatch(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an architecture like sm_80, sm_90, sm_120")
    if int(m.group(1)) < MIN_ARCH:
        raise argparse.ArgumentTypeError(f"{text}: fastcomm needs sm_{MIN_ARCH} or newer (Ampere and later)")
    return text.strip()


def fail(prog: str, message: str, code: int = 2) -> int:
    print(f"{prog}: {message}", file=sys.stderr)
    return code


def visible_gpus() -> tuple[int, str]:
    """(number of CUDA GPUs torch sees, why there are none when there are none)."""
    try:
        import torch
    except ImportError as e:
        return 0, f"torch is not importable ({e})"
    if torch.version.cuda is None:
        return 0, f"this torch ({torch.__version__}) is a CPU-only build"
    try:
        if torch.cuda.is_available():
            return torch.cuda.device_count(), ""
        torch.cuda.init()  # raises with CUDA's reason (no driver, driver too old, no device)
        return 0, "CUDA reports no device"
    except Exception as e:
        return 0, f"CUDA unavailable: {str(e).strip().splitlines()[0].split('. ')[0]}"


def prepare_gpus(requested: int, cache_dir: Path) -> tuple[int, str | None]:
    """Before spawning ranks: (world size, None), with the kernels compiled for GPU 0's architecture (once, here,
    with a line saying so, rather than silently in every rank); or (0, the one-line reason it cannot run)."""
    world, why = world_or_error(requested)
    why = why or cupy_missing()
    if why:
        return 0, why
    import torch

    from ..runtime import jit

    major, minor = torch.cuda.get_device_capability(0)
    arch = f"sm_{major}{minor}"
    if major * 10 + minor < MIN_ARCH:
        return 0, f"GPU 0 is {arch}: fastcomm needs sm_{MIN_ARCH} or newer (Ampere and later)"
    try:
        compile_with_notice(arch, cache_dir)
    except jit.CompileError as e:
        return 0, str(e).splitlines()[0]
    return world, None


def world_or_error(requested: int) -> tuple[int, str | None]:
    """(world size, None) for ``--world`` (0: every visible GPU), or (0, the one-line reason it cannot run)."""
    found, why = visible_gpus()
    where = f"found {found} GPU{'' if found == 1 else 's'}" + (f" ({why})" if why else "")
    if requested and requested < 2:
        return 0, f"--world {requested}: needs at least 2 ranks"
    world = requested or found
    if world < 2:
        return 0, f"needs at least 2 GPUs, {where}"
    if world > found:
        return 0, f"--world {requested}: {where}"
    return world, None


def writable_file(path: str | Path) -> str | None:
    """None if ``path`` can be written (its folder is created), else why not. Checked before a long run."""
    path = Path(path).expanduser()
    try:
        if path.is_dir():
            return f"{path} is a directory"
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".check"):
            pass
        if path.exists() and not os.access(path, os.W_OK):
            return f"{path} is not writable"
    except OSError as e:
        return f"cannot write {path}: {e.strerror or e}"
    return None


def writable_dir(path: str | Path) -> str | None:
    """None if files can be created in ``path`` (created if missing), else why not."""
    path = Path(path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check."):
            pass
    except OSError as e:
        return f"cannot write to {path}: {e.strerror or e}"
    return None


def cupy_missing() -> str | None:
    """None if CuPy's NVRTC binding is importable, else the one-line install hint."""
    if importlib.util.find_spec("cupy_backends") is None:
        return f"CuPy is not installed (it provides NVRTC, which compiles the kernels): {CUPY_HINT}"
    return None


# How long a cold compile of each unit takes on two cores (jit.LOCK_WAIT_S names the slowest), for the notice.
COMPILE_TIME = {"comm": "about half a minute", "kquant": "about 20 s"}


def compile_with_notice(arch: str, cache_dir: Path, stream=None, unit: str = "comm") -> tuple[Path, float]:
    """The cached cubin of compile unit ``unit`` (a key of jit.UNITS) for ``arch``, compiling it on a cache miss.
    A cache hit takes milliseconds; when the call is still busy after half a second it is compiling, and a line
    says so (NVRTC needs 20-30 s per unit and arch on 2 cores, which must not look like a hang). Raises
    jit.CompileError; the commands print it."""
    import threading

    from ..runtime import jit

    stream = stream or sys.stderr
    what = "kernels" if unit == "comm" else f"{unit} kernels"
    notice = threading.Timer(0.5, lambda: print(f"compiling {what} for {arch} (first use, "
                                                f"{COMPILE_TIME.get(unit, 'a few minutes')})...",
                                                file=stream, flush=True))
    t0 = time.monotonic()
    notice.start()
    try:
        path = jit.cached_cubin(arch, Path(cache_dir), unit=unit)
    except jit.CompileError:
        raise
    except (OSError, RuntimeError) as e:
        why = jit.nvrtc_library_missing(e)
        if why is None:
            raise
        raise jit.CompileError(why) from None
    finally:
        notice.cancel()
    return path, time.monotonic() - t0


def nonneg_int_arg(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be >= 0")
    return n


def add_sweep_arguments(p: argparse.ArgumentParser, *, iters: int, max_help: str) -> None:
    """The nccl-tests-shaped sweep flags that `fastcomm tune` and `fastcomm bench` share."""
    p.add_argument("-b", "--minbytes", dest="min_bytes", type=positive_size_arg, default=1 << 10,
                   help="smallest message (default 1K)")
    p.add_argument("-e", "--maxbytes", dest="max_size", type=positive_size_arg, default=64 << 20, help=max_help)
    p.add_argument("-f", "--stepfactor", dest="factor", type=positive_float_arg, default=2.0)
    p.add_argument("-n", "--iters", type=positive_int_arg, default=iters,
                   help=f"timed graph replays per point (default {iters})")
    p.add_argument("-w", "--warmup_iters", dest="warmup", type=nonneg_int_arg, default=5)
    p.add_argument("-G", "--graph-calls", dest="graph_calls", type=positive_int_arg, default=20,
                   help="back-to-back calls captured in one graph (per-call time = replay / G)")
