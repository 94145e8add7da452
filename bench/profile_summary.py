"""Where a decode step's GPU time goes, per backend, from vLLM's torch-profiler traces.

    python -m fastcomm_bench.profile_summary PROFILE_DIR [--backend NAME] [--json OUT]

PROFILE_DIR is what ``fastcomm bench-decode --profile-dir`` wrote: one folder per backend, each with one
Chrome trace per rank (``*.pt.trace.json.gz``). For every trace this reports the GPU window (first kernel
start to last kernel end), how much of it the GPU was busy, the all-reduce kernels' count and time (their
share of the window: what fastcomm can win), the busiest other kernels, and the host-side launch counts
(graph launches vs single kernel launches: a backend whose pieces stopped being replayed as CUDA graphs
shows many more kernel launches per step), and per CUDA-graph launch (one decode step when vLLM runs the
step as one full graph) the step's GPU span and the all-reduce share of it, prefill and host gaps excluded.

All-reduce kernels are told by name: NCCL's all-reduce, vLLM's custom all-reduce, torch symmetric memory,
fastcomm's ``fc_*`` kernels and FlashInfer's. Per graph step it also gives the time by kernel family
(``families_us``: the GGUF plugin's K-quant kernels, GEMMs, fused MoE, attention, norms, all-reduce, other),
so two backends' steps of the same shapes read side by side.
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

# NCCL's all-reduce kernels carry "AllReduce" in their names; its all-gathers (vLLM's logits) are not counted.
# fastcomm_standin: fastcomm_vllm.standin's kernel where a TP 8 shard's all-reduces would be.
# Not all-reduces: torch.compile's Triton kernels named after the ops they fuse around
# (triton_poi_fused_add_all_reduce_mul: the add after an all-reduce). fastcomm's K-quant kernels (fc_kq_*) are
# told apart by FAMILIES' order.
ALL_REDUCE = re.compile(r"^(?!triton_)(?:fc_|.*(?:allreduce|all_reduce|cross_device_reduce|one_shot|two_shot|"
                        r"multimem|lamport|oneshot|twoshot|fastcomm_standin))", re.IGNORECASE)
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
# Kernel families by name (first match wins; the rest is "other"), so a GGUF step and an FP8 step of the same
# shapes read side by side: vllm-gguf-plugin's kernels (mmvq.cuh's mul_mat_vec_q, mmq.cuh's mul_mat_q*,
# moe_vec.cuh's moe_vec_q, moe.cuh's moe_q*, the activations' quantize_q8_1, dequantize_block*), then the
# FP8 / bf16 path's GEMMs and fused MoE, attention, norms.
FAMILIES = (
    ("fastcomm K-quant", re.compile(r"^fc_kq_")),  # fastcomm.kquant's products, quantize and dequantize
    ("all-reduce", ALL_REDUCE),
    ("K-quant GEMV", re.compile(r"mul_mat_vec_q")),
    ("K-quant GEMM", re.compile(r"mul_mat_q\d|mul_mat_q_")),
    ("K-quant MoE", re.compile(r"moe_vec_q|moe_q\d|moe_q_")),
    ("activation quantize", re.compile(r"quantize_q8_1|quant.*fp8|fp8.*quant", re.IGNORECASE)),
    ("dequantize", re.compile(r"dequantize_block")),
    ("fused MoE", re.compile(r"fused_moe|moe_align|moe_sum|topk", re.IGNORECASE)),  # topk: grouped_topk too
    # Before GEMM: FlashAttention 3's kernels are cutlass templates (cutlass::device_kernel<flash::FlashAttnFwdSm90>).
    ("attention", re.compile(r"flash|fmha|mla|attn|attention|indexer|rotary|rope", re.IGNORECASE)),
    ("GEMM", re.compile(r"gemm|cutlass|xmma|nvjet|scaled_mm|cublas|gemv", re.IGNORECASE)),
    ("norm", re.compile(r"rms|norm", re.IGNORECASE)),
)


# A kernel's name in the per-step table, cut here: templated names (FlashAttention 3's, cutlass's) share long
# prefixes, which the other lists' 90 characters would merge where they differ past them.
KERNEL_NAME = 200


def family(name: str) -> str:
    return next((fam for fam, pat in FAMILIES if pat.search(name)), "other")
PROG = "python -m fastcomm_bench.profile_summary"
LAUNCHES = {"graph": re.compile(r"^cu(da)?GraphLaunch"), "kernel": re.compile(r"^cu(da)?LaunchKernel")}


def load_trace(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data.get("traceEvents", data) if isinstance(data, dict) else data


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def graph_steps(events: list[dict], gpu: list[dict], top_kernels: int = 4) -> dict | None:
    """Per full-step CUDA-graph launch (a decode step when vLLM runs it as one graph): its GPU span and the
    all-reduce kernels' time inside it, and the busiest other kernels' time per step. CUPTI gives a graph's
    kernels the correlation id of the cudaGraphLaunch that ran them, so the eager prefill and the host gaps
    between steps stay out."""
    launches = {e.get("args", {}).get("correlation") for e in events
                if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")
                and LAUNCHES["graph"].match(str(e.get("name", "")))}
    launches.discard(None)
    steps: dict[int, list[dict]] = defaultdict(list)
    for e in gpu:
        c = e.get("args", {}).get("correlation")
        if c in launches:
            steps[c].append(e)
    if not steps:
        return None
    # A prefill (or a batch beyond the full-graph sizes) runs as piecewise graphs: a few kernels each, one
    # layer's worth, not a step. A full decode-step graph holds by far the most kernels, so keep the graphs
    # of at least half the largest kernel count.
    most = max(len(kernels) for kernels in steps.values())
    full = [kernels for kernels in steps.values() if len(kernels) * 2 >= most]
    spans, ars, counts, nodes, idle, gaps = [], [], [], [], [], []
    # Other kernels per step too: a whole-trace total mixes the prefill's (large) calls with the decode
    # steps', so two backends' totals can differ where their steps do not.
    others: list[dict[str, float]] = []
    fams: list[dict[str, float]] = []
    every: list[dict[str, list[float]]] = []  # every kernel's calls in a step, the all-reduce's too
    for kernels in full:
        spans.append(max(float(e["ts"]) + float(e["dur"]) for e in kernels) - min(float(e["ts"]) for e in kernels))
        # Nodes and the GPU's idle time between them: a step of thousands of small kernels loses time to the
        # gaps between nodes, which neither bandwidth nor a faster all-reduce wins back.
        nodes.append(len(kernels))
        busy = _union_length([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels])
        idle.append(spans[-1] - busy)
        gaps.append(idle[-1] / max(1, len(kernels) - 1))
        per_name: dict[str, float] = defaultdict(float)
        per_family: dict[str, float] = defaultdict(float)
        calls: dict[str, list[float]] = defaultdict(list)
        ar = []
        for e in kernels:
            name, dur = str(e.get("name", "?")), float(e["dur"])
            fam = family(name)  # the all-reduce test included: one regex pass per kernel
            per_family[fam] += dur
            calls[name[:KERNEL_NAME]].append(dur)
            if fam == "all-reduce":
                ar.append(dur)
            else:
                per_name[name[:90]] += dur
        ars.append(sum(ar))
        counts.append(len(ar))
        others.append(per_name)
        fams.append(per_family)
        every.append(calls)
    span, ar = statistics.median(spans), statistics.median(ars)
    names = {n for per_name in others for n in per_name}
    medians = {n: statistics.median(per_name.get(n, 0.0) for per_name in others) for n in names}
    top = sorted(medians.items(), key=lambda nm: -nm[1])[:top_kernels]
    fam_medians = {f: round(statistics.median(pf.get(f, 0.0) for pf in fams), 1)
                   for f in {f for pf in fams for f in pf}}
    return {"steps": len(full), "piecewise_graphs_left_out": len(steps) - len(full),
            "median_span_us": round(span, 1), "median_all_reduce_us": round(ar, 1),
            "all_reduce_share": round(ar / span, 3) if span else None,
            "all_reduce_calls_per_step": statistics.median(counts),
            "nodes_per_step": statistics.median(nodes), "median_idle_us": round(statistics.median(idle), 1),
            "median_gap_us": round(statistics.median(gaps), 3),
            "top_other_kernels_us": [{"name": n, "median_us": round(m, 1)} for n, m in top],
            "families_us": dict(sorted(fam_medians.items(), key=lambda fm: -fm[1])),
            "kernels": step_kernels(every)}


def step_kernels(steps: list[dict[str, list[float]]]) -> list[dict]:
    """Every kernel of a graph step, by name: its family, its calls a step and its GPU time a step (medians over
    the steps; a kernel a step lacks counts 0 there), the busiest first. The whole table goes on record, so a
    lever (a kernel's calls x its time a call) can be read off a committed profile without its trace."""
    names = {n for calls in steps for n in calls}
    rows = []
    for n in names:
        us = statistics.median(sum(calls.get(n, ())) for calls in steps)
        count = statistics.median(len(calls.get(n, ())) for calls in steps)
        rows.append({"name": n, "family": family(n), "calls": count, "us": round(us, 1),
                     "us_a_call": round(us / count, 2) if count else None})
    return sorted(rows, key=lambda r: (-r["us"], r["name"]))


def summarize_events(events: list[dict], top: int = 8) -> dict:
    """Times in microseconds (Chrome traces are in us)."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS and "dur" in e]
    launches = {k: 0 for k in LAUNCHES}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver"):
            for k, pat in LAUNCHES.items():
                if pat.match(str(e.get("name", ""))):
                    launches[k] += 1
    if not gpu:
        return {"gpu_events": 0, "launches": launches}
    start = min(float(e["ts"]) for e in gpu)
    end = max(float(e["ts"]) + float(e["dur"]) for e in gpu)
    busy = _union_length([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu])
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in gpu:
        by_name[str(e.get("name", "?"))].append(float(e["dur"]))
    ar = {n: d for n, d in by_name.items() if family(n) == "all-reduce"}
    ar_durs = [x for d in ar.values() for x in d]
    others = sorted(((n, d) for n, d in by_name.items() if n not in ar), key=lambda nd: -sum(nd[1]))[:top]
    window = end - start
    return {
        "gpu_events": len(gpu),
        "window_us": round(window, 1),
        "busy_us": round(busy, 1),
        "busy_share": round(busy / window, 3) if window else None,
        "all_reduce": {
            "calls": len(ar_durs),
            "total_us": round(sum(ar_durs), 1),
            "share_of_window": round(sum(ar_durs) / window, 3) if window else None,
            "median_us": round(statistics.median(ar_durs), 2) if ar_durs else None,
            "kernels": {n[:90]: {"calls": len(d), "total_us": round(sum(d), 1),
                                 "median_us": round(statistics.median(d), 2)} for n, d in ar.items()},
        },
        "top_other_kernels": [{"name": n[:90], "calls": len(d), "total_us": round(sum(d), 1)} for n, d in others],
        "launches": launches,
        "graph_steps": graph_steps(events, gpu),
    }


def summarize_dir(root: Path, only: str | None = None) -> dict:
    """{backend: {trace file name: summary}} for every trace under ``root`` (or under ``root/only``)."""
    out: dict[str, dict] = {}
    base = root / only if only else root
    for trace in sorted(list(base.rglob("*.pt.trace.json.gz")) + list(base.rglob("*.pt.trace.json"))):
        backend = trace.relative_to(root).parts[0] if trace.parent != root else root.name
        out.setdefault(backend, {})[trace.name] = summarize_events(load_trace(trace))
    return out


def floor_ms(weight_bytes: float, copy_gbps: float) -> float:
    """The step's weight-read floor: every weight byte read once at the GPU's measured copy bandwidth."""
    return weight_bytes / (copy_gbps * 1e9) * 1e3


def print_summary(summary: dict, file=None, *, layers: int = 78, floor: float | None = None,
                  kernel_rows: int = 20) -> None:
    """``floor``: the weight-read floor (ms, ``floor_ms``) each graph step is set against; ``kernel_rows``: the
    step's busiest kernels printed (the JSON holds every one)."""
    file = file or sys.stdout
    print(f"{'backend':<16} {'trace':<28} {'window ms':>9} {'busy':>5} {'AR calls':>8} {'AR ms':>7} "
          f"{'AR share':>8} {'AR med us':>9} {'graphs':>6} {'kernels':>7}", file=file)
    for backend, traces in summary.items():
        for name, s in traces.items():
            if not s.get("gpu_events"):
                print(f"{backend:<16} {name[:28]:<28} (no GPU events)", file=file)
                continue
            ar = s["all_reduce"]
            print(f"{backend:<16} {name[:28]:<28} {s['window_us'] / 1e3:>9.2f} {s['busy_share']:>5.2f} "
                  f"{ar['calls']:>8} {ar['total_us'] / 1e3:>7.2f} {ar['share_of_window']:>8.3f} "
                  f"{ar['median_us'] if ar['median_us'] is not None else '-':>9} "
                  f"{s['launches']['graph']:>6} {s['launches']['kernel']:>7}", file=file)
            st = s.get("graph_steps")
            if st:
                print(f"{'':<16}   per graph step (median of {st['steps']}): span {st['median_span_us'] / 1e3:.2f} ms, "
                      f"all-reduce {st['median_all_reduce_us'] / 1e3:.3f} ms in {st['all_reduce_calls_per_step']:g} "
                      f"calls = {st['all_reduce_share']:.3f} of the step"
                      + (f" ({st['piecewise_graphs_left_out']} piecewise graphs left out)"
                         if st.get("piecewise_graphs_left_out") else ""), file=file)
                if "nodes_per_step" in st:
                    print(f"{'':<16}   {st['nodes_per_step']:g} nodes a step ({st['nodes_per_step'] / layers:.1f} a "
                          f"layer of {layers}), GPU idle between them {st['median_idle_us'] / 1e3:.3f} ms "
                          f"({st['median_gap_us']:.2f} us a gap)"
                          + (f"; weight-read floor {floor:.2f} ms, step {st['median_span_us'] / 1e3 / floor:.2f}x it"
                             if floor else ""), file=file)
                fams = st.get("families_us") or {}
                if fams:
                    print(f"{'':<16}   step by kernel family (ms): "
                          + ", ".join(f"{f} {us / 1e3:.3f}" for f, us in fams.items()), file=file)
                rows = st.get("kernels")
                if rows is None:  # a summary written before the per-step table
                    for k in st.get("top_other_kernels_us", []):
                        print(f"{'':<16}   step {k['median_us'] / 1e3:>7.3f} ms  {k['name']}", file=file)
                for k in (rows or [])[:kernel_rows]:
                    print(f"{'':<16}   step {k['us'] / 1e3:>7.3f} ms = {k['calls']:>5g} x {k['us_a_call'] or 0:>6.2f} us  "
                          f"{k['family']:<19} {k['name']}", file=file)
                if rows and len(rows) > kernel_rows:
                    rest = rows[kernel_rows:]
                    print(f"{'':<16}   step {sum(k['us'] for k in rest) / 1e3:>7.3f} ms = {sum(k['calls'] for k in rest):>5g} "
                          f"calls of {len(rest)} other kernels (the JSON lists them)", file=file)
            for n, k in ar["kernels"].items():
                print(f"{'':<16}   AR  {k['calls']:>5} x {k['median_us']:>7.2f} us  {n}", file=file)
            for k in s["top_other_kernels"][:4]:
                print(f"{'':<16}   top {k['calls']:>5}   {k['total_us'] / 1e3:>7.2f} ms  {k['name']}", file=file)


def step_diff(base: dict, other: dict) -> list[dict]:
    """Per kernel, the GPU time a graph step of ``other`` spends beyond ``base``'s (two summaries' graph_steps,
    e.g. the 4-request profile against the 1-request one: where a verify step's increment goes), the largest
    change first; a kernel one step lacks counts 0 there."""
    a = {k["name"]: k for k in base.get("kernels") or []}
    b = {k["name"]: k for k in other.get("kernels") or []}
    rows = []
    for name in set(a) | set(b):
        ka, kb = a.get(name, {}), b.get(name, {})
        rows.append({"name": name, "family": (kb or ka)["family"], "base_us": ka.get("us", 0.0),
                     "us": kb.get("us", 0.0), "delta_us": round(kb.get("us", 0.0) - ka.get("us", 0.0), 1),
                     "base_calls": ka.get("calls", 0), "calls": kb.get("calls", 0)})
    return sorted(rows, key=lambda r: (-abs(r["delta_us"]), r["name"]))


def _steps_of(summary: dict) -> dict | None:
    """The one trace's graph_steps of a summary (a saved --json of one backend and trace)."""
    found = [s["graph_steps"] for traces in summary.values() for s in traces.values() if s.get("graph_steps")]
    return found[0] if len(found) == 1 else None


def print_diff(base: dict, other: dict, rows: int = 20, file=None) -> None:
    file = file or sys.stdout
    fam: dict[str, float] = defaultdict(float)
    diff = step_diff(base, other)
    for r in diff:
        fam[r["family"]] += r["delta_us"]
    print(f"graph step: {base['median_span_us'] / 1e3:.3f} -> {other['median_span_us'] / 1e3:.3f} ms "
          f"({(other['median_span_us'] - base['median_span_us']) / 1e3:+.3f}), nodes {base.get('nodes_per_step', 0):g} "
          f"-> {other.get('nodes_per_step', 0):g}, GPU idle {base.get('median_idle_us', 0) / 1e3:.3f} -> "
          f"{other.get('median_idle_us', 0) / 1e3:.3f} ms", file=file)
    print("by family (ms): " + ", ".join(f"{f} {us / 1e3:+.3f}" for f, us in sorted(fam.items(), key=lambda x: -abs(x[1]))),
          file=file)
    for r in diff[:rows]:
        print(f"  {r['delta_us'] / 1e3:+8.3f} ms  {r['base_us'] / 1e3:7.3f} -> {r['us'] / 1e3:7.3f} ms  calls "
              f"{r['base_calls']:g} -> {r['calls']:g}  {r['family']:<19} {r['name']}", file=file)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("profile_dir", nargs="?")
    p.add_argument("--backend", default=None, help="only this backend's folder")
    p.add_argument("--json", default=None, help="write the summary here too")
    p.add_argument("--print", nargs="+", default=None, metavar="JSON", help="print summaries written earlier")
    p.add_argument("--diff", nargs=2, default=None, metavar=("BASE", "OTHER"),
                   help="two summaries written earlier (one trace each, e.g. the 1- and 4-request profiles): what "
                        "OTHER's graph step spends beyond BASE's, by kernel and family")
    p.add_argument("--layers", type=int, default=78, help="decoder layers a step runs (nodes a layer)")
    p.add_argument("--kernels", type=int, default=20, help="a graph step's busiest kernels printed (the JSON: all)")
    p.add_argument("--weight-bytes", type=float, default=None,
                   help="bytes of weights a step reads (e.g. the TP 8 shard's, from synth.plan) for the floor")
    p.add_argument("--copy-gbps", type=float, default=None,
                   help="the GPU's measured device-to-device copy bandwidth (GB/s) for the floor")
    args = p.parse_args(argv)
    if (args.weight_bytes is None) != (args.copy_gbps is None):
        return _error("--weight-bytes and --copy-gbps go together (the floor needs both)")
    if args.kernels < 0:
        return _error("--kernels must be 0 or more")
    if args.layers < 1 or (args.weight_bytes is not None and not (args.weight_bytes > 0 and args.copy_gbps > 0)):
        return _error("--layers, --weight-bytes and --copy-gbps must be positive")
    floor = floor_ms(args.weight_bytes, args.copy_gbps) if args.weight_bytes is not None else None
    if args.diff:
        steps = []
        for f in args.diff:
            try:
                st = _steps_of(json.loads(Path(f).read_text()))
            except OSError as e:
                return _error(f"--diff {f}: {e.strerror or e}")
            except (ValueError, AttributeError) as e:
                return _error(f"--diff {f}: not a summary ({e})")
            if st is None or "kernels" not in st:
                return _error(f"--diff {f}: needs one trace with graph steps and their kernel table")
            steps.append(st)
        print_diff(*steps, rows=args.kernels)
        return 0
    if args.print:
        summary = {}
        for f in args.print:
            try:
                summary.update(json.loads(Path(f).read_text()))
            except OSError as e:
                return _error(f"--print {f}: {e.strerror or e}")
            except ValueError as e:
                return _error(f"--print {f}: not JSON ({e})")
        print_summary(summary, layers=args.layers, floor=floor, kernel_rows=args.kernels)
        return 0
    if not args.profile_dir:
        return _error("name a PROFILE_DIR (what bench-decode --profile-dir wrote) or --print saved summaries")
    if not Path(args.profile_dir).is_dir():
        return _error(f"{args.profile_dir}: no such directory")
    summary = summarize_dir(Path(args.profile_dir), args.backend)
    if not summary:
        print(f"{PROG}: no traces under {args.profile_dir}", file=sys.stderr)
        return 1
    print_summary(summary, layers=args.layers, floor=floor, kernel_rows=args.kernels)
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(summary, indent=1))
        except OSError as e:
            return _error(f"--json {args.json}: {e.strerror or e}")
    return 0


def _error(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
