"""The K-quant serving settings: every FASTCOMM_GGUF_* variable (and the K-quant test switch), validated
once into a frozen ``Settings`` that the vLLM wiring hands to each layer it serves.

The variables share fastcomm.config's machinery (``Var``, ``read``, ``check_environment``), not its ``Config``:
the collectives never read these. A bad value raises ConfigError with one line naming it, before any model loads.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping

from ..config import ConfigError, Var, boolean, choice, count, read, read_fields
from . import policy
from .forms import AUTO as FORMS_AUTO, OFF as FORMS_OFF, FormsError, load as load_forms


def _decode_tokens(text: str) -> int:
    v = count(text)
    if not 1 <= v <= policy.MAX_TOKENS + 1:
        raise ValueError(f"must be 1-{policy.MAX_TOKENS + 1} (tokens of a decode product; "
                         f"{policy.MAX_TOKENS + 1}: never)")
    return v


def _forms(text: str) -> str:
    """auto, none, or a forms table's file, read here so that a bad one is named before any model loads."""
    if text in (FORMS_AUTO, FORMS_OFF):
        return text
    try:
        load_forms(text)
    except FormsError as e:
        raise ValueError(str(e).removeprefix(f"{text}: ")) from None
    return text


# Set, these thresholds say how the user wants the products to run: the shipped table then stands aside.
THRESHOLDS = ("mma_min_tokens", "grouped_min_tokens")

