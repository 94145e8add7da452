"""fastcomm: low-latency all-reduce for tensor-parallel decode on PCIe GPUs.

    ws = fastcomm.Workspace(group)             # collective; any torch.distributed group (gloo is enough)
    y = fastcomm.all_reduce(x, ws)             # one-shot / two-shot chosen by policy
    out, res = fastcomm.fused_all_reduce_rmsnorm(x, weight, eps, ws, residual=res)
    ws.close()
"""
from .config import Config
from .errors import FastcommError, FastcommTimeoutError
from .ops import all_reduce, fused_all_reduce_rmsnorm, register_torch_ops
from .policy import Algo, Transport
from .workspace import Workspace

__all__ = ["Config", "FastcommError", "FastcommTimeoutError", "Workspace", "all_reduce",
           "fused_all_reduce_rmsnorm", "register_torch_ops", "Algo", "Transport"]
__version__ = "0.1.0"
