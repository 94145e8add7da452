"""GLM-5 (llama.cpp arch ``glm-dsa``) tensor names -> the Hugging Face checkpoint names vLLM's loader takes.

Pure data and functions, no I/O. vLLM's ``load_weights`` (the same in 0.25.0 and 0.33.0) consumes HF names
and does its own stacking (``q_a_proj`` + ``kv_a_proj_with_mqa`` -> ``fused_qkv_a_proj``, ``wk`` +
``weights_proj`` -> ``wk_weights_proj``, ``gate_proj`` + ``up_proj`` -> ``gate_up_proj``, per-expert
weights -> ``w13``/``w2``), and the MTP model (block 78) its own ``mtp_block`` renaming, so producing exact
HF names is the whole contract. Three things the file does differently from the checkpoint:
- llama.cpp splits ``kv_b_proj`` into ``attn_k_b`` (per head, stored transposed) and ``attn_v_b``;
  each is quantized along its own last axis, so they can only be joined after dequantizing.
- experts are stacked into one 3-D tensor per projection (``ffn_gate_exps`` = [experts, out, in]).
- tensors stream in llama.cpp's order (``attn_kv_a_mqa`` before ``attn_q_a``), not the fused order.
"""
from __future__ import annotations

import dataclasses
import re

ARCH = "glm-dsa"            # general.architecture of a GLM-5 GGUF
MODEL_TYPE = "glm_moe_dsa"  # the Hugging Face model_type it corresponds to

# How a tensor is handed to vLLM:
QUANT = "quant"      # as stored: quantized blocks stay quantized (the plugin's kernels), F32/F16/BF16 as is
DENSE = "dense"      # dequantized to the model dtype: vLLM builds this module without a quantization method
KV_B_K = "kv_b:k"    # half of kv_b_proj, joined with its other half after dequantizing
KV_B_V = "kv_b:v"
EXPERTS = "experts"  # stacked [n_experts, ...]: split into one tensor per expert ("{e}" in the HF name)

# GGUF per-block tensor (after "blk.{i}.") -> (HF name after "model.layers.{i}.", how it is handed over).
# The GGUF side is gguf-py's MODEL_TENSORS[GLM_DSA] (tests check every name against it).
BLOCK = {
    "attn_norm.weight": ("input_layernorm.weight", QUANT),
    "attn_q_a.weight": ("self_attn.q_a_proj.weight", QUANT),
    "attn_q_a_norm.weight": ("self_attn.q_a_layernorm.weight", QUANT),
    "attn_q_b.weight": ("self_attn.q_b_proj.weight", QUANT),
    "attn_kv_a_mqa.weight": ("self_attn.kv_a_proj_with_mqa.weight", QUANT),
    "attn_kv_a_norm.weight": ("self_attn.kv_a_layernorm.weight", QUANT),
    "attn_k_b.weight": ("self_attn.kv_b_proj.weight", KV_B_K),
    "attn_v_b.weight": ("self_attn.kv_b_proj.weight", KV_B_V),
    "attn_output.weight": ("self_attn.o_proj.weight", QUANT),
    "indexer.attn_q_b.weight": ("self_attn.indexer.wq_b.weight", QUANT),
    # vLLM builds the indexer's fused wk_weights_proj with quant_config=None.
    "indexer.attn_k.weight": ("self_attn.indexer.wk.weight", DENSE),
    "indexer.proj.weight": ("self_attn.indexer.weights_proj.weight", DENSE),
    "indexer.k_norm.weight": ("self_attn.indexer.k_norm.weight", QUANT),
    "indexer.k_norm.bias": ("self_attn.indexer.k_norm.bias", QUANT),
    "ffn_norm.weight": ("post_attention_layernorm.weight", QUANT),
    "ffn_gate.weight": ("mlp.gate_proj.weight", QUANT),
    "ffn_up.weight": ("mlp.up_proj.weight", QUANT),
    "ffn_down.weight": ("mlp.down_proj.weight", QUANT),
    # The router is a ReplicatedLinear with quant_config=None; files keep it F32, but be safe.
    "ffn_gate_inp.weight": ("mlp.gate.weight", DENSE),
    "exp_probs_b.bias": ("mlp.gate.e_score_correction_bias", QUANT),
    "ffn_gate_exps.weight": ("mlp.experts.{e}.gate_proj.weight", EXPERTS),
    "ffn_up_exps.weight": ("mlp.experts.{e}.up_proj.weight", EXPERTS),
    "ffn_down_exps.weight": ("mlp.experts.{e}.down_proj.weight", EXPERTS),
    "ffn_gate_shexp.weight": ("mlp.shared_experts.gate_proj.weight", QUANT),
    "ffn_up_shexp.weight": ("mlp.shared_experts.up_proj.weight", QUANT),
    "ffn_down_shexp.weight": ("mlp.shared_experts.down_proj.weight", QUANT),
    # MTP (nextn) block only. eh_proj is a plain torch nn.Linear in vLLM's MTP layer.
    "nextn.eh_proj.weight": ("eh_proj.weight", DENSE),
    "nextn.embed_tokens.weight": ("embed_tokens.weight", QUANT),
    "nextn.enorm.weight": ("enorm.weight", QUANT),
    "nextn.hnorm.weight": ("hnorm.weight", QUANT),
    "nextn.shared_head_head.weight": ("shared_head.head.weight", QUANT),
    "nextn.shared_head_norm.weight": ("shared_head.norm.weight", QUANT),
}

