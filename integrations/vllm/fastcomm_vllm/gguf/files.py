"""Which files make up a GGUF model: a single file, the first shard of a split, or a folder of shards.

llama.cpp's gguf-split names shards ``<stem>-00001-of-00003.gguf`` and also records ``split.no`` /
``split.count`` in each shard's metadata. The name is what a person sees, so errors name the missing file.
Pure path logic; reading metadata to cross-check the split lives in ``metadata``.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from .errors import GgufError

SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclasses.dataclass(frozen=True)
class GgufFiles:
    shards: tuple[Path, ...]          # in split order; shards[0] carries the metadata

    @property
    def first(self) -> Path:
        return self.shards[0]


def looks_like_path(name: str) -> bool:
    """Whether a model / config / tokenizer argument names a file system location rather than a Hugging Face
    id ("name" or "org/name")."""
    return name.startswith(("/", "./", "../", "~")) or name in (".", "..") or name.count("/") > 1


def model_name(files: GgufFiles) -> str:
    """The model's name as its files spell it: the first shard's name less the split suffix and .gguf
    (GLM-5-UD-Q4_K_XL-00001-of-00009.gguf -> GLM-5-UD-Q4_K_XL)."""
    m = SPLIT_RE.match(files.first.name)
    return m["stem"] if m else files.first.name.removesuffix(".gguf")


def looks_like_gguf(model: str) -> bool:
    """A .gguf file, or a folder holding .gguf files (no I/O beyond a stat and a listing)."""
    p = Path(model).expanduser()
    if p.suffix == ".gguf":
        return True
    return p.is_dir() and any(p.glob("*.gguf"))


def discover(model: str) -> GgufFiles:
    """The shards of ``model`` (a .gguf file, any shard of a split, or a folder), all checked to exist."""
    p = Path(model).expanduser()
    if p.is_dir():
        return _from_folder(p)
    if not p.exists():
        raise GgufError(f"GGUF file {str(p)!r} does not exist")
    m = SPLIT_RE.match(p.name)
    if m is None:
        return GgufFiles((p,))
    return _split(p.parent, m["stem"], int(m["count"]))


def _split(folder: Path, stem: str, count: int) -> GgufFiles:
    shards = tuple(folder / f"{stem}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1))
    missing = [s.name for s in shards if not s.is_file()]
    if missing:
        raise GgufError(f"GGUF split {stem!r} has {count} shards but {', '.join(missing)} "
                        f"{'is' if len(missing) == 1 else 'are'} missing from {str(folder)!r}")
    return GgufFiles(shards)


def _from_folder(folder: Path) -> GgufFiles:
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise GgufError(f"folder {str(folder)!r} holds no .gguf file")
    # mmproj-*.gguf (vision projectors) sit beside some text models; they are not the model.
    ggufs = [g for g in ggufs if not g.name.startswith("mmproj")] or ggufs
    splits = {(m["stem"], int(m["count"])) for g in ggufs if (m := SPLIT_RE.match(g.name))}
    singles = [g for g in ggufs if not SPLIT_RE.match(g.name)]
    models = len(splits) + len(singles)
    if models > 1:
        names = sorted([f"{s}-00001-of-{c:05d}.gguf" for s, c in splits] + [g.name for g in singles])
        raise GgufError(f"folder {str(folder)!r} holds {models} GGUF models ({', '.join(names)}); "
                        "pass the one to serve (its first shard)")
    if singles:
        return GgufFiles((singles[0],))
    stem, count = splits.pop()
    return _split(folder, stem, count)
