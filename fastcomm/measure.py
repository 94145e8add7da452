"""Measuring helpers shared by `fastcomm tune` and the benchmarks in bench/: the size sweep, timers, the
exact-result check, and the commit a result file names. torch is imported by the callers (passed in), so importing this module is cheap."""
from __future__ import annotations

import contextlib
import statistics
import subprocess
from pathlib import Path


MAX_POINTS = 1000  # a sweep longer than this is a typo (-f 1.0001), and would run for days


def sizes(lo: int, hi: int, factor: float) -> list[int]:
    """lo, lo*factor, ... up to hi (factor <= 1: lo, 2lo, 3lo, ...). Refuses sweeps that would never end
    (lo < 1 never grows) or that hold more than MAX_POINTS sizes."""
    if lo < 1 or hi < lo:
        raise ValueError(f"size range {lo}..{hi}: need 1 <= min <= max")
    if not 0 < factor < float("inf"):
        raise ValueError(f"step factor {factor} must be a finite number > 0")
    if 1 < factor < 1.01:  # below this the float product barely moves and the sweep crawls
        raise ValueError(f"step factor {factor}: use at least 1.01 (or <= 1 for steps of min)")
    out, s = [], lo
    while s <= hi:
        if not out or int(s) != out[-1]:
            out.append(int(s))
        if len(out) > MAX_POINTS:
            raise ValueError(f"sizes {lo}..{hi} with step factor {factor} make more than {MAX_POINTS} points")
        s = s * factor if factor > 1 else s + lo
    return out


def timers(torch, fn, calls: int, iters: int, warmup: int, graph: bool, capture_ctx=None) -> float:
    """Median microseconds per call: graph replays of `calls` calls, or eager loops of `calls` calls.

    ``capture_ctx`` wraps the graph capture (vLLM's custom all-reduce registers captured buffers on exit).
    """
    import torch.distributed as dist

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
        if graph:
            g = torch.cuda.CUDAGraph()
            with (capture_ctx() if capture_ctx else contextlib.nullcontext()):
                with torch.cuda.graph(g, stream=s):
                    for _ in range(calls):
                        fn()
        run = g.replay if graph else (lambda: [fn() for _ in range(calls)])
        for _ in range(warmup):
            run()
        torch.cuda.synchronize()
        if dist.is_available() and dist.is_initialized():  # ranks start together; one process has none to wait for
            dist.barrier()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(iters):
            e0.record(s)
            run()
            e1.record(s)
            e1.synchronize()
            times.append(e0.elapsed_time(e1) * 1000.0 / calls)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    return statistics.median(times)


def check_exact(torch, fn, out, inp, rank) -> int:
    """#wrong: elements differing from the exact sum of small integers (the in-place baselines too)."""
    import torch.distributed as dist

    n = inp.numel()
    base = (torch.arange(n, device=inp.device) % 7 - 3).to(inp.dtype)
    inp.copy_(base * (rank + 1))
    res = fn()
    got = out if out is not None else res
    torch.cuda.synchronize()
    world = dist.get_world_size()
    want = (base.float() * (world * (world + 1) // 2)).to(inp.dtype)
    return int((got != want).sum().item())


def source_commit(given: str | None = None) -> str | None:
    """The fastcomm commit results come from: ``given`` where the caller has it (the scripts' FASTCOMM_COMMIT:
    a device machine's copy of the tree can carry stale git metadata), else the checkout's HEAD."""
    if given:
        return given
    try:
        r = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short=12", "HEAD"],
                           capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (r.stdout.strip() or None) if r.returncode == 0 else None
