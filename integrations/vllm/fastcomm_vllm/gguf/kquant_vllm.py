"""vllm-gguf-plugin's linear and MoE layers through fastcomm's K-quant decode kernels (kquant.py).

``install()`` wraps ``GGUFLinearMethod.apply`` (every quantized linear layer, the LM head included) and
``GGUFMoEMethod.apply``: a layer whose weights the kernels can read (``kquant.plan_linear`` /
``kquant.moe_types_ok``, decided once per layer) calls a torch custom op that takes fastcomm's kernels for
1-8 tokens (a decode step, an MTP verify), so a CUDA graph of a decode batch records fastcomm's kernels.
Layers the kernels cannot read keep the plugin's ``apply``. A prefill (past 8 tokens) takes the form
kquant.prefill_form / moe_prefill_form choose: the weights dequantized to bf16 for the tensor cores
(``dequant_linear`` / ``dequant_moe``; FASTCOMM_GGUF_DEQUANT_*), fastcomm's kernels 8 tokens a call
(kquant.linear_chunks / moe_chunks; FASTCOMM_GGUF_CHUNK_MAX_TOKENS), or the plugin's own function. Idempotent.
``install(tensor_cores=False)`` (FASTCOMM_GGUF_KERNELS=dp4a) keeps the products on
the dp4a forms; ``mma_min`` / ``grouped_min`` move the tensor-core forms' token thresholds
(FASTCOMM_GGUF_MMA_MIN_TOKENS / FASTCOMM_GGUF_GROUPED_MIN_TOKENS); ``pdl`` allows the dense tensor-core form's
dependent launch (FASTCOMM_GGUF_PDL).
"""
import functools

import torch

from . import kquant

_PLAN = "_fastcomm_kq_plan"  # per layer: the segments (linear), True (MoE), or None (the plugin's path)
# Set once by install(), from the FASTCOMM_GGUF_* settings, before any layer runs.
_FORMS = {"tensor_cores": True, "mma_min": kquant.MMA_MIN_TOKENS, "grouped_min": kquant.MOE_GROUPED_MIN_TOKENS,
          "pdl": True, "dequant_min": 0, "dequant_moe_min": 0, "chunk_max": 0,
          "dequant_kernel": kquant.DEQUANT_KERNEL}


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


