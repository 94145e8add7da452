"""Rank bodies for the vLLM integration tests (importable by spawned children), and a CPU spawn helper."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import traceback


def run_python(code: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter: plugin installation changes process-wide state (vLLM's platform
    class, sys.meta_path), which must not leak into other tests."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


# ---- CPU ranks over gloo ---------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_entry(fn, rank, world, port, env, queue):
    os.environ.update(env)
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        queue.put((rank, "ok", fn(rank, world)))
    except BaseException as e:  # report; never leave the parent waiting
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    queue.close()
    queue.join_thread()
    os._exit(0)


def run_cpu_ranks(fn, world: int, env: dict | None = None, timeout: float = 240) -> list:
    """``fn(rank, world)`` on ``world`` spawned gloo ranks, joined against one deadline; leftovers killed."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_cpu_entry, args=(fn, r, world, port, dict(env or {}), queue), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + timeout
    while len(results) < world and time.monotonic() < deadline:
        try:
            rank, status, value = queue.get(timeout=0.5)
            results[rank] = (status, value)
        except Exception:
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            results.setdefault(r, ("error", f"rank {r} killed at the {timeout:.0f} s deadline (hang?)"))
        p.join(5)
        results.setdefault(r, ("error", f"rank {r} exited with {p.exitcode} without reporting"))
    bad = {r: v for r, (s, v) in results.items() if s != "ok"}
    assert not bad, "\n".join(f"--- rank {r}:\n{v}" for r, v in sorted(bad.items()))
    return [results[r][1] for r in range(world)]


def cpu_communicator(rank: int, world: int) -> dict:
    """Our communicator on CPU gloo groups: no workspace on any rank, and vLLM's all-reduce still sums."""
    import torch
    import torch.distributed as dist

    from fastcomm_vllm.communicator import FastcommCudaCommunicator

    cpu = dist.new_group(backend="gloo")
    comm = FastcommCudaCommunicator(cpu_group=cpu, device=torch.device("cpu"), device_group=dist.group.WORLD,
                                    unique_name="tp:0")
    x = torch.full((4, 8), float(rank + 1))
    y = comm.all_reduce(x)
    other = FastcommCudaCommunicator(cpu_group=cpu, device=torch.device("cpu"), device_group=dist.group.WORLD,
                                     unique_name="pp:0")
    out = {"workspace": comm.fastcomm_workspace, "why_not": comm.fastcomm_why_not, "sum": y[0, 0].item(),
           "input_kept": x[0, 0].item(), "pp_why_not": other.fastcomm_why_not}
    comm.destroy()
    other.destroy()
    return out


# ---- GPU ranks (fastcomm.spawn: NCCL world + gloo group, one GPU per rank) -----------------------------

