"""The attention configuration a GLM-5 (DSA) GGUF needs on the GPU it runs on, and whether the installed
vLLM + FlashInfer can run it there. ``stack()`` reads the facts from the installed packages' files (no
import: it runs before vLLM starts); ``choose`` is pure.

Why sm_120 needs it (read from vLLM 0.25.0 / 0.33.0 / 0.34.0 and flashinfer-python 0.6.13 / 0.7.2.post1):
on capability 12.x vLLM's only sparse-MLA (DSA) backend is FLASHINFER_MLA_SPARSE_SM120. It takes bf16
activations only, keeps the KV cache as ``fp8_ds_mla`` (vLLM rewrites auto / fp8 to it), pages of a multiple
of 64 tokens (0.25: 64 or 256), and a model with index_topk 2048. Its decode calls FlashInfer's
``trtllm_batch_decode_with_kv_cache_mla`` with ``kv_scale_format=``, which flashinfer 0.6.x lacks (vLLM 0.25.0
pins 0.6.13): that pairing fails with a TypeError at the first attention forward, i.e. during CUDA-graph
capture at start-up, after the weights have loaded.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import re
from pathlib import Path

SM120_BACKEND = "FLASHINFER_MLA_SPARSE_SM120"
SM120_KV_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla")
SM120_PAGE = 64                 # tokens a KV page: a multiple of it
SM120_TOPK = 2048
SM120_DTYPES = ("auto", "bfloat16", "bf16")
# What fastcomm's sources were read against; printed in the "install" line (not run on an sm_120 GPU).
SM120_KNOWN_GOOD = "vllm==0.33.0 (with its flashinfer-python==0.7.2.post1)"

_SM120_MODULE = ("v1", "attention", "backends", "mla", "flashinfer_mla_sparse_sm120.py")


@dataclasses.dataclass(frozen=True)
class Stack:
    """What the installed vLLM and FlashInfer can do on sm_120, read from their files."""
    vllm: str | None                        # versions (None: not installed)
    flashinfer: str | None
    sm120_backend: bool                     # vLLM has FLASHINFER_MLA_SPARSE_SM120
    backend_passes_scale_format: bool       # ... and its decode passes kv_scale_format=
    sparse_api: bool                        # FlashInfer has the sparse-MLA decode vLLM checks for
    takes_scale_format: bool                # FlashInfer's MLA decode accepts kv_scale_format


@dataclasses.dataclass(frozen=True)
class UserAttention:
    """The user's own vLLM options that the choice must respect (None: not given)."""
    dtype: str | None = None
    kv_cache_dtype: str | None = None
    block_size: int | None = None
    backend: str | None = None


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    args: tuple[str, ...]           # vLLM options to add
    notes: tuple[str, ...]          # each choice and why
    error: str | None = None        # a one-line reason it cannot run, naming what to install or change


def choose(capability: tuple[int, int] | None, index_topk: int | None, user: UserAttention,
           stack: Stack | None) -> AttentionPlan:
    """The vLLM options for a DSA model (``index_topk`` set) on a GPU of ``capability`` (``stack`` is read
    only for sm_120, where the choice depends on it)."""
    if index_topk is None:
        return AttentionPlan((), ())
    if capability is None:
        return AttentionPlan((), ("attention: compute capability unknown (pass --capability); vLLM picks the "
                                  "backend",))
    cc = f"{capability[0]}.{capability[1]}"
    if capability[0] != 12:
        return AttentionPlan((), (f"attention: capability {cc}: vLLM's own choice of sparse-MLA backend",))
    problem = _sm120_problem(index_topk, user, stack or Stack(None, None, False, False, False, False))
    if problem is not None:
        return AttentionPlan((), (), f"GLM-5 on capability {cc} (sm_120): {problem}")
    args: list[str] = []
    notes = [f"attention: {SM120_BACKEND}, vLLM's only sparse-MLA (DSA) backend on sm_120 "
             f"(vLLM {stack.vllm}, flashinfer-python {stack.flashinfer})"]
    if user.backend is None:
        args += ["--attention-backend", SM120_BACKEND]
    if user.dtype is None:
        args += ["--dtype", "bfloat16"]
        notes.append(f"activations bfloat16: {SM120_BACKEND} takes no other dtype (fastcomm's K-quant "
                     "kernels and vllm-gguf-plugin's serve bf16)")
    if user.kv_cache_dtype is None:
        args += ["--kv-cache-dtype", "fp8_ds_mla"]
        notes.append("KV cache fp8_ds_mla: the packed FP8 layout that backend reads (vLLM would turn auto into "
                     "it too)")
    if user.block_size is None:
        args += ["--block-size", str(SM120_PAGE)]
        notes.append(f"KV pages of {SM120_PAGE} tokens: that backend's page (a multiple of {SM120_PAGE})")
    return AttentionPlan(tuple(args), tuple(notes))