def _linear_fn(x: torch.Tensor, qweight: torch.Tensor, types: list[int], starts: list[int],
               rows: list[int]) -> torch.Tensor:
    from vllm_gguf_plugin.quantization import linear as plin

    aligned = kquant.weights_aligned(qweight.data_ptr())
    segs = tuple(kquant.Segment(t, s, r) for t, s, r in zip(types, starts, rows))
    forms = {"tensor_cores": _FORMS["tensor_cores"], "mma_min": _FORMS["mma_min"], "pdl": _FORMS["pdl"]}
    if kquant.decode_tokens_ok(x.shape[0]) and aligned:
        return kquant.linear(x, qweight, segs, **forms)
    # eager (no graph capture), a chunked linear's host time exceeds its GPU time: kquant.prefill_form
    prefill = kquant.prefill_form(x.shape[0], _FORMS["chunk_max"] if aligned else 0, _FORMS["dequant_min"],
                                  host_bound=not (x.is_cuda and torch.cuda.is_current_stream_capturing()))
    if prefill == "dequant":  # fastcomm's dequantize reads as its other kernels do: an aligned weight only
        kernel = _FORMS["dequant_kernel"] if aligned else "plugin"
        return dequant_linear(x, qweight, types, starts, rows, kernel=kernel)
    if prefill == "chunks":
        return kquant.linear_chunks(x, qweight, segs, **forms)
    # Bytes of a row a segment uses (its shard's type over x's columns; the stored rows are padded to the widest).
    used = [kquant.BLOCKS[t][1] * (x.shape[1] // kquant.BLOCKS[t][0]) for t in types]
    if len(types) == 1 and used[0] == qweight.shape[1] and rows[0] == qweight.shape[0]:
        return plin._fused_mul_mat_gguf(x, qweight, types[0])
    return torch.cat([plin._fused_mul_mat_gguf(x, qweight[s:s + r, :u].contiguous(), t)
                      for t, s, r, u in zip(types, starts, rows, used)], dim=1)


def _linear_fake(x: torch.Tensor, qweight: torch.Tensor, types: list[int], starts: list[int],
                 rows: list[int]) -> torch.Tensor:
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
            topk_ids: torch.Tensor, t13: int, t2: int, activation: str) -> torch.Tensor:
    from vllm_gguf_plugin.quantization import fused_moe as pmoe

    aligned = kquant.weights_aligned(w13.data_ptr(), w2.data_ptr())
    forms = {"silu": activation == "silu", "tensor_cores": _FORMS["tensor_cores"], "grouped_min": _FORMS["grouped_min"]}
    if kquant.decode_tokens_ok(x.shape[0]) and aligned:
        return kquant.moe(x, w13, w2, topk_weights, topk_ids, t13, t2, _activation(activation), **forms)
    prefill = kquant.moe_prefill_form(x.shape[0], topk_ids.shape[1], w13.shape[0],
                                      _FORMS["chunk_max"] if aligned else 0, _FORMS["dequant_moe_min"])
    if prefill == "dequant":
        return dequant_moe(x, w13, w2, topk_weights, topk_ids, t13, t2, activation,
                           kernel=_FORMS["dequant_kernel"] if aligned else "plugin")
    if prefill == "chunks":
        return kquant.moe_chunks(x, w13, w2, topk_weights, topk_ids, t13, t2, _activation(activation), **forms)
    return pmoe._fused_moe_gguf(x, w13, w2, topk_weights, topk_ids, t13, t2, activation)


def _moe_fake(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, t13: int, t2: int, activation: str) -> torch.Tensor:
    return torch.empty_like(x)


@functools.lru_cache(maxsize=None)
def register_ops() -> None:
    from vllm.utils.torch_utils import direct_register_custom_op

    direct_register_custom_op(op_name="fastcomm_gguf_linear", op_func=_linear_fn, fake_impl=_linear_fake)
    direct_register_custom_op(op_name="fastcomm_gguf_moe", op_func=_moe_fn, fake_impl=_moe_fake)


def linear_plan(layer) -> tuple[kquant.Segment, ...] | None:
    """The plugin's stored weight of ``layer`` as kernel segments, in the order its ``apply`` concatenates."""
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
    return kquant.plan_linear(types, offsets, row_stride, cols)


def moe_plan(layer) -> bool:
    w13, w2 = layer.w13_qweight, layer.w2_qweight
    if any(isinstance(w, torch.nn.parameter.UninitializedParameter) for w in (w13, w2)):
        return False
    if layer.apply_router_weight_on_input or w13.dim() != 3 or w2.dim() != 3:
        return False
    t13, t2 = layer.w13_qweight_type.weight_type, layer.w2_qweight_type.weight_type
    if t13 not in kquant.BLOCKS:
        return False
    hidden = w13.shape[2] // kquant.BLOCKS[t13][1] * kquant.BLOCKS[t13][0]
    return kquant.moe_types_ok(t13, t2, hidden, w13.shape[1] // 2, w13.shape[2], w2.shape[2]) and w2.shape[1] == hidden


def _after_loading(original, plan):
    @functools.wraps(original)
    def process(self, layer):
        original(self, layer)
        # Decided here, once, outside any torch.compile trace: apply only reads it.
        setattr(layer, _PLAN, plan(layer) or None)
    process._fastcomm = True
    return process


def install(tensor_cores: bool = True, mma_min: int | None = None, grouped_min: int | None = None,
            pdl: bool = True, dequant_min: int = 0, dequant_moe_min: int = 0, chunk_max: int = 0,
            dequant_kernel: str = kquant.DEQUANT_KERNEL) -> bool:
    """Wrap the plugin's methods (once); False when the plugin is not importable here. The prefill's settings
    (``dequant_min``, ``dequant_moe_min``, ``chunk_max``) as kquant.prefill_form takes them; 0: off;
    ``dequant_kernel`` (kquant.DEQUANT_KERNELS) writes the dequantized form's weights."""
    try:
        from vllm_gguf_plugin.quantization import fused_moe as pmoe, linear as plin
    except ImportError:
        return False
    _FORMS["tensor_cores"] = tensor_cores
    _FORMS["mma_min"] = mma_min or kquant.MMA_MIN_TOKENS
    _FORMS["grouped_min"] = grouped_min or kquant.MOE_GROUPED_MIN_TOKENS
    _FORMS["pdl"] = pdl
    _FORMS.update(dequant_min=dequant_min, dequant_moe_min=dequant_moe_min, chunk_max=chunk_max,
                  dequant_kernel=dequant_kernel)
    if getattr(plin.GGUFLinearMethod.apply, "_fastcomm", False):
        return True
    register_ops()
    linear_apply, moe_apply = plin.GGUFLinearMethod.apply, pmoe.GGUFMoEMethod.apply

    @functools.wraps(linear_apply)
    def apply_linear(self, layer, x, bias=None):
        segs = getattr(layer, _PLAN, None)
        if segs is None:
            return linear_apply(self, layer, x, bias)
        out = torch.ops.vllm.fastcomm_gguf_linear(x, layer.qweight, [s.type for s in segs], [s.start for s in segs],
                                                  [s.rows for s in segs])
        if bias is not None:
            out.add_(bias)
        return out

    @functools.wraps(moe_apply)
    def apply_moe(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        if getattr(layer, _PLAN, None) is None:
            return moe_apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
        return torch.ops.vllm.fastcomm_gguf_moe(x, layer.w13_qweight, layer.w2_qweight, topk_weights, topk_ids,
                                                layer.w13_qweight_type.weight_type, layer.w2_qweight_type.weight_type,
                                                layer.activation.value)

    apply_linear._fastcomm = apply_moe._fastcomm = True
    plin.GGUFLinearMethod.apply = apply_linear
    pmoe.GGUFMoEMethod.apply = apply_moe
    plin.GGUFLinearMethod.process_weights_after_loading = _after_loading(
        plin.GGUFLinearMethod.process_weights_after_loading, linear_plan)
    pmoe.GGUFMoEMethod.process_weights_after_loading = _after_loading(
        pmoe.GGUFMoEMethod.process_weights_after_loading, moe_plan)
    return True
