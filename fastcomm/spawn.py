"""Run a function on N local ranks (one process each) with a deadline; kill whatever is left.

The failure we hunt in a collective library is a deadlock, so the harness never waits unboundedly: it
joins every rank against one deadline, kills survivors, and reports each rank's outcome. The one harness
for `fastcomm tune`, the benchmarks and every test suite.

Backends:
- ``nccl``: one GPU per rank; an NCCL world (for baselines and references) plus a gloo group for fastcomm.
- ``shared``: ranks share GPUs (rank r on GPU r % count), a gloo world only. Test mode: it sets
  FASTCOMM_TEST_MODE=1 and FASTCOMM_TEST_SHARED_GPU=1, the switches that let several ranks' workspaces sit
  on one device (CUDA IPC between processes of one device works; the GPU time-slices their kernels). NCCL
  refuses two ranks on one GPU, so bodies compute references on the CPU there.
- ``gloo``: CPU only.
- ``auto``: ``nccl`` when there are at least ``world`` GPUs, else ``shared``.
"""
from __future__ import annotations

import os
import socket
import time
import traceback

import torch.multiprocessing as mp

BACKENDS = ("auto", "nccl", "shared", "gloo")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_backend(backend: str, world: int) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    import torch

    return "nccl" if torch.cuda.device_count() >= world else "shared"


def _entry(fn, rank, world, port, env, queue, args, backend):
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    try:
        import torch
        import torch.distributed as dist

        if backend == "nccl":  # one GPU per rank; the bodies also get a gloo group for fastcomm's handshake
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
            gloo = dist.new_group(backend="gloo")
        else:
            if backend == "shared":
                torch.cuda.set_device(rank % torch.cuda.device_count())
            dist.init_process_group("gloo", rank=rank, world_size=world)
            gloo = dist.group.WORLD
        result = fn(rank, world, gloo, *args)
        queue.put((rank, "ok", result))
    except BaseException as e:  # report, do not hang the parent
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    # Skip NCCL/CUDA teardown: after a deliberate timeout the context is dead and teardown could block.
    # Workspaces are closed by the bodies themselves; the OS reclaims IPC mappings with the process.
    queue.close()
    queue.join_thread()
    os._exit(0)


def run_ranks(fn, world: int, *args, timeout: float = 300.0, env: dict | None = None,
              allow_exit: tuple[int, ...] = (), backend: str = "auto") -> dict[int, tuple[str, object]]:
    """Run ``fn(rank, world, gloo_group, *args)`` on ``world`` spawned ranks; return {rank: (status, value)}.

    Ranks listed in ``allow_exit`` may die without reporting (tests that kill a rank on purpose).
    """
    backend = resolve_backend(backend, world)
    env = dict(env or {})
    if backend == "shared":
        env.setdefault("FASTCOMM_TEST_MODE", "1")
        env.setdefault("FASTCOMM_TEST_SHARED_GPU", "1")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, env, queue, args, backend), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout
    expected = set(range(world))
    while time.monotonic() < deadline and set(results) | set(r for r in allow_exit if not procs[r].is_alive()) != expected:
        try:
            rank, status, value = queue.get(timeout=0.5)
            results[rank] = (status, value)
        except Exception:
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results and r not in allow_exit]
            if dead:
                time.sleep(1.0)  # a late message may still be in the pipe
                while not queue.empty():
                    rank, status, value = queue.get()
                    results[rank] = (status, value)
                for r in dead:
                    results.setdefault(r, ("error", f"rank {r} died with exit code {procs[r].exitcode}"))
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            results.setdefault(r, ("error", f"rank {r} killed at the {timeout:.0f} s deadline (hang?)"))
        p.join(5)
    return results


def check_all_ok(results: dict) -> list:
    bad = {r: v for r, (s, v) in results.items() if s != "ok"}
    assert not bad, "\n".join(f"--- rank {r}:\n{v}" for r, v in sorted(bad.items()))
    return [results[r][1] for r in sorted(results)]
