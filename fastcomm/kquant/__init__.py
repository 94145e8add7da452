"""GGUF K-quant decode products (Q4_K, Q5_K, Q6_K, Q8_0 weights; 1-8 tokens, and prefill forms past that):
the second product over fastcomm's kernel runtime, beside the collectives.

Modules, bottom up: ``abi`` (the mirror of csrc/kquant/), ``policy`` (pure: which form, launch shape, limits),
``settings`` (FASTCOMM_GGUF_*, one frozen ``Settings``), ``ops`` (launches on torch tensors). Nothing here knows
vLLM: fastcomm_vllm.gguf.kquant_vllm wires these into vllm-gguf-plugin's layers.

The package re-exports the policy's and the launchers' public names, so ``kquant.linear`` and
``kquant.linear_form`` read as one API; each is owned by its module.
"""
from .policy import *  # noqa: F401,F403
from .ops import dequantize, forget_limits, launch_warps, limits, linear, linear_chunks, moe, moe_chunks, quantize, \
    staged_fits  # noqa: F401
