"""Markdown tables from `fastcomm bench --json` results (the tables in bench/RESULTS.md are made with this).

    python -m fastcomm_bench.summarize RUN-p2p.json [--nop2p RUN-nop2p.json]
"""
from __future__ import annotations

import argparse
import json
import sys

from fastcomm.units import KiB as KB
from fastcomm.units import MiB as MB
from fastcomm.units import format_size

SIZES = (4 * KB, 12 * KB, 64 * KB, 256 * KB, 1 * MB, 4 * MB, 16 * MB, 64 * MB)


PROG = "python -m fastcomm_bench.summarize"


class InputError(Exception):
    """A file that is not a `fastcomm bench --json` result: one line, exit status 2."""


def _load(path):
    try:
        with open(path) as f:
            run = json.load(f)
    except OSError as e:
        raise InputError(f"{path}: {e.strerror or e}") from None
    except ValueError as e:
        raise InputError(f"{path}: not JSON ({e})") from None
    if not isinstance(run, dict) or not isinstance(run.get("rows"), list):
        raise InputError(f"{path}: not a `fastcomm bench --json` result (no rows)")
    return run


def _graph(rows, impl, size):
    for r in rows:
        if r["impl"] == impl and r["size"] == size and r["redop"] == "sum":
            return r["graph_us"]
    return None


def allreduce_table(rows, impls, base, sizes=SIZES) -> str:
    head = "| size | " + " | ".join(impls) + f" | {impls[0]} / {base} |"
    out = [head, "|" + "---|" * (len(impls) + 2)]
    for s in sizes:
        vals = [_graph(rows, i, s) for i in impls]
        if vals[0] is None:
            continue
        b = _graph(rows, base, s)
        ratio = f"{vals[0] / b:.2f}" if b else "n/a"
        out.append(f"| {format_size(s)} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in vals) + f" | {ratio} |")
    return "\n".join(out)


def fused_table(rows, prefix="") -> str:
    out = ["| tokens x hidden | fused us | all-reduce + norm us | ratio | NCCL + norm us |", "|---|---|---|---|---|"]
    fused = {r["impl"].split(" ")[1]: r for r in rows if r["redop"] == "fused" and r["impl"].startswith(prefix + "fused ")}
    for shape, r in fused.items():
        un = next((x for x in rows if x["impl"] == f"{prefix}allreduce+norm {shape}"), None)
        nc = next((x for x in rows if x["impl"] == f"nccl+norm {shape}"), None)
        if un:
            out.append(f"| {shape} | {r['graph_us']:.2f} | {un['graph_us']:.2f} | {r['graph_us'] / un['graph_us']:.2f} | "
                       f"{nc['graph_us']:.2f} |" if nc else
                       f"| {shape} | {r['graph_us']:.2f} | {un['graph_us']:.2f} | {r['graph_us'] / un['graph_us']:.2f} | - |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("p2p", help="a `fastcomm bench --json` result with P2P")
    p.add_argument("--nop2p", help="one made with NCCL_P2P_DISABLE=1 (host transport rows)")
    a = p.parse_args(argv)
    try:
        run = _load(a.p2p)
        nrun = _load(a.nop2p) if a.nop2p else None
    except InputError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    rows = run["rows"]
    print(f"### P2P ({run['meta'].get('label', '')}; NCCL {run['meta'].get('nccl')}, torch {run['meta'].get('torch')})\n")
    print("Graph mode, us per call:\n")
    impls = ["fastcomm-auto", "fastcomm-one_shot", "fastcomm-two_shot", "nccl", "symm-one_shot", "symm-two_shot"]
    # Kernels newer than some results files: a column where the run has them.
    impls[3:3] = [i for i in ("fastcomm-two_shot_ll", "fastcomm-pull") if any(r["impl"] == i for r in rows)]
    if any(r["impl"] == "vllm-custom-ar" for r in rows):
        impls.append("vllm-custom-ar")
    print(allreduce_table(rows, impls, "nccl"))
    print("\nfastcomm-auto / symm-one_shot:", ", ".join(
        f"{format_size(s)} {_graph(rows, 'fastcomm-auto', s) / _graph(rows, 'symm-one_shot', s):.2f}"
        for s in SIZES if _graph(rows, "symm-one_shot", s) and _graph(rows, "fastcomm-auto", s)))
    print("\nFused all-reduce + residual + RMSNorm (P2P):\n")
    print(fused_table(rows))
    if nrun is not None:
        print(f"\n### Host transport vs NCCL_P2P_DISABLE=1 ({nrun['meta'].get('label', '')})\n")
        print(allreduce_table(nrun["rows"], ["fastcomm-host-auto", "fastcomm-host-one_shot", "fastcomm-host-two_shot",
                                             "nccl"], "nccl", SIZES[:6]))
        print("\nFused (host transport):\n")
        print(fused_table(nrun["rows"], "host-"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
