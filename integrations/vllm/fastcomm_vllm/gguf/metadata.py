"""What a GGUF file says about itself: architecture, split, hyper-parameters, MTP block, tokenizer.

Reads metadata and tensor headers only (gguf-py memory-maps the data and never touches it here), and turns a
``glm-dsa`` file's metadata into the Hugging Face ``config.json`` vLLM's GLM-5 model reads.
"""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

from . import names
from .errors import GgufError, missing_package
from .files import GgufFiles


def _gguf():
    try:
        import gguf
    except ImportError:
        raise missing_package("the `gguf` package (gguf-py, llama.cpp's GGUF reader)") from None
    return gguf


@dataclasses.dataclass(frozen=True)
class Meta:
    files: GgufFiles
    fields: dict[str, Any]                      # first shard's key/values, decoded
    tensors: tuple[tuple[str, str, tuple], ...]  # every shard's (name, type name, GGUF shape), in file order

    @property
    def arch(self) -> str:
        return str(self.fields.get("general.architecture", ""))

    def get(self, key: str, default=None):
        """``key`` with ``{arch}`` filled in, e.g. get("{arch}.block_count")."""
        return self.fields.get(key.format(arch=self.arch), default)

    def need(self, key: str):
        value = self.get(key)
        if value is None:
            raise GgufError(f"{self.files.first.name}: metadata key {key.format(arch=self.arch)!r} is missing")
        return value

    @functools.cached_property
    def tensor_names(self) -> frozenset[str]:
        return frozenset(t[0] for t in self.tensors)


# The vocabulary: decoding 150k strings costs seconds, and only the tokenizer needs them.
_BIG_ARRAYS = frozenset(f"tokenizer.ggml.{k}" for k in ("tokens", "merges", "token_type", "scores"))


def _decode(field) -> Any:
    value = field.contents()
    if isinstance(value, float):
        # GGUF stores float32: 1e-5 reads back as 9.99999974e-06. The shortest decimal that is the same
        # float32 is what the converter was given.
        import numpy as np

        value = float(str(np.float32(value)))
    return value


