"""Markdown summary of benchmark JSON files (the tables in bench/RESULTS.md are made with this).

    python -m fastcomm_bench.summarize bench/results/RUN-p2p.json [--nop2p bench/results/RUN-nop2p.json]
"""
from __future__ import annotations

import argparse
import json

KB, MB = 1 << 10, 1 << 20
SIZES = (4 * KB, 12 * KB, 64 * KB, 256 * KB, 1 * MB, 4 * MB, 16 * MB, 64 * MB)


def _load(path):
    with open(path) as f:
        return json.load(f)


def _fmt(n):
    return f"{n // MB} MB" if n >= MB else f"{n // KB} KB"


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
        out.append(f"| {_fmt(s)} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in vals) + f" | {ratio} |")
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
    p = argparse.ArgumentParser()
    p.add_argument("p2p")
    p.add_argument("--nop2p")
    a = p.parse_args(argv)
    run = _load(a.p2p)
    rows = run["rows"]
    print(f"### P2P ({run['meta'].get('label', '')}; NCCL {run['meta'].get('nccl')}, torch {run['meta'].get('torch')})\n")
    print("Graph mode, us per call:\n")
    impls = ["fastcomm-auto", "fastcomm-one_shot", "fastcomm-two_shot", "nccl", "symm-one_shot", "symm-two_shot"]
    if any(r["impl"] == "vllm-custom-ar" for r in rows):
        impls.append("vllm-custom-ar")
    print(allreduce_table(rows, impls, "nccl"))
    print("\nfastcomm-auto / symm-one_shot:", ", ".join(
        f"{_fmt(s)} {_graph(rows, 'fastcomm-auto', s) / _graph(rows, 'symm-one_shot', s):.2f}"
        for s in SIZES if _graph(rows, "symm-one_shot", s) and _graph(rows, "fastcomm-auto", s)))
    print("\nFused all-reduce + residual + RMSNorm (P2P):\n")
    print(fused_table(rows))
    if a.nop2p:
        nrun = _load(a.nop2p)
        print(f"\n### Host transport vs NCCL_P2P_DISABLE=1 ({nrun['meta'].get('label', '')})\n")
        print(allreduce_table(nrun["rows"], ["fastcomm-host-auto", "fastcomm-host-one_shot", "fastcomm-host-two_shot",
                                             "nccl"], "nccl", SIZES[:6]))
        print("\nFused (host transport):\n")
        print(fused_table(nrun["rows"], "host-"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
