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

FORMAT = 1   # bump when what is written changes, so old folders are not reused


def cache_root() -> Path:
    from fastcomm.config import Config

    return Config.from_env().cache_dir / "gguf"


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


def write_tokenizer(meta: metadata.Meta, folder: Path) -> str:
    """Write tokenizer.json + tokenizer_config.json from the GGUF vocabulary with transformers' GGUF
    tokenizer converter; returns what happened, in words (it never raises for a tokenizer it cannot build:
    --tokenizer still works)."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (convert_gguf_tokenizer,
                                                                           get_gguf_tokenizer)
    except ImportError:
        return "not derived: this transformers has no GGUF tokenizer converter; pass --tokenizer"
    try:
        _, tok_dict, tok_config = get_gguf_tokenizer(str(meta.files.first))
        pre = tok_dict.get("pre_tokenizer_type")
        tok_dict = {**tok_dict, "pre_tokenizer_type": _PRE_ALIASES.get(pre, pre)}
        backend, _ = convert_gguf_tokenizer("glm4", tok_dict)
        specials = {k: v for k, v in tok_config.items() if k.endswith("_token") and v is not None}
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **specials)
        if tok_config.get("chat_template"):
            tokenizer.chat_template = tok_config["chat_template"]
        tokenizer.save_pretrained(str(folder))
    except Exception as e:  # a vocabulary transformers cannot convert: say so, the user can pass one
        return f"not derived ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); pass --tokenizer"
    return f"derived from the GGUF vocabulary ({tok_dict.get('tokenizer_type')}, pre-tokenizer {pre})"


def check_writable(root: Path) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GgufError(f"cannot create {str(root)!r} for the config derived from the GGUF ({e.strerror}); "
                        "set FASTCOMM_CACHE_DIR or pass --hf-config-path") from None
