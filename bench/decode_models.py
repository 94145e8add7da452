"""What ``bench-decode --model`` names, turned into the arguments vLLM's ``LLM`` gets.

A model is one of (tried in this order):
- a GGUF file (or the first part of a split one): its own weights, read through ``fastcomm_vllm.gguf``;
- a directory with ``config.json``: with weight files it is a local checkpoint (real weights unless
  ``--dummy``); with only the config, vLLM's dummy weights;
- a config shipped with this package (``bench/models/<name>``, see SHIPPED): dummy weights;
- a Hugging Face id (``org/name``): vLLM downloads it; real weights unless ``--dummy`` (then only the config).
Dummy weights are random, from the same seed in every backend, so all rows compute the same thing.

MTP (speculative decoding with the model's own multi-token-prediction layers): ``mtp`` None is the model's
default (off, except where a GGUF file's own default says otherwise), 0 is off, N > 0 drafts N tokens.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import re
from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parent / "models"
WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.pth")
HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelError(ValueError):
    """A --model / --dummy / --mtp combination bench-decode cannot run; the message is one line."""


def shipped() -> list[str]:
    return sorted(p.parent.name for p in SHIPPED_DIR.glob("*/config.json"))


@dataclasses.dataclass(frozen=True)
class Model:
    source: str   # "gguf", "checkpoint", "config", "shipped" or "huggingface"
    label: str    # for file names and the report header
    weights: str  # "dummy" (vLLM's random weights) or "real"
    mtp: int      # draft tokens per step; 0: no speculative decoding
    engine: dict  # keyword arguments for vllm.LLM (model=..., load_format=..., speculative_config=...)
    gguf: dict | None = None  # fastcomm_vllm.gguf.engine_kwargs's arguments, for a GGUF file

    @property
    def record_name(self) -> str:
        """How the results name the model: what reproduces it, without this machine's directories."""
        return self.engine["model"] if self.source == "huggingface" else self.label

    def describe(self) -> str:
        what = {"gguf": "GGUF file", "checkpoint": "local checkpoint", "config": "config-only directory",
                "shipped": "config shipped with fastcomm", "huggingface": "Hugging Face id"}[self.source]
        weights = ("vLLM dummy weights (random, the same seed for every backend)" if self.weights == "dummy"
                   else "real weights")
        mtp = f"MTP with {self.mtp} draft token(s)" if self.mtp else "no MTP"
        return f"{self.engine['model']} ({what}, {weights}, {mtp})"


def _mtp_config(mtp: int | None) -> dict:
    if not mtp:
        return {}
    return {"speculative_config": {"method": "mtp", "num_speculative_tokens": mtp}}


def _gguf():
    """(fastcomm_vllm.gguf, None), or (None, why it does not import) (GGUF support is part of the vLLM extra)."""
    import importlib

    try:  # through sys.modules (not the package attribute), so what is registered there is what runs
        return importlib.import_module("fastcomm_vllm.gguf"), None
    except ImportError as e:
        return None, str(e)


def _looks_gguf(name: str) -> bool:
    return name.lower().endswith(".gguf")


def resolve(name: str, *, dummy: bool = False, mtp: int | None = None) -> Model:
    """The model ``name`` means; raises ModelError with a one-line reason."""
    if mtp is not None and mtp < 0:
        raise ModelError(f"--mtp {mtp}: the number of draft tokens must be 1 or more (--no-mtp turns MTP off)")
    if _looks_gguf(name) and not Path(name).expanduser().is_file():  # before the GGUF reader is asked for
        raise ModelError(f"--model {name}: no such file")
    gguf, missing = _gguf()
    if (gguf.is_gguf(name) if gguf is not None else _looks_gguf(name)):
        return _resolve_gguf(gguf, missing, name, dummy=dummy, mtp=mtp)
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        has_weights = any(next(path.glob(g), None) for g in WEIGHT_GLOBS)
        source, weights = ("checkpoint", "dummy" if dummy else "real") if has_weights else ("config", "dummy")
        _check_mtp_layers(path, mtp)
        return _model(source, str(path.resolve()), path.resolve().name, weights, mtp)
    if (SHIPPED_DIR / name / "config.json").is_file():
        _check_mtp_layers(SHIPPED_DIR / name, mtp)
        return _model("shipped", str(SHIPPED_DIR / name), name, "dummy", mtp)
    if path.exists():
        raise ModelError(f"--model {name}: neither a GGUF file nor a directory with config.json")
    if HF_ID.match(name):
        return _model("huggingface", name, name.replace("/", "--"), "dummy" if dummy else "real", mtp)
    raise ModelError(f"--model {name}: no such file or directory, not a shipped config ({', '.join(shipped())}) "
                     f"and not a Hugging Face id (org/name)")


def _check_mtp_layers(directory: Path, mtp: int | None) -> None:
    """--mtp on a local config without MTP layers would fail minutes later inside vLLM's worker."""
    if not mtp:
        return
    config = json.loads((directory / "config.json").read_text())
    # DeepSeek / GLM name it num_nextn_predict_layers; others say mtp (mtp_num_hidden_layers): either counts.
    if not any(("nextn" in k or "mtp" in k) and isinstance(v, int) and v > 0 for k, v in config.items()):
        shipped_mtp = [n for n in shipped() if n.endswith("-mtp")]
        raise ModelError(f"--mtp {mtp}: {directory.name}'s config.json has no MTP layers (num_nextn_predict_layers)"
                         + (f"; the shipped {', '.join(shipped_mtp)} has one" if shipped_mtp else ""))


def _model(source: str, model: str, label: str, weights: str, mtp: int | None) -> Model:
    engine = {"model": model, **({"load_format": "dummy"} if weights == "dummy" else {}), **_mtp_config(mtp)}
    return Model(source, label, weights, mtp or 0, engine)


def _resolve_gguf(gguf, missing: str | None, name: str, *, dummy: bool, mtp: int | None) -> Model:
    if gguf is None:
        raise ModelError(f"--model {name}: reading GGUF files needs fastcomm_vllm.gguf, which does not import here "
                         f"({missing}; from a checkout: pip install -e \".[vllm]\")")
    if dummy:
        raise ModelError(f"--model {name}: --dummy does not apply to a GGUF file (it brings its own weights)")
    args = gguf_args(name, mtp)
    try:
        engine = gguf_engine_kwargs(gguf, args)
    except gguf.GgufError as e:
        raise ModelError(f"--model {name}: {e}") from None
    spec = engine.get("speculative_config") or {}
    drafts = int(spec.get("num_speculative_tokens", 1)) if spec else 0
    label = Path(name).name.rsplit(".", 1)[0]
    # gguf: the worker asks the contract again, which also registers the GGUF adapter in its own process.
    return Model("gguf", label, "real", drafts, {"model": name, **engine}, gguf=args)


def gguf_args(name: str, mtp: int | None) -> dict:
    return {"model": name, "mtp": None if mtp is None else mtp > 0, "num_speculative_tokens": mtp or 1}


def gguf_engine_kwargs(gguf, args: dict) -> dict:
    """``fastcomm_vllm.gguf.engine_kwargs`` for ``args``. Prompts are token ids here, so no tokenizer is
    needed: asked not to derive one where the module takes that option."""
    params = inspect.signature(gguf.engine_kwargs).parameters
    takes = "derive_tokenizer" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    return gguf.engine_kwargs(args["model"], mtp=args["mtp"], num_speculative_tokens=args["num_speculative_tokens"],
                              **({"derive_tokenizer": False} if takes else {}))
