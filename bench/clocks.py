"""GPU clocks while a benchmark ran, from `nvidia-smi --query-gpu` samples.

Why: in the end-to-end runs the same MoE kernel took 47 to 69 us per call depending on the run, and the
rows of one backend were fast or slow as a block. Clock or power state is one candidate cause; sampling
the clocks beside each backend lets a report tell it from a communicator effect. Read-only: the clocks
are observed, never set (the device machines are shared).

    python -m fastcomm_bench.clocks SAMPLES.csv [...]      # one line per file and GPU

SAMPLES.csv is what `device_decode.sh` records per backend:
    nvidia-smi --query-gpu=index,clocks.sm,clocks.mem,power.draw,utilization.gpu --format=csv,noheader,nounits -lms 500
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

QUERY = "index,clocks.sm,clocks.mem,power.draw,utilization.gpu"
BUSY_UTIL = 50  # percent: samples below this are start-up, compile or idle, not the timed decode


def parse(text: str) -> dict[int, list[tuple[float, float, float, float]]]:
    """Samples per GPU index: (sm MHz, mem MHz, watts, util %). Lines nvidia-smi could not fill are skipped."""
    per_gpu: dict[int, list[tuple[float, float, float, float]]] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(QUERY.split(",")):
            continue
        try:
            idx = int(parts[0])
            vals = tuple(float(p) for p in parts[1:])
        except ValueError:  # "[N/A]", "[Not Supported]", a header line
            continue
        per_gpu.setdefault(idx, []).append(vals)
    return per_gpu


def summarize(text: str, busy_util: float = BUSY_UTIL) -> dict[int, dict]:
    """Per GPU, over the busy samples: median and lowest SM clock, median memory clock and power."""
    out = {}
    for idx, samples in sorted(parse(text).items()):
        busy = [s for s in samples if s[3] >= busy_util]
        row = {"samples": len(samples), "busy_samples": len(busy)}
        if busy:
            row.update(sm_mhz_median=statistics.median(s[0] for s in busy), sm_mhz_min=min(s[0] for s in busy),
                       mem_mhz_median=statistics.median(s[1] for s in busy),
                       power_w_median=round(statistics.median(s[2] for s in busy), 1))
        out[idx] = row
    return out


def format_line(name: str, summary: dict[int, dict]) -> str:
    parts = []
    for idx, r in summary.items():
        if r["busy_samples"]:
            parts.append(f"GPU{idx} SM {r['sm_mhz_median']:.0f} MHz (min {r['sm_mhz_min']:.0f}), "
                         f"mem {r['mem_mhz_median']:.0f}, {r['power_w_median']:.0f} W, {r['busy_samples']} busy samples")
        else:
            parts.append(f"GPU{idx} no busy samples ({r['samples']} in all)")
    return f"{name}: " + "; ".join(parts) if parts else f"{name}: no samples"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastcomm_bench.clocks", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--busy-util", type=float, default=BUSY_UTIL, help="utilization %% that counts as busy")
    args = p.parse_args(argv)
    for f in args.files:
        try:
            text = f.read_text(errors="replace")
        except OSError as e:
            print(f"{p.prog}: error: {f}: {e.strerror or e}", file=sys.stderr)
            return 2
        print(format_line(f.stem, summarize(text, args.busy_util)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
