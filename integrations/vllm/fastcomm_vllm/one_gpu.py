"""Test harness: vLLM at tensor parallel N with every rank on one GPU (FASTCOMM_TEST_MODE=1 only).

NCCL refuses two ranks on one GPU, and vLLM maps rank r to GPU r. So that TP 2-8 can be tested where one GPU
is lent, ``engine_kwargs(tp)`` gives ``vllm.LLM`` (or ``vllm serve``):
- ``worker_cls`` = ``OneGpuWorker``: vLLM's GPU worker with every rank on device 0, torch.distributed on gloo
  (vLLM's device group then needs no NCCL), and this module's communicator for every group;
- ``OneGpuCommunicator``: fastcomm's vLLM communicator (its all-reduce is fastcomm's, in shared-GPU test mode:
  ranks' workspaces on one GPU, captured in CUDA graphs as on the user's box), with vLLM's NCCL, custom
  all-reduce and symmetric-memory setup skipped and every other collective (and an all-reduce fastcomm
  declines) done on the CPU over the group's gloo group. A declined all-reduce cannot be captured: a graph
  capture that meets one fails, which is the point (none may fall back silently);
- the multiprocessing executor (vLLM checks the GPU count only when it picks the executor itself), and a
  fixed KV-cache size (vLLM's memory profiling would count the other ranks' memory as its own).
Every all-reduce is counted by forward pass and destination (``counts``, through ``LLM.collective_rpc``).
"""
from __future__ import annotations

import inspect
import itertools
import logging
import os
import time

import torch
import torch.distributed as dist

from .communicator import FastcommCudaCommunicator

logger = logging.getLogger("vllm.fastcomm")

WORKER = "fastcomm_vllm.one_gpu.OneGpuWorker"
COMMUNICATOR = "fastcomm_vllm.one_gpu.OneGpuCommunicator"
FASTCOMM, FALLBACK = "fastcomm", "fallback"


def require_test_mode() -> None:
    from fastcomm.config import Config

    if not Config.from_env().test_mode:
        raise RuntimeError("fastcomm_vllm.one_gpu is a test harness (every rank on one GPU): it needs "
                           "FASTCOMM_TEST_MODE=1")


def environment() -> dict[str, str]:
    """What the engine's processes need in their environment (set before vLLM starts them)."""
    return {"FASTCOMM_TEST_MODE": "1", "FASTCOMM_TEST_SHARED_GPU": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}


def engine_kwargs(tp: int, kv_cache_bytes: int = 1 << 30, memory_fraction: float | None = None) -> dict:
    """kwargs for ``vllm.LLM`` at tensor parallel ``tp`` on one GPU (see the module text)."""
    require_test_mode()
    os.environ.update(environment())
    kwargs = {"tensor_parallel_size": tp, "kv_cache_memory_bytes": kv_cache_bytes,
              "disable_custom_all_reduce": True,
              "gpu_memory_utilization": memory_fraction or min(0.9, 0.8 / tp)}
    if tp > 1:
        kwargs.update(distributed_executor_backend="mp", worker_cls=WORKER)
    return kwargs


def serve_args(tp: int, kv_cache_bytes: int = 1 << 30) -> list[str]:
    """``engine_kwargs`` as ``vllm serve`` options (what ``fastcomm-serve`` passes on), in the same order."""
    out = []
    for name, value in engine_kwargs(tp, kv_cache_bytes).items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            out.append(flag)
        elif name != "tensor_parallel_size":  # fastcomm-serve's own -tp, given beside these
            out += [flag, str(value)]
    return out


def _worker_base():
    from vllm.v1.worker.gpu_worker import Worker

    return Worker


