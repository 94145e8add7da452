"""fastcomm: low-latency all-reduce for tensor-parallel decode on PCIe GPUs.

    ws = fastcomm.Workspace(group)             # collective; any torch.distributed group (gloo is enough)
    y = fastcomm.all_reduce(x, ws)             # one-shot / two-shot chosen by policy
    out, res = fastcomm.fused_all_reduce_rmsnorm(x, weight, eps, ws, residual=res)
    ws.close()

Importing the package is cheap and needs no torch: the GPU parts load on first use, so `fastcomm topo`
and the policy work on machines without torch or GPUs.
"""
from .config import Config, ConfigError
from .errors import FastcommError, FastcommTimeoutError
from .policy import Algo, Transport

__all__ = ["Config", "ConfigError", "FastcommError", "FastcommTimeoutError", "Workspace", "all_reduce",
           "try_all_reduce", "fused_all_reduce_rmsnorm", "register_torch_ops", "translate_error", "Algo", "Transport"]
from .version import __version__

_LAZY = {"Workspace": "workspace", "translate_error": "workspace", "all_reduce": "ops", "try_all_reduce": "ops",
         "fused_all_reduce_rmsnorm": "ops", "register_torch_ops": "ops"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'fastcomm' has no attribute {name!r}")
