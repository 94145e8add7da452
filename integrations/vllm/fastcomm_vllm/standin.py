"""Stand-in all-reduces for timing one rank's share of a TP step on one GPU (FASTCOMM_TEST_STANDIN_US).

A TP 8 rank's decode step is measured as a TP 1 engine over that rank's shard of the weights
(``python -m fastcomm_bench.glm5_gguf OUT --tp8-shard``). At TP 1 vLLM calls no all-reduce, so the step
would lack the 157 calls (and the graph nodes, launch gaps and serialisation) a TP 8 rank pays. With the
switch, every module where TP > 1 all-reduces gets a stand-in after it: one kernel that copies its input to a
new output (the sum over one rank, as an out-of-place all-reduce returns it) and spins until the set time has
passed. The time lives in device memory, so captured CUDA graphs replay with whatever ``set_us`` last wrote:
one engine measures the step at 0, 5, 10, 20 and 60 us per call, and the slope is the step's cost per
all-reduce microsecond, measured instead of assumed.

Sites, as vLLM 0.25's GLM-5 class (deepseek_v2) reduces at TP > 1: a ``RowParallelLinear`` with
``reduce_results`` (o_proj; the dense layers' down_proj), the ``DeepseekV2MoE`` block (routed + shared
experts, one all-reduce), and the ``VocabParallelEmbedding`` lookup (not the LM head: its logits are
gathered, not summed). vLLM >= 0.33's DSA class on CUDA reduces inside its fused all-reduce + RMSNorm helper
instead, which this does not cover; ``count_sites`` says how many sites a model has, so a bench can refuse a
count that is not TP 8's.
"""
from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger("vllm.fastcomm")

# One block a 64 KB chunk copies it; every block spins from its own start, so the kernel lasts about
# max(copy, the set time). The copy keeps the node a real all-reduce's shape: it reads x, writes a new tensor.
_SOURCE = r"""
extern "C" __global__ void fastcomm_standin(const uint4* __restrict__ in, uint4* __restrict__ out,
                                            unsigned long long n16, const long long* __restrict__ ns) {
  unsigned long long t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n16;
       i += (unsigned long long)gridDim.x * blockDim.x)
    out[i] = in[i];
  if (threadIdx.x == 0) {
    const long long wait = *ns;
    unsigned long long t = t0;
    while ((long long)(t - t0) < wait) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  }
}
"""
_MAX_BLOCKS = 132

_state: dict = {"ns": None, "kernel": None, "initial_ns": 0}


def _kernel():
    if _state["kernel"] is None:
        import cupy

        _state["kernel"] = cupy.RawKernel(_SOURCE, "fastcomm_standin")
        _state["kernel"].compile()
    return _state["kernel"]


def _ns_tensor(device) -> torch.Tensor:
    if _state["ns"] is None or _state["ns"].device != device:
        # First made inside vLLM's warm-up (inference mode); a normal tensor, so set_us may write it from an RPC
        # outside inference mode (an inference tensor refuses in-place updates there).
        with torch.inference_mode(False):
            _state["ns"] = torch.full((1,), _state["initial_ns"], dtype=torch.int64, device=device)
    return _state["ns"]


def set_us(us: float) -> float:
    """Every stand-in's time from now on, captured graphs included (a device write on the current stream)."""
    if not us >= 0:
        raise ValueError(f"stand-in time {us!r} us: must be >= 0")
    dev = _state["ns"].device if _state["ns"] is not None else torch.device("cuda", torch.cuda.current_device())
    _ns_tensor(dev).fill_(int(round(us * 1000)))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return us


@torch.library.custom_op("fastcomm_standin::all_reduce", mutates_args=())
def standin_all_reduce(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    if x.numel() == 0:
        return out
    if x.device.type != "cuda":  # CPU ranks (the load checks): the sum over one rank, nothing to wait for
        return out.copy_(x)
    import cupy  # only here: cupy comes with the CUDA extras, which a CPU install lacks

    src = x.contiguous()
    nbytes = src.numel() * src.element_size()
    whole = nbytes % 16 == 0 and src.data_ptr() % 16 == 0 and out.data_ptr() % 16 == 0
    n16 = nbytes // 16 if whole else 0
    if n16 == 0:
        out.copy_(src)   # not whole aligned 16-byte words (never GLM-5's 6144 x 2 B rows): the kernel only spins
    blocks = max(1, min(_MAX_BLOCKS, (n16 + 4095) // 4096))
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(x.device).cuda_stream, x.device.index)
    with stream:
        _kernel()((blocks,), (256,), (src.data_ptr(), out.data_ptr(), cupy.uint64(n16),
                                      _ns_tensor(x.device).data_ptr()))
    return out


@standin_all_reduce.register_fake
def _(x):
    return torch.empty_like(x)


def _after(forward, pick=lambda out: out):
    """``forward`` with the stand-in applied to its output (``pick`` finds the tensor in a tuple output)."""
    @functools.wraps(forward)
    def wrapped(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if not _reduces(self):
            return out
        if isinstance(out, tuple):
            return (standin_all_reduce(out[0]),) + out[1:]
        return standin_all_reduce(out)

    wrapped._fastcomm_standin = True
    return wrapped


def _classes():
    from vllm.model_executor.layers.linear import RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2MoE

    return RowParallelLinear, VocabParallelEmbedding, ParallelLMHead, DeepseekV2MoE


def _reduces(module) -> bool:
    """Whether TP > 1 would all-reduce this module's output (as vLLM 0.25's deepseek_v2 does)."""
    row, embedding, lm_head, moe = _classes()
    if isinstance(module, row):
        return bool(module.reduce_results)
    if isinstance(module, lm_head):
        return False
    return isinstance(module, (embedding, moe))


def count_sites(model: torch.nn.Module) -> int:
    """How many modules of ``model`` reduce at TP > 1: each takes one stand-in per forward."""
    return sum(1 for m in model.modules() if _reduces(m))


def install(us: float = 0.0) -> None:
    """Wrap the site classes' forwards (idempotent), each stand-in spinning ``us`` until ``set_us``."""
    _state["initial_ns"] = int(round(us * 1000))
    row, embedding, _, moe = _classes()
    for cls in (row, embedding, moe):
        if not getattr(cls.forward, "_fastcomm_standin", False):
            cls.forward = _after(cls.forward)
    logger.info("fastcomm: stand-in all-reduces after row-parallel outputs, MoE blocks and the embedding "
                "(FASTCOMM_TEST_STANDIN_US=%s)", us)


def check_tp1() -> None:
    from vllm.distributed import get_tensor_model_parallel_world_size

    if get_tensor_model_parallel_world_size() != 1:
        raise RuntimeError("FASTCOMM_TEST_STANDIN_US is for TP 1 (one rank's shard on one GPU); at TP "
                           f"{get_tensor_model_parallel_world_size()} the real all-reduces run")


# ---- for LLM.collective_rpc (``worker`` is vLLM's) ----------------------------------------------------------

def worker_set_us(worker, us: float) -> float:
    check_tp1()
    return set_us(us)


def worker_sites(worker) -> dict:
    from .plugin import worker_model

    runner = worker.model_runner
    out = {"model": count_sites(worker_model(worker))}
    drafter = getattr(runner, "drafter", None)
    if drafter is not None and getattr(drafter, "model", None) is not None:
        out["drafter"] = count_sites(drafter.model)
    return out