class OneGpuWorker(_worker_base()):
    """vLLM's GPU worker, every rank on device 0 and torch.distributed on gloo."""

    def init_device(self):
        require_test_mode()
        from vllm.platforms import current_platform

        platform = type(current_platform)
        platform.dist_backend = "gloo"
        platform.get_device_communicator_cls = classmethod(lambda cls: COMMUNICATOR)
        self.local_rank = 0
        from fastcomm.config import Config

        if Config.from_env().test_swap_shards:
            swap_gate_up_of_layer_0()
        return super().init_device()

    def fastcomm_counts(self) -> dict:
        """``counts`` by name, for ``LLM.collective_rpc("fastcomm_counts")`` (vLLM serializes no functions)."""
        return {**counts(), "routing": getattr(self, "_fastcomm_routing", [])}

    def load_model(self, *args, **kwargs):
        out = super().load_model(*args, **kwargs)
        from fastcomm.config import Config

        if Config.from_env().test_routing and self.rank == 0:  # every rank routes alike: rank 0 records
            self._fastcomm_routing = record_routing(self.model_runner.get_model(),
                                                   self.vllm_config.model_config.hf_config.num_experts_per_tok)
        return out

    def determine_available_memory(self, *args, **kwargs):
        # The first forward (the profile run) follows: the start-up skew test delays one rank here.
        from fastcomm.config import Config

        delay = Config.from_env().test_startup_delay
        if delay is not None and delay[0] == self.rank:
            logger.warning("fastcomm test: rank %d waits %.0f s before its first forward", self.rank, delay[1])
            time.sleep(delay[1])
        return super().determine_available_memory(*args, **kwargs)


ROUTING_MAX_TOKENS = 8  # decode and verify steps; warm-up and prefill forwards are not recorded


def routing_choice(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int) -> tuple[list, list]:
    """GLM-5's routing (sigmoid scores plus the correction bias, one group) of router ``logits`` [tokens,
    experts]: per token, the top_k experts in order, and the margin (in score) between the last one chosen and
    the first one not."""
    choice = torch.sigmoid(logits.float())
    if bias is not None:
        choice = choice + bias.float()
    ranked = choice.sort(dim=-1, descending=True)
    margin = ranked.values[:, top_k - 1] - ranked.values[:, top_k]
    return ranked.indices[:, :top_k].tolist(), margin.tolist()


def record_routing(model, top_k: int) -> list[dict]:
    """FASTCOMM_TEST_ROUTING: a pre-forward hook on each MoE layer (a module with ``gate`` and ``experts``) that
    recomputes its router's choice from the layer's input in fp32 (eager forwards only: a graph replay runs no
    hooks). Returns the list the records go to."""
    records: list[dict] = []

    def hook(name, module, args):
        x = args[0] if args else None
        if (not isinstance(x, torch.Tensor) or torch.compiler.is_compiling()
                or (x.is_cuda and torch.cuda.is_current_stream_capturing())):
            return
        x = x.view(-1, x.shape[-1])
        if x.shape[0] > ROUTING_MAX_TOKENS:  # a mark only: where the prompt's prefill was
            records.append({"forward": _forward_id(), "module": name, "tokens": int(x.shape[0])})
            return
        gate = module.gate
        logits = x.float() @ gate.weight.float().t()
        experts, margin = routing_choice(logits, getattr(gate, "e_score_correction_bias", None), top_k)
        records.append({"forward": _forward_id(), "module": name, "tokens": int(x.shape[0]),
                        "experts": experts, "margin": margin})

    for name, m in model.named_modules():
        weight = getattr(getattr(m, "gate", None), "weight", None)
        if hasattr(m, "experts") and isinstance(weight, torch.Tensor) and weight.is_floating_point():
            m.register_forward_pre_hook(lambda mod, args, name=name: hook(name, mod, args))
    return records


def swap_gate_up_of_layer_0() -> None:
    """The negative control: layer 0's gate and up shards (same shape and type, so a wrong order loads and
    runs, silently wrong) handed over under each other's names."""
    from .gguf import weights

    original = weights.iter_weights
    if getattr(original, "_fastcomm_swapped", False):
        return
    a, b = "model.layers.0.mlp.gate_proj.", "model.layers.0.mlp.up_proj."

    def swapped(*args, **kwargs):
        for name, tensor in original(*args, **kwargs):
            yield (b + name[len(a):] if name.startswith(a) else a + name[len(b):] if name.startswith(b)
                   else name), tensor

    swapped._fastcomm_swapped = True
    weights.iter_weights = swapped


