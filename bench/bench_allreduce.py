"""All-reduce microbenchmark: fastcomm against NCCL and the other baselines, as rows of the same run.

Prints an nccl-tests-shaped table row by row (time per call inside a CUDA graph of -G back-to-back calls,
median of replays; and eager), and with --json writes the rows and a PNG plot (latency against size per
implementation, log-log; needs matplotlib: the `plot` extra) beside it. Run on N local GPUs:

    fastcomm bench -b 1K -e 64M -f 2 --world 2 --json results.json     # also writes results.png
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from fastcomm.commands.args import add_sweep_arguments, fail, nonneg_int_arg, positive_float_arg, positive_int_arg, \
    positive_size_arg, prepare_gpus, transports_arg, writable_file
from fastcomm.measure import check_exact, sizes, timers
from fastcomm.units import MiB as MB
from fastcomm.units import format_size, parse_size


# ---- per-rank body -------------------------------------------------------------------------------------

def _impls(torch, rank, world, gloo, opts):
    """name -> (setup(n, dtype) -> (fn, out, in) or None when the impl cannot serve that size)."""
    import torch.distributed as dist

    import fastcomm

    impls = {}
    workspaces = []
    if "p2p" in opts.transports:
        try:
            ws = fastcomm.Workspace(gloo, rank, transport="p2p", max_bytes=opts.workspace_bytes)
            workspaces.append(ws)
            for algo in ("one_shot", "two_shot", "two_shot_ll", "pull", "auto"):
                impls[f"fastcomm-{algo}"] = (ws, algo)
        except fastcomm.FastcommError as e:
            print(f"[rank {rank}] no P2P workspace: {e}")
    if "host" in opts.transports:
        ws = fastcomm.Workspace(gloo, rank, transport="host", max_bytes=min(opts.workspace_bytes, opts.host_workspace_bytes))
        workspaces.append(ws)
        for algo in ("one_shot", "two_shot", "two_shot_ll", "auto"):
            impls[f"fastcomm-host-{algo}"] = (ws, algo)
    if opts.islands and "p2p" in opts.transports:
        isl = tuple((r,) for r in range(world)) if world == 2 else (tuple(range(world // 2)), tuple(range(world // 2, world)))
        ws = fastcomm.Workspace(gloo, rank, transport="p2p", max_bytes=opts.workspace_bytes, islands=isl)
        workspaces.append(ws)
        impls["fastcomm-islands-one_shot"] = (ws, "one_shot")
        if world >= 4:  # islands of 2+ ranks: the island two-shot (in one launch)
            impls["fastcomm-islands-two_shot_islands"] = (ws, "two_shot_islands")
    impls["nccl"] = ("nccl", None)
    if opts.symm:
        try:
            import torch.distributed._symmetric_memory as symm_mem

            impls["symm-one_shot"] = ("symm", "one_shot")
            impls["symm-two_shot"] = ("symm", "two_shot")
            symm = {}
            group_name = dist.group.WORLD.group_name

            def symm_buf(dtype):
                if dtype not in symm:
                    t = symm_mem.empty(opts.workspace_bytes // torch.tensor([], dtype=dtype).element_size(), dtype=dtype,
                                       device=torch.device("cuda", rank))
                    symm_mem.rendezvous(t, group_name)
                    symm[dtype] = t
                return symm[dtype]
        except Exception as e:
            print(f"[rank {rank}] torch symmetric memory unavailable: {e}")
            symm_buf, group_name = None, None
    vllm_ca = None
    if opts.vllm:
        try:  # vLLM's own custom all-reduce, where vLLM is installed (it needs only a CPU group)
            from vllm.distributed.device_communicators.custom_all_reduce import CustomAllreduce

            vllm_ca = CustomAllreduce(gloo, torch.device("cuda", rank), max_size=min(opts.workspace_bytes, 8 << 20))
            if vllm_ca.disabled:
                print(f"[rank {rank}] vLLM custom all-reduce is disabled on this machine")
                vllm_ca = None
            else:
                impls["vllm-custom-ar"] = ("vllm", None)
        except Exception as e:
            print(f"[rank {rank}] vLLM custom all-reduce unavailable: {type(e).__name__}: {e}")

    def setup(name, n, dtype):
        kind, algo = impls[name]
        dev = torch.device("cuda", rank)
        nbytes = n * torch.tensor([], dtype=dtype).element_size()
        if kind == "nccl":
            x = torch.empty(n, dtype=dtype, device=dev)
            return (lambda: dist.all_reduce(x)), x, x
        if kind == "vllm":
            x = torch.empty(n, dtype=dtype, device=dev)
            if not vllm_ca.should_custom_ar(x):
                return None
            return (lambda: vllm_ca.custom_all_reduce(x)), None, x
        if kind == "symm":
            if symm_buf is None or nbytes > opts.workspace_bytes:
                return None
            buf = symm_buf(dtype)[:n]
            if algo == "one_shot":
                return (lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name)), None, buf
            return (lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group_name)), buf, buf
        ws = kind
        if ws.algo_for(nbytes, algo) is fastcomm.Algo.NCCL:
            return None
        x = torch.empty(n, dtype=dtype, device=dev)
        out = torch.empty_like(x)
        return (lambda: fastcomm.all_reduce(x, ws, algo=algo, out=out)), out, x

    capture = {"vllm-custom-ar": vllm_ca.capture} if vllm_ca is not None else {}
    return impls, setup, workspaces, capture


def _setup_on_all(torch, setup, gloo, name, n, dtype):
    """``setup(name, n, dtype)`` on every rank, or None on all of them if any rank cannot run that row
    (a rank that skipped alone would leave the others waiting in the row's collectives)."""
    import torch.distributed as dist

    dist.barrier()
    got = setup(name, n, dtype)
    ok = torch.tensor([0 if got is None else 1], dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=gloo)
    return got if ok.item() else None


def bench_rank(rank, world, gloo, opts):
    import torch

    dtype = getattr(torch, opts.dtype)
    impls, setup, workspaces, capture = _impls(torch, rank, world, gloo, opts)
    names = [n for n in impls if not opts.only or any(o in n for o in opts.only)]
    rows = []
    elem = torch.tensor([], dtype=dtype).element_size()
    extra = [parse_size(x) for x in opts.extra_sizes.split(",") if x.strip()]
    for nbytes in sorted(set(sizes(opts.min_bytes, opts.max_size, opts.factor) + extra)):
        n = max(1, nbytes // elem)
        for name in names:
            got = _setup_on_all(torch, setup, gloo, name, n, dtype)
            if got is None:
                continue
            fn, out, inp = got
            wrong = check_exact(torch, fn, out, inp, rank)
            t_graph = timers(torch, fn, opts.graph_calls, opts.iters, opts.warmup, graph=True,
                              capture_ctx=capture.get(name))
            t_eager = timers(torch, fn, opts.graph_calls, max(3, opts.iters // 4), 2, graph=False)
            rows.append(dict(size=n * elem, count=n, type=opts.dtype, redop="sum", impl=name,
                             graph_us=t_graph, eager_us=t_eager, wrong=wrong,
                             wire_bytes=wire_for(impls[name], n * elem, world)))
            _show(rows[-1], rank, world)
    if opts.interleave:
        rows += _bench_interleaved(torch, rank, gloo, names, setup, capture, opts)
    if opts.fused:
        rows += _bench_fused(torch, rank, world, gloo, workspaces, opts)
    for ws in workspaces:
        ws.close()
    return rows if rank == 0 else None


def _bench_interleaved(torch, rank, gloo, names, setup, capture, opts):
    """Each all-reduce right after the GEMM that writes its input, as in a decode step.

    Back-to-back all-reduces (the table above) hide what a collective costs around its neighbours: its
    launch after a GEMM, extra graph nodes or stream joins. Here a graph holds G x (GEMM -> all-reduce) and
    another G x GEMM alone; the row is their difference per call: what the all-reduce adds to a step.
    """
    import torch.distributed as dist

    dtype = getattr(torch, opts.dtype)
    dev = torch.device("cuda", rank)
    hidden = opts.hidden
    g = torch.Generator(device="cpu").manual_seed(rank)
    weight = (torch.randn(hidden, hidden, generator=g) / hidden ** 0.5).to(dtype=dtype, device=dev)
    rows = []
    for tokens in opts.interleave_tokens:
        a = torch.randn(tokens, hidden, generator=g).to(dtype=dtype, device=dev)
        scratch = torch.empty(tokens, hidden, dtype=dtype, device=dev)
        dist.barrier()
        t_gemm = timers(torch, lambda: torch.matmul(a, weight, out=scratch), opts.graph_calls, opts.iters,
                         opts.warmup, graph=True)
        for name in names:
            got = _setup_on_all(torch, setup, gloo, name, tokens * hidden, dtype)
            if got is None:
                continue
            fn, _, inp = got
            target = inp.view(tokens, hidden)

            def step(fn=fn, target=target):
                torch.matmul(a, weight, out=target)
                return fn()

            t_both = timers(torch, step, opts.graph_calls, opts.iters, opts.warmup, graph=True,
                             capture_ctx=capture.get(name))
            rows.append(dict(size=tokens * hidden * a.element_size(), count=tokens * hidden, type=opts.dtype,
                             redop="gemm+", impl=f"{name} {tokens}x{hidden}", graph_us=t_both - t_gemm,
                             eager_us=float("nan"), gemm_us=t_gemm, wrong=-1))
            _show(rows[-1], rank, dist.get_world_size())
    return rows


def _bench_fused(torch, rank, world, gloo, workspaces, opts):
    """Fused all-reduce + add + RMSNorm against all-reduce followed by a one-kernel add + RMSNorm."""
    import torch.distributed as dist

    import fastcomm
    from fastcomm import policy
    from fastcomm_bench.norm_baseline import add_rmsnorm

    rows = []
    dtype = getattr(torch, opts.dtype)
    dev = torch.device("cuda", rank)
    for ws in workspaces:
        if ws.islands is not None:
            continue
        tag = "" if ws.transport.value == "p2p" else "host-"
        for tokens in (1, 8, 32, 64):
            hidden = opts.hidden
            x = torch.randn(tokens, hidden, dtype=dtype, device=dev)
            res = torch.randn_like(x)
            w = torch.rand(hidden, dtype=dtype, device=dev) + 0.5
            out, rout, ar = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
            kernel, _ = ws.fused_route(x, res)  # which fused kernel the policy runs (None: none), for the wire
            if kernel is None:
                continue
            nbytes = tokens * hidden * x.element_size()
            fused_wire = policy.wire_bytes("fused" if kernel is policy.FusedAlgo.ONE_SHOT else "fused_two_shot", nbytes, world,
                                           ws.transport.value, elem_size=x.element_size(), hidden=hidden)
            variants = {
                f"{tag}fused": lambda: fastcomm.fused_all_reduce_rmsnorm(x, w, 1e-5, ws, residual=res, out=out, residual_out=rout),
                f"{tag}allreduce+norm": lambda: (fastcomm.all_reduce(x, ws, out=ar), add_rmsnorm(ar, res, w, 1e-5, out, rout)),
                "nccl+norm": lambda: (ar.copy_(x), dist.all_reduce(ar), add_rmsnorm(ar, res, w, 1e-5, out, rout)),
            }
            for name, fn in variants.items():
                if name == "nccl+norm" and tag:
                    continue
                dist.barrier()
                t_graph = timers(torch, fn, opts.graph_calls, opts.iters, opts.warmup, graph=True)
                t_eager = timers(torch, fn, opts.graph_calls, max(3, opts.iters // 4), 2, graph=False)
                fused = name.endswith("fused")
                rows.append(dict(size=nbytes, count=tokens * hidden, type=opts.dtype, redop="fused",
                                 impl=f"{name} {tokens}x{hidden}{f' {kernel.value}' if fused else ''}",
                                 graph_us=t_graph, eager_us=t_eager, wrong=-1,
                                 wire_bytes=fused_wire if fused else None))
                _show(rows[-1], rank, world)
    return rows


# ---- reporting -----------------------------------------------------------------------------------------

def _show(row: dict, rank: int, world: int) -> None:
    """Rank 0 prints each row as soon as it is measured (nccl-tests does): a long sweep shows progress."""
    if rank == 0:
        print(table_row(row, world), flush=True)


def wire_for(impl, nbytes: int, world: int) -> int | None:
    """Bytes each GPU sends per call: fastcomm's from its layout (``policy.wire_bytes``), NCCL's ring
    all-reduce from its schedule (2 (n-1)/n of the message); None where no model is kept (other baselines)."""
    from fastcomm import Algo, policy

    kind, algo = impl
    if kind == "nccl":
        return policy.nccl_ring_bytes(nbytes, world)
    if not hasattr(kind, "plan"):
        return None
    chosen = kind.algo_for(nbytes, algo)
    if chosen is Algo.NCCL:
        return None
    return policy.wire_bytes(chosen.value, nbytes, world, kind.transport.value,
                             islands=len(kind.islands) if kind.islands else 1)


def table_header(world: int) -> list[str]:
    return [f"# fastcomm all-reduce benchmark, {world} ranks; time = us per call (graph: median of replays of "
            "G back-to-back calls; eager: same loop without a graph)",
            f"#{'size':>12} {'count':>10} {'type':>8} {'redop':>6} {'impl':>28} {'graph us':>9} {'algbw':>7} "
            f"{'busbw':>7} {'eager us':>9} {'#wrong':>7} {'wire B/GPU':>11}"]


def table_row(r: dict, world: int) -> str:
    # An interleaved row's time is a difference and can be ~0 (fully hidden): no bandwidth then.
    algbw = r["size"] / (r["graph_us"] * 1e-6) / 1e9 if r["graph_us"] > 0 else float("nan")
    busbw = algbw * 2 * (world - 1) / world
    return (f" {r['size']:>12} {r['count']:>10} {r['type']:>8} {r['redop']:>6} {r['impl']:>28} "
            f"{r['graph_us']:>9.2f} {algbw:>7.2f} {busbw:>7.2f} {r['eager_us']:>9.2f} "
            f"{('n/a' if r['wrong'] < 0 else r['wrong']):>7} "
            f"{('-' if r.get('wire_bytes') is None else r['wire_bytes']):>11}")


def table(rows: list[dict], world: int) -> str:
    return "\n".join(table_header(world) + [table_row(r, world) for r in rows])


def plot(rows: list[dict], world: int, path: str | Path, title: str = "") -> Path:
    """Graph-mode latency against message size, one line per implementation (back-to-back rows), log-log.
    Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    by: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r["redop"] == "sum" and r["graph_us"] > 0:
            by.setdefault(r["impl"], []).append((r["size"], r["graph_us"]))
    fig, ax = plt.subplots(figsize=(8, 5))
    for impl, pts in sorted(by.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=impl)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("us per call (CUDA graph)")
    ax.set_title(title or f"all-reduce latency, {world} ranks")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def ratios(rows: list[dict]) -> str:
    """fastcomm-auto (and host-auto) over NCCL and over torch symmetric-memory one-shot, per size."""
    by = {(r["impl"], r["size"]): r["graph_us"] for r in rows if r["redop"] == "sum"}
    out = ["# ratios (graph mode): impl / baseline, lower is better"]
    for impl in ("fastcomm-auto", "fastcomm-host-auto"):
        for base in ("nccl", "symm-one_shot", "vllm-custom-ar"):
            pairs = [(s, by[(impl, s)] / by[(base, s)]) for (i, s) in by if i == impl and (base, s) in by]
            if pairs:
                out.append(f"{impl} / {base}: " + ", ".join(f"{format_size(s, compact=True)} {q:.2f}" for s, q in sorted(pairs)))
    inter = {r["impl"]: r["graph_us"] for r in rows if r["redop"] == "gemm+"}
    for key, t in sorted(inter.items()):
        name, shape = key.rsplit(" ", 1)
        if name in ("fastcomm-auto", "fastcomm-host-auto") and f"nccl {shape}" in inter:
            out.append(f"{name} / nccl after a GEMM, {shape}: {t / inter[f'nccl {shape}']:.2f} "
                       f"(adds {t:.2f} us against {inter[f'nccl {shape}']:.2f} us per call)")
    return "\n".join(out)


def _token_counts(text: str) -> list[int]:
    return [positive_int_arg(t) for t in text.split(",") if t.strip()] or [positive_int_arg(text)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_sweep_arguments(p, iters=50, max_help="largest message (default 64M)")
    p.add_argument("--extra-sizes", default="12K", help="comma list of sizes added to the sweep (12K: GLM-5 decode)")
    p.add_argument("-d", "--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--world", type=nonneg_int_arg, default=0, help="ranks (default: all visible GPUs)")
    p.add_argument("--transports", type=transports_arg, default=["p2p"], help="comma list of p2p,host (default p2p)")
    p.add_argument("--workspace-bytes", dest="workspace_bytes", type=positive_size_arg, default=64 * MB,
                   help="P2P workspace size: fastcomm rows stop above it (default 64M)")
    p.add_argument("--host-workspace-bytes", dest="host_workspace_bytes", type=positive_size_arg, default=4 * MB,
                   help="host-transport workspace size (default 4M)")
    p.add_argument("--no-symm", dest="symm", action="store_false", help="skip torch symmetric memory rows")
    p.add_argument("--no-vllm", dest="vllm", action="store_false", help="skip vLLM's custom all-reduce row")
    p.add_argument("--islands", action="store_true", help="add forced-island (hierarchical) one-shot and two-shot rows")
    p.add_argument("--fused", action="store_true", help="also time the fused all-reduce + RMSNorm")
    p.add_argument("--interleave", action="store_true",
                   help="also time each all-reduce right after a hidden x hidden GEMM (--interleave-tokens): "
                        "the cost it adds to a step, launch and graph-node effects included")
    p.add_argument("--interleave-tokens", type=_token_counts, default=[1, 8],
                   help="token counts of the --interleave rows (64: a 64-request decode step's 768 KB)")
    p.add_argument("--hidden", type=positive_int_arg, default=6144)
    p.add_argument("--only", action="append", help="only impls whose name contains this (repeatable)")
    p.add_argument("--json", help="write rows and metadata here, and the plot beside it (same name, .png)")
    p.add_argument("--plot", help="write the PNG plot here (default: beside --json)")
    p.add_argument("--label", default="", help="free text stored in the JSON (machine, env)")
    p.add_argument("--timeout", type=positive_float_arg, default=900)


PROG = "fastcomm bench"


def _check(opts) -> str | None:
    """Everything that can be wrong before the run, as one line (None: go)."""
    from fastcomm.config import Config

    try:
        extra = [parse_size(x) for x in opts.extra_sizes.split(",") if x.strip()]
        sizes(opts.min_bytes, opts.max_size, opts.factor)
    except ValueError as e:
        return f"-b/-e/-f/--extra-sizes: {e}"
    if any(x < 1 for x in extra):
        return "--extra-sizes: sizes must be at least 1 byte"
    # The ranks' workspaces, configured here first: a bad setting is one ConfigError line (run() prints it).
    Config.from_env(max_bytes=opts.workspace_bytes)
    if "host" in opts.transports:
        Config.from_env(max_bytes=min(opts.workspace_bytes, opts.host_workspace_bytes))
    named_plot = bool(opts.plot)
    if opts.json and not opts.plot:  # beside the JSON, where matplotlib is installed (the run says when not)
        opts.plot = str(Path(opts.json).with_suffix(".png"))
    for flag, path in (("--json", opts.json), ("--plot", opts.plot)):
        why = path and writable_file(path)
        if why:
            return f"{flag}: {why}"
    if named_plot:  # asked for by name: without matplotlib, say so before the run, not after
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            return '--plot: matplotlib is not installed (pip install -e ".[plot]")'
    return None


def run(opts) -> int:
    from fastcomm.config import ConfigError, read

    try:
        why = _check(opts)
        read("FASTCOMM_MAX_BYTES")  # overridden by the run's own sizes, but a typo in it is still the user's
        cache = read("FASTCOMM_CACHE_DIR")
    except ConfigError as e:
        why = str(e)
    if why:
        return fail(PROG, why)
    world, why = prepare_gpus(opts.world, cache)
    if why:
        return fail(PROG, why)
    import torch

    from fastcomm.spawn import run_ranks

    t0 = time.time()
    print("\n".join(table_header(world)), flush=True)
    results = run_ranks(bench_rank, world, opts, timeout=opts.timeout, backend="nccl")
    bad = {r: v for r, (s, v) in results.items() if s != "ok"}
    if bad:
        for r, v in sorted(bad.items()):
            print(f"--- rank {r} failed:\n{v}", file=sys.stderr)
        return 1
    rows = results[0][1]
    print(ratios(rows))
    if opts.json:
        meta = dict(world=world, label=opts.label, seconds=round(time.time() - t0, 1), torch=torch.__version__,
                    nccl=".".join(map(str, torch.cuda.nccl.version())), device=torch.cuda.get_device_name(0),
                    env={k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "FASTCOMM_", "TORCH_SYMM"))},
                    args={k: v for k, v in vars(opts).items() if k != "func"})
        with open(opts.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        print(f"wrote {opts.json}")
    if opts.plot:
        try:
            print(f"wrote {plot(rows, world, opts.plot, title=opts.label)}")
        except ImportError:
            print(f"{PROG}: no plot (matplotlib is not installed: pip install -e \".[plot]\")", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="fastcomm bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