def _sm120_problem(index_topk: int, user: UserAttention, stack: Stack) -> str | None:
    install = f"install {SM120_KNOWN_GOOD}"
    if stack.vllm is None:
        return f"vLLM is not installed; {install}"
    if not stack.sm120_backend:
        return f"vLLM {stack.vllm} has no {SM120_BACKEND} backend (no DSA attention on sm_120); {install}"
    if stack.flashinfer is None or not stack.sparse_api:
        return (f"flashinfer-python {stack.flashinfer or '(not installed)'} lacks the sparse-MLA decode "
                f"{SM120_BACKEND} needs; {install}")
    if stack.backend_passes_scale_format and not stack.takes_scale_format:
        return (f"vLLM {stack.vllm}'s {SM120_BACKEND} passes kv_scale_format= to flashinfer-python "
                f"{stack.flashinfer}, which does not take it (a TypeError at CUDA-graph capture); {install}")
    if index_topk != SM120_TOPK:
        return f"{SM120_BACKEND} needs index_topk {SM120_TOPK}; the file says {index_topk}"
    if user.backend is not None and user.backend != SM120_BACKEND:
        return f"--attention-backend {user.backend} cannot run sparse MLA (DSA) here; use {SM120_BACKEND}"
    if user.dtype is not None and user.dtype not in SM120_DTYPES:
        return f"--dtype {user.dtype}: {SM120_BACKEND} takes bfloat16 only; drop --dtype or pass bfloat16"
    if user.kv_cache_dtype is not None and user.kv_cache_dtype not in SM120_KV_DTYPES:
        return (f"--kv-cache-dtype {user.kv_cache_dtype}: {SM120_BACKEND} reads fp8_ds_mla only (auto / fp8 "
                "become it); drop the option")
    if user.block_size is not None and user.block_size % SM120_PAGE:
        return f"--block-size {user.block_size}: {SM120_BACKEND} needs a multiple of {SM120_PAGE}"
    return None


# ---- the installed packages, from their files --------------------------------------------------------------

def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _signature(text: str, function: str) -> str | None:
    """The parameter list of ``def function(...)`` in ``text`` (up to the closing ``)`` of the def), or None."""
    m = re.search(rf"^\s*def {re.escape(function)}\(", text, re.M)
    if m is None:
        return None
    depth, i = 1, m.end()
    while i < len(text) and depth:
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    return text[m.end():i]


def stack() -> Stack:
    """The facts ``choose`` needs, from the installed vLLM's and FlashInfer's files."""
    vllm_dir, fi_dir = _package_dir("vllm"), _package_dir("flashinfer")
    module = vllm_dir.joinpath(*_SM120_MODULE) if vllm_dir else None
    backend = module is not None and module.is_file()
    passes = backend and "kv_scale_format=" in module.read_text(errors="replace")
    sparse, takes = False, False
    if fi_dir is not None:
        for path in sorted(fi_dir.glob("*.py")) + sorted(fi_dir.glob("mla/*.py")):
            text = path.read_text(errors="replace")
            sparse = sparse or _signature(text, "trtllm_batch_decode_sparse_mla_dsv4") is not None
            params = _signature(text, "trtllm_batch_decode_with_kv_cache_mla")
            takes = takes or (params is not None and "kv_scale_format" in params)
    return Stack(vllm=_version("vllm"), flashinfer=_version("flashinfer-python") if fi_dir else None,
                 sm120_backend=backend, backend_passes_scale_format=passes, sparse_api=sparse,
                 takes_scale_format=takes)
