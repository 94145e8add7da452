"""GGUF models through vllm-gguf-plugin, with fastcomm's GLM-5 (``glm-dsa``) mapping and its MTP draft.

The interface for ``fastcomm-serve`` and ``fastcomm bench-decode``:
    is_gguf(model)          a .gguf file, any shard of a split, or a folder of shards
    plan(model, ...)        what will be served and why (for --dry-run), with the engine kwargs
    engine_kwargs(model, ...) the kwargs for ``vllm.LLM(...)`` / the ``vllm serve`` options
    GgufError               a one-line user error
Modules: files (split discovery), metadata (GGUF metadata -> config, MTP detection), names (GGUF -> vLLM
names, fused shard order), weights (the weight stream), derive (the config/tokenizer folder), kernels (CUDA
extension or Triton fallback), attention (the backend, dtype and KV cache a GPU needs), adapter + plugin (registration into vllm-gguf-plugin, in vLLM's processes).
"""
from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from .errors import GgufError, missing_package
from .files import GgufFiles, looks_like_gguf, looks_like_path

__all__ = ["GgufError", "GgufPlan", "engine_kwargs", "is_gguf", "plan"]

PLUGIN_ENTRY_POINT = "fastcomm_gguf"


def is_gguf(model: str) -> bool:
    """A .gguf file (single or a shard of a split) or a folder holding .gguf files."""
    return looks_like_gguf(model)


@dataclasses.dataclass(frozen=True)
class GgufPlan:
    files: GgufFiles
    arch: str
    glm: bool                      # fastcomm's GLM-5 mapping serves it (else the plugin's own, unchanged)
    mtp_blocks: int                # MTP blocks present in the file
    mtp: bool                      # speculative decoding with the MTP block on
    num_speculative_tokens: int
    config_dir: Path | None        # derived config (and tokenizer) folder, or None
    kwargs: dict                   # for vllm.LLM(...)
    notes: tuple[str, ...]         # what was chosen and why, one line each
    index_topk: int | None = None  # DSA's top-k (GLM-5), which the attention backend must take


_VOCAB_FILES = ("tokenizer.json", "tokenizer.model")  # a fast tokenizer, or a SentencePiece model


def _tokenizer_source(path: str) -> bool:
    """Whether ``path`` (a --hf-config-path) can be the tokenizer too: a local folder holding a vocabulary
    (tokenizer_config.json alone is none), or a Hugging Face id (vLLM resolves it and reports a miss)."""
    p = Path(path).expanduser()
    if not looks_like_path(path) and not p.exists():
        return True
    return p.is_dir() and any((p / name).is_file() for name in _VOCAB_FILES)


def require_packages() -> None:
    for module, what in (("gguf", "the `gguf` package"), ("vllm_gguf_plugin", "vllm-gguf-plugin")):
        if importlib.util.find_spec(module) is None:
            raise missing_package(what)