GLOBAL = {
    "token_embd.weight": ("model.embed_tokens.weight", QUANT),
    "output_norm.weight": ("model.norm.weight", QUANT),
    "output.weight": ("lm_head.weight", QUANT),
}

# Fused projections: vLLM parameter -> its checkpoint shards in canonical order (shard id = position).
# Loaded in any other order, a quantized fused weight is silently wrong, so the adapter emits shards in
# this order whatever order the file has them in.
FUSED = {
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "wk_weights_proj": ("wk", "weights_proj"),
    "kv_b_proj": ("k_b", "v_b"),          # joined here, not by vLLM: [per head: k_nope rows, then v rows]
}

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclasses.dataclass(frozen=True)
class Target:
    hf: str         # the HF checkpoint name ("{e}" left in for EXPERTS)
    how: str        # QUANT, DENSE, KV_B_K, KV_B_V or EXPERTS
    layer: int | None


def target(gguf_name: str) -> Target | None:
    """Where one GGUF tensor goes, or None for a tensor this mapping does not know."""
    if gguf_name in GLOBAL:
        hf, how = GLOBAL[gguf_name]
        return Target(hf, how, None)
    m = _BLOCK_RE.match(gguf_name)
    if m is None or m[2] not in BLOCK:
        return None
    hf, how = BLOCK[m[2]]
    return Target(f"model.layers.{m[1]}.{hf}", how, int(m[1]))


def fused_slot(hf_name: str) -> tuple[str, int, int] | None:
    """(group key, position, group size) when ``hf_name`` is a shard of a fused projection, else None.

    The group key is the fused parameter's name, so shards of different layers never mix. Routed experts
    are not fused here: vLLM places their gate/up by shard name (w1/w3), so their order cannot matter.
    """
    if ".mlp.experts." in hf_name:
        return None
    module, _, leaf = hf_name.rpartition(".")
    parent, _, proj = module.rpartition(".")
    for fused, shards in FUSED.items():
        if proj in shards and fused != "kv_b_proj":
            return f"{parent}.{fused}.{leaf}", shards.index(proj), len(shards)
    return None


def mtp_prefixes(hf_module: str, main_layers: int) -> list[str]:
    """The module paths a block-``main_layers`` (MTP) module has in vLLM: as in the checkpoint, and under
    the MTP model's ``mtp_block`` (its decoder layer), which is where quantization decisions look it up."""
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", hf_module)
    if m is None or int(m[1]) < main_layers:
        return [hf_module]
    return [hf_module, f"model.layers.{m[1]}.mtp_block.{m[2]}"]


def join_kv_b(k_b, v_b):
    """kv_b_proj [heads * (qk_nope + v_head), kv_lora] from llama.cpp's halves.

    k_b is [heads, kv_lora, qk_nope] (each head's k block stored transposed), v_b is [heads, v_head, kv_lora];
    the checkpoint interleaves per head: head 0's k rows, head 0's v rows, head 1's k rows, ...
    Works on torch tensors (and numpy arrays, via the same method names).
    """
    heads, kv_lora, qk_nope = k_b.shape
    if v_b.shape[0] != heads or v_b.shape[2] != kv_lora:
        raise ValueError(f"attn_k_b {tuple(k_b.shape)} and attn_v_b {tuple(v_b.shape)} do not belong together")
    k = k_b.transpose(1, 2) if hasattr(k_b, "contiguous") else k_b.transpose(0, 2, 1)
    cat = _cat((k, v_b), axis=1)
    return cat.reshape(heads * (qk_nope + v_b.shape[1]), kv_lora)


def split_kv_b(kv_b, heads: int, qk_nope: int, v_head: int):
    """The inverse of ``join_kv_b`` (what llama.cpp's converter does), for writing test files."""
    kv_lora = kv_b.shape[-1]
    per_head = kv_b.reshape(heads, qk_nope + v_head, kv_lora)
    k, v = per_head[:, :qk_nope], per_head[:, qk_nope:]
    k_b = k.transpose(1, 2) if hasattr(k, "contiguous") else k.transpose(0, 2, 1)
    return k_b, v


def _cat(parts, axis: int):
    first = parts[0]
    if hasattr(first, "contiguous"):  # torch
        import torch

        return torch.cat(parts, dim=axis)
    import numpy as np

    return np.concatenate(parts, axis=axis)
