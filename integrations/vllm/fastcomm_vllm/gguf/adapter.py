"""fastcomm's GLM-5 adapter for vllm-gguf-plugin (0.0.5's weights-adapter interface).

The plugin's loader asks its adapter registry which adapter takes a model config; this one takes GLM-5
(``glm_moe_dsa``, and the ``deepseek_mtp`` config vLLM derives from it for the MTP draft) when the GGUF is a
``glm-dsa`` file, and hands every other file to the plugin's own default adapter unchanged. Imports the
plugin (and so vLLM): only the worker processes and ``plugin.register`` import this module.
"""
from __future__ import annotations

import logging

from vllm_gguf_plugin.weights_adapter import GGUFWeightsAdapter
from vllm_gguf_plugin.weights_adapter.base import GGUFLoadSpec

from . import files, metadata, names, weights

logger = logging.getLogger("vllm.fastcomm.gguf")


def takes(config) -> bool:
    """GLM-5 configs: a checkpoint's, one fastcomm derived from a GGUF, or the MTP draft's derived from
    either (vLLM rewrites model_type to deepseek_mtp and keeps the other fields)."""
    model_type = getattr(config, "model_type", None)
    if getattr(config, "fastcomm_gguf_arch", None) == names.ARCH or model_type == names.MODEL_TYPE:
        return True
    return model_type == "deepseek_mtp" and getattr(config, "index_n_heads", None) is not None \
        and getattr(config, "first_k_dense_replace", None) is not None and _from_glm(config)


def _from_glm(config) -> bool:
    # DeepSeek-V3.2's draft looks the same; GLM-5's keeps GLM's vocabulary size and head layout. The GGUF
    # architecture is checked again in prepare_loading, so a wrong guess only costs the default adapter.
    return getattr(config, "qk_nope_head_dim", None) == 192 and getattr(config, "v_head_dim", None) == 256


class GlmDsaGGUFAdapter(GGUFWeightsAdapter):
    """GLM-5 from a glm-dsa GGUF; anything else goes to the plugin's default behaviour."""

    _files: files.GgufFiles | None = None

    @classmethod
    def matches(cls, config) -> bool:
        return takes(config)

    def prepare_loading(self, model_path: str, model_config) -> GGUFLoadSpec:
        found = files.discover(model_path)
        meta = metadata.read(found)
        if not metadata.is_glm_dsa(meta):
            logger.info("fastcomm: %s is a %r GGUF; the plugin's default adapter loads it", found.first.name,
                        meta.arch)
            return super().prepare_loading(model_path, model_config)
        self._files = found
        self._main_layers = int(model_config.hf_config.num_hidden_layers)
        self._part = weights.MTP if is_draft(model_config.hf_config) else weights.MAIN
        self.load_spec = GGUFLoadSpec(weights_source=[str(p) for p in found.shards],
                                      unquantized_modules=unquantized_modules(meta, self._main_layers, self._part))
        logger.info("fastcomm: GLM-5 GGUF, %d shard(s), %d tensors; MTP blocks in the file: %d",
                    len(found.shards), len(meta.tensors), metadata.mtp_layers(meta))
        return self.load_spec

    def prepare_weights(self, model_config):
        if self._files is None:
            yield from super().prepare_weights(model_config)
            return
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        tp = (get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size())
        yield from weights.iter_weights(self._files, model_config.dtype, self._part, self._main_layers, tp)


def is_draft(config) -> bool:
    """The MTP draft's config: vLLM rewrites model_type to deepseek_mtp and names an MTP architecture."""
    return getattr(config, "model_type", None) == "deepseek_mtp" or any(
        "MTP" in a for a in (getattr(config, "architectures", None) or ()))


def unquantized_modules(meta: metadata.Meta, main_layers: int, part: str | None = None) -> list[str]:
    """Modules whose weights arrive dense (float in the file, or dequantized by ``weights``): the plugin
    must give them vLLM's unquantized method. MTP-block modules are listed under both of their names."""
    out: set[str] = set()
    for name, type_name, _ in meta.tensors:
        tgt = names.target(name)
        if tgt is None or not tgt.hf.endswith(".weight"):
            continue
        dense = tgt.how in (names.DENSE, names.KV_B_K, names.KV_B_V) or type_name in weights.FLOAT_TYPES \
            or (part == weights.MTP and weights.dense_in_draft(tgt))
        if dense and tgt.how != names.EXPERTS:
            out.update(names.mtp_prefixes(tgt.hf.removesuffix(".weight"), main_layers))
    return sorted(out)
