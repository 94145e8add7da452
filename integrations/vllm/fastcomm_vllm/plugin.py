"""The `vllm.general_plugins` entry point: vLLM calls ``register()`` in every process it starts.

Hooks, identical in vLLM 0.25.0 and the newest release (0.33.0):
- ``vllm.platforms.cuda.CudaPlatformBase.get_device_communicator_cls``: every ``GroupCoordinator`` resolves
  its device communicator through it, so returning ours puts fastcomm under ``tensor_model_parallel_all_reduce``.
- ``...get_pass_manager_cls``: vLLM's compile backend builds its post-grad pass manager from it; ours adds
  the all-reduce + RMSNorm fusion pass.
- the fused all-reduce + RMSNorm helper of the DSA (GLM-5 / DeepSeek-V3.2) model: see ``helper_route``;
  always routed, so its all-reduce reaches fastcomm (without the fusion: fastcomm's all-reduce, then the norm).
The pass manager and the fused kernel only with FASTCOMM_VLLM_FUSION=1: no end-to-end run has yet shown the fused kernel faster than
fastcomm's all-reduce followed by vLLM's own norm (bench/RESULTS.md), so the default is the communicator alone.
"""
from __future__ import annotations

import hashlib
import logging
import sys
from pathlib import Path

# A child of vLLM's logger, so the lines come out through vLLM's handler and format.
logger = logging.getLogger("vllm.fastcomm")

COMMUNICATOR = "fastcomm_vllm.communicator.FastcommCudaCommunicator"
PASS_MANAGER = "fastcomm_vllm.compile_pass.FastcommPassManager"
VLLM_COMMUNICATOR = "vllm.distributed.device_communicators.cuda_communicator.CudaCommunicator"
VLLM_PASS_MANAGER = "vllm.compilation.passes.pass_manager.PostGradPassManager"
# What the fused graphs are made of: their source is part of vLLM's compile-cache key.
FUSION_MODULES = ("fused_op.py", "helper_route.py", "compile_pass.py")


def register() -> None:
    """Entry point. A no-op with a log line when FASTCOMM_VLLM=0 or the platform is not CUDA."""
    from fastcomm.config import Config
    from fastcomm.variables import unknown_variables

    config = Config.from_env()
    for name in unknown_variables():
        logger.warning("fastcomm: %s is not a fastcomm setting; it is ignored (`fastcomm env` lists them)", name)
    if config.test_standin_us is not None:  # one rank's shard timed at TP 1, any row (fastcomm_vllm.standin)
        from . import standin

        standin.install(config.test_standin_us)
    if not config.vllm_enabled:
        logger.info("fastcomm: plugin off (FASTCOMM_VLLM=0); vLLM runs unchanged")
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        logger.debug("fastcomm: platform %s is not CUDA; plugin inactive", type(current_platform).__name__)
        return
    from vllm.platforms.cuda import CudaPlatformBase  # needs libcuda: import only on CUDA platforms

    install(CudaPlatformBase, fuse=config.vllm_fusion)


def install(platform_cls: type, fuse: bool = False) -> None:
    """Point ``platform_cls`` at fastcomm's communicator and (with ``fuse``) pass manager, and route the
    fused helper.

    Idempotent (vLLM may load plugins more than once per process). Raises if another plugin already
    replaced either class: silently overriding it would break that plugin.
    """
    hooks = (("get_device_communicator_cls", COMMUNICATOR, VLLM_COMMUNICATOR),)
    if fuse:
        hooks += (("get_pass_manager_cls", PASS_MANAGER, VLLM_PASS_MANAGER),)
    else:
        logger.info("fastcomm: fusion off (FASTCOMM_VLLM_FUSION=1 turns it on): all-reduce and RMSNorm stay "
                    "separate")
    for method, ours, vllms in hooks:  # check both before changing either
        _check(platform_cls, method, ours, vllms)
    for method, ours, _ in hooks:
        _point(platform_cls, method, ours)
    from . import helper_route

    if fuse:  # the fused op and the compile-key tag exist only for the fusion
        from . import fused_op

        fused_op.register_ops()
        _fold_into_compile_hash()
    helper_route.route_fused_helper(fuse)


def _check(platform_cls: type, method: str, ours: str, vllms: str) -> None:
    current = getattr(platform_cls, method)()
    if current not in (ours, vllms):
        raise RuntimeError(
            f"fastcomm: {platform_cls.__name__}.{method}() returns {current!r}, not vLLM's {vllms!r}: another "
            f"plugin replaced it. Turn one off (FASTCOMM_VLLM=0, or name the plugins to load in VLLM_PLUGINS).")


def _point(platform_cls: type, method: str, ours: str) -> None:
    def qualname(cls) -> str:
        return ours

    setattr(platform_cls, method, classmethod(qualname))


def _fold_into_compile_hash() -> None:
    """Make the fusion pass part of vLLM's torch.compile cache key.

    vLLM keys its compile cache on the vLLM config, not on the post-grad passes, so without this a run
    with the fusion could load graphs compiled without it (or a FASTCOMM_VLLM=0 run load graphs holding
    fastcomm's op). The tag changes whenever the fusion code changes. Without the fusion the compiled
    graphs are vLLM's own (the communicator is picked at run time), so they share vLLM's cache entries.
    """
    from vllm.config.compilation import CompilationConfig

    original = CompilationConfig.compute_hash
    if getattr(original, "_fastcomm_tag", None):
        return
    digest = hashlib.sha256()
    for name in FUSION_MODULES:
        digest.update((Path(__file__).parent / name).read_bytes())
    tag = "fastcomm-" + digest.hexdigest()[:12]

    def compute_hash(self) -> str:
        return hashlib.sha256(f"{original(self)}|{tag}".encode()).hexdigest()

    compute_hash._fastcomm_tag = tag
    CompilationConfig.compute_hash = compute_hash


def worker_model(worker):
    """The model a vLLM worker runs (its runner's ``get_model()`` where the runner has one; for
    ``LLM.collective_rpc`` functions)."""
    runner = worker.model_runner
    return runner.get_model() if hasattr(runner, "get_model") else runner.model


def worker_status(worker=None) -> dict:
    """What fastcomm does in this worker (for ``LLM.collective_rpc``; ``worker`` is vLLM's, unused)."""
    from vllm.distributed.parallel_state import get_tp_group

    from . import helper_route

    comm = get_tp_group().device_communicator
    ws = getattr(comm, "fastcomm_workspace", None)
    passes = sys.modules.get(f"{__package__}.compile_pass")  # not imported: no pass ran in this worker
    kq = sys.modules.get(f"{__package__}.gguf.kquant_vllm")  # not imported: no GGUF layer here
    return {
        "communicator": None if comm is None else type(comm).__name__,
        "fastcomm": ws is not None,
        "describe": None if ws is None else ws.describe(),
        "why_not": getattr(comm, "fastcomm_why_not", None),
        "helper_routed": helper_route.helper_routed(),
        "compile_pass_rewrites": passes.FastcommFusionPass.total_rewrites if passes else 0,
        "kquant_forms": kq.forms_served() if kq else {},  # layers on a measured form, by table
    }
