"""Whether a GLM-5 GGUF splits across ``tp`` tensor-parallel ranks the way vLLM splits GLM-5.

Pure: the file's tensor headers in, the first problem as one line out (None: it splits). vLLM's GLM-5
(DeepSeek-V2 layers) gives each rank
- a slice of every row of the row-parallel weights (``ROW_PARALLEL``): for a quantized tensor that is a slice
  of each row's bytes, which is only that rank's weights when K / tp is whole blocks of its type; vllm-gguf-plugin
  cuts the bytes without looking;
- whole rows of the column-parallel ones (``COLUMN_PARALLEL``: rows / tp must be whole; the heads for q_b and kv_b);
- a padded share of the vocabulary (embedding and LM head: any size), and everything else whole.
"""
from __future__ import annotations

from collections.abc import Callable

# GGUF leaf names (after "blk.N.").
ROW_PARALLEL = ("attn_output.weight", "ffn_down.weight", "ffn_down_shexp.weight", "ffn_down_exps.weight")
COLUMN_PARALLEL = ("attn_q_b.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_gate_shexp.weight",
                   "ffn_up_shexp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight")


def _leaf(name: str) -> str:
    parts = name.split(".", 2)
    return parts[2] if len(parts) == 3 and parts[0] == "blk" else name


def tp_problem(tensors, heads: int, tp: int, block_of: Callable[[str], int]) -> str | None:
    """The first reason a file with ``tensors`` ((name, type name, GGUF shape) with the innermost dimension
    first, as gguf-py reports it) and ``heads`` attention heads cannot be served at tensor parallel ``tp``.
    ``block_of(type name)`` is the type's block size in elements (1 for F32 / F16 / BF16)."""
    if tp < 1:
        return f"tensor parallel size must be at least 1, got {tp}"
    if tp == 1:
        return None
    if heads % tp:
        return (f"GLM-5 has {heads} attention heads, which do not divide among {tp} tensor-parallel ranks "
                f"(use a tensor parallel size that divides {heads})")
    for name, type_name, shape in tensors:
        leaf = _leaf(name)
        if leaf in ROW_PARALLEL:
            k, block = int(shape[0]), block_of(type_name)
            if k % tp or (k // tp) % block:
                return (f"{name} ({type_name}, K = {k}) does not split on block boundaries at tensor parallel {tp}: "
                        f"each rank's {k / tp:g} elements of a row are not whole {block}-element {type_name} blocks, "
                        f"so no rank would hold its own weights (use a tensor parallel size with K / tp a multiple "
                        f"of {block})")
        elif leaf in COLUMN_PARALLEL:
            rows = int(shape[1])
            if rows % tp:
                return f"{name} has {rows} rows, which do not divide among {tp} tensor-parallel ranks"
    return None


def gguf_block_of(type_name: str) -> int:
    """Block size in elements of a GGML type, from gguf-py's table."""
    import gguf

    return int(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0])
