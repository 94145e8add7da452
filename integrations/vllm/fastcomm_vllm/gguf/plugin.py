"""Registration of fastcomm's GLM-5 support into vllm-gguf-plugin, in every vLLM process.

``register()`` is a ``vllm.general_plugins`` entry point (``fastcomm_gguf``), so it runs in the front end and
in each worker, after or before the plugin's own ``gguf`` entry point (both orders work). Two hooks:
- the adapter goes first in the plugin's adapter registry (workers: the loader picks it);
- vLLM's ``ReplicatedLinear.weight_loader`` learns to store a GGUF parameter's blocks (vllm-gguf-plugin 0.0.5
  gives a quantized ReplicatedLinear, e.g. GLM-5's indexer ``wq_b``, vLLM's plain loader, which asserts on
  the still-empty parameter); every other parameter goes to vLLM's loader unchanged;
- the plugin's config parser, which reads config.json from the GGUF's folder, reads the folder fastcomm
  derived from the file's metadata instead when the GGUF is GLM-5 and its folder has no config.json (front
  end: the MTP draft's config is parsed from the GGUF path, with no --hf-config-path to point elsewhere);
- vLLM <= 0.25 asks transformers for the image processor of every model, the MTP draft's too, whose model is
  the GGUF file: transformers takes a file path for a Hub repo id and raises. A GGUF file has none: {};
- (FASTCOMM_GGUF_KERNELS=auto, the default, or dp4a) the plugin's linear and MoE methods take fastcomm's
  K-quant kernels for 1-8 tokens (kquant_vllm.py);
- vllm-gguf-plugin 0.0.5's fused-weight loads (``load_merged_column_weight`` / ``load_qkv_weight``) narrow at
  ``kwargs.get("tp_rank", 0)``; vLLM 0.25 passes the layer's rank, newer vLLM does not (its own parameters carry
  it; the plugin's, uninitialized parameters, do not), so at TP > 1 every rank would load rank 0's rows of
  gate_up_proj. The layer's loader stamps its rank on the parameter, and the load takes it where the call
  gives none;
- vLLM's MTP drafter shares the target's embedding, but first reads its ``.weight``, which a GGUF-quantized
  embedding does not have (its data is ``qweight``): for an MTP draft over such an embedding it shares it
  directly (GLM-5's nextn.embed_tokens is a copy of token_embd, so nothing is lost).
Idempotent; a no-op when the plugin is not installed.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
from pathlib import Path

logger = logging.getLogger("vllm.fastcomm.gguf")


def register() -> None:
    if importlib.util.find_spec("vllm_gguf_plugin") is None or importlib.util.find_spec("gguf") is None:
        logger.debug("fastcomm: vllm-gguf-plugin or gguf not installed; GLM-5 GGUF support inactive")
        return
    from vllm_gguf_plugin import weights_adapter
    from vllm_gguf_plugin.config_parser import GGUFConfigParser

    from .adapter import GlmDsaGGUFAdapter

    if GlmDsaGGUFAdapter not in weights_adapter._ADAPTER_REGISTRY:
        weights_adapter._ADAPTER_REGISTRY.insert(0, GlmDsaGGUFAdapter)
    _teach_replicated_linear()
    _fused_loads_take_the_layers_rank()
    _no_image_processor_for_gguf_files()
    _mtp_draft_shares_gguf_embedding()
    original = GGUFConfigParser._resolve_config_source
    if not getattr(original, "_fastcomm", False):
        GGUFConfigParser._resolve_config_source = staticmethod(_config_source(original))
    from .kernels import status

    kernel = status()
    if not kernel.cuda:
        logger.warning("fastcomm: %s", kernel.warning())
    _decode_kernels()


def _decode_kernels() -> None:
    """fastcomm's K-quant kernels for 1-8 token products (kquant_vllm), unless FASTCOMM_GGUF_KERNELS=plugin."""
    from fastcomm.config import ConfigError
    from fastcomm.kquant.settings import Settings

    try:
        settings = Settings.from_env()
    except ConfigError as e:  # a plugin hook must not stop vLLM: say it, keep the plugin's kernels
        logger.warning("fastcomm: %s; GGUF products stay with vllm-gguf-plugin's kernels", e)
        return
    if not settings.enabled:
        return
    from . import kquant_vllm

    if kquant_vllm.install(settings):
        most = kquant_vllm.kquant.MAX_TOKENS
        logger.info("fastcomm: GGUF products of 1-%d tokens through fastcomm's K-quant kernels%s "
                    "(FASTCOMM_GGUF_KERNELS=plugin: the plugin's)", most,
                    "" if settings.tensor_cores else " (dp4a forms only)")
        logger.info("fastcomm: GGUF products past %d tokens: dequantized for the tensor cores (linears from %s "
                    "tokens, MoE from %s routed tokens an expert), else fastcomm's kernels 8 tokens a call up to "
                    "%s tokens, else the plugin's (0: never); dequantized by %s's kernel", most,
                    settings.dequant_min_tokens, settings.dequant_moe_min, settings.chunk_max_tokens,
                    settings.dequant_kernel)


