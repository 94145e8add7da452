"""The collective ops: free functions over a Workspace, plus their torch custom-op registrations.

Hot path rules: no host sync, no allocation except the output (through torch's caching allocator, which
is graph-safe), no environment reads. An all-reduce's route (algorithm, kernel, tables, launch shape) is one
call, ``policy.allreduce_route`` (through ``Workspace.route``); this module only packs the kernel's parameters
from ``abi``'s kernel table and launches.
"""
from __future__ import annotations

import contextlib

import torch

from . import abi, policy
from .runtime import launch_ex
from .abi import FLAT, ISLAND, PARTNER
from .errors import FastcommError
from .policy import Transport
from .policy.launch import fused_cluster_launch
from .workspace import Workspace, dtype_name, get


def _driver():
    from cupy_backends.cuda.api import driver

    return driver


def _launch(ws: Workspace, kernel: abi.Kernel, dtype: torch.dtype, grid: int, block: int, *args,
            variant: str = "") -> None:
    fn = ws.function(kernel, dtype_name(dtype), variant)
    packed = kernel.pack(*args)
    _driver().launchKernel(fn, grid, 1, 1, block, 1, 1, 0, ws.stream(), packed.address, 0)


# The kernels' peer-table parameters (abi's kernel table): each takes the table of the route's next group.
_TABLE_PARAMS = ("t", "ti", "tp")


def _all_reduce_args(ws: Workspace, route: policy.Route, src: torch.Tensor, dst: torch.Tensor) -> list:
    """The route's kernel parameters, by name: its tables, then what each all-reduce kernel takes."""
    lc = route.launch
    tables = iter(ws.tables[g] for g in route.groups)
    values = {"in": src.data_ptr(), "out": dst.data_ptr(), "nbytes": src.numel() * src.element_size(),
              "n": src.numel(), "seg": lc.seg, "chunk": lc.chunk}
    return [next(tables) if name in _TABLE_PARAMS else values[name] for name, _ in route.kernel.params]


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _fused(ws: Workspace, table: int, x: torch.Tensor, residual, weight, out, residual_out, eps: float,
           island_table: int | None = None) -> None:
    """The fused kernel on ``table``'s group; with ``island_table``, the island form (sum inside the island
    first, then across the partners of ``table``), in one launch."""
    hidden = x.shape[-1]
    tokens = x.numel() // hidden
    # Every block of a row reads the row's whole residual; a sibling block may not overwrite it meanwhile.
    # Host transport: every block of a row reads the whole row from host memory, so splitting a row
    # multiplies those reads; one block per row there.
    split_rows = ws.transport is not Transport.HOST and (
        residual is None or not (_overlap(out, residual) or
                                 (residual_out is not None and _overlap(residual_out, residual))))
    lc = policy.fused_launch(tokens, hidden, x.element_size(), ws.plan.max_blocks, split_rows=split_rows)
    kernel, tables = (abi.FUSED_RMSNORM, (table,)) if island_table is None else \
        (abi.FUSED_RMSNORM_ISLANDS, (island_table, table))
    _launch(ws, kernel, x.dtype, lc.grid, lc.block, *tables, x.data_ptr(),
            residual.data_ptr() if residual is not None else 0, weight.data_ptr(), out.data_ptr(),
            residual_out.data_ptr() if residual_out is not None else 0, tokens, hidden, lc.splits, eps,
            variant=str(lc.k))


