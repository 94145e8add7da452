"""`fastcomm compile`: compile (and cache) the kernels for GPU architectures; needs no GPU."""
from __future__ import annotations

from pathlib import Path

DEFAULT_ARCHS = ("sm_80", "sm_90", "sm_120")


def add_parser(sub) -> None:
    c = sub.add_parser("compile", help="compile (and cache) the kernels for GPU architectures; no GPU needed")
    c.add_argument("--arch", action="append", default=None,
                   help=f"e.g. sm_90 (repeatable; default {' '.join(DEFAULT_ARCHS)})")
    c.add_argument("--cache-dir", default=None)
    c.set_defaults(func=run)


def run(args) -> int:
    from .. import jit
    from ..config import Config

    cache = Path(args.cache_dir) if args.cache_dir else Config.from_env().cache_dir
    for arch in args.arch or DEFAULT_ARCHS:
        path = jit.cached_cubin(arch, cache)
        print(f"{arch}: {path} ({path.stat().st_size} bytes)")
    return 0
