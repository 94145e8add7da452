"""All-reduce followed by RMSNorm, as one fastcomm kernel.

Two routes, because vLLM reaches "all-reduce then RMSNorm" two ways:

1. The DSA model (GLM-5 ``GlmMoeDsaForCausalLM`` and DeepSeek-V3.2) calls a helper,
   ``fused_allreduce_rms_norm(hidden_states, residual, norm)``, twice per layer and once for the final
   norm. It runs eagerly (under vLLM's breakable CUDA graph), so no compile pass sees it. Its fast path is
   FlashInfer's NVLink/NVSwitch kernel; on PCIe it falls back to NCCL + a separate norm. We wrap it.
   Where it lives: vLLM 0.33 ``vllm.models.common.ops.fused_allreduce_rms_norm`` (used by
   ``vllm.models.deepseek_v32.nvidia.model``, the default class for GlmMoeDsaForCausalLM on CUDA);
   vLLM 0.25 ``vllm.models.deepseek_v32.nvidia.fused_ops`` (used by ``...deepseek_v32.nvidia.model``, which
   0.25 only serves through ``model_class_overrides``; its default GLM-5 class is ``deepseek_v2``'s).
2. torch.compiled models (0.25's default GLM-5 path included) show ``vllm.all_reduce`` followed by
   ``vllm_ir.rms_norm`` / ``vllm_ir.fused_add_rms_norm`` in the post-grad graph. ``FastcommFusionPass``
   replaces each pair with ``fastcomm_vllm.fused_all_reduce_rms_norm``, which decides at run time (the
   token count is symbolic at compile time) between fastcomm's fused kernel and the two original ops.
"""
from __future__ import annotations

import functools
import importlib.abc
import logging
import operator
import sys
from typing import Callable

import torch
from torch import fx
from vllm.compilation.passes.inductor_pass import InductorPass
from vllm.compilation.passes.pass_manager import PostGradPassManager

logger = logging.getLogger("vllm.fastcomm")

HELPER = "fused_allreduce_rms_norm"
# Module defining the helper, newest layout first. Consumers bind it with `from ... import`, so it must be
# wrapped in the defining module before they import it (see route_fused_helper).
HELPER_MODULES = ("vllm.models.common.ops.fused_allreduce_rms_norm",  # vLLM 0.33
                  "vllm.models.deepseek_v32.nvidia.fused_ops")         # vLLM 0.25
OP = "fastcomm_vllm::fused_all_reduce_rms_norm"


# ---- the runtime decision ------------------------------------------------------------------------------

def workspace_of(group_name: str):
    """The fastcomm workspace of vLLM's group ``group_name`` ("tp:0"), or None."""
    from vllm.distributed import parallel_state

    ref = parallel_state._groups.get(group_name)  # vLLM's registry behind torch.ops.vllm.all_reduce
    group = ref() if ref is not None else None
    comm = None if group is None else group.device_communicator
    return getattr(comm, "fastcomm_workspace", None)


def _fusable(ws, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
    # Same on every rank: shapes, dtypes and layout are. The weight check mirrors the kernel's own, so a
    # call we route never raises on the hot path.
    return (ws.why_not_fused(x, residual) is None and weight.dtype == x.dtype and weight.is_contiguous()
            and weight.shape == x.shape[-1:] and weight.device == x.device)


def _impl(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
          group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    ws = workspace_of(group_name)
    if ws is not None and _fusable(ws, x, residual, weight):
        import fastcomm

        return fastcomm.fused_all_reduce_rmsnorm(x, weight, eps, ws, residual=residual)
    # What the graph held before the rewrite: the group's all-reduce, then vLLM's norm (same IR dispatch).
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


# ---- route 1: the DSA model's helper -------------------------------------------------------------------

def _plain_rms_norm(norm) -> bool:
    from vllm.model_executor.layers.layernorm import RMSNorm

    return (type(norm) is RMSNorm and getattr(norm, "has_weight", True)
            and getattr(norm, "variance_size_override", None) is None)


def wrap_helper(original: Callable) -> Callable:
    """The helper with fastcomm first; anything fastcomm cannot take goes to ``original`` unchanged."""
    from vllm.distributed.parallel_state import get_tp_group

    @functools.wraps(original)
    def fused_allreduce_rms_norm(hidden_states, residual, norm):
        comm = get_tp_group().device_communicator
        ws = getattr(comm, "fastcomm_workspace", None)
        if ws is None or not _plain_rms_norm(norm):
            return original(hidden_states, residual, norm)
        if torch.compiler.is_compiling():
            # Traced callers get the op (decides at run time); eager callers skip the dispatcher.
            return torch.ops.fastcomm_vllm.fused_all_reduce_rms_norm(
                hidden_states, residual, norm.weight, norm.variance_epsilon, get_tp_group().unique_name)
        if not _fusable(ws, hidden_states, residual, norm.weight):
            return original(hidden_states, residual, norm)
        import fastcomm

        return fastcomm.fused_all_reduce_rmsnorm(hidden_states, norm.weight, norm.variance_epsilon, ws,
                                                 residual=residual)

    fused_allreduce_rms_norm._fastcomm_original = original
    return fused_allreduce_rms_norm


def _wrap_module(module) -> None:
    helper = getattr(module, HELPER, None)
    if helper is None or hasattr(helper, "_fastcomm_original"):
        return
    wrapped = wrap_helper(helper)
    setattr(module, HELPER, wrapped)
    # Consumers imported before us hold the original: rebind them too (normally there are none yet).
    for other in list(sys.modules.values()):
        if getattr(other, HELPER, None) is helper:
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


def route_fused_helper() -> None:
    """Wrap the helper wherever this vLLM defines it, now or when first imported. Idempotent."""
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


# ---- route 2: the compile pass ------------------------------------------------------------------------

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
