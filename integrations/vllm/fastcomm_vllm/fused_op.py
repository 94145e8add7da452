"""``fastcomm_vllm::fused_all_reduce_rms_norm``: all-reduce then RMSNorm as one op, decided at run time.

The op is what both fusion routes call (``helper_route`` for the DSA model's eager helper, ``compile_pass``
for torch.compiled graphs). It takes fastcomm's fused kernel only where the workspace says the input fits
(``Workspace.why_not_fused``: the fused op's size range lives in fastcomm's policy table); everywhere else
it runs what the graph held before the rewrite: the group's all-reduce (fastcomm's or vLLM's, by the
communicator's own routing) and then vLLM's norm.
"""
from __future__ import annotations

import torch

OP = "fastcomm_vllm::fused_all_reduce_rms_norm"


def workspace_of(group_name: str):
    """The fastcomm workspace of vLLM's group ``group_name`` ("tp:0"), or None."""
    from vllm.distributed import parallel_state

    ref = parallel_state._groups.get(group_name)  # vLLM's registry behind torch.ops.vllm.all_reduce
    group = ref() if ref is not None else None
    comm = None if group is None else group.device_communicator
    return getattr(comm, "fastcomm_workspace", None)


def fusable(ws, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """Whether fastcomm's fused kernel takes this call. The same answer on every rank: it depends on shapes,
    dtypes and layout only. The weight checks mirror the kernel's own, so a routed call never raises."""
    return (ws.why_not_fused(x, residual) is None and weight.dtype == x.dtype and weight.is_contiguous()
            and weight.shape == x.shape[-1:] and weight.device == x.device)


def fused(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, ws):
    """fastcomm's fused kernel; CUDA's launch failure after a device-side timeout comes out in fastcomm's
    words (rank, peer, step), as from the communicator's all-reduce."""
    import fastcomm

    from .communicator import raise_translated

    try:
        return fastcomm.fused_all_reduce_rmsnorm(x, weight, eps, ws, residual=residual)
    except RuntimeError as exc:
        raise_translated(exc)
        raise


def _impl(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
          group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    ws = workspace_of(group_name)
    if ws is not None and fusable(ws, x, residual, weight):
        return fused(x, residual, weight, eps, ws)
    import vllm.ir.ops
    from vllm.distributed import parallel_state

    reduced = parallel_state._groups[group_name]()._all_reduce_out_place(x)
    if residual is None:
        return vllm.ir.ops.rms_norm(reduced, weight, eps), reduced
    return vllm.ir.ops.fused_add_rms_norm(reduced, residual, weight, eps)


def _fake(x, residual, weight, eps, group_name):
    return torch.empty_like(x), torch.empty_like(x)


# The Library must outlive the process's use of the op (dropping it unregisters the op).
_library: torch.library.Library | None = None


def register_ops() -> None:
    """Define ``torch.ops.fastcomm_vllm.fused_all_reduce_rms_norm``. Idempotent.

    Returns ``(out, residual_out)``: residual_out = all_reduce(x) + residual (or all_reduce(x)),
    out = rms_norm(residual_out) * weight. Functional: fresh outputs, inputs untouched.
    """
    global _library
    if _library is not None or hasattr(torch.ops.fastcomm_vllm, "fused_all_reduce_rms_norm"):
        return
    lib = torch.library.Library("fastcomm_vllm", "FRAGMENT")
    lib.define("fused_all_reduce_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps, str group_name)"
               " -> (Tensor, Tensor)")
    lib.impl("fused_all_reduce_rms_norm", _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(OP, _fake, lib=lib)
    _library = lib