def _fused_cluster(ws: Workspace, x: torch.Tensor, residual, weight, out, residual_out, eps: float) -> bool:
    """fused_cluster.cuh on the flat group; False (nothing launched) where not one cluster of the shape can
    be resident. Rows split whatever aliases what (each block reads only its chunk's residual)."""
    hidden = x.shape[-1]
    tokens = x.numel() // hidden
    fn = ws.function(abi.FUSED_CLUSTER, dtype_name(x.dtype))
    shape = fused_cluster_launch(tokens, hidden, x.element_size(), ws.plan.max_blocks)
    resident = ws.resident_clusters(fn, shape.block, shape.splits)
    if resident < 1:
        return False
    lc = fused_cluster_launch(tokens, hidden, x.element_size(), ws.plan.max_blocks, resident)
    packed = abi.FUSED_CLUSTER.pack(ws.tables[FLAT], x.data_ptr(), residual.data_ptr() if residual is not None else 0,
                                    weight.data_ptr(), out.data_ptr(),
                                    residual_out.data_ptr() if residual_out is not None else 0, tokens, hidden,
                                    lc.splits, eps)
    launch_ex.launch_cluster(fn, lc.grid, lc.block, lc.splits, ws.stream(), packed.address)
    return True


def _fused_two_shot(ws: Workspace, x: torch.Tensor, residual, weight, out, residual_out, eps: float) -> None:
    """fused_two_shot.cuh on the flat group. Splitting rows across blocks has the fused op's conditions
    (every block of a row reads its whole residual; host: every block would read the row from host memory)."""
    hidden = x.shape[-1]
    tokens = x.numel() // hidden
    split_rows = ws.transport is not Transport.HOST and (
        residual is None or not (_overlap(out, residual) or
                                 (residual_out is not None and _overlap(residual_out, residual))))
    lc = policy.fused_two_shot_launch(tokens, hidden, x.element_size(), ws.world_size, ws.plan.max_blocks,
                                      split_rows=split_rows)
    _launch(ws, abi.FUSED_TWO_SHOT, x.dtype, lc.grid, lc.block, ws.tables[FLAT], x.data_ptr(),
            residual.data_ptr() if residual is not None else 0, weight.data_ptr(), out.data_ptr(),
            residual_out.data_ptr() if residual_out is not None else 0, tokens, hidden, lc.cols, lc.splits, eps)


def _check_out(name: str, out: torch.Tensor, like: torch.Tensor) -> None:
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device or not out.is_contiguous():
        raise FastcommError(f"{name} must be a contiguous {like.dtype} tensor of shape {tuple(like.shape)} on {like.device}")
    if out.data_ptr() % abi.ALIGN:
        raise FastcommError(f"{name} data is not {abi.ALIGN}-byte aligned")


