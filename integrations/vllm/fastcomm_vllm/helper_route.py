"""Route 1 of the fusion: the DSA model's ``fused_allreduce_rms_norm`` helper, wrapped as its module loads.

The DSA model (GLM-5 ``GlmMoeDsaForCausalLM`` and DeepSeek-V3.2) calls ``fused_allreduce_rms_norm(
hidden_states, residual, norm)`` twice per layer and once for the final norm. It runs eagerly (under vLLM's
breakable CUDA graph), so no compile pass sees it. Its fast path is FlashInfer's NVLink/NVSwitch kernel; on
PCIe it falls back to NCCL + a separate norm. The wrapper puts fastcomm's fused kernel first.

Where it lives: vLLM 0.33 ``vllm.models.common.ops.fused_allreduce_rms_norm`` (used by
``vllm.models.deepseek_v32.nvidia.model``, the default class for GlmMoeDsaForCausalLM on CUDA); vLLM 0.25
``vllm.models.deepseek_v32.nvidia.fused_ops`` (used by ``...deepseek_v32.nvidia.model``, which 0.25 serves
only through ``model_class_overrides``; its default GLM-5 class is ``deepseek_v2``'s, reached by the compile
pass instead).
"""
from __future__ import annotations

import functools
import importlib.abc
import sys
from typing import Callable

import torch

from .fused_op import fusable, fused

HELPER = "fused_allreduce_rms_norm"
# Module defining the helper, newest layout first. Consumers bind it with `from ... import`, so it must be
# wrapped in the defining module before they import it (see route_fused_helper).
HELPER_MODULES = ("vllm.models.common.ops.fused_allreduce_rms_norm",  # vLLM 0.33
                  "vllm.models.deepseek_v32.nvidia.fused_ops")         # vLLM 0.25


def _plain_rms_norm(norm) -> bool:
    from vllm.model_executor.layers.layernorm import RMSNorm

    return (type(norm) is RMSNorm and getattr(norm, "has_weight", True)
            and getattr(norm, "variance_size_override", None) is None)


def wrap_helper(original: Callable, fuse: bool = True) -> Callable:
    """The helper with fastcomm first; anything fastcomm cannot take goes to ``original`` unchanged.

    ``fuse`` False (FASTCOMM_VLLM_FUSION unset): where a workspace exists, the all-reduce goes to the group's
    communicator (fastcomm) followed by the norm, as the helper's own fallback does, instead of a fused kernel
    of another library (FlashInfer's, which on some GPUs the helper would pick and fastcomm would never see)."""
    from vllm.distributed import tensor_model_parallel_all_reduce
    from vllm.distributed.parallel_state import get_tp_group

    @functools.wraps(original)
    def fused_allreduce_rms_norm(hidden_states, residual, norm):
        comm = get_tp_group().device_communicator
        ws = getattr(comm, "fastcomm_workspace", None)
        if ws is None:
            return original(hidden_states, residual, norm)
        if not fuse or not _plain_rms_norm(norm):
            return norm(tensor_model_parallel_all_reduce(hidden_states), residual)
        if torch.compiler.is_compiling():
            # Traced callers get the op (it decides at run time); eager callers skip the dispatcher.
            return torch.ops.fastcomm_vllm.fused_all_reduce_rms_norm(
                hidden_states, residual, norm.weight, norm.variance_epsilon, get_tp_group().unique_name)
        if not fusable(ws, hidden_states, residual, norm.weight):
            return original(hidden_states, residual, norm)
        return fused(hidden_states, residual, norm.weight, norm.variance_epsilon, ws)

    fused_allreduce_rms_norm._fastcomm_original = original
    return fused_allreduce_rms_norm


_FUSE = {"on": True}  # set once by route_fused_helper, before any module is wrapped


def _wrap_module(module) -> None:
    helper = getattr(module, HELPER, None)
    if helper is None or hasattr(helper, "_fastcomm_original"):
        return
    wrapped = wrap_helper(helper, _FUSE["on"])
    setattr(module, HELPER, wrapped)
    # Consumers imported before us hold the original: rebind them too (normally there are none yet). Read
    # each module's own dict: getattr would run lazy module __getattr__ hooks (flashinfer imports on them).
    for other in list(sys.modules.values()):
        if getattr(other, "__dict__", {}).get(HELPER) is helper:
            setattr(other, HELPER, wrapped)


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Wraps the helper right after its module executes, without importing model code ourselves
    (in vLLM 0.25 importing the helper's module imports the whole DSA model)."""

    def __init__(self, names: tuple[str, ...]):
        self.names = frozenset(names)

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.names:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _WrappingLoader(spec.loader)
                return spec
        return None


class _WrappingLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        _wrap_module(module)

    def __getattr__(self, name):  # get_source, get_filename, ...: the real loader's
        return getattr(self.loader, name)


def route_fused_helper(fuse: bool = True) -> None:
    """Wrap the helper wherever this vLLM defines it, now or when first imported. Idempotent."""
    _FUSE["on"] = fuse
    pending = []
    for name in HELPER_MODULES:
        if name in sys.modules:
            _wrap_module(sys.modules[name])
        else:
            pending.append(name)
    if pending and not any(isinstance(f, _WrapOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _WrapOnImport(tuple(pending)))


def helper_routed() -> bool:
    """Whether a loaded helper module carries the wrapper (False before the model is imported)."""
    return any(hasattr(getattr(sys.modules.get(n), HELPER, None), "_fastcomm_original") for n in HELPER_MODULES)