def _base_init_args(args, kwargs):
    from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase

    params = inspect.signature(DeviceCommunicatorBase.__init__).parameters
    return DeviceCommunicatorBase, {k: v for k, v in kwargs.items() if k in params}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bits as integers (NaN payloads and -0.0 compare exactly)."""
    return t.contiguous().view(-1).view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


_FORWARDS = itertools.count()


def _forward_id() -> int | None:
    """A number per vLLM forward pass (its forward context), None outside one."""
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available
    except ImportError:
        return None
    if not is_forward_context_available():
        return None
    ctx = get_forward_context()
    if not hasattr(ctx, "_fastcomm_forward"):
        ctx._fastcomm_forward = next(_FORWARDS)
    return ctx._fastcomm_forward


class OneGpuCommunicator(FastcommCudaCommunicator):
    """fastcomm's communicator over a gloo group, without vLLM's NCCL-based setup (see the module text)."""

    def __init__(self, *args, **kwargs):
        base, base_kwargs = _base_init_args(args, kwargs)
        base.__init__(self, *args[:6], **base_kwargs)
        for name in ("pynccl_comm", "ca_comm", "qr_comm", "symm_mem_comm", "fi_ar_comm", "aiter_ar_comm"):
            setattr(self, name, None)
        self.use_custom_allreduce = False
        self.calls: list[tuple[int | None, int, str]] = []  # (forward, tokens, destination)
        from fastcomm.config import Config

        self.check = Config.from_env().test_check_allreduce
        self.checked = 0
        self.mismatches: list[dict] = []  # the first few calls whose result was not the exact sum
        self._open_fastcomm()

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        ws = self.fastcomm_workspace
        if ws is not None:
            if not self.fastcomm_ready and not torch.cuda.is_current_stream_capturing():
                dist.barrier(group=self.cpu_group)
            checking = self.check and not torch.cuda.is_current_stream_capturing()
            terms = self._gather_all(input_) if checking else None
            try:
                out = self._fastcomm_try(input_, ws)
            except RuntimeError as exc:
                from .communicator import raise_translated

                raise_translated(exc)
                raise
            if out is not None:
                self.calls.append((_forward_id(), int(input_.shape[0]) if input_.dim() else 1, FASTCOMM))
                if terms is not None:
                    self._check_sum(terms, out)
                return out
        self.calls.append((_forward_id(), int(input_.shape[0]) if input_.dim() else 1, FALLBACK))
        return self._on_cpu(input_, lambda t: dist.all_reduce(t, group=self.cpu_group))

    def _check_sum(self, terms: list[torch.Tensor], out: torch.Tensor) -> None:
        """FASTCOMM_TEST_CHECK_ALLREDUCE: ``out`` must be the ranks' ``terms`` summed in fp32 in rank order and
        rounded once (what every fastcomm kernel computes), bit for bit, and the same on every rank."""
        total = terms[0].float()
        for t in terms[1:]:
            total = total + t.float()
        mine = out.detach().to("cpu")
        want, got = _bits(total.to(out.dtype)), _bits(mine)
        same = all(torch.equal(_bits(o), got) for o in self._gather_all(out))
        self.checked += 1
        if not (torch.equal(got, want) and same) and len(self.mismatches) < 16:
            diff = (mine.float().view(-1) - total.view(-1)).abs()
            self.mismatches.append({"call": len(self.calls) - 1, "forward": self.calls[-1][0],
                                    "tokens": self.calls[-1][1], "elements": int(got.numel()),
                                    "wrong": int((got != want).sum()),
                                    "max_abs_diff": float(diff.nan_to_num(float("inf")).max()),
                                    "ranks_agree": same})

    def _on_cpu(self, input_: torch.Tensor, op) -> torch.Tensor:
        t = input_.detach().to("cpu", copy=True)
        op(t)
        return t.to(input_.device)

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        parts = self._gather_all(input_)
        return torch.cat(parts, dim=dim if dim >= 0 else dim + input_.dim()).to(input_.device)

    def _gather_all(self, input_: torch.Tensor) -> list[torch.Tensor]:
        t = input_.detach().to("cpu").contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t, group=self.cpu_group)
        return parts

    def all_gatherv(self, input_, dim: int = 0, sizes=None):
        if isinstance(input_, list):
            return [self.all_gatherv(t, dim, sizes) for t in input_]
        if sizes is None:
            return self.all_gather(input_, dim)
        # Pad to the largest size, gather, cut each rank's part back to its size.
        longest = max(sizes)
        pad = list(input_.shape)
        pad[dim] = longest - input_.shape[dim]
        padded = torch.cat([input_, input_.new_zeros(pad)], dim=dim) if pad[dim] else input_
        parts = self._gather_all(padded)
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim).to(input_.device)

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        total = self._on_cpu(input_, lambda t: dist.all_reduce(t, group=self.cpu_group))
        return total.chunk(self.world_size, dim=dim)[self.rank_in_group].contiguous()

    def reduce_scatterv(self, input_: torch.Tensor, dim: int = -1, sizes=None) -> torch.Tensor:
        if sizes is None:
            return self.reduce_scatter(input_, dim)
        total = self._on_cpu(input_, lambda t: dist.all_reduce(t, group=self.cpu_group))
        start = sum(sizes[:self.rank_in_group])
        return total.narrow(dim, start, sizes[self.rank_in_group]).contiguous()

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1):
        parts = self._gather_all(input_)
        if self.rank_in_group != dst:
            return None
        return torch.cat(parts, dim=dim if dim >= 0 else dim + input_.dim()).to(input_.device)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        t = tensor.detach().to("cpu", copy=True)
        dist.broadcast(t, self.ranks[src], group=self.cpu_group)
        tensor.copy_(t)
        return tensor

    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        dst = (self.rank_in_group + 1) % self.world_size if dst is None else dst
        dist.send(tensor.detach().to("cpu"), self.ranks[dst], group=self.cpu_group)

    def recv(self, size, dtype, src: int | None = None) -> torch.Tensor:
        src = (self.rank_in_group - 1) % self.world_size if src is None else src
        t = torch.empty(size, dtype=dtype)
        dist.recv(t, self.ranks[src], group=self.cpu_group)
        return t.to(self.device)

    def destroy(self) -> None:
        ws, self.fastcomm_workspace = self.fastcomm_workspace, None
        if ws is not None:
            ws.close()


def counts(worker=None) -> dict:
    """This rank's all-reduces, per forward pass: {"forwards": [[tokens, calls, fastcomm, fallback], ...] for
    every forward seen (warm-up, capture, eager steps), "outside": calls outside a forward} (for
    ``LLM.collective_rpc``; ``worker`` is vLLM's, unused)."""
    from vllm.distributed.parallel_state import get_tp_group

    comm = get_tp_group().device_communicator
    calls = getattr(comm, "calls", [])
    by_forward: dict[int, list] = {}
    outside = 0
    for forward, tokens, dest in calls:
        if forward is None:
            outside += 1
            continue
        rec = by_forward.setdefault(forward, [tokens, 0, 0, 0])
        rec[1] += 1
        rec[2 if dest == FASTCOMM else 3] += 1
    return {"forwards": [by_forward[k] for k in sorted(by_forward)], "outside": outside,
            "fastcomm": getattr(comm, "fastcomm_workspace", None) is not None,
            "checked": getattr(comm, "checked", 0), "mismatches": getattr(comm, "mismatches", []),
            "why_not": getattr(comm, "fastcomm_why_not", None)}