def _teach_replicated_linear() -> None:
    from vllm.model_executor.layers.linear import ReplicatedLinear

    original = ReplicatedLinear.weight_loader
    if getattr(original, "_fastcomm", False):
        return

    @functools.wraps(original)
    def weight_loader(self, param, loaded_weight):
        # The plugin's GGUF parameters (qweight, qweight_type) know how to take their data: _store.
        if hasattr(param, "_store") and hasattr(param, "data_container"):
            param._store(loaded_weight)
            return
        original(self, param, loaded_weight)

    weight_loader._fastcomm = True
    ReplicatedLinear.weight_loader = weight_loader


def _fused_loads_take_the_layers_rank() -> None:
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
    from vllm_gguf_plugin.quantization import params

    mixin = getattr(params, "_GGUFParamLoadMixin", None)
    if mixin is None:  # another plugin layout: tests/gguf/test_tp_load.py checks what it loads
        logger.warning("fastcomm: vllm-gguf-plugin has no _GGUFParamLoadMixin; fused GGUF weights at TP > 1 "
                       "are loaded as the plugin does")
        return
    for layer in (MergedColumnParallelLinear, QKVParallelLinear):
        if not getattr(layer.weight_loader_v2, "_fastcomm", False):
            layer.weight_loader_v2 = stamping_layers_rank(layer.weight_loader_v2)
    for name in ("load_merged_column_weight", "load_qkv_weight"):
        if not getattr(getattr(mixin, name), "_fastcomm", False):
            setattr(mixin, name, with_stamped_rank(getattr(mixin, name)))


def stamping_layers_rank(original):
    """The layer's loader stamps its rank on a GGUF parameter (the plugin's are uninitialized parameters,
    without vLLM's tp_rank) before the parameter narrows: 0 for a replicated layer, the rank otherwise."""
    @functools.wraps(original)
    def loader(self, param, loaded_weight, *args, **kwargs):
        if hasattr(param, "_store"):  # a vllm-gguf-plugin parameter
            param.fastcomm_tp_rank = self.tp_rank
        return original(self, param, loaded_weight, *args, **kwargs)

    loader._fastcomm = True
    return loader


def with_stamped_rank(original):
    @functools.wraps(original)
    def load(self, loaded_weight, **kwargs):
        if "tp_rank" not in kwargs:  # vLLM >= 0.3x passes none
            kwargs["tp_rank"] = getattr(self, "fastcomm_tp_rank", getattr(self, "tp_rank", 0))
        return original(self, loaded_weight, **kwargs)

    load._fastcomm = True
    return load


def _no_image_processor_for_gguf_files() -> None:
    from vllm.config import model as model_module

    original = getattr(model_module, "get_hf_image_processor_config", None)  # newer vLLM probes multimodal only
    if original is None or getattr(original, "_fastcomm", False):
        return

    @functools.wraps(original)
    def probe(model, *args, **kwargs):
        if str(model).endswith(".gguf") and Path(str(model)).is_file():
            return {}
        return original(model, *args, **kwargs)

    probe._fastcomm = True
    model_module.get_hf_image_processor_config = probe


def _mtp_draft_shares_gguf_embedding() -> None:
    try:
        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    except ImportError:  # another vLLM layout: nothing to fix there
        return
    original = getattr(SpecDecodeBaseProposer, "_maybe_share_embeddings", None)
    if original is None or getattr(original, "_fastcomm", False):
        return

    @functools.wraps(original)
    def share(self, target_language_model):
        target = getattr(getattr(target_language_model, "model", None), "embed_tokens", None)
        draft = getattr(getattr(self, "model", None), "model", None)
        if shares_gguf_embedding(target, self.model) and draft is not None:
            if hasattr(draft, "embed_tokens"):
                del draft.embed_tokens
            draft.embed_tokens = target
            logger.info("fastcomm: the MTP draft shares the target's GGUF-quantized embedding")
            return
        return original(self, target_language_model)

    share._fastcomm = True
    SpecDecodeBaseProposer._maybe_share_embeddings = share


def shares_gguf_embedding(target_embedding, draft_model) -> bool:
    """An MTP draft (vLLM marks EAGLE drafts with has_own_embed_tokens) over an embedding that is GGUF
    quantized (qweight, no weight)."""
    return (target_embedding is not None and not hasattr(target_embedding, "weight")
            and hasattr(target_embedding, "qweight") and not hasattr(draft_model, "has_own_embed_tokens"))


def _config_source(original):
    @functools.wraps(original)
    def resolve(model):
        source = original(model)
        path = Path(str(model))
        if path.suffix == ".gguf" and path.is_file() and not (Path(source) / "config.json").is_file():
            derived = glm_folder(str(path))
            if derived is not None:
                return derived
        return source

    resolve._fastcomm = True
    return resolve


def glm_folder(gguf_path: str) -> Path | None:
    """The derived folder for a GLM-5 GGUF, or None for any other GGUF (the plugin's default path)."""
    from . import derive, files, metadata

    meta = metadata.read(files.discover(gguf_path))
    if not metadata.is_glm_dsa(meta):
        return None
    return derive.derive(meta)