VARIABLES: tuple[Var, ...] = (
    Var("FASTCOMM_GGUF_KERNELS", "kernels", "auto", "auto | dp4a | plugin: GGUF products of 1-8 tokens "
        "(decode, MTP verify) through fastcomm's K-quant kernels (csrc/kquant/; Q4_K, Q5_K, Q6_K, Q8_0 weights), "
        "the rest through vllm-gguf-plugin's (or dequantized, FASTCOMM_GGUF_DEQUANT_*, or in calls of 8, "
        "FASTCOMM_GGUF_CHUNK_MAX_TOKENS); dp4a: fastcomm's without "
        "the tensor-core forms; plugin: all through the plugin's.", choice(*policy.KERNEL_SETTINGS)),
    Var("FASTCOMM_GGUF_MMA_MIN_TOKENS", "mma_min_tokens", str(policy.MMA_MIN_TOKENS), "Tokens from which a GGUF linear layer's product "
        f"takes fastcomm's tensor-core form (the default from an H200; rows of at most {policy.MMA_SHORT_ROW_COLS} inputs "
        "from 1 token; 9: never). "
        "`python -m fastcomm_bench.gguf_kernels` suggests it for the GPU at hand.", _decode_tokens),
    Var("FASTCOMM_GGUF_GROUPED_MIN_TOKENS", "grouped_min_tokens", str(policy.MOE_GROUPED_MIN_TOKENS), "Tokens from which a GGUF MoE layer's "
        "experts take the tensor-core form grouped by expert (the default from an H200; 9: never).",
        _decode_tokens),
    Var("FASTCOMM_GGUF_MOE_STAGED", "moe_staged", "1" if policy.MOE_STAGED else "0", "1: a GGUF MoE layer's "
        "experts below the grouped form's tokens run staged (two launches, each block quantizing its activations "
        "into shared memory; the same sums bit for bit) instead of per pair in four launches, where the stage fits "
        "a block; 0: per pair.",
        boolean),
    Var("FASTCOMM_GGUF_FORMS", "forms", FORMS_AUTO, "auto | none | FILE: which form each GGUF product of 1-8 "
        "tokens takes where a table measured it fastest on this GPU (fastcomm.kquant.forms; per product shape and "
        "token count, in place of the MMA / GROUPED thresholds there): auto, this GPU's table, the one "
        "`python -m fastcomm_bench.gguf_kernels --save-forms` measured on this machine (FASTCOMM_CACHE_DIR/"
        "kquant-forms/), else the one fastcomm ships for a GPU of this name (fastcomm/kquant/tables/), unless "
        "FASTCOMM_GGUF_MMA_MIN_TOKENS or _GROUPED_MIN_TOKENS is set; none, the thresholds alone; FILE, the "
        "table `gguf_kernels --forms-out FILE` wrote (on whatever GPU it serves).", _forms, names_file=True),
    Var("FASTCOMM_GGUF_DEQUANT_MIN_TOKENS", "dequant_min_tokens", "16", "Tokens from which a GGUF linear "
        "layer's product past fastcomm's 1-8 (a prefill) dequantizes its weight to bf16 and multiplies on the tensor "
        "cores (cuBLAS) instead of the plugin's dp4a MMQ kernel; 0: never. 16 from an H200 (bench/RESULTS.md); "
        "`python -m fastcomm_bench.gguf_kernels --tokens 16,64,256` times both and suggests it.", count),
    Var("FASTCOMM_GGUF_DEQUANT_MOE_MIN", "dequant_moe_min", "0", "Routed tokens per expert, on average "
        "(tokens x top-k / experts), from which a GGUF MoE layer's prefill dequantizes all its experts to bf16 and "
        "runs vLLM's fused_experts instead of fastcomm's calls (FASTCOMM_GGUF_CHUNK_MAX_TOKENS) or the plugin's dp4a MoE "
        "kernel; 0: never (the default: at 32 it slowed "
        "8 requests' decode on an H200).", count),
    Var("FASTCOMM_GGUF_DEQUANT_KERNEL", "dequant_kernel", policy.DEQUANT_KERNEL, "fastcomm | plugin: which kernel writes "
        "the dequantized prefill form's bf16 weights: fastcomm's (csrc/kquant/kquant.cu fc_kq_dequant: one launch for a "
        "fused weight's segments, 16-byte stores; half the plugin's time on an H200) or vllm-gguf-plugin's "
        "ggml_dequantize (a launch a segment).",
        choice(*policy.DEQUANT_KERNELS)),
    Var("FASTCOMM_GGUF_CHUNK_MAX_TOKENS", "chunk_max_tokens", "256", "Tokens up to which a GGUF product "
        "past 1-8 (a prefill, or a decode batch of 9+) that is not dequantized runs through fastcomm's K-quant "
        "kernels 8 tokens a call (the MoE up to 32 of top 8), each call a read of the weights, instead of the "
        "plugin's dp4a kernels: the MoE always, a linear only inside a CUDA graph capture (launched eagerly its "
        "calls' host time exceeds their GPU time); 0: never. 256 from an H200 (bench/RESULTS.md).", count),
    Var("FASTCOMM_GGUF_PDL", "pdl", "1", "1 lets fastcomm's dense tensor-core K-quant product start while the "
        "quantize launch before it runs (programmatic dependent launch, sm_90+: it fetches its first weights, then "
        "waits on the GPU for the activations); 0: plain launches.", boolean),
    Var("FASTCOMM_TEST_DEVICE_LIMITS", "device_limits", "", "Tests only (needs FASTCOMM_TEST_MODE=1): "
        "'sm_120' makes fastcomm's K-quant launches plan for an RTX PRO 6000 Blackwell's SMs and shared memory "
        "(188 SMs, 99 KB a block, 100 KB an SM) on whatever GPU runs them.", choice(*policy.EMULATED)),
)
_BY_FIELD = {v.field: v for v in VARIABLES}


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the K-quant path serves with; the defaults are the policy's (set from an H200)."""

    kernels: str = "auto"                                     # FASTCOMM_GGUF_KERNELS (policy.KERNEL_SETTINGS)
    mma_min_tokens: int = policy.MMA_MIN_TOKENS               # FASTCOMM_GGUF_MMA_MIN_TOKENS (policy.linear_form)
    grouped_min_tokens: int = policy.MOE_GROUPED_MIN_TOKENS   # FASTCOMM_GGUF_GROUPED_MIN_TOKENS (policy.moe_form)
    moe_staged: bool = policy.MOE_STAGED                     # FASTCOMM_GGUF_MOE_STAGED (policy.moe_form)
    forms: str = FORMS_AUTO                                   # FASTCOMM_GGUF_FORMS (fastcomm.kquant.forms)
    dequant_min_tokens: int = 16                              # FASTCOMM_GGUF_DEQUANT_MIN_TOKENS (policy.prefill_form)
    dequant_moe_min: int = 0                                  # FASTCOMM_GGUF_DEQUANT_MOE_MIN (moe_prefill_form)
    chunk_max_tokens: int = 256                               # FASTCOMM_GGUF_CHUNK_MAX_TOKENS (prefill_form)
    dequant_kernel: str = policy.DEQUANT_KERNEL               # FASTCOMM_GGUF_DEQUANT_KERNEL
    pdl: bool = True                                          # FASTCOMM_GGUF_PDL (policy.dependent_launch)
    device_limits: str | None = None                          # FASTCOMM_TEST_DEVICE_LIMITS (policy.EMULATED)

    def __post_init__(self):
        def bad(field: str, why: str):
            raise ConfigError(f"{_BY_FIELD[field].name} ({field}={getattr(self, field)!r}): {why}")

        if self.kernels not in policy.KERNEL_SETTINGS:
            bad("kernels", f"must be one of {', '.join(policy.KERNEL_SETTINGS)}")
        if self.dequant_kernel not in policy.DEQUANT_KERNELS:
            bad("dequant_kernel", f"must be one of {', '.join(policy.DEQUANT_KERNELS)}")
        if self.device_limits is not None and self.device_limits not in policy.EMULATED:
            bad("device_limits", f"must be one of {', '.join(policy.EMULATED)}")
        for field in ("mma_min_tokens", "grouped_min_tokens"):
            if not 1 <= getattr(self, field) <= policy.MAX_TOKENS + 1:
                bad(field, f"must be 1-{policy.MAX_TOKENS + 1}")

    @property
    def enabled(self) -> bool:
        """fastcomm's kernels serve at all (FASTCOMM_GGUF_KERNELS is not 'plugin')."""
        return self.kernels != "plugin"

    @property
    def tensor_cores(self) -> bool:
        """The tensor-core forms may serve (FASTCOMM_GGUF_KERNELS=auto)."""
        return self.kernels == "auto"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> "Settings":
        """Resolve the environment, then ``overrides`` (None: not given). The test switch needs
        FASTCOMM_TEST_MODE=1, as the collectives' do."""
        env = os.environ if env is None else env
        unknown = set(overrides) - set(_BY_FIELD)
        if unknown:
            raise TypeError(f"unknown K-quant setting(s): {', '.join(sorted(unknown))}")
        values = read_fields(VARIABLES, env, overrides)
        if "forms" not in values and any(f in values for f in THRESHOLDS):
            values["forms"] = FORMS_OFF
        if values.get("device_limits") and not read("FASTCOMM_TEST_MODE", env):
            raise ConfigError("FASTCOMM_TEST_DEVICE_LIMITS (device_limits) is a test switch: it needs "
                              "FASTCOMM_TEST_MODE=1")
        return cls(**values)


def read_device_limits(env: Mapping[str, str] | None = None) -> str | None:
    """The emulated GPU's name (FASTCOMM_TEST_DEVICE_LIMITS), or None: read where a device's limits are first
    asked for (ops), validated as ``Settings.from_env`` validates it."""
    return Settings.from_env(env).device_limits


# This product's variables and how they resolve together (fastcomm.config.check_environment).
GROUP = (VARIABLES, Settings.from_env)
