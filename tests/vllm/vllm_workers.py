"""Rank bodies for the vLLM integration tests (importable by the children of ``fastcomm.spawn.run_ranks``)."""
from __future__ import annotations

import os
import subprocess
import sys


def run_python(code: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter: plugin installation changes process-wide state (vLLM's platform
    class, sys.meta_path), which must not leak into other tests."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


# ---- CPU ranks (fastcomm.spawn.run_ranks with backend="gloo": one deadline, survivors killed) ------------

def cpu_communicator(rank: int, world: int, group) -> dict:
    """Our communicator on CPU gloo groups: no workspace on any rank, and vLLM's all-reduce still sums."""
    import torch

    from fastcomm_vllm.communicator import FastcommCudaCommunicator

    def make(name):
        return FastcommCudaCommunicator(cpu_group=group, device=torch.device("cpu"), device_group=group,
                                        unique_name=name)

    comm, other = make("tp:0"), make("pp:0")
    base = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    x = base * (rank + 1)
    kept = x.clone()
    y = comm.all_reduce(x)
    reference = base * sum(r + 1 for r in range(world))  # exact: small integers
    out = {"workspace": comm.fastcomm_workspace, "why_not": comm.fastcomm_why_not,
           "sum_error": (y - reference).abs().max().item(), "input_changed": not torch.equal(x, kept),
           "pp_why_not": other.fastcomm_why_not}
    out["timeouts"] = timeout_reporting(comm)
    comm.destroy()
    other.destroy()
    return out


class FakeWorkspace:
    """The part of ``fastcomm.Workspace`` the communicator uses around a device-side timeout: ``watch``
    (the real one calls back from a daemon thread once the pinned error record is set) and its record."""

    def __init__(self, group=None, device=None):
        self.message: str | None = None
        self.watchers: list = []
        self.closed = False

    def watch(self, callback) -> None:
        self.watchers.append(callback)

    def record(self, message: str) -> None:  # what the kernel's trap leaves behind
        self.message = message
        for callback in self.watchers:
            callback(message)

    def describe(self) -> str:
        return "fake workspace"

    def close(self) -> None:
        self.closed = True


def timeout_reporting(comm) -> dict:
    """What reaches vLLM when a device-side timeout kills the context: run the communicator against a fake
    workspace (this machine has no GPU) and a ``fastcomm.translate_error`` that reads it, as the real one
    reads every open workspace of the process."""
    import logging

    import fastcomm
    import torch

    ws_made = []

    def workspace(group, device):
        ws_made.append(FakeWorkspace(group, device))
        return ws_made[-1]

    def translate_error(exc=None):
        ws = ws_made[-1] if ws_made else None
        return fastcomm.FastcommTimeoutError(ws.message) if ws is not None and ws.message else None

    fastcomm.Workspace, fastcomm.translate_error = workspace, translate_error  # this child process only
    seen: list[tuple[str, str]] = []

    class Capture(logging.Handler):
        def emit(self, record):
            seen.append((record.levelname, record.getMessage()))

    logger = logging.getLogger("vllm.fastcomm")
    logger.addHandler(Capture())
    comm._local_reason = lambda: None  # as on a GPU rank: fastcomm usable here
    ws, why_not = comm._open_workspace()  # collective, like the real construction
    comm.fastcomm_workspace = ws
    out = {"opened": ws is not None and why_not is None}

    cuda_failure = RuntimeError("CUDA error: unspecified launch failure")

    def failing_launch(x, ws):
        raise cuda_failure

    comm._fastcomm_try = failing_launch
    x = torch.ones(4)

    def outcome():
        try:
            comm.all_reduce(x)
        except Exception as e:
            return {"type": type(e).__name__, "message": str(e), "same": e is cuda_failure,
                    "cause": type(e.__cause__).__name__ if e.__cause__ is not None else None}
        return None

    out["no_record"] = outcome()  # no timeout recorded: CUDA's error is someone else's, passed on unchanged
    message = (f"fastcomm: rank {comm.rank_in_group} timed out after 3 s waiting for peer rank "
               f"{1 - comm.rank_in_group} in the one-shot exchange")
    ws.record(message)
    out["logged"] = [m for m in seen if m[1] == message]
    out["recorded"] = outcome()
    own = fastcomm.FastcommTimeoutError("fastcomm: its own words")

    def fastcomm_raises(x, ws):
        raise own

    comm._fastcomm_try = fastcomm_raises
    out["fastcomm_own"] = outcome()
    return out


# ---- GPU ranks (fastcomm.spawn: NCCL world + gloo group, one GPU per rank) -----------------------------

def gpu_vllm_tp(rank: int, world: int, gloo, replays: int) -> dict:
    """vLLM's own distributed setup with the plugin installed: routing, graphs (captured twice), fusion.

    Returns what it observed: per graph replay, the largest difference from a CPU reference."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.platforms.cuda import CudaPlatformBase

    from fastcomm_vllm import helper_route, plugin
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
        def pattern(r, step):  # small integers, different per rank, element and step: exact in bf16
            return ((torch.arange(buf.numel()).reshape(buf.shape) * (r + 1) + step) % 31).to(torch.bfloat16)

        out["replay_errors"] = []
        for step in range(replays):
            buf.copy_(pattern(rank, step))  # the input changes between replays
            g.replay()
            torch.cuda.synchronize()
            want = sum(pattern(r, step).double() for r in range(world))  # CPU reference
            out["replay_errors"].append((res.cpu().double() - want).abs().max().item())

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
            wrapped = helper_route.wrap_helper(lambda a, b, n: n(tp.all_reduce(a), b))
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
            out[f"why_not_fused_{tokens}"] = ws.why_not_fused(h, residual)

        # Above the fused op's range (fastcomm's policy table) both routes must give the unfused answer:
        # the helper its original, the op the group's all-reduce then vLLM's norm.
        above = next((t for t in (128, 256, 512, 1024, 2048, 4096, 8192) if ws.why_not_fused(
            torch.empty((t, 4096), dtype=torch.bfloat16, device=dev)) is not None), None)
        out["above_fused_range"] = None
        if above is not None:
            h = torch.randn((above, 4096), generator=gen, device=dev, dtype=torch.bfloat16)
            residual = torch.randn((above, 4096), generator=gen, device=dev, dtype=torch.bfloat16)
            ref_out, ref_res = norm(tp.all_reduce(h), residual.clone())
            f_out, f_res = helper_route.wrap_helper(lambda a, b, n: n(tp.all_reduce(a), b))(h, residual.clone(), norm)
            o_out, o_res = torch.ops.fastcomm_vllm.fused_all_reduce_rms_norm(h, residual, norm.weight, 1e-5,
                                                                            tp.unique_name)
            out["above_fused_range"] = {
                "tokens": above, "why_not": ws.why_not_fused(h, residual),
                "helper_equal": torch.equal(f_out, ref_out) and torch.equal(f_res, ref_res),
                "op_residual_equal": torch.equal(o_res, ref_res), "op_ulps": ulp_stats(o_out, ref_out)[0]}
        ps.destroy_model_parallel()
    out["closed"] = ws.closed
    return out
