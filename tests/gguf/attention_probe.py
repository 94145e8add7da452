"""vLLM's own engine configuration and attention-backend selection for ``vllm serve`` arguments, on this
CPU-only machine with vLLM's platform made CUDA of a given compute capability. Prints one JSON line.

    python attention_probe.py CASES.json    (a list of [MAJOR.MINOR, [vllm serve args; the first the model]])

One JSON line per case ("PROBE {...}", or "PROBE {"error": ...}" where vLLM refuses), all in one process
(vLLM's import is most of the time).

What vLLM would decide at start-up before any GPU work: the activation dtype, the KV-cache dtype and page
size of the cache config (after the model's config hooks), the backend its selector picks for the model's
sparse-MLA layers, the KV dtype that backend turns the cache into, and whether the backend takes them. Only
the capability queries are answered here; everything else is vLLM's code.
"""
import contextlib
import json
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "integrations" / "vllm")]


def fake_cuda(major: int, minor: int):
    """vLLM's current platform object, turned into CudaPlatform reporting ``major.minor``."""
    sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))  # no libcuda here
    import vllm.platforms as platforms
    from vllm.platforms.cuda import CudaPlatform
    from vllm.platforms.interface import DeviceCapability

    here = major * 10 + minor

    class Faked(CudaPlatform):
        @classmethod
        def get_device_capability(cls, device_id=0):
            return DeviceCapability(major, minor)

        @classmethod
        def has_device_capability(cls, capability, device_id=0):
            wanted = capability if isinstance(capability, int) else capability[0] * 10 + capability[1]
            return here >= wanted

        @classmethod
        def is_device_capability(cls, capability, device_id=0):
            wanted = capability if isinstance(capability, int) else capability[0] * 10 + capability[1]
            return here == wanted

        @classmethod
        def is_device_capability_family(cls, capability, device_id=0):
            return here // 10 == capability // 10

        @classmethod
        def device_count(cls):
            return 8  # the user's box: TP 8 must fit

    platforms.current_platform.__class__ = Faked  # every module holding the object sees the change
    return platforms.current_platform


@contextlib.contextmanager
def modules_without_a_gpu():
    """Some backend modules allocate a CUDA workspace when imported (CUTLASS MLA's); let them make it on the
    meta device, so the selector can import them to ask whether they apply."""
    import torch

    real_empty = torch.empty

    def empty(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "meta"
        return real_empty(*args, **kwargs)

    import vllm.utils.platform_utils as pu

    real_units = getattr(pu, "num_compute_units", None)
    torch.empty = empty
    if real_units is not None:
        pu.num_compute_units = lambda device=0: 132
    try:
        yield
    finally:
        torch.empty = real_empty
        if real_units is not None:
            pu.num_compute_units = real_units


def _forget_selections() -> None:
    """vLLM caches backend choices by selector config, which holds no capability: a case must not reuse the
    previous capability's answer."""
    import vllm.platforms.cuda as cuda
    import vllm.v1.attention.selector as selector

    for module in (selector, cuda):
        for value in vars(module).values():
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()


def prepare() -> None:
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # vllm-gguf-plugin's quantization and fastcomm's GGUF adapter, as in vLLM's processes
    from vllm.model_executor.layers.quantization import get_quantization_config

    get_quantization_config("gguf")  # imported on the CPU platform: its modules query CUDA kernels at import


def probe(capability: str, serve_args: list[str]) -> dict:
    major, minor = (int(p) for p in capability.split("."))
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    platform = fake_cuda(major, minor)
    _forget_selections()
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    ns = parser.parse_args(["--model", serve_args[0], *serve_args[1:]])
    engine_args = EngineArgs.from_cli_args(ns)
    config = engine_args.create_engine_config()

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import mla_attention
    from vllm.v1.attention.selector import get_attn_backend

    hf = config.model_config.hf_text_config
    cache = config.cache_config
    with set_current_vllm_config(config), modules_without_a_gpu():
        backend = get_attn_backend(hf.kv_lora_rank + hf.qk_rope_head_dim, config.model_config.dtype,
                                   cache.cache_dtype, use_mla=True, use_sparse=True,
                                   num_heads=hf.num_attention_heads // config.parallel_config.tensor_parallel_size)
        kv = mla_attention._canonicalize_sparse_mla_kv_cache_dtype(backend, cache.cache_dtype)
        pages = [getattr(s, "base", s) for s in backend.get_supported_kernel_block_sizes()]
    return {"capability": str(platform.get_device_capability()), "backend": backend.get_name(),
            "dtype": str(config.model_config.dtype).split(".")[-1], "cache_dtype": cache.cache_dtype,
            "kv_dtype": kv, "block_size": cache.block_size, "backend_pages": pages,
            "backend_dtypes": [str(d).split(".")[-1] for d in backend.supported_dtypes],
            "backend_kv_dtypes": list(backend.supported_kv_cache_dtypes)}


if __name__ == "__main__":
    prepare()
    for capability, args in json.loads(open(sys.argv[1]).read()):
        try:
            result = probe(capability, args)
        except Exception as e:  # vLLM's refusal is a result of the case, not a failure of the probe
            result = {"capability": capability, "error": f"{type(e).__name__}: {e}"}
        print("PROBE " + json.dumps(result), flush=True)
