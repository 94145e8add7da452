"""`fastcomm tune`: time the algorithms on this machine and write the tune cache (``fastcomm.tunecache``)."""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from ..config import Config
from ..measure import check_exact, sizes, timers
from ..policy import Algo, PolicyKey, render_ranges, size_ranges
from ..tunecache import DEFAULT_MARGIN, FASTCOMM_ALGOS, SCHEMA_VERSION, Fingerprint, TuneCache, default_path, \
    fingerprint_here, rules_from_measurements
from .args import add_sweep_arguments, fail, nonneg_int_arg, positive_float_arg, prepare_gpus, writable_file

PROG = "fastcomm tune"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("tune", help="measure the algorithm crossovers here and write the tune cache",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=nonneg_int_arg, default=0, help="ranks (default: all visible GPUs)")
    p.add_argument("--transport", choices=("auto", "p2p", "host"), default="auto",
                   help="transport to tune (auto: what a workspace would pick here)")
    add_sweep_arguments(p, iters=30, max_help="largest size measured (default 64M; also the tuning workspace's size)")
    p.add_argument("--margin", type=float, default=DEFAULT_MARGIN, help="fraction by which fastcomm must beat NCCL")
    p.add_argument("--out", default=None, help="cache file (default: tune.json under FASTCOMM_CACHE_DIR)")
    p.add_argument("--timeout", type=positive_float_arg, default=900, help="deadline for the whole measurement, seconds")
    p.set_defaults(func=tune)
    return p


def _tune_rank(rank, world, gloo, opts, sweep):
    """One rank: time every fastcomm algorithm the workspace serves at a size, and NCCL (bfloat16, the decode
    dtype)."""
    import torch
    import torch.distributed as dist

    import fastcomm

    ws = fastcomm.Workspace(gloo, rank, transport=opts.transport, max_bytes=max(sweep))
    rows = []
    try:
        dev = torch.device("cuda", rank)
        elem = torch.tensor([], dtype=torch.bfloat16).element_size()
        for nbytes in sweep:
            n = max(1, nbytes // elem)
            for algo in (*FASTCOMM_ALGOS, Algo.NCCL):
                # algo_for is a pure function of shared data, so every rank skips the same points.
                if algo is not Algo.NCCL and ws.algo_for(n * elem, algo.value) is Algo.NCCL:
                    continue
                x = torch.empty(n, dtype=torch.bfloat16, device=dev)
                if algo is Algo.NCCL:
                    fn, out = (lambda x=x: dist.all_reduce(x)), x
                else:
                    out = torch.empty_like(x)
                    fn = (lambda x=x, out=out, a=algo.value: fastcomm.all_reduce(x, ws, algo=a, out=out))
                dist.barrier()
                wrong = check_exact(torch, fn, out, x, rank)
                t = timers(torch, fn, opts.graph_calls, opts.iters, opts.warmup, graph=True)
                rows.append(dict(size=n * elem, algo=algo.value, us=t, wrong=wrong))
            if rank == 0:  # row by row, as nccl-tests prints: a long sweep shows progress
                print(table_row(n * elem, {r["algo"]: r["us"] for r in rows if r["size"] == n * elem}), flush=True)
        fp = fingerprint_here(ws.transport, ws.link, world, rank).to_json() if rank == 0 else None
    finally:
        ws.close()
    return (fp, rows) if rank == 0 else None


def table_header(world: int) -> str:
    return (f"# fastcomm tune: {world} ranks; us per call (graph mode), bfloat16\n"
            f"#{'size':>11} " + " ".join(f"{a.value:>11}" for a in (*FASTCOMM_ALGOS, Algo.NCCL)))


def table_row(size: int, us: dict[str, float]) -> str:
    cells = [us.get(a.value) for a in (*FASTCOMM_ALGOS, Algo.NCCL)]
    return f" {size:>11} " + " ".join(f"{'-' if c is None else f'{c:.2f}':>11}" for c in cells)


def tune(opts) -> int:
    """`fastcomm tune`: measure on all ranks, decide on rank 0's timings, write the cache atomically."""
    try:
        sweep = sizes(opts.min_bytes, opts.max_size, opts.factor)
    except ValueError as e:
        return fail(PROG, f"-b/-e/-f: {e}")
    # The ranks' settings, checked here: a bad FASTCOMM_* value stops in one line, not in every rank.
    config = Config.from_env(max_bytes=max(sweep))
    if not 0 <= opts.margin < 1:
        return fail(PROG, f"--margin {opts.margin}: must be in [0, 1)")
    out = Path(opts.out).expanduser() if opts.out else default_path(config.cache_dir)
    why = writable_file(out)
    if why:
        return fail(PROG, f"--out: {why}")
    world, why = prepare_gpus(opts.world, config.cache_dir)
    if why:
        return fail(PROG, why)
    from ..spawn import run_ranks

    print(table_header(world), flush=True)
    results = run_ranks(_tune_rank, world, opts, sweep, timeout=opts.timeout, backend="nccl")
    bad = {r: v for r, (s, v) in results.items() if s != "ok"}
    if bad:
        for r, v in sorted(bad.items()):
            print(f"--- rank {r} failed:\n{v}", file=sys.stderr)
        return 1
    fp_json, rows = results[0][1]
    fp = Fingerprint.from_json(fp_json)
    wrong = [r for r in rows if r["wrong"]]
    if wrong:  # timings of a kernel that gives wrong sums must not steer anything
        print("fastcomm tune: wrong results, no cache written:\n" + "\n".join(map(str, wrong)), file=sys.stderr)
        return 1
    measured = sorted({r["size"] for r in rows})
    rules = rules_from_measurements(rows, measured, margin=opts.margin)
    cache = TuneCache(version=SCHEMA_VERSION, fingerprint=fp,
                      table={PolicyKey(fp.transport, fp.link, fp.gpu_count): rules},
                      created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      measurements=tuple(rows))
    print(f"# measured on {world} x {fp.gpu_name}, transport {fp.transport.value}, link {fp.link.value}")
    ranges = size_ranges(rules, one_shot_max_bytes=max(sweep), max_bytes=max(sweep))
    print("chosen ranges:\n" + "\n".join("  " + line for line in render_ranges(ranges)))
    try:
        cache.save(out)
    except OSError as e:
        print(f"fastcomm tune: cannot write {out}: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
