"""Route 2 of the fusion: a post-grad pass that fuses all-reduce + RMSNorm in torch.compiled graphs.

torch.compiled models (vLLM 0.25's default GLM-5 path included) show ``vllm.all_reduce`` followed by
``vllm_ir.rms_norm`` / ``vllm_ir.fused_add_rms_norm`` in the post-grad graph. ``FastcommFusionPass`` replaces
each pair with ``fastcomm_vllm.fused_all_reduce_rms_norm`` (``fused_op``), which decides at run time (the
token count is symbolic at compile time) between fastcomm's fused kernel and the two original ops.
``FastcommPassManager`` is vLLM's post-grad pass manager with this pass appended; the plugin points vLLM's
CUDA platform at it.
"""
from __future__ import annotations

import logging
import operator
from typing import Callable

import torch
from torch import fx
from vllm.compilation.passes.inductor_pass import InductorPass
from vllm.compilation.passes.pass_manager import PostGradPassManager

from .fused_op import register_ops, workspace_of

logger = logging.getLogger("vllm.fastcomm")

# Views that keep the shape (they survive when noop elimination is off) do not stop a match.
_VIEWS = ("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default")


def _arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _shape(node) -> tuple | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


class FastcommFusionPass(InductorPass):
    """Rewrite ``vllm.all_reduce`` -> ``vllm_ir.(fused_add_)rms_norm`` into one fastcomm_vllm op."""

    # Rewrites in this process, for diagnostics (plugin.worker_status); stays 0 when vLLM loads its
    # compiled graphs from the cache instead of compiling.
    total_rewrites = 0

    def __init__(self, eligible: Callable[[str], bool] | None = None):
        import vllm.distributed.parallel_state  # noqa: F401 -- defines torch.ops.vllm.all_reduce
        import vllm.ir.ops  # noqa: F401 -- defines torch.ops.vllm_ir.*

        register_ops()
        # Only groups that own a workspace; same answer on every rank (workspace creation is agreed).
        self.eligible = eligible or (lambda group_name: workspace_of(group_name) is not None)
        self.all_reduce = torch.ops.vllm.all_reduce.default
        self.rms_norm = torch.ops.vllm_ir.rms_norm.default
        self.add_rms_norm = torch.ops.vllm_ir.fused_add_rms_norm.default
        self.fused = torch.ops.fastcomm_vllm.fused_all_reduce_rms_norm.default
        self.rewrites = 0  # in the last graph

    def __call__(self, graph: fx.Graph) -> None:
        self.rewrites = 0
        for ar in [n for n in graph.nodes if n.op == "call_function" and n.target is self.all_reduce]:
            # Match against the current graph: an earlier rewrite may have replaced this one's inputs.
            order = {n: i for i, n in enumerate(graph.nodes)}
            m = self._match(ar, order)
            if m is not None:
                self._rewrite(graph, *m)
                self.rewrites += 1
        if self.rewrites:
            first = FastcommFusionPass.total_rewrites == 0
            FastcommFusionPass.total_rewrites += self.rewrites
            (logger.info if first else logger.debug)(
                "fastcomm: compile pass fused %d all-reduce + RMSNorm pair(s) in this graph", self.rewrites)

    def _match(self, ar: fx.Node, order: dict):
        group_name = _arg(ar, 1, "group_name")
        if not isinstance(group_name, str) or not self.eligible(group_name):
            return None
        chain, tap = [], ar
        while len(tap.users) == 1:
            (user,) = tap.users
            if str(user.target) not in _VIEWS or _shape(user) != _shape(ar) or _shape(ar) is None:
                break
            chain.append(user)
            tap = user
        norms = sorted((u for u in tap.users if u.target in (self.rms_norm, self.add_rms_norm)
                        and u.args and u.args[0] is tap), key=order.__getitem__)
        if not norms:
            return None
        norm = norms[0]
        with_residual = norm.target is self.add_rms_norm
        k = 1 if with_residual else 0
        residual = _arg(norm, 1, "x_residual") if with_residual else None
        weight, eps = _arg(norm, 1 + k, "weight"), _arg(norm, 2 + k, "epsilon")
        if not isinstance(weight, fx.Node) or _arg(norm, 3 + k, "variance_size") is not None or residual is tap:
            return None
        others = [u for u in tap.users if u is not norm]
        if with_residual and others:
            return None  # someone needs all_reduce(x) alone, which the fused op does not return
        if any(order[u] < order[norm] for u in others):
            return None  # the fused op sits where the norm was; earlier readers would lose their input
        return ar, chain, tap, norm, residual, weight, float(eps), group_name

    def _rewrite(self, graph, ar, chain, tap, norm, residual, weight, eps, group_name) -> None:
        x = ar.args[0]
        with graph.inserting_before(norm):
            fused = graph.call_function(self.fused, (x, residual, weight, eps, group_name))
            if residual is not None:
                fused.meta["val"] = norm.meta.get("val")
                norm.replace_all_uses_with(fused)  # its users are getitem(0) / getitem(1), same layout
            else:
                out = graph.call_function(operator.getitem, (fused, 0))
                res = graph.call_function(operator.getitem, (fused, 1))
                fused.meta["val"] = (norm.meta.get("val"), tap.meta.get("val"))
                out.meta["val"], res.meta["val"] = norm.meta.get("val"), tap.meta.get("val")
                norm.replace_all_uses_with(out)
        graph.erase_node(norm)
        if residual is None:
            tap.replace_all_uses_with(res)
        for node in reversed([ar] + chain):
            graph.erase_node(node)


class FastcommPassManager(PostGradPassManager):
    """vLLM's post-grad pass manager plus ``FastcommFusionPass`` after vLLM's own fusions."""

    def configure(self, config) -> None:
        super().configure(config)
        if config.parallel_config.tensor_parallel_size > 1:
            self.passes.append(FastcommFusionPass())