def gpu_vllm_tp(rank: int, world: int, gloo) -> dict:
    """vLLM's own distributed setup with the plugin installed: routing, graphs (captured twice), fusion."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.platforms.cuda import CudaPlatformBase

    from fastcomm_vllm import fusion, plugin
    from fastcomm_vllm.communicator import FastcommCudaCommunicator
    from numerics import rmsnorm_ref, ulp_stats

    plugin.install(CudaPlatformBase, fuse=True)  # the fusion is opt-in; this test covers it
    out = {}
    config = VllmConfig()
    config.kernel_config.ir_op_priority.set_default()  # as vLLM's workers do: the norm kernels they would run
    with set_current_vllm_config(config):
        ps.init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="nccl")
        ps.initialize_model_parallel(tensor_model_parallel_size=world)
        tp = ps.get_tp_group()
        comm = tp.device_communicator
        ws = comm.fastcomm_workspace
        assert isinstance(comm, FastcommCudaCommunicator), type(comm)
        assert ws is not None, comm.fastcomm_why_not
        out["describe"] = ws.describe()
        dev = torch.device("cuda", rank)
        expect = sum(range(1, world + 1))

        # Small message: fastcomm, exact for small integers (bf16 holds them exactly).
        x = torch.full((8, 4096), float(rank + 1), dtype=torch.bfloat16, device=dev)
        assert ws.can_all_reduce(x)
        y = tp.all_reduce(x)
        assert torch.equal(y, torch.full_like(x, expect)), y
        assert torch.equal(x, torch.full_like(x, rank + 1)), "input modified"
        # Larger than the workspace: vLLM's path, same answer.
        big = torch.full((ws.config.max_bytes // 2 + 4096,), float(rank + 1), dtype=torch.bfloat16, device=dev)
        assert not ws.can_all_reduce(big)
        assert torch.equal(tp.all_reduce(big), torch.full_like(big, expect))

        # Graphs the way vLLM makes them: one capture thrown away (memory profiling), then the real one.
        buf = torch.zeros((4, 4096), dtype=torch.bfloat16, device=dev)
        for attempt in range(2):
            with ps.graph_capture(dev) as ctx:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=ctx.stream):
                    res = tp.all_reduce(buf)
            if attempt == 0:
                del g, res
                torch.cuda.synchronize()
        for step in range(20):
            buf.fill_(float(rank + step))
            g.replay()
            torch.cuda.synchronize()
            want = float(sum(r + step for r in range(world)))
            assert torch.equal(res, torch.full_like(res, want)), (step, res[0, :4])
        out["graph_replays"] = 20

        # Fusion: the wrapped DSA helper and the compile-pass op against the unfused path.
        from vllm.ir.op import IrOp
        from vllm.model_executor.layers.layernorm import RMSNorm

        norm = RMSNorm(4096, eps=1e-5).to(device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(4096, device=dev, dtype=torch.bfloat16) + 0.5)
        gen = torch.Generator(device=dev).manual_seed(1234 + rank)
        torch.set_grad_enabled(False)  # as in vLLM's forward: the norm weight is a Parameter
        # Eager vLLM rounds once more than the compiled norm (before the weight): two ulps at most from it;
        # its CUDA kernel (vllm_c, eager without inductor) also rounds z before the norm: three.
        out["norm_priority"] = IrOp.registry["fused_add_rms_norm"].get_priority()
        eager_bound = 2.0 if out["norm_priority"][0] == "native" else 3.0
        for tokens in (1, 8, 64):
            h = torch.randn((tokens, 4096), generator=gen, device=dev, dtype=torch.bfloat16)
            residual = torch.randn((tokens, 4096), generator=torch.Generator(device=dev).manual_seed(7),
                                   device=dev, dtype=torch.bfloat16)
            reduced = tp.all_reduce(h)
            ref_out, ref_res = norm(reduced.clone(), residual.clone())
            wrapped = fusion.wrap_helper(lambda a, b, n: n(tp.all_reduce(a), b))
            f_out, f_res = wrapped(h, residual.clone(), norm)
            o_out, o_res = torch.ops.fastcomm_vllm.fused_all_reduce_rms_norm(h, residual, norm.weight, 1e-5,
                                                                            tp.unique_name)
            # Served, vLLM compiles this norm (tests/numerics.rmsnorm_ref, pinned on CPU by
            # test_fusion_numerics): the fused op follows that one, up to the order of the sum of squares.
            comp_out, comp_res = rmsnorm_ref(reduced, residual, norm.weight, 1e-5)
            assert torch.equal(comp_res, ref_res)
            for name, (a, b) in {"helper": (f_out, f_res), "op": (o_out, o_res)}.items():
                assert torch.equal(b, ref_res), (name, tokens, (b.float() - ref_res.float()).abs().max())
                ulps, exact = ulp_stats(a, comp_out)
                assert ulps <= 1.0 and exact >= 0.99, (name, tokens, "vs compiled norm", ulps, exact)
                eager_ulps, _ = ulp_stats(a, ref_out)
                assert eager_ulps <= eager_bound, (name, tokens, "vs eager norm", out["norm_priority"], eager_ulps)
                out[f"{name}_ulps_{tokens}"] = (ulps, exact, eager_ulps)
        ps.destroy_model_parallel()
    out["closed"] = ws.closed
    return out
