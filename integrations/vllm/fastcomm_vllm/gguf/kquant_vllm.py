"""vllm-gguf-plugin's linear and MoE layers through fastcomm's K-quant decode kernels (fastcomm.kquant).

``install()`` wraps ``GGUFLinearMethod.apply`` (every quantized linear layer, the LM head included) and
``GGUFMoEMethod.apply``: a layer whose weights the kernels can read (``kquant.plan_linear`` /
``kquant.moe_types_ok``, decided once per layer) calls a torch custom op that takes fastcomm's kernels for
1-8 tokens (a decode step, an MTP verify), so a CUDA graph of a decode batch records fastcomm's kernels.
Layers the kernels cannot read keep the plugin's ``apply``. A prefill (past 8 tokens) takes the form
kquant.prefill_form / moe_prefill_form choose: the weights dequantized to bf16 for the tensor cores
(``dequant_linear`` / ``dequant_moe``; FASTCOMM_GGUF_DEQUANT_*), fastcomm's kernels 8 tokens a call
(kquant.linear_chunks / moe_chunks; FASTCOMM_GGUF_CHUNK_MAX_TOKENS), or the plugin's own function.

``install(settings)`` takes one ``kquant.settings.Settings``; each layer's plan holds it from its loading on,
and the custom ops receive the fields they decide by as arguments, so nothing reads a module global at run
time. Installing again (other settings) rewraps the plugin's original methods. A layer's plan also holds its
measured forms (fastcomm.kquant.forms: the table FASTCOMM_GGUF_FORMS names for this GPU, looked up by the
layer's shape once, at its loading), which its op receives as one form a token count.
"""
from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from fastcomm import kquant
from fastcomm.kquant import forms as measured
from fastcomm.kquant.settings import Settings

log = logging.getLogger("fastcomm")
NO_FORMS = (measured.NONE,) * kquant.MAX_TOKENS  # every token count by the policy's rule
# This process's layers that took a measured form, by the table's source: what a run's record says served
# (fastcomm_vllm.plugin.worker_status reads it through ``forms_served``).
_SERVED: dict[str, int] = {}

_PLAN = "_fastcomm_kq_plan"  # per layer: a LayerPlan, or None (the plugin's path)
_ORIGINAL = "_fastcomm_original"  # on a wrapped method: the plugin's own
_SETTINGS = "_fastcomm_settings"  # on the wrapped loading method: the settings its layers get


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """What a layer's products run with, decided once at its loading: the weight's segments (a linear; None
    for a MoE), the settings, and the measured form of each token count 1..MAX_TOKENS (NONE: the rule's)."""
    segments: tuple[kquant.Segment, ...] | None
    settings: Settings
    forms: tuple[str, ...] = NO_FORMS


def layer_plan(layer, missing=None):
    """The plan a layer got at its loading (a LayerPlan, or None: the plugin's path), ``missing`` where no
    loading of ours has run on it."""
    return getattr(layer, _PLAN, missing)


def linear_args(s: Settings) -> tuple:
    """The settings a linear custom op decides by, in its argument order (after the weight's layout)."""
    return s.tensor_cores, s.mma_min_tokens, s.pdl, s.chunk_max_tokens, s.dequant_min_tokens, s.dequant_kernel


def moe_args(s: Settings) -> tuple:
    """The settings a MoE custom op decides by, in its argument order (after the activation)."""
    return s.tensor_cores, s.grouped_min_tokens, s.moe_staged, s.chunk_max_tokens, s.dequant_moe_min, s.dequant_kernel


