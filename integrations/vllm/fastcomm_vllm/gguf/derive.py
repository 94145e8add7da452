"""A Hugging Face-style folder (config.json, tokenizer) derived from a GLM-5 GGUF's own metadata.

vLLM (and the plugin) read a model's config and tokenizer from a folder; a GGUF-only download has none.
The folder lives under fastcomm's cache (FASTCOMM_CACHE_DIR/gguf), keyed by the first shard's path, size and
mtime, and is written once (to a temporary name, then renamed, so concurrent starts never see half a folder).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from . import metadata
from .errors import GgufError

FORMAT = 2   # bump when what is written changes, so old folders are not reused (2: the tokenizers build)


def cache_root() -> Path:
    from fastcomm.config import read

    return read("FASTCOMM_CACHE_DIR") / "gguf"  # this setting alone: another bad one is named where it is used


def folder_for(meta: metadata.Meta, root: Path | None = None) -> Path:
    first = meta.files.first.resolve()
    st = first.stat()
    key = hashlib.sha256(f"{FORMAT}|{first}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return (root or cache_root()) / f"{first.name.removesuffix('.gguf')}-{key}"


def derive(meta: metadata.Meta, root: Path | None = None) -> Path:
    """The folder for ``meta`` (written if missing): config.json always, tokenizer files when they can be
    built from the file (``has_tokenizer`` tells)."""
    target = folder_for(meta, root)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(metadata.hf_config(meta), indent=1, sort_keys=True))
        note = write_tokenizer(meta, tmp)
        (tmp / "fastcomm_gguf.json").write_text(json.dumps(
            {"gguf": [str(p) for p in meta.files.shards], "tokenizer": note}, indent=1))
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race: its folder is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file()


def tokenizer_note(folder: Path) -> str:
    try:
        return json.loads((folder / "fastcomm_gguf.json").read_text())["tokenizer"]
    except (OSError, ValueError, KeyError):
        return ""


# llama.cpp's "glm4" pre-tokenizer splits text with the same expression as Llama 3's.
_PRE_ALIASES = {"glm4": "llama3"}
# The expression itself, for transformers releases without a GGUF converter that knows it (below).
_SPLITS = {"llama3": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                      r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")}
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                "pad_token": "padding_token_id"}
_CONTROL, _USER_DEFINED = 3, 4   # llama.cpp's token types


def write_tokenizer(meta: metadata.Meta, folder: Path) -> str:
    """Write tokenizer.json + tokenizer_config.json from the GGUF vocabulary; returns what happened, in
    words (it never raises for a tokenizer it cannot build: --tokenizer still works).

    transformers' GGUF tokenizer converter builds it where the installed release has one that knows the
    file's pre-tokenizer (transformers.integrations.gguf, in newer releases); older ones (those vLLM
    0.25 brings) only know a fixed list of architectures, so for those the byte-level BPE vocabulary GLM-5
    uses is built here with `tokenizers` the same way (a CPU test holds both to the same ids)."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return "not derived: transformers is not installed; pass --tokenizer"
    try:
        try:
            backend, specials, template, how = _with_transformers(meta)
        except Exception:  # no converter in this transformers, or none that knows this vocabulary
            backend, specials, template, how = _byte_level_bpe(meta)
        if backend is None:
            return f"not derived: {how}; pass --tokenizer"
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **specials)
        if template:
            tokenizer.chat_template = template
        tokenizer.save_pretrained(str(folder))
    except Exception as e:  # a vocabulary that cannot be converted: say so, the user can pass one
        return f"not derived ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); pass --tokenizer"
    return how


def _with_transformers(meta: metadata.Meta):
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    _, tok_dict, tok_config = get_gguf_tokenizer(str(meta.files.first))
    pre = tok_dict.get("pre_tokenizer_type")
    tok_dict = {**tok_dict, "pre_tokenizer_type": _PRE_ALIASES.get(pre, pre)}
    backend, _ = convert_gguf_tokenizer("glm4", tok_dict)
    specials = {k: v for k, v in tok_config.items() if k.endswith("_token") and v is not None}
    how = f"derived from the GGUF vocabulary ({tok_dict.get('tokenizer_type')}, pre-tokenizer {pre})"
    return backend, specials, tok_config.get("chat_template"), how


def _byte_level_bpe(meta: metadata.Meta):
    """(backend, special tokens, chat template, note) for a byte-level BPE vocabulary (tokenizer.ggml.model
    "gpt2") whose pre-tokenizer is known; backend None (and the note says why) for any other."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    split = _SPLITS.get(_PRE_ALIASES.get(pre, pre))
    if kind != "gpt2" or split is None:
        return None, {}, None, f"tokenizer {kind!r} with pre-tokenizer {pre!r} needs a newer transformers"
    tokens = [str(t) for t in metadata.value(meta, "tokenizer.ggml.tokens")]
    merges = [tuple(str(m).split(" ", 1)) for m in metadata.value(meta, "tokenizer.ggml.merges")]
    types = list(metadata.value(meta, "tokenizer.ggml.token_type") or ())
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control tokens stay whole as special tokens, user-defined ones (e.g. <think>) as plain added tokens.
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    specials = {name: tokens[int(meta.get(f"tokenizer.ggml.{key}"))] for name, key in _SPECIAL_IDS.items()
                if meta.get(f"tokenizer.ggml.{key}") is not None}
    how = f"derived from the GGUF vocabulary (gpt2, pre-tokenizer {pre}; built with tokenizers)"
    return tok, specials, meta.get("tokenizer.chat_template"), how


def check_writable(root: Path) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GgufError(f"cannot create {str(root)!r} for the config derived from the GGUF ({e.strerror}); "
                        "set FASTCOMM_CACHE_DIR or pass --hf-config-path") from None
