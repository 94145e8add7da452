"""The `fastcomm` command: benchmarks, tuning, topology, kernel compilation, settings."""
from __future__ import annotations

import argparse
import sys


def _compile(args) -> int:
    from pathlib import Path

    from . import jit
    from .config import Config

    cache = Path(args.cache_dir) if args.cache_dir else Config.from_env().cache_dir
    for arch in args.arch:
        path = jit.cached_cubin(arch, cache)
        print(f"{arch}: {path} ({path.stat().st_size} bytes)")
    return 0


def _env(args) -> int:
    from .config import describe_variables

    print(describe_variables())
    return 0


def _bench(args) -> int:
    from fastcomm_bench import bench_allreduce

    return bench_allreduce.run(args)


def _bench_decode(args) -> int:
    from fastcomm_bench import bench_decode

    return bench_decode.main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastcomm", description="fastcomm: fast all-reduce for PCIe tensor parallelism")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compile", help="compile (and cache) the kernels for GPU architectures; no GPU needed")
    c.add_argument("--arch", action="append", default=None, help="e.g. sm_90 (repeatable; default sm_80 sm_90 sm_120)")
    c.add_argument("--cache-dir", default=None)
    c.set_defaults(func=_compile)

    e = sub.add_parser("env", help="list every FASTCOMM_* variable and its meaning")
    e.set_defaults(func=_env)

    try:
        from fastcomm_bench import bench_allreduce
    except ImportError:  # installed without the bench package
        bench_allreduce = None
    if bench_allreduce is not None:
        b = sub.add_parser("bench", help="all-reduce microbenchmark against NCCL and other baselines")
        bench_allreduce.add_arguments(b)
        b.set_defaults(func=_bench)
        d = sub.add_parser("bench-decode", help="end-to-end vLLM decode benchmark (arguments passed through)")
        d.add_argument("rest", nargs=argparse.REMAINDER)
        d.set_defaults(func=_bench_decode)

    try:
        from . import topo_cli
    except ImportError:
        topo_cli = None
    if topo_cli is not None and hasattr(topo_cli, "add_parser"):
        topo_cli.add_parser(sub)

    from . import tuning

    tuning.add_parser(sub)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench-decode"]:
        # argparse's REMAINDER drops arguments that start with '--' when they come first: hand them over as-is
        # (its own --help included).
        try:
            from fastcomm_bench import bench_decode
        except ImportError:  # installed without the bench package: argparse says the command is unknown
            bench_decode = None
        if bench_decode is not None:
            return int(bench_decode.main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    if getattr(args, "command", None) == "compile" and not args.arch:
        args.arch = ["sm_80", "sm_90", "sm_120"]
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