def all_reduce(x: torch.Tensor, ws: Workspace, *, algo: str = "auto", out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum ``x`` over the workspace's ranks (out-of-place unless ``out is x``). Collective."""
    ws.raise_if_failed()
    if ws.closed:
        raise FastcommError("fastcomm.all_reduce: workspace is closed")
    reason = ws.tensor_reason(x)
    if reason is not None:
        raise FastcommError(f"fastcomm.all_reduce: {reason}")
    if out is None:
        out = torch.empty_like(x)
    else:
        _check_out("out", out, x)
    if x.numel() == 0:
        return out
    route = policy.allreduce_route(ws.plan, x.numel() * x.element_size(), x.element_size(), algo)
    if route.kernel is None:
        raise FastcommError(f"fastcomm.all_reduce: {x.numel() * x.element_size()} bytes with algo={algo!r} is not "
                            "served by fastcomm (check ws.can_all_reduce first and use NCCL)")
    _run(ws, route, x, out)
    return out


def try_all_reduce(x: torch.Tensor, ws: Workspace) -> torch.Tensor | None:
    """``all_reduce(x, ws)`` if fastcomm's policy takes ``x``, else None (the caller then uses NCCL).

    For integrations that route per call: one check instead of ``ws.why_not`` followed by ``all_reduce``'s
    own. The answer depends only on the workspace and ``x``'s shape, dtype and layout, so it is the same on
    every rank. A device-side timeout recorded earlier still raises.
    """
    ws.raise_if_failed()
    route, _ = ws.route(x)
    if route is None:
        return None
    out = torch.empty_like(x)
    if x.numel():
        _run(ws, route, x, out)
    return out


def _run(ws: Workspace, route: policy.Route, x: torch.Tensor, out: torch.Tensor) -> None:
    """Launch the route's kernel: nothing here decides (policy.allreduce_route did)."""
    with _on_device(ws):
        _launch(ws, route.kernel, x.dtype, route.launch.grid, route.launch.block, *_all_reduce_args(ws, route, x, out))


def _on_device(ws: Workspace):
    """Kernels were loaded in the workspace device's context; switch only when the caller is elsewhere."""
    if torch.cuda.current_device() == ws.device_index:
        return contextlib.nullcontext()
    return torch.cuda.device(ws.device_index)


def fused_all_reduce_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, ws: Workspace, *,
                             residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                             residual_out: torch.Tensor | None = None,
                             algo: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``residual_out = all_reduce(x) + residual`` (or ``all_reduce(x)``) and ``out = rmsnorm(residual_out) * weight``.

    Same rounding as all_reduce followed by vLLM's native (fused_add_)rms_norm as torch.compile runs it
    (``residual_out`` bit for bit; ``out`` too but for the order of the row's sum of squares, which can move
    it by one ulp, rarely). Outputs may alias the inputs (``out is x``, ``residual_out is residual``) for
    in-place use. Collective.

    The kernel comes from the policy (``ws.fused_route``: the one-shot form in the one-shot's range, the
    two-shot form above it at >= 4 ranks), else whichever can run; ``algo`` ("one_shot" / "two_shot")
    forces one. Both keep the same rounding contract.
    """
    ws.raise_if_failed()
    kernel, reason = ws.fused_route(x, residual, weight, within_policy=False, algo=algo)  # routing: ws.can_fuse()
    if reason is not None:
        raise FastcommError(f"fastcomm.fused_all_reduce_rmsnorm: {reason}")
    out = torch.empty_like(x) if out is None else out
    residual_out = torch.empty_like(x) if residual_out is None else residual_out
    _check_out("out", out, x)
    _check_out("residual_out", residual_out, x)
    if x.numel() == 0:
        return out, residual_out
    with _on_device(ws):
        if kernel is policy.FusedAlgo.TWO_SHOT:
            _fused_two_shot(ws, x, residual, weight, out, residual_out, float(eps))
        elif ws.plan.islands is not None:
            # One launch: the island sum (rounded to the dtype) crosses to the partners, then the norm.
            _fused(ws, ws.tables[PARTNER], x, residual, weight, out, residual_out, float(eps),
                   island_table=ws.tables[ISLAND])
        # The cluster form where the plan chose it (agreed by every rank at build) and one cluster fits.
        elif not (ws.plan.fused_cluster and _fused_cluster(ws, x, residual, weight, out, residual_out, float(eps))):
            _fused(ws, ws.tables[FLAT], x, residual, weight, out, residual_out, float(eps))
    return out, residual_out


# ---- torch custom ops ---------------------------------------------------------------------------------

_registered = False


def register_torch_ops() -> None:
    """Register ``torch.ops.fastcomm.*`` (with fake kernels, so torch.compile can trace). Idempotent."""
    global _registered
    if _registered or hasattr(torch.ops.fastcomm, "all_reduce"):
        _registered = True
        return

    @torch.library.custom_op("fastcomm::all_reduce", mutates_args=())
    def _all_reduce(x: torch.Tensor, ws_id: int, algo: str) -> torch.Tensor:
        return all_reduce(x, get(ws_id), algo=algo)

    @_all_reduce.register_fake
    def _(x, ws_id, algo):
        return torch.empty_like(x)

    @torch.library.custom_op("fastcomm::fused_all_reduce_rmsnorm", mutates_args=())
    def _fused_op(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                  ws_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_all_reduce_rmsnorm(x, weight, eps, get(ws_id), residual=residual)

    @_fused_op.register_fake
    def _(x, residual, weight, eps, ws_id):
        return torch.empty_like(x), torch.empty_like(x)

    _registered = True
