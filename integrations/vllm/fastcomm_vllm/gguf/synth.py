"""GLM-5-shaped models written the way llama.cpp writes GLM-5 GGUFs, plus their float "truth".

Shared by the tests and the benchmarks (``python -m fastcomm_bench.glm5_gguf`` is its command). Two uses:
the tests' tiny model (``Shape()``, with its truth, for the mapping and logits checks), and the benchmark's
full-width one (``FULL``: GLM-5's widths, 78 layers + the MTP block, 16 routed experts with top-8 kept, so
each token reads the real model's bytes; ~41 GB, one H200). For the benchmark no truth is
kept and one random array per (type, shape) is reused by every layer, so writing it is disk-bound:

    python -m fastcomm_bench.glm5_gguf OUT_DIR --full [--no-mtp] [--shards N]
    python -m fastcomm_bench.glm5_gguf OUT_DIR --tp8-shard   # one TP 8 rank's share of GLM-5 (TP8_SHARD)

Shapes keep what the sparse-MLA kernels fix (kv_lora 512, rope 64, indexer 32 heads x 128, qk_nope 192,
v_head 256) and shrink the rest. Tensor types mix what an Unsloth UD-Q4_K_XL file mixes (Q4_K, Q5_K, Q6_K,
Q8_0, F32). gguf-py quantizes only Q8_0, so K-quant tensors are random blocks whose fp16 scale fields are
set so the weights come out small and centred; the truth is their dequantization (gguf.quants).

The conversion below is written from llama.cpp's converter (HF name -> GGUF name, kv_b_proj split per head
with k transposed, experts stacked, nextn block appended) and deliberately shares nothing with
fastcomm_vllm.gguf.names, so a mapping mistake there cannot cancel out here.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as Q


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int = 512
    vocab: int = 1024
    layers: int = 2             # main decoder layers; the MTP block is layer `layers`
    dense: int = 1              # first_k_dense_replace
    heads: int = 16
    q_lora: int = 256
    kv_lora: int = 512
    rope: int = 64
    qk_nope: int = 192
    v_head: int = 256
    index_heads: int = 32
    index_dim: int = 128
    index_topk: int = 2048
    # Block-aligned as GLM-5's are at TP 8: every row-parallel K (ffn, moe_ffn, heads * v_head) over 8 ranks is
    # a multiple of the 256-element K-quant super-block, so each rank's slice of a row is whole blocks.
    ffn: int = 2048
    moe_ffn: int = 2048
    experts: int = 8
    top_k: int = 2
    mtp: bool = True


FULL = Shape(hidden=6144, vocab=154880, layers=78, dense=3, heads=64, q_lora=2048, ffn=12288, moe_ffn=2048,
             experts=16, top_k=8)  # bench/models/glm5-78L-16E's shapes
GLM5 = dataclasses.replace(FULL, experts=256)  # the real model's shapes (744B: 256 routed experts)
TP8 = 8


def rank_shard(s: Shape, tp: int) -> Shape:
    """One rank's share of ``s`` at tensor parallel ``tp``, as a model of its own (what vLLM keeps per rank):
    attention heads, every expert's (and the shared expert's) intermediate, the dense FFN and the vocabulary
    (embedding and LM head rows) split ``tp`` ways; the rest (q_a / kv_a, the indexer, the router, eh_proj,
    the norms) replicated at full size. Every split must be whole K-quant super-blocks, as GLM-5's are at TP 8."""
    for name, n in (("heads", s.heads), ("ffn", s.ffn), ("moe_ffn", s.moe_ffn), ("vocab", s.vocab)):
        if n % tp:
            raise ValueError(f"{name}={n} does not split {tp} ways")
    shard = dataclasses.replace(s, heads=s.heads // tp, ffn=s.ffn // tp, moe_ffn=s.moe_ffn // tp,
                                vocab=s.vocab // tp)
    for name, k in (("ffn", shard.ffn), ("moe_ffn", shard.moe_ffn), ("heads x v_head", shard.heads * s.v_head)):
        if k % 256:
            raise ValueError(f"{name}={k} per rank is not whole 256-element super-blocks")
    return shard


TP8_SHARD = rank_shard(GLM5, TP8)  # rank 0 of GLM-5 at TP 8: ~55 GB, one H200


# HF leaf name -> (llama.cpp GGUF leaf, type). Types follow a UD-Q4_K_XL file's mix; q_a and kv_a differ on
# purpose, so the plugin must keep per-shard types in the fused projection.
ATTN = {
    "input_layernorm.weight": ("attn_norm.weight", Q.F32),
    "post_attention_layernorm.weight": ("ffn_norm.weight", Q.F32),
    "self_attn.indexer.k_norm.bias": ("indexer.k_norm.bias", Q.F32),
    "self_attn.indexer.k_norm.weight": ("indexer.k_norm.weight", Q.F32),
    "self_attn.indexer.weights_proj.weight": ("indexer.proj.weight", Q.F32),
    "self_attn.indexer.wk.weight": ("indexer.attn_k.weight", Q.Q8_0),
    "self_attn.indexer.wq_b.weight": ("indexer.attn_q_b.weight", Q.Q8_0),
    "self_attn.kv_a_layernorm.weight": ("attn_kv_a_norm.weight", Q.F32),
    "self_attn.kv_a_proj_with_mqa.weight": ("attn_kv_a_mqa.weight", Q.Q8_0),
    "self_attn.o_proj.weight": ("attn_output.weight", Q.Q4_K),
    "self_attn.q_a_layernorm.weight": ("attn_q_a_norm.weight", Q.F32),
    "self_attn.q_a_proj.weight": ("attn_q_a.weight", Q.Q5_K),
    "self_attn.q_b_proj.weight": ("attn_q_b.weight", Q.Q4_K),
}
KV_B_TYPES = (Q.Q8_0, Q.Q6_K)   # attn_k_b (inner dim qk_nope = 192: not a K-quant multiple), attn_v_b
DENSE_MLP = {
    "mlp.down_proj.weight": ("ffn_down.weight", Q.Q6_K),
    "mlp.gate_proj.weight": ("ffn_gate.weight", Q.Q4_K),
    "mlp.up_proj.weight": ("ffn_up.weight", Q.Q4_K),
}
MOE = {
    "mlp.gate.e_score_correction_bias": ("exp_probs_b.bias", Q.F32),
    "mlp.gate.weight": ("ffn_gate_inp.weight", Q.F32),
    "mlp.shared_experts.down_proj.weight": ("ffn_down_shexp.weight", Q.Q6_K),
    "mlp.shared_experts.gate_proj.weight": ("ffn_gate_shexp.weight", Q.Q4_K),
    "mlp.shared_experts.up_proj.weight": ("ffn_up_shexp.weight", Q.Q4_K),
}
EXPERTS = {"down_proj": ("ffn_down_exps.weight", Q.Q5_K), "gate_proj": ("ffn_gate_exps.weight", Q.Q4_K),
           "up_proj": ("ffn_up_exps.weight", Q.Q4_K)}
NEXTN = {
    "eh_proj.weight": ("nextn.eh_proj.weight", Q.Q8_0),
    "embed_tokens.weight": ("nextn.embed_tokens.weight", Q.Q4_K),
    "enorm.weight": ("nextn.enorm.weight", Q.F32),
    "hnorm.weight": ("nextn.hnorm.weight", Q.F32),
    "shared_head.head.weight": ("nextn.shared_head_head.weight", Q.Q6_K),
    "shared_head.norm.weight": ("nextn.shared_head_norm.weight", Q.F32),
}
TOP = {"model.embed_tokens.weight": ("token_embd.weight", Q.Q4_K), "model.norm.weight": ("output_norm.weight", Q.F32),
       "lm_head.weight": ("output.weight", Q.Q6_K)}


def hf_shapes(s: Shape, layer: int) -> dict[str, tuple]:
    """HF (checkpoint) names and shapes of one decoder layer (and the nextn extras for the MTP layer)."""
    p = f"model.layers.{layer}."
    out = {
        "input_layernorm.weight": (s.hidden,), "post_attention_layernorm.weight": (s.hidden,),
        "self_attn.q_a_proj.weight": (s.q_lora, s.hidden), "self_attn.q_a_layernorm.weight": (s.q_lora,),
        "self_attn.q_b_proj.weight": (s.heads * (s.qk_nope + s.rope), s.q_lora),
        "self_attn.kv_a_proj_with_mqa.weight": (s.kv_lora + s.rope, s.hidden),
        "self_attn.kv_a_layernorm.weight": (s.kv_lora,),
        "self_attn.o_proj.weight": (s.hidden, s.heads * s.v_head),
        "self_attn.indexer.wq_b.weight": (s.index_heads * s.index_dim, s.q_lora),
        "self_attn.indexer.wk.weight": (s.index_dim, s.hidden),
        "self_attn.indexer.k_norm.weight": (s.index_dim,), "self_attn.indexer.k_norm.bias": (s.index_dim,),
        "self_attn.indexer.weights_proj.weight": (s.index_heads, s.hidden),
    }
    if layer < s.dense:
        out.update({"mlp.gate_proj.weight": (s.ffn, s.hidden), "mlp.up_proj.weight": (s.ffn, s.hidden),
                    "mlp.down_proj.weight": (s.hidden, s.ffn)})
    else:
        out.update({"mlp.gate.weight": (s.experts, s.hidden), "mlp.gate.e_score_correction_bias": (s.experts,),
                    "mlp.shared_experts.gate_proj.weight": (s.moe_ffn, s.hidden),
                    "mlp.shared_experts.up_proj.weight": (s.moe_ffn, s.hidden),
                    "mlp.shared_experts.down_proj.weight": (s.hidden, s.moe_ffn)})
    if layer == s.layers:
        out.update({"eh_proj.weight": (s.hidden, 2 * s.hidden), "embed_tokens.weight": (s.vocab, s.hidden),
                    "enorm.weight": (s.hidden,), "hnorm.weight": (s.hidden,),
                    "shared_head.head.weight": (s.vocab, s.hidden), "shared_head.norm.weight": (s.hidden,)})
    return {p + k: v for k, v in out.items()}


# ---- making quantized tensors -----------------------------------------------------------------------------

_K_CENTRE = {Q.Q4_K: 7.5, Q.Q5_K: 15.5}  # mean q: dmin = centre * d puts the mean weight near 0
_K_SPREAD = {Q.Q4_K: 260.0, Q.Q5_K: 520.0}  # measured: d = std / spread gives weights of about `std`


def _kquant_blocks(rng, qtype: Q, rows_shape: tuple, cols: int, std: float) -> np.ndarray:
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    assert cols % block == 0, (qtype, cols)
    raw = rng.integers(0, 256, size=(*rows_shape, cols // block, nbytes), dtype=np.uint8)
    if qtype == Q.Q6_K:
        scale = np.float16(std / 1400.0)         # measured: gives weights of about `std`
        raw[..., nbytes - 2:] = np.frombuffer(scale.tobytes(), np.uint8)
    else:
        d = np.float16(std / _K_SPREAD[qtype])
        dmin = np.float16(float(d) * _K_CENTRE[qtype])
        raw[..., 0:2] = np.frombuffer(d.tobytes(), np.uint8)
        raw[..., 2:4] = np.frombuffer(dmin.tobytes(), np.uint8)
    return raw.reshape(*rows_shape, cols // block * nbytes)


def make_tensor(rng, qtype: Q, shape: tuple, *, norm: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(stored array for GGUFWriter, float32 truth) for a tensor of numpy ``shape`` and GGUF ``qtype``."""
    fan_in = shape[-1]
    if qtype == Q.F32:
        truth = (1.0 + 0.1 * rng.standard_normal(shape)) if norm else rng.standard_normal(shape) / np.sqrt(fan_in)
        truth = truth.astype(np.float32)
        return truth, truth
    if qtype == Q.Q8_0:
        x = (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
        stored = gguf.quants.quantize(x, qtype)
    else:
        stored = _kquant_blocks(rng, qtype, shape[:-1], shape[-1], 1.0 / np.sqrt(fan_in))
    return stored, gguf.quants.dequantize(stored, qtype).astype(np.float32).reshape(shape)


# ---- the model ---------------------------------------------------------------------------------------------

class _Reuse:
    """make_tensor without truth, one stored array per (type, shape, norm): the benchmark model's layers
    share their bytes (what is read per token is what matters there, not what the values are)."""

    def __init__(self, rng):
        self.rng, self.seen = rng, {}

    def __call__(self, qtype: Q, shape: tuple, *, norm: bool = False):
        key = (qtype, shape, norm)
        if key not in self.seen:
            if qtype in (Q.F32, Q.Q8_0):
                self.seen[key] = make_tensor(self.rng, qtype, shape, norm=norm)[0]
            else:
                self.seen[key] = _kquant_blocks(self.rng, qtype, shape[:-1], shape[-1], 1.0 / np.sqrt(shape[-1]))
        return self.seen[key], None


def _no_data(qtype: Q, shape: tuple, *, norm: bool = False):
    """A stored array's shape and dtype without its bytes (a zero-stride view): for ``plan``."""
    if qtype == Q.F32:
        return np.broadcast_to(np.zeros((), np.float32), shape), None
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    return np.broadcast_to(np.zeros((), np.uint8), (*shape[:-1], shape[-1] // block * nbytes)), None


def build(s: Shape, seed: int = 0, *, truth: bool = True, data: bool = True):
    """(GGUF tensors in llama.cpp's write order as (gguf_name, stored, qtype), HF truth {name: float32});
    ``truth=False``: no truth (empty), and arrays are reused across layers (_Reuse); ``data=False``: no bytes
    either (``plan``)."""
    rng = np.random.default_rng(seed)
    gguf_tensors: list[tuple[str, np.ndarray, Q]] = []
    truth_of: dict[str, np.ndarray] = {}
    make = (lambda qtype, shape, norm=False: make_tensor(rng, qtype, shape, norm=norm)) if truth \
        else _Reuse(rng) if data else _no_data

    def put(hf: str, gname: str, qtype: Q, shape: tuple):
        stored, t = make(qtype, shape, norm=hf.endswith("norm.weight") and "indexer" not in hf)
        gguf_tensors.append((gname, stored, qtype))
        if truth:
            truth_of[hf] = t

    for hf, (g, qt) in TOP.items():
        if hf != "lm_head.weight":
            put(hf, g, qt, (s.vocab, s.hidden) if "embed" in hf else (s.hidden,))
    blocks = s.layers + (1 if s.mtp else 0)
    for layer in range(blocks):
        shapes = hf_shapes(s, layer)
        table = {**ATTN, **DENSE_MLP, **MOE, **NEXTN}
        # llama.cpp converts tensors in the checkpoint's (sorted) order: kv_a_proj_with_mqa before q_a_proj,
        # indexer.weights_proj before indexer.wk, the experts and kv_b_proj where they sort.
        hf_names = sorted(list(shapes) + [f"model.layers.{layer}.self_attn.kv_b_proj.weight"]
                          + ([f"model.layers.{layer}.mlp.experts"] if layer >= s.dense else []))
        for hf in hf_names:
            leaf = hf.split(f"model.layers.{layer}.", 1)[1]
            if leaf == "self_attn.kv_b_proj.weight":
                _put_kv_b(make, s, layer, gguf_tensors, truth_of if truth else None)
            elif leaf == "mlp.experts":
                for proj in sorted(EXPERTS):
                    gname, qt = EXPERTS[proj]
                    out_in = (s.moe_ffn, s.hidden) if proj != "down_proj" else (s.hidden, s.moe_ffn)
                    stored, t = make(qt, (s.experts, *out_in))
                    gguf_tensors.append((f"blk.{layer}.{gname}", stored, qt))
                    for e in range(s.experts if truth else 0):
                        truth_of[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] = t[e]
            elif leaf == "embed_tokens.weight":  # the MTP block's copy of the shared embedding
                gname, qt = table[leaf]
                first = next(x for x in gguf_tensors if x[0] == "token_embd.weight")
                gguf_tensors.append((f"blk.{layer}.{gname}", first[1], first[2]))
                if truth:
                    truth_of[hf] = truth_of["model.embed_tokens.weight"]
            else:
                gname, qt = table[leaf]
                put(hf, f"blk.{layer}.{gname}", qt, shapes[hf])
    put("lm_head.weight", "output.weight", TOP["lm_head.weight"][1], (s.vocab, s.hidden))
    return gguf_tensors, truth_of


def plan(s: Shape) -> list[tuple[str, tuple, Q, int]]:
    """The file's tensors as (gguf_name, numpy shape of the stored array, type, bytes), without making them."""
    return [(n, a.shape, q, a.size * a.itemsize) for n, a, q in build(s, truth=False, data=False)[0]]


def step_read_bytes(s: Shape, experts_read: int | None = None) -> int:
    """Weight bytes one plain decode step reads: every main-layer tensor and the LM head once, the routed experts
    only ``experts_read`` of ``s.experts`` (default top_k: one token's), the embedding one row (nothing, to the
    byte count's precision), the MTP block not at all (a plain step runs no draft). The floor of a step is this
    over the GPU's bandwidth."""
    n = s.top_k if experts_read is None else experts_read
    if not 0 <= n <= s.experts:
        raise ValueError(f"experts_read={n}: between 0 and {s.experts}")
    total = 0
    for name, _, _, nbytes in plan(s):
        if name.startswith("token_embd.") or name.startswith(f"blk.{s.layers}."):
            continue
        total += nbytes * n // s.experts if "_exps." in name else nbytes
    return total


def _put_kv_b(make, s: Shape, layer: int, gguf_tensors, truth):
    kt, vt = KV_B_TYPES
    # As llama.cpp stores them: attn_k_b [heads, kv_lora, qk_nope] (k transposed), attn_v_b [heads, v_head, kv_lora]
    k_stored, k_b = make(kt, (s.heads, s.kv_lora, s.qk_nope))
    v_stored, v_b = make(vt, (s.heads, s.v_head, s.kv_lora))
    gguf_tensors.append((f"blk.{layer}.attn_k_b.weight", k_stored, kt))
    gguf_tensors.append((f"blk.{layer}.attn_v_b.weight", v_stored, vt))
    if truth is None:
        return
    kv_b = np.empty((s.heads, s.qk_nope + s.v_head, s.kv_lora), np.float32)
    for h in range(s.heads):  # per head: the k rows (un-transposed), then the v rows
        kv_b[h, :s.qk_nope] = k_b[h].T
        kv_b[h, s.qk_nope:] = v_b[h]
    truth[f"model.layers.{layer}.self_attn.kv_b_proj.weight"] = kv_b.reshape(-1, s.kv_lora)


# GLM-5's special tokens (the first ten of its added vocabulary), last in the list as in the real file.
SPECIALS = ("<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
            "<|assistant|>", "<|observation|>")
# A chat template of GLM's form (the real file carries GLM-5's, much longer): vLLM's chat endpoint needs one.
CHAT_TEMPLATE = ("[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _vocab(s: Shape) -> tuple[list[str], list[str]]:
    """(tokens, merges): a byte-level BPE vocabulary of the 256 byte symbols, then merges, then GLM's special
    tokens. Every string distinct (llama.cpp refuses a vocabulary with duplicates): merge i < 65536 joins
    symbols (i mod 256, 7i + i // 256 mod 256), a distinct pair for each i; past those (GLM-5's 154880
    entries), merge j joins the (j // 256)-th pair with symbol j mod 256."""
    sym = list(_bytes_to_unicode().values())
    n = s.vocab - 256 - len(SPECIALS)
    assert 0 < n <= 256 * 256 * 257, s.vocab
    pairs = [(sym[i % 256], sym[(7 * i + i // 256) % 256]) for i in range(min(n, 256 * 256))]
    triples = [(pairs[j // 256][0] + pairs[j // 256][1], sym[j % 256]) for j in range(n - len(pairs))]
    merged = pairs + triples
    return sym + [a + b for a, b in merged] + list(SPECIALS), [f"{a} {b}" for a, b in merged]


def _tokens(s: Shape) -> list[str]:
    return _vocab(s)[0]


def special_id(s: Shape, token: str) -> int:
    return s.vocab - len(SPECIALS) + SPECIALS.index(token)


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def write_gguf(out: Path, s: Shape = Shape(), *, seed: int = 0, shards: int = 3, name: str = "GLM-5-tiny-UD-Q4_K_XL",
               mtp_tensors: bool = True, extra: tuple = (), truth: bool = True):
    """Write the model as ``shards`` GGUF files; returns (first shard path, truth).

    ``mtp_tensors=False`` keeps the metadata of the MTP block but drops its tensors (a converter run that
    skipped them); ``extra`` appends (gguf_name, float32 array) tensors; ``truth=False``: see build."""
    tensors, truth = build(s, seed, truth=truth)
    if not mtp_tensors:
        tensors = [t for t in tensors if not t[0].startswith(f"blk.{s.layers}.")]
    tensors += [(n, a, Q.F32) for n, a in extra]
    out.mkdir(parents=True, exist_ok=True)
    per = -(-len(tensors) // shards)
    w = gguf.GGUFWriter(out / f"{name}.gguf", "glm-dsa", split_max_tensors=per)
    arch = "glm-dsa"
    w.add_name(name)
    blocks = s.layers + (1 if s.mtp else 0)
    w.add_block_count(blocks)
    w.add_context_length(4096)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_used_count(s.top_k)
    w.add_expert_group_count(1)
    w.add_expert_group_used_count(1)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_leading_dense_block_count(s.dense)
    w.add_vocab_size(s.vocab)
    w.add_q_lora_rank(s.q_lora)
    w.add_kv_lora_rank(s.kv_lora)
    w.add_key_length(s.kv_lora + s.rope)
    w.add_value_length(s.kv_lora)
    w.add_key_length_mla(s.qk_nope + s.rope)
    w.add_value_length_mla(s.v_head)
    w.add_expert_feed_forward_length(s.moe_ffn)
    w.add_expert_count(s.experts)
    w.add_expert_shared_count(1)
    w.add_expert_weights_scale(2.5)
    w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(s.rope)
    w.add_nextn_predict_layers(1 if s.mtp else 0)
    w.add_indexer_head_count(s.index_heads)
    w.add_indexer_key_length(s.index_dim)
    w.add_indexer_top_k(s.index_topk)
    toks, merges = _vocab(s)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("glm4")
    w.add_token_list(toks)
    w.add_token_types([3 if t in SPECIALS else 1 for t in toks])   # 3: control
    w.add_token_merges(merges)
    # As llama.cpp's converter sets a GLM vocabulary's special tokens.
    w.add_eos_token_id(special_id(s, "<|endoftext|>"))
    w.add_bos_token_id(special_id(s, "[gMASK]"))
    w.add_eot_token_id(special_id(s, "<|user|>"))
    w.add_eom_token_id(special_id(s, "<|observation|>"))
    w.add_unk_token_id(special_id(s, "<|endoftext|>"))
    w.add_pad_token_id(special_id(s, "<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for gname, stored, qtype in tensors:
        if qtype == Q.F32:
            w.add_tensor(gname, stored)
        else:
            w.add_tensor(gname, stored, raw_dtype=qtype)  # the element shape follows from the byte shape
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    first = sorted(out.glob(f"{name}-*.gguf"))[0] if shards > 1 else out / f"{name}.gguf"
    assert arch
    return first, truth


def hf_config(s: Shape = Shape()) -> dict:
    """The GLM-5 config.json these shapes correspond to (for the bf16 reference checkpoint)."""
    return {
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "vocab_size": s.vocab,
        "hidden_size": s.hidden, "intermediate_size": s.ffn, "moe_intermediate_size": s.moe_ffn,
        "num_hidden_layers": s.layers, "num_nextn_predict_layers": 1 if s.mtp else 0,
        "num_attention_heads": s.heads, "num_key_value_heads": s.heads, "q_lora_rank": s.q_lora,
        "kv_lora_rank": s.kv_lora, "qk_rope_head_dim": s.rope, "qk_nope_head_dim": s.qk_nope,
        "v_head_dim": s.v_head, "n_routed_experts": s.experts, "n_shared_experts": 1, "num_experts_per_tok": s.top_k,
        "first_k_dense_replace": s.dense, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "n_group": 1,
        "topk_group": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "index_n_heads": s.index_heads,
        "index_head_dim": s.index_dim, "index_topk": s.index_topk, "tie_word_embeddings": False,
        "rope_theta": 1_000_000.0, "torch_dtype": "bfloat16",
    }


def write_reference(out: Path, truth: dict, s: Shape = Shape()) -> Path:
    """The truth as a bf16 safetensors checkpoint vLLM's normal loader reads."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: torch.from_numpy(np.ascontiguousarray(v)).to(torch.bfloat16) for k, v in truth.items()},
              str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(hf_config(s), indent=1))
    return out


def write_other_arch(path: Path) -> Path:
    """A one-tensor GGUF of another architecture (llama): what fastcomm must pass to the plugin unchanged."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


SHARD_NAME = "GLM-5-TP8-rank0-UD-Q4_K_XL"


def main(argv=None) -> None:
    import argparse
    import shutil

    p = argparse.ArgumentParser(prog="python -m fastcomm_bench.glm5_gguf", description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="folder for the GGUF shards")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--full", action="store_true", help="GLM-5's widths, 78 layers, 16 experts (top-8): ~41 GB")
    what.add_argument("--tp8-shard", action="store_true",
                      help="rank 0 of GLM-5 at TP 8 as a TP 1 model: 78 layers, 256 experts at 256, 8 heads, "
                           "19,360 vocabulary rows, replicated tensors at full size: ~55 GB")
    p.add_argument("--no-mtp", action="store_true", help="without the MTP block")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    base, name = ((FULL, "GLM-5-78L-16E-UD-Q4_K_XL") if a.full else (TP8_SHARD, SHARD_NAME) if a.tp8_shard
                  else (Shape(), "GLM-5-tiny-UD-Q4_K_XL"))
    shape = dataclasses.replace(base, mtp=not a.no_mtp)
    big = a.full or a.tp8_shard
    if big:
        need = sum(t[3] for t in plan(shape))
        # The nearest folder that exists: write_gguf makes the missing ones.
        where = next(d for d in (a.out, *a.out.absolute().parents) if d.exists())
        free = shutil.disk_usage(where).free
        if need > free:
            p.exit(2, f"glm5_gguf: {a.out}: {need / 2**30:.1f} GiB needed, {free / 2**30:.1f} GiB free\n")
    first, _ = write_gguf(a.out, shape, seed=a.seed, shards=a.shards, name=name, truth=not big)
    total = sum(f.stat().st_size for f in a.out.glob(f"{name}*.gguf"))
    print(f"{first} ({total / 2**30:.1f} GiB in {a.shards} shard(s))")


if __name__ == "__main__":
    main()