def dequant_linear(x: torch.Tensor, qweight: torch.Tensor, types: list[int], starts: list[int],
                   rows: list[int], kernel: str | None = None) -> torch.Tensor:
    """x times the weight dequantized to x's dtype by ``kernel`` (kquant.DEQUANT_KERNELS; None:
    kquant.DEQUANT_KERNEL): fastcomm's, every segment in one launch and one cuBLAS GEMM; the plugin's
    ggml_dequantize, a GEMM a segment."""
    cols, outs = x.shape[1], []
    if (kernel or kquant.DEQUANT_KERNEL) == "fastcomm":
        segs = tuple(kquant.Segment(t, s, r) for t, s, r in zip(types, starts, rows))
        return x @ kquant.dequantize(qweight, segs, cols, x.dtype).T
    from vllm_gguf_plugin import ops as pops

    for t, s, r in zip(types, starts, rows):
        used = kquant.BLOCKS[t][1] * (cols // kquant.BLOCKS[t][0])
        outs.append(x @ pops.ggml_dequantize(qweight[s:s + r, :used].contiguous(), t, r, cols, x.dtype).T)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def dequant_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, t13: int, t2: int, activation: str, kernel: str | None = None) -> torch.Tensor:
    """The routed experts dequantized to x's dtype by ``kernel`` (as ``dequant_linear``), every one (no host
    sync: a CUDA graph may hold it), through vLLM's fused_experts (Triton, the tensor cores), which weighs each
    pair by its router weight."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

    experts, hidden, inter2 = w13.shape[0], x.shape[1], w13.shape[1]
    inter = inter2 // 2
    w13r, w2r = w13.reshape(experts * inter2, -1), w2.reshape(experts * hidden, -1)
    if (kernel or kquant.DEQUANT_KERNEL) == "fastcomm":
        a = kquant.dequantize(w13r, (kquant.Segment(t13, 0, experts * inter2),), hidden, x.dtype)
        b = kquant.dequantize(w2r, (kquant.Segment(t2, 0, experts * hidden),), inter, x.dtype)
    else:
        from vllm_gguf_plugin import ops as pops

        a = pops.ggml_dequantize(w13r, t13, experts * inter2, hidden, x.dtype)
        b = pops.ggml_dequantize(w2r, t2, experts * hidden, inter, x.dtype)
    return fused_experts(x, a.view(experts, inter2, hidden), b.view(experts, hidden, inter), topk_weights, topk_ids,
                         activation=MoEActivation.from_str(activation))


def forms_arg(forms: tuple[str, ...]) -> str:
    """A plan's measured forms as its custom op takes them: one string, comma-separated (a torch op schema has
    no list of strings)."""
    return ",".join(forms)


def _measured(forms: str, tokens: int) -> str | None:
    """The measured form at ``tokens`` (1..MAX_TOKENS) in a ``forms_arg`` string, None where the rule serves."""
    found = forms.split(",")
    return (found[tokens - 1] or None) if tokens <= len(found) else None


def _linear_fn(x: torch.Tensor, qweight: torch.Tensor, types: list[int], starts: list[int], rows: list[int],
               tensor_cores: bool, mma_min: int, pdl: bool, chunk_max: int, dequant_min: int,
               dequant_kernel: str, measured_forms: str) -> torch.Tensor:
    from vllm_gguf_plugin.quantization import linear as plin

    aligned = kquant.weights_aligned(qweight.data_ptr())
    segs = tuple(kquant.Segment(t, s, r) for t, s, r in zip(types, starts, rows))
    forms = {"tensor_cores": tensor_cores, "mma_min": mma_min, "pdl": pdl}
    if kquant.decode_tokens_ok(x.shape[0]) and aligned:
        return kquant.linear(x, qweight, segs, form=_measured(measured_forms, x.shape[0]), **forms)
    # eager (no graph capture), a chunked linear's host time exceeds its GPU time: kquant.prefill_form
    prefill = kquant.prefill_form(x.shape[0], chunk_max if aligned else 0, dequant_min,
                                  host_bound=not (x.is_cuda and torch.cuda.is_current_stream_capturing()))
    if prefill == "dequant":  # fastcomm's dequantize reads as its other kernels do: an aligned weight only
        kernel = dequant_kernel if aligned else "plugin"
        return dequant_linear(x, qweight, types, starts, rows, kernel=kernel)
    if prefill == "chunks":
        return kquant.linear_chunks(x, qweight, segs, **forms)
    # Bytes of a row a segment uses (its shard's type over x's columns; the stored rows are padded to the widest).
    used = [kquant.BLOCKS[t][1] * (x.shape[1] // kquant.BLOCKS[t][0]) for t in types]
    if len(types) == 1 and used[0] == qweight.shape[1] and rows[0] == qweight.shape[0]:
        return plin._fused_mul_mat_gguf(x, qweight, types[0])
    return torch.cat([plin._fused_mul_mat_gguf(x, qweight[s:s + r, :u].contiguous(), t)
                      for t, s, r, u in zip(types, starts, rows, used)], dim=1)


def _linear_fake(x: torch.Tensor, qweight: torch.Tensor, types: list[int], starts: list[int], rows: list[int],
                 tensor_cores: bool, mma_min: int, pdl: bool, chunk_max: int, dequant_min: int,
                 dequant_kernel: str, measured_forms: str) -> torch.Tensor:
    return torch.empty(x.shape[0], sum(rows), dtype=x.dtype, device=x.device)


@functools.lru_cache(maxsize=None)
def _activation(name: str):
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation, apply_moe_activation

    kind = MoEActivation.from_str(name)

    def act(inp):
        out = torch.empty(inp.shape[:-1] + (inp.shape[-1] // 2,), dtype=inp.dtype, device=inp.device)
        apply_moe_activation(kind, out, inp)
        return out

    return act


def _moe_fn(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, t13: int, t2: int, activation: str, tensor_cores: bool, grouped_min: int,
            staged: bool, chunk_max: int, dequant_moe_min: int, dequant_kernel: str,
            measured_forms: str) -> torch.Tensor:
    from vllm_gguf_plugin.quantization import fused_moe as pmoe

    aligned = kquant.weights_aligned(w13.data_ptr(), w2.data_ptr())
    forms = {"silu": activation == "silu", "tensor_cores": tensor_cores, "grouped_min": grouped_min,
             "staged": staged}
    if kquant.decode_tokens_ok(x.shape[0]) and aligned:
        return kquant.moe(x, w13, w2, topk_weights, topk_ids, t13, t2, _activation(activation),
                          form=_measured(measured_forms, x.shape[0]), **forms)
    prefill = kquant.moe_prefill_form(x.shape[0], topk_ids.shape[1], w13.shape[0], chunk_max if aligned else 0,
                                      dequant_moe_min)
    if prefill == "dequant":
        return dequant_moe(x, w13, w2, topk_weights, topk_ids, t13, t2, activation,
                           kernel=dequant_kernel if aligned else "plugin")
    if prefill == "chunks":
        return kquant.moe_chunks(x, w13, w2, topk_weights, topk_ids, t13, t2, _activation(activation), **forms)
    return pmoe._fused_moe_gguf(x, w13, w2, topk_weights, topk_ids, t13, t2, activation)


def _moe_fake(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, t13: int, t2: int, activation: str, tensor_cores: bool, grouped_min: int,
              staged: bool, chunk_max: int, dequant_moe_min: int, dequant_kernel: str,
              measured_forms: str) -> torch.Tensor:
    return torch.empty_like(x)


@functools.lru_cache(maxsize=None)
def register_ops() -> None:
    from vllm.utils.torch_utils import direct_register_custom_op

    direct_register_custom_op(op_name="fastcomm_gguf_linear", op_func=_linear_fn, fake_impl=_linear_fake)
    direct_register_custom_op(op_name="fastcomm_gguf_moe", op_func=_moe_fn, fake_impl=_moe_fake)


def linear_plan(layer, settings: Settings) -> LayerPlan | None:
    """The plugin's stored weight of ``layer`` as kernel segments, in the order its ``apply`` concatenates, with
    the measured forms of its shape (None: the plugin's path)."""
    qweight, qtype = layer.qweight, layer.qweight_type
    if isinstance(qweight, torch.nn.parameter.UninitializedParameter) or qweight.dim() != 2:
        return None
    shard_id = list(getattr(qweight, "shard_id", None) or [])
    row_stride = qweight.shape[1]
    if not shard_id:
        offsets, types = [(0, qweight.shape[0], row_stride)], [qtype.weight_type]
    else:
        shard_id = ["q", "k", "v"] if "q" in shard_id else shard_id  # the plugin's apply does the same
        types = [qtype.shard_weight_type.get(i, qtype.weight_type) for i in shard_id]
        if len(set(types)) == 1:
            offsets, types = [(0, qweight.shape[0], row_stride)], types[:1]
        else:
            offsets = [tuple(qweight.shard_offset_map[i]) for i in shard_id]
    first = types[0]
    if first not in kquant.BLOCKS:
        return None
    values, nbytes = kquant.BLOCKS[first]
    cols = offsets[0][2] // nbytes * values  # every shard has the layer's input features
    segs = kquant.plan_linear(types, offsets, row_stride, cols)
    if segs is None:
        return None
    table = _table(settings.forms, _device_name(qweight))
    found = measured.forms_for(table, measured.LinearShape.of(segs, cols), tensor_cores=settings.tensor_cores,
                               mma=kquant.mma_ok(segs, cols))
    return LayerPlan(segs, settings, _served(table, found))


def moe_plan(layer, settings: Settings) -> LayerPlan | None:
    w13, w2 = layer.w13_qweight, layer.w2_qweight
    if any(isinstance(w, torch.nn.parameter.UninitializedParameter) for w in (w13, w2)):
        return None
    if layer.apply_router_weight_on_input or w13.dim() != 3 or w2.dim() != 3:
        return None
    t13, t2 = layer.w13_qweight_type.weight_type, layer.w2_qweight_type.weight_type
    if t13 not in kquant.BLOCKS:
        return None
    hidden, inter = w13.shape[2] // kquant.BLOCKS[t13][1] * kquant.BLOCKS[t13][0], w13.shape[1] // 2
    if not kquant.moe_types_ok(t13, t2, hidden, inter, w13.shape[2], w2.shape[2]) or w2.shape[1] != hidden:
        return None
    topk = _top_k(layer)
    if topk is None:  # no shape to look up: the rule serves every token count
        return LayerPlan(None, settings)
    fits = None
    if w13.is_cuda:  # the staged form's stage against this GPU's (or the emulated one's) shared memory
        block = kquant.limits(w13.device.index).smem_per_block
        fits = lambda n: kquant.moe_stage_bytes(n, topk, hidden, inter) <= block  # noqa: E731
    table = _table(settings.forms, _device_name(w13))
    found = measured.forms_for(table, measured.MoeShape(t13, t2, hidden, inter, topk),
                               tensor_cores=settings.tensor_cores, staged_fits=fits)
    return LayerPlan(None, settings, _served(table, found))


def _served(table: measured.Table | None, found: tuple[str, ...]) -> tuple[str, ...]:
    if table is not None and any(found):
        _SERVED[table.source] = _SERVED.get(table.source, 0) + 1
    return found


def forms_served() -> dict[str, int]:
    """Layers of this process that took a measured form, by the source of the table it came from."""
    return dict(_SERVED)


def _top_k(layer) -> int | None:
    """Experts a token of ``layer`` (vLLM's FusedMoE: ``top_k``; 0.3x's routed experts: their moe_config's)."""
    k = getattr(layer, "top_k", None)
    if k is None:
        k = getattr(getattr(layer, "moe_config", None), "experts_per_token", None)
    return int(k) if isinstance(k, int) and k > 0 else None


def _device_name(weight: torch.Tensor) -> str | None:
    """The GPU a weight serves on as the forms tables name it: its limits' name (a test's emulated GPU's under
    FASTCOMM_TEST_DEVICE_LIMITS, so another GPU's measured forms do not serve there); None on a CPU."""
    return kquant.limits(weight.device.index).name if weight.is_cuda else None


@functools.lru_cache(maxsize=None)
def _table(setting: str, device: str | None) -> measured.Table | None:
    """The forms table for FASTCOMM_GGUF_FORMS=``setting`` on ``device``, read once a process."""
    if setting == measured.AUTO and device is None:  # a CPU rank: no GPU's table (it runs none of the kernels)
        return None
    from fastcomm.config import read

    table = measured.resolve(setting, device, cache_dir=read("FASTCOMM_CACHE_DIR"))
    if table is not None:
        where = "" if device is None or table.device == device else f", measured on {table.device}"
        log.info("fastcomm: K-quant forms of %d product shapes from %s (%s%s)", len(table.entries),
                 "this GPU's table" if setting == measured.AUTO else setting, table.source, where)
    return table


def _after_loading(original, plan, settings: Settings):
    @functools.wraps(original)
    def process(self, layer):
        original(self, layer)
        # Decided here, once, outside any torch.compile trace: apply only reads it.
        setattr(layer, _PLAN, plan(layer, settings))
    setattr(process, _ORIGINAL, original)
    setattr(process, _SETTINGS, settings)
    return process


def _own(method):
    """The plugin's method under any wrapper of ours."""
    return getattr(method, _ORIGINAL, method)


def install(settings: Settings) -> bool:
    """Wrap the plugin's methods so that the layers loaded from now on serve with ``settings``; False when the
    plugin is not importable here."""
    try:
        from vllm_gguf_plugin.quantization import fused_moe as pmoe, linear as plin
    except ImportError:
        return False
    register_ops()
    linear_apply, moe_apply = _own(plin.GGUFLinearMethod.apply), _own(pmoe.GGUFMoEMethod.apply)

    @functools.wraps(linear_apply)
    def apply_linear(self, layer, x, bias=None):
        plan = getattr(layer, _PLAN, None)
        if plan is None:
            return linear_apply(self, layer, x, bias)
        segs = plan.segments
        out = torch.ops.vllm.fastcomm_gguf_linear(x, layer.qweight, [s.type for s in segs], [s.start for s in segs],
                                                  [s.rows for s in segs], *linear_args(plan.settings),
                                                  forms_arg(plan.forms))
        if bias is not None:
            out.add_(bias)
        return out

    @functools.wraps(moe_apply)
    def apply_moe(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        plan = getattr(layer, _PLAN, None)
        if plan is None:
            return moe_apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
        return torch.ops.vllm.fastcomm_gguf_moe(x, layer.w13_qweight, layer.w2_qweight, topk_weights, topk_ids,
                                                layer.w13_qweight_type.weight_type, layer.w2_qweight_type.weight_type,
                                                layer.activation.value, *moe_args(plan.settings),
                                                forms_arg(plan.forms))

    setattr(apply_linear, _ORIGINAL, linear_apply)
    setattr(apply_moe, _ORIGINAL, moe_apply)
    plin.GGUFLinearMethod.apply = apply_linear
    pmoe.GGUFMoEMethod.apply = apply_moe
    plin.GGUFLinearMethod.process_weights_after_loading = _after_loading(
        _own(plin.GGUFLinearMethod.process_weights_after_loading), linear_plan, settings)
    pmoe.GGUFMoEMethod.process_weights_after_loading = _after_loading(
        _own(pmoe.GGUFMoEMethod.process_weights_after_loading), moe_plan, settings)
    return True


def installed_settings() -> Settings | None:
    """The settings the plugin's layers load with now, or None where fastcomm's kernels are not installed."""
    try:
        from vllm_gguf_plugin.quantization import linear as plin
    except ImportError:
        return None
    return getattr(plin.GGUFLinearMethod.process_weights_after_loading, _SETTINGS, None)
