"""The GGUF tensors of a GLM-5 file as the (name, tensor) stream vLLM's ``load_weights`` takes.

Quantized tensors go as the plugin's pair ``<module>.qweight_type`` (the GGML type) + ``<module>.qweight``
(the raw blocks), so its K-quant kernels run on them; ``names.DENSE`` tensors and ``kv_b_proj`` are
dequantized here (gguf-py's reference dequantizer, once at load) because vLLM builds those modules without
a quantization method. Shards of a fused projection come out in canonical order whatever the file order.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from . import names
from .errors import GgufError
from .files import GgufFiles

FLOAT_TYPES = ("F32", "F16", "BF16")


MAIN, MTP = "main", "mtp"


def iter_weights(files: GgufFiles, dtype, part: str | None = None, main_layers: int | None = None,
                 tp: tuple[int, int] = (0, 1)) -> Iterator[tuple[str, object]]:
    """The tensors of every shard, mapped; raises GgufError on a tensor the GLM-5 mapping does not know.

    ``part`` MAIN leaves out the MTP blocks (layers >= ``main_layers``; vLLM's main model skips them anyway),
    MTP leaves out what the MTP draft does not load (the main layers, the final norm and head), so neither
    load copies the other's tensors. None streams everything. ``tp`` (rank, size): the rank this load is for
    (only the draft's dense embedding uses it: see ``_draft_embedding``).
    """
    yield from _canonical(_mapped(files, dtype, part, main_layers, tp))


def wanted(tgt: names.Target, part: str | None, main_layers: int | None) -> bool:
    if part is None:
        return True
    in_mtp = tgt.layer is not None and tgt.layer >= main_layers
    if part == MAIN:
        return not in_mtp
    return in_mtp or tgt.hf == "model.embed_tokens.weight"


def dense_in_draft(tgt: names.Target) -> bool:
    """vLLM's generic DeepSeek MTP model (0.25's, and the newest's off NVIDIA) builds its embedding without
    a quantization method; the draft's embedding is therefore always handed over dense (and listed as an
    unquantized module, so a quantization-aware embedding agrees)."""
    return tgt.hf.endswith("embed_tokens.weight")


def _mapped(files: GgufFiles, dtype, part, main_layers, tp=(0, 1)) -> Iterator[tuple[str, list]]:
    import gguf
    import torch

    kv_b: dict[int, dict[str, np.ndarray]] = {}
    for path in files.shards:
        # Copy-on-write mapping: tensors go out as views of the file (writable, so torch takes them without a
        # warning; nothing writes them), vLLM narrows each to this rank's slice and the plugin copies only that.
        # No rank reads or copies the rest of the file.
        reader = gguf.GGUFReader(path, "c")
        for t in reader.tensors:
            tgt = names.target(t.name)
            if tgt is None:
                raise GgufError(f"{path.name}: tensor {t.name!r} has no place in vLLM's GLM-5 model "
                                "(not a glm-dsa tensor fastcomm knows)")
            if not wanted(tgt, part, main_layers):
                continue
            if part == MTP and dense_in_draft(tgt):
                tgt = dataclasses.replace(tgt, how=names.DENSE)
            qtype = t.tensor_type
            quantized = qtype.name not in FLOAT_TYPES
            if tgt.how in (names.KV_B_K, names.KV_B_V):
                parts = kv_b.setdefault(tgt.layer, {})
                parts[tgt.how] = _dense(t)
                if len(parts) == 2:
                    del kv_b[tgt.layer]
                    joined = names.join_kv_b(torch.from_numpy(parts[names.KV_B_K]),
                                             torch.from_numpy(parts[names.KV_B_V]))
                    yield tgt.hf, [(tgt.hf, joined.contiguous())]  # float32: see _dense_out
                continue
            if tgt.how == names.EXPERTS:
                data = np.asarray(t.data) if quantized else None
                dense = None if quantized else _dense(t)
                for e in range(int(t.shape[-1])):  # GGUF shape is reversed: experts last
                    hf = tgt.hf.format(e=e)
                    if quantized:
                        yield hf, _quant_pair(hf, qtype, data[e])
                    else:
                        yield hf, [(hf, torch.from_numpy(dense[e]))]
                continue
            if part == MTP and dense_in_draft(tgt) and quantized:
                yield tgt.hf, [(tgt.hf, _draft_embedding(t, dtype, *tp))]
            elif tgt.how == names.DENSE or (quantized and not tgt.hf.endswith(".weight")):
                yield tgt.hf, [(tgt.hf, _dense_out(tgt, torch.from_numpy(_dense(t)), dtype))]
            elif quantized:
                yield tgt.hf, _quant_pair(tgt.hf, qtype, np.asarray(t.data))
            else:
                yield tgt.hf, [(tgt.hf, _float(t))]
    if kv_b:
        layer, parts = next(iter(kv_b.items()))
        missing = "attn_v_b" if names.KV_B_K in parts else "attn_k_b"
        raise GgufError(f"blk.{layer}.{missing}.weight is missing: kv_b_proj of layer {layer} needs both halves")


def _dense_out(tgt: names.Target, dense, dtype):
    """A dequantized tensor goes out in float32, so vLLM's loader rounds it once, to its parameter's dtype
    (GLM-5's router is float32 while the model is bf16: rounding to the model dtype here would lose its
    precision). The one exception is the draft's embedding, always a model-dtype parameter and large (vocab x
    hidden): it goes in the model dtype, the same values."""
    return dense.to(dtype) if dense_in_draft(tgt) else dense


VOCAB_PADDING = 64  # vLLM's VocabParallelEmbedding pads the vocabulary to a multiple of this, then splits it


def _draft_embedding(t, dtype, rank: int, size: int):
    """The draft's embedding, dense, full shape, with only ``rank``'s vocabulary rows filled: vLLM narrows it to
    exactly those rows, and the rest of the (vocab x hidden) tensor is never written, so never resident. The
    whole table dequantized on every rank was 3.8 GB of float32 per rank at GLM-5's size."""
    import gguf
    import torch

    data = np.asarray(t.data)
    vocab = data.shape[0]
    padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
    per = padded // size
    start, end = min(rank * per, vocab), min((rank + 1) * per, vocab)
    out = torch.empty((vocab, int(t.shape[0])), dtype=dtype)
    step = 4096  # rows at a time: the float32 intermediate stays small
    for r in range(start, end, step):
        rows = gguf.quants.dequantize(data[r:min(r + step, end)], t.tensor_type)
        out[r:r + rows.shape[0]] = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)).to(dtype)
    return out