def plan(model: str, *, mtp: bool | None = None, num_speculative_tokens: int = 1, tokenizer: str | None = None,
         hf_config_path: str | None = None, derive_tokenizer: bool = True, tensor_parallel_size: int = 1) -> GgufPlan:
    """Decide how to serve the GGUF ``model`` at ``tensor_parallel_size``; raises GgufError for anything that
    cannot work (before vLLM starts, so before any GPU memory is taken)."""
    from . import derive, files, metadata, shards

    require_packages()
    if num_speculative_tokens < 1:
        raise GgufError(f"the number of MTP draft tokens must be at least 1, got {num_speculative_tokens}")
    found = files.discover(model)
    meta = metadata.read(found)
    notes = [f"GGUF {found.first.name}: {len(found.shards)} shard(s), architecture {meta.arch!r}"]
    kwargs: dict = {"model": str(found.first), "quantization": "gguf", "load_format": "gguf"}
    glm = metadata.is_glm_dsa(meta)
    if not glm:
        if mtp:
            raise GgufError(f"MTP needs a GLM-5 GGUF with its MTP block; {found.first.name} is {meta.arch!r}")
        notes.append("not GLM-5: vllm-gguf-plugin loads it with its own mapping; MTP off")
        return GgufPlan(found, meta.arch, False, 0, False, num_speculative_tokens, None, kwargs, tuple(notes))
    problem = shards.tp_problem(meta.tensors, int(meta.need("{arch}.attention.head_count")), tensor_parallel_size,
                                shards.gguf_block_of)
    if problem is not None:
        raise GgufError(f"{found.first.name}: {problem}")
    if tensor_parallel_size > 1:
        notes.append(f"tensor parallel {tensor_parallel_size}: every split weight divides on block boundaries")
    n_main, blocks = metadata.main_layers(meta), metadata.mtp_layers(meta)
    if mtp and blocks == 0:
        raise GgufError(f"MTP requested, but {found.first.name} has no MTP block (no blk.{n_main}.nextn.* "
                        "tensors); serve it without MTP (--no-mtp)")
    use_mtp = blocks > 0 if mtp is None else mtp
    if use_mtp:
        notes.append(f"MTP on: block {n_main} of the file drafts {num_speculative_tokens} token(s) per step"
                     + (" (default for a GLM-5 GGUF carrying its MTP block; --no-mtp turns it off)" if mtp is None
                        else ""))
        kwargs["speculative_config"] = {
            "method": "mtp", "num_speculative_tokens": num_speculative_tokens,
            # Named explicitly: vLLM 0.25 would otherwise give the draft the config folder as its model.
            "model": str(found.first), "quantization": "gguf"}
    elif blocks == 0:
        notes.append(f"MTP off: the file has no MTP block (blk.{n_main}.nextn.*)")
    else:
        notes.append("MTP off (--no-mtp)")
    # The derived folder: the config unless --hf-config-path is given, and the tokenizer unless one is given
    # or that config folder (or Hub id) brings its own.
    own_tokenizer = tokenizer is not None or not derive_tokenizer or (
        hf_config_path is not None and _tokenizer_source(hf_config_path))
    config_dir = None
    if hf_config_path is None or not own_tokenizer:
        derive.check_writable(derive.cache_root())
        config_dir = derive.derive(meta)
    if hf_config_path is None:
        kwargs["hf_config_path"] = str(config_dir)
        notes.append(f"config derived from the GGUF metadata: {config_dir / 'config.json'}")
    else:
        kwargs["hf_config_path"] = hf_config_path
        notes.append(f"config from --hf-config-path {hf_config_path}")
    if tokenizer is not None:
        kwargs["tokenizer"] = tokenizer
    elif not derive_tokenizer:
        pass
    elif own_tokenizer:  # the --hf-config-path folder (or Hub id) carries it: where the user's model comes from
        kwargs["tokenizer"] = hf_config_path
        notes.append(f"tokenizer from --hf-config-path {hf_config_path} (--tokenizer overrides)")
    elif derive.has_tokenizer(config_dir):
        kwargs["tokenizer"] = str(config_dir)
        notes.append(f"tokenizer {derive.tokenizer_note(config_dir)} (--tokenizer zai-org/GLM-5 for the original)")
    else:
        raise GgufError(f"no tokenizer: {derive.tokenizer_note(config_dir)} (e.g. --tokenizer zai-org/GLM-5)")
    return GgufPlan(found, meta.arch, True, blocks, use_mtp, num_speculative_tokens, config_dir, kwargs,
                    tuple(notes), int(meta.need("{arch}.attention.indexer.top_k")))


def engine_kwargs(model: str, *, mtp: bool | None = None, num_speculative_tokens: int = 1, **options) -> dict:
    """kwargs for ``vllm.LLM(...)`` serving the GGUF ``model`` (options: tokenizer, hf_config_path,
    derive_tokenizer, tensor_parallel_size: checked here, passed to vLLM by the caller). Registers fastcomm's GLM-5 adapter in this process too (in-process engines)."""
    p = plan(model, mtp=mtp, num_speculative_tokens=num_speculative_tokens, **options)
    from . import plugin

    plugin.register()
    return dict(p.kwargs)
