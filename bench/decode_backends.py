"""The rows of bench-decode: one all-reduce backend each, defined by the environment its vLLM process gets."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    about: str
    env: dict
    disable_custom_all_reduce: bool = False
    fastcomm: bool = False


# Each backend sets FASTCOMM_VLLM explicitly so an inherited value cannot change what a row measures.
BACKENDS = {b.name: b for b in (
    Backend("vllm", "vLLM default (its custom all-reduce, NCCL above its range)", {"FASTCOMM_VLLM": "0"}),
    Backend("nccl", "vLLM, custom all-reduce off: NCCL only", {"FASTCOMM_VLLM": "0"}, True),
    Backend("fastcomm", "vLLM + fastcomm with the all-reduce + RMSNorm fusion (FASTCOMM_VLLM_FUSION=1)",
            {"FASTCOMM_VLLM": "1", "FASTCOMM_VLLM_FUSION": "1"}, fastcomm=True),
    Backend("fastcomm-nofuse", "vLLM + fastcomm all-reduce only (FASTCOMM_VLLM_FUSION=0, the default)",
            {"FASTCOMM_VLLM": "1", "FASTCOMM_VLLM_FUSION": "0"}, fastcomm=True),
    # Stand-ins for GPUs without P2P: vLLM's custom all-reduce needs P2P, so it is off in both.
    Backend("nccl-nop2p", "NCCL only, NCCL_P2P_DISABLE=1", {"FASTCOMM_VLLM": "0", "NCCL_P2P_DISABLE": "1"}, True),
    Backend("fastcomm-host", "fastcomm host transport with the fusion, NCCL_P2P_DISABLE=1",
            {"FASTCOMM_VLLM": "1", "FASTCOMM_TRANSPORT": "host", "FASTCOMM_VLLM_FUSION": "1",
             "NCCL_P2P_DISABLE": "1"}, True, fastcomm=True),
    Backend("fastcomm-host-nofuse", "fastcomm host transport, all-reduce only, NCCL_P2P_DISABLE=1",
            {"FASTCOMM_VLLM": "1", "FASTCOMM_TRANSPORT": "host", "FASTCOMM_VLLM_FUSION": "0",
             "NCCL_P2P_DISABLE": "1"}, True, fastcomm=True),
)}
# Whose greedy tokens the others are compared against, first present wins.
REFERENCE_ORDER = ("vllm", "nccl", "nccl-nop2p", "fastcomm", "fastcomm-host")
# The variables that make a row what its name says; --fastcomm-env may not change them.
ROW_DEFINING = ("FASTCOMM_VLLM", "FASTCOMM_VLLM_FUSION", "FASTCOMM_TRANSPORT")


def row_env(backend: Backend, spec: dict) -> dict:
    """What a row sets in its process: the backend's own variables, plus --fastcomm-env in fastcomm rows, plus
    the stand-in all-reduces in every row of a --standin-us run (its first time; the worker sets the others)."""
    extra = (spec.get("fastcomm_env") or {}) if backend.fastcomm else {}
    standin = spec.get("standin_us")
    if standin:
        extra = {**extra, "FASTCOMM_TEST_MODE": "1", "FASTCOMM_TEST_STANDIN_US": f"{standin[0]:g}"}
    return {**backend.env, **extra}