@functools.lru_cache(maxsize=8)
def _read_cached(shards: tuple[Path, ...], stamp: tuple) -> Meta:
    gguf = _gguf()
    fields: dict[str, Any] = {}
    tensors = []
    for i, path in enumerate(shards):
        try:
            reader = gguf.GGUFReader(path)
        except Exception as e:  # a truncated or non-GGUF file: say which one
            raise GgufError(f"{path.name} is not a readable GGUF file ({type(e).__name__}: {e})") from None
        if i == 0:
            # Skip the big arrays (the vocabulary) unless asked: decoding them costs seconds on 150k tokens.
            fields = {k: (_Lazy(f) if k in _BIG_ARRAYS else _decode(f))
                      for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        else:
            count = reader.fields.get("split.count")
            no = reader.fields.get("split.no")
            if count is not None and no is not None and (_decode(no) != i or _decode(count) != len(shards)):
                raise GgufError(f"{path.name} says it is shard {_decode(no) + 1} of {_decode(count)}, "
                                f"but it is file {i + 1} of {len(shards)} of this split")
        for t in reader.tensors:
            tensors.append((t.name, t.tensor_type.name, tuple(int(d) for d in t.shape)))
    count = fields.get("split.count")
    if count is not None and int(count) != len(shards):
        raise GgufError(f"{shards[0].name} belongs to a split of {count} files, but {len(shards)} were found")
    return Meta(files=GgufFiles(shards), fields=fields, tensors=tuple(tensors))


class _Lazy:
    """A tokenizer array, decoded on first use from the field the first shard's reader already parsed (the
    reader's memory map of the file stays open as long as this does)."""

    def __init__(self, field):
        self.field = field

    @functools.cached_property
    def value(self):
        return self.field.contents()


def read(files: GgufFiles) -> Meta:
    stamp = tuple((p.stat().st_size, p.stat().st_mtime_ns) for p in files.shards)
    return _read_cached(files.shards, stamp)


def value(meta: Meta, key: str):
    v = meta.fields.get(key)
    return v.value if isinstance(v, _Lazy) else v


# ---- GLM-5 ----------------------------------------------------------------------------------------------

def is_glm_dsa(meta: Meta) -> bool:
    return meta.arch == names.ARCH


def main_layers(meta: Meta) -> int:
    """Decoder layers of the main model: llama.cpp's block_count includes the MTP (nextn) blocks."""
    return int(meta.need("{arch}.block_count")) - int(meta.get("{arch}.nextn_predict_layers", 0) or 0)


def mtp_layers(meta: Meta) -> int:
    """How many MTP blocks the file really carries: declared by nextn_predict_layers AND present as tensors
    (a converter run with --no-mtp can keep the key but drop the tensors, or the block count can include
    blocks whose tensors were dropped)."""
    declared = int(meta.get("{arch}.nextn_predict_layers", 0) or 0)
    first = int(meta.need("{arch}.block_count")) - declared
    present = 0
    for b in range(first, first + declared):
        if f"blk.{b}.nextn.eh_proj.weight" in meta.tensor_names and f"blk.{b}.attn_q_a.weight" in meta.tensor_names:
            present += 1
        else:
            break
    return present


def hf_config(meta: Meta) -> dict:
    """The config.json of the GLM-5 checkpoint this file was converted from, as far as the file tells it."""
    if not is_glm_dsa(meta):
        raise GgufError(f"{meta.files.first.name} is a {meta.arch!r} GGUF, not GLM-5 ({names.ARCH!r})")
    heads = int(meta.need("{arch}.attention.head_count"))
    rope = int(meta.need("{arch}.rope.dimension_count"))
    k_mla = int(meta.need("{arch}.attention.key_length_mla"))
    gating = int(meta.get("{arch}.expert_gating_func", 2) or 2)
    vocab = meta.get("{arch}.vocab_size")
    if vocab is None:
        vocab = _tensor_dim(meta, "token_embd.weight", 1)
    n_mtp = mtp_layers(meta)
    cfg = {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": names.MODEL_TYPE,
        "vocab_size": int(vocab),
        "hidden_size": int(meta.need("{arch}.embedding_length")),
        "intermediate_size": int(meta.need("{arch}.feed_forward_length")),
        "moe_intermediate_size": int(meta.need("{arch}.expert_feed_forward_length")),
        "num_hidden_layers": main_layers(meta),
        "num_nextn_predict_layers": n_mtp,
        "num_attention_heads": heads,
        # GGUF stores MLA as MQA (head_count_kv = 1); the checkpoint config counts the decompressed heads.
        "num_key_value_heads": heads,
        "q_lora_rank": int(meta.need("{arch}.attention.q_lora_rank")),
        "kv_lora_rank": int(meta.need("{arch}.attention.kv_lora_rank")),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": k_mla - rope,
        "qk_head_dim": k_mla,
        "head_dim": rope,
        "v_head_dim": int(meta.need("{arch}.attention.value_length_mla")),
        "n_routed_experts": int(meta.need("{arch}.expert_count")),
        "n_shared_experts": int(meta.get("{arch}.expert_shared_count", 1)),
        "num_experts_per_tok": int(meta.need("{arch}.expert_used_count")),
        "first_k_dense_replace": int(meta.get("{arch}.leading_dense_block_count", 0)),
        "routed_scaling_factor": float(meta.get("{arch}.expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(meta.get("{arch}.expert_weights_norm", True)),
        "n_group": int(meta.get("{arch}.expert_group_count", 1) or 1),
        "topk_group": int(meta.get("{arch}.expert_group_used_count", 1) or 1),
        "scoring_func": "sigmoid" if gating == 2 else "softmax",   # ExpertGatingFuncType: 1 softmax, 2 sigmoid
        "topk_method": "noaux_tc",
        "hidden_act": "silu",
        "rms_norm_eps": float(meta.need("{arch}.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(meta.need("{arch}.context_length")),
        "rope_theta": float(meta.get("{arch}.rope.freq_base", 10000.0)),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(meta.get("{arch}.rope.freq_base", 10000.0))},
        "index_n_heads": int(meta.need("{arch}.attention.indexer.head_count")),
        "index_head_dim": int(meta.need("{arch}.attention.indexer.key_length")),
        "index_topk": int(meta.need("{arch}.attention.indexer.top_k")),
        # GLM-5 rotates the indexer's rope part interleaved (its config.json says so; the GGUF does not).
        "indexer_rope_interleave": True,
        "attention_bias": False,
        "tie_word_embeddings": "output.weight" not in meta.tensor_names,
        "torch_dtype": "bfloat16",
        # Marks a config fastcomm derived from a GGUF: the adapter recognizes it in the worker processes.
        "fastcomm_gguf_arch": names.ARCH,
    }
    for key, hf in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id"),
                    ("tokenizer.ggml.padding_token_id", "pad_token_id")):
        if meta.fields.get(key) is not None:
            cfg[hf] = int(meta.fields[key])
    return cfg


def _tensor_dim(meta: Meta, name: str, axis: int) -> int:
    for n, _, shape in meta.tensors:
        if n == name:
            return shape[axis]
    raise GgufError(f"{meta.files.first.name}: tensor {name!r} is missing")