def _canonical(units: Iterator[tuple[str, list]]) -> Iterator:
    """Hold a fused shard until the shards before it (canonical order) have gone out."""
    pending: dict[str, dict[int, list]] = {}
    nxt: dict[str, int] = {}
    for hf, unit in units:
        slot = names.fused_slot(hf)
        if slot is None:
            yield from unit
            continue
        group, pos, size = slot
        pending.setdefault(group, {})[pos] = unit
        while nxt.get(group, 0) in pending[group]:
            yield from pending[group].pop(nxt.get(group, 0))
            nxt[group] = nxt.get(group, 0) + 1
        if nxt.get(group) == size:
            del pending[group], nxt[group]
    for group, held in pending.items():
        if held:
            want = names.FUSED[group.rsplit(".", 2)[-2]][nxt.get(group, 0)]
            raise GgufError(f"{group}: the file has a later shard but not {want!r}; the fused projection "
                            "cannot be built")


def _quant_pair(hf: str, qtype, data: np.ndarray) -> list:
    import torch

    base = hf.removesuffix(".weight")
    return [(f"{base}.qweight_type", torch.tensor(int(qtype))),
            (f"{base}.qweight", torch.from_numpy(data))]  # a view of the mapped file: see _mapped


def _dense(t) -> np.ndarray:
    """float32 in numpy (checkpoint) shape."""
    import gguf

    if t.tensor_type.name in FLOAT_TYPES:
        return np.asarray(_float(t).float().numpy())
    return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)


def _float(t):
    import torch

    data = np.asarray(t.data)
    if t.tensor_type.name == "BF16":  # gguf-py hands BF16 over as raw uint16/uint8
        return torch.from_numpy(data.view(np.uint16).copy()).view(torch.bfloat16).reshape(data.shape[:-1] + (-1,))
    return torch.from_numpy(data.copy())
