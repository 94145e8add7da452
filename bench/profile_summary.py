"""Where a decode step's GPU time goes, per backend, from vLLM's torch-profiler traces.

    python -m bench.profile_summary PROFILE_DIR [--json OUT]

PROFILE_DIR is what ``fastcomm bench-decode --profile-dir`` wrote: one folder per backend, each with one
Chrome trace per rank (``*.pt.trace.json.gz``). For every trace this reports the GPU window (first kernel
start to last kernel end), how much of it the GPU was busy, the all-reduce kernels' count and time (their
share of the window: what fastcomm can win), the busiest other kernels, and the host-side launch counts
(graph launches vs single kernel launches: a backend whose pieces stopped being replayed as CUDA graphs
shows many more kernel launches per step).

All-reduce kernels are told by name: NCCL's, vLLM's custom all-reduce, torch symmetric memory, fastcomm's
``fc_*`` kernels and FlashInfer's.
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

ALL_REDUCE = re.compile(r"nccl|allreduce|all_reduce|cross_device_reduce|one_shot|two_shot|multimem|"
                        r"^fc_|lamport|oneshot|twoshot", re.IGNORECASE)
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
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
    ar = {n: d for n, d in by_name.items() if ALL_REDUCE.search(n)}
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
    }


def summarize_dir(root: Path, only: str | None = None) -> dict:
    """{backend: {trace file name: summary}} for every trace under ``root`` (or under ``root/only``)."""
    out: dict[str, dict] = {}
    base = root / only if only else root
    for trace in sorted(list(base.rglob("*.pt.trace.json.gz")) + list(base.rglob("*.pt.trace.json"))):
        backend = trace.relative_to(root).parts[0] if trace.parent != root else root.name
        out.setdefault(backend, {})[trace.name] = summarize_events(load_trace(trace))
    return out


def print_summary(summary: dict, file=None) -> None:
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
            for n, k in ar["kernels"].items():
                print(f"{'':<16}   AR  {k['calls']:>5} x {k['median_us']:>7.2f} us  {n}", file=file)
            for k in s["top_other_kernels"][:4]:
                print(f"{'':<16}   top {k['calls']:>5}   {k['total_us'] / 1e3:>7.2f} ms  {k['name']}", file=file)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile_summary", description=__doc__.split("\n\n")[0])
    p.add_argument("profile_dir", nargs="?")
    p.add_argument("--backend", default=None, help="only this backend's folder")
    p.add_argument("--json", default=None, help="write the summary here too")
    p.add_argument("--print", nargs="+", default=None, metavar="JSON", help="print summaries written earlier")
    args = p.parse_args(argv)
    if args.print:
        summary = {}
        for f in args.print:
            summary.update(json.loads(Path(f).read_text()))
        print_summary(summary)
        return 0
    if not args.profile_dir:
        p.error("profile_dir is required")
    summary = summarize_dir(Path(args.profile_dir), args.backend)
    if not summary:
        print(f"profile_summary: no traces under {args.profile_dir}", file=sys.stderr)
        return 1
    print_summary(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
