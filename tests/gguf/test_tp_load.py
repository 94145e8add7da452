"""Tensor parallel 2, 4 and 8 on CPU ranks: N gloo processes each load the tiny GLM-5 GGUF (block-aligned as
GLM-5's is at TP 8) into vLLM's real GLM-5 and MTP models, and every parameter on every rank must equal the
file's slice for that rank, computed here from the file with gguf-py alone: byte for byte for quantized
tensors, value for value for dequantized ones, the MTP block included.

The expectation below is written from vLLM's sharding (DeepSeek-V2 layers: which linears are column- or
row-parallel, how the vocabulary is padded) and shares nothing with fastcomm_vllm.gguf.names or .shards, so a
mistake there cannot cancel out here. A swapped-rank control (rank 1's dump checked as rank 0's) must fail.
"""
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import installed, needs_gguf

pytestmark = [needs_gguf, pytest.mark.vllm,
              pytest.mark.skipif(not (installed("vllm") and installed("vllm_gguf_plugin")),
                                 reason="needs vLLM and vllm-gguf-plugin")]

WORKER = Path(__file__).with_name("tp_load_worker.py")
DEADLINE_S = 900


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(world: int, first: Path, config_dir: Path, out: Path, *extra: str) -> None:
    """WORLD rank processes, joined with a deadline; leftovers killed; a failing rank's stderr shown."""
    out.mkdir(parents=True, exist_ok=True)
    port = str(_free_port())
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}
    logs = [open(out / f"rank{r}.log", "w+") for r in range(world)]
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), port, str(first), str(config_dir),
                               str(out), *extra], stdout=logs[r], stderr=subprocess.STDOUT, env=env) for r in range(world)]
    deadline = time.monotonic() + DEADLINE_S
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = [r for r, p in enumerate(procs) if p.returncode != 0]
    if bad:
        logs[bad[0]].seek(0)
        pytest.fail(f"TP {world}: rank(s) {bad} failed or passed the {DEADLINE_S} s deadline; rank {bad[0]}:\n"
                    + logs[bad[0]].read()[-4000:])
    for f in logs:
        f.close()


# ---- the file's slice for a rank, from gguf-py alone ------------------------------------------------------

class File:
    def __init__(self, first: Path):
        import gguf

        folder = first.parent
        self.tensors = {}
        for p in sorted(folder.glob("*.gguf")):
            for t in gguf.GGUFReader(p).tensors:
                self.tensors[t.name] = t

    def raw(self, name: str) -> np.ndarray:
        return np.asarray(self.tensors[name].data)

    def type(self, name: str) -> int:
        return int(self.tensors[name].tensor_type)

    def quantized(self, name: str) -> bool:
        return self.tensors[name].tensor_type.name not in ("F32", "F16", "BF16")

    def dense(self, name: str) -> np.ndarray:
        import gguf

        t = self.tensors[name]
        if not self.quantized(name):
            return np.asarray(t.data, dtype=np.float32)
        return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)


def _rows(a, rank, world):
    n = a.shape[0] // world
    assert n * world == a.shape[0]
    return a[rank * n:(rank + 1) * n]


def _cols(a, rank, world):
    n = a.shape[-1] // world
    assert n * world == a.shape[-1]
    return a[..., rank * n:(rank + 1) * n]


def _vocab(a, rank, world):
    # VocabParallelEmbedding pads the vocabulary to a multiple of 64, then splits it evenly; the tiny
    # vocabulary (1024) is a multiple of 64 x 8, so each rank's rows are an even share with no padding.
    assert a.shape[0] % (64 * world) == 0
    return _rows(a, rank, world)


def _join_kv_b(k_b, v_b):
    """kv_b_proj rows per head: the head's k rows (attn_k_b stored transposed), then its v rows."""
    heads = k_b.shape[0]
    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(heads * (k_b.shape[2] + v_b.shape[1]), -1)


COLUMN, ROW, WHOLE, VOCAB = "column", "row", "whole", "vocab"


def _split(a, how, rank, world):
    return {COLUMN: _rows, ROW: _cols, VOCAB: _vocab}[how](a, rank, world) if how != WHOLE else a


def expected(f: File, layers: int, rank: int, world: int) -> dict[str, dict]:
    """{vLLM parameter: what it must hold on ``rank``} for the main model ("main:...") and the MTP model
    ("mtp:..."). Each value: {"quant": [(gguf tensor, split)], "fused": bool} for a quantized weight (and its
    qweight_type), {"dense": array} for a dense one."""
    out = {}

    def quant(key, parts, fused=False):
        out[key + ".qweight"] = {"quant": parts, "fused": fused}
        out[key + ".qweight_type"] = {"types": [f.type(n) for n, _ in parts], "fused": fused}

    def weight(key, name, how):  # quantized in the file: qweight + type; float: a dense parameter
        if f.quantized(name):
            quant(key, [(name, how)])
        else:
            out[key + ".weight"] = {"dense": _split(f.dense(name), how, rank, world)}

    def dense(key, array):
        out[key] = {"dense": array}

    def block(prefix, b):
        g = f"blk.{b}."
        a = prefix + "self_attn."
        quant(a + "fused_qkv_a_proj", [(g + "attn_q_a.weight", WHOLE), (g + "attn_kv_a_mqa.weight", WHOLE)], True)
        dense(a + "q_a_layernorm.weight", f.dense(g + "attn_q_a_norm.weight"))
        dense(a + "kv_a_layernorm.weight", f.dense(g + "attn_kv_a_norm.weight"))
        weight(a + "q_b_proj", g + "attn_q_b.weight", COLUMN)
        dense(a + "kv_b_proj.weight", _rows(_join_kv_b(f.dense(g + "attn_k_b.weight"), f.dense(g + "attn_v_b.weight")),
                                            rank, world))
        weight(a + "o_proj", g + "attn_output.weight", ROW)
        weight(a + "indexer.wq_b", g + "indexer.attn_q_b.weight", WHOLE)
        dense(a + "indexer.wk_weights_proj.weight",
              np.concatenate([f.dense(g + "indexer.attn_k.weight"), f.dense(g + "indexer.proj.weight")]))
        dense(a + "indexer.k_norm.weight", f.dense(g + "indexer.k_norm.weight"))
        dense(a + "indexer.k_norm.bias", f.dense(g + "indexer.k_norm.bias"))
        dense(prefix + "input_layernorm.weight", f.dense(g + "attn_norm.weight"))
        dense(prefix + "post_attention_layernorm.weight", f.dense(g + "ffn_norm.weight"))
        m = prefix + "mlp."
        if g + "ffn_gate.weight" in f.tensors:
            quant(m + "gate_up_proj", [(g + "ffn_gate.weight", COLUMN), (g + "ffn_up.weight", COLUMN)], True)
            weight(m + "down_proj", g + "ffn_down.weight", ROW)
            return
        dense(m + "gate.weight", f.dense(g + "ffn_gate_inp.weight"))
        dense(m + "gate.e_score_correction_bias", f.dense(g + "exp_probs_b.bias"))
        quant(m + "shared_experts.gate_up_proj",
              [(g + "ffn_gate_shexp.weight", COLUMN), (g + "ffn_up_shexp.weight", COLUMN)], True)
        weight(m + "shared_experts.down_proj", g + "ffn_down_shexp.weight", ROW)
        out[m + "experts.w13_qweight"] = {"experts13": (g + "ffn_gate_exps.weight", g + "ffn_up_exps.weight")}
        out[m + "experts.w2_qweight"] = {"experts2": g + "ffn_down_exps.weight"}
        out[m + "experts.w13_qweight_type"] = {"types": [f.type(g + "ffn_gate_exps.weight")] * 2, "experts": True}
        out[m + "experts.w2_qweight_type"] = {"types": [f.type(g + "ffn_down_exps.weight")], "experts": True}

    for b in range(layers):
        block(f"main:model.layers.{b}.", b)
    weight("main:model.embed_tokens", "token_embd.weight", VOCAB)
    dense("main:model.norm.weight", f.dense("output_norm.weight"))
    weight("main:lm_head", "output.weight", VOCAB)
    if f"blk.{layers}.nextn.eh_proj.weight" in f.tensors:
        p, g = f"mtp:model.layers.{layers}.", f"blk.{layers}."
        block(p + "mtp_block.", layers)
        dense(p + "eh_proj.weight", f.dense(g + "nextn.eh_proj.weight"))
        dense(p + "enorm.weight", f.dense(g + "nextn.enorm.weight"))
        dense(p + "hnorm.weight", f.dense(g + "nextn.hnorm.weight"))
        dense(p + "shared_head.norm.weight", f.dense(g + "nextn.shared_head_norm.weight"))
        weight(p + "shared_head.head", g + "nextn.shared_head_head.weight", VOCAB)
        # The draft's embedding arrives dense (vLLM's MTP model builds it without a quantization method), in
        # the model's dtype (bf16): on a GPU that is its parameter's dtype; the CPU model keeps it in float32.
        import torch

        emb = torch.from_numpy(_vocab(f.dense(g + "nextn.embed_tokens.weight"), rank, world)).to(torch.bfloat16)
        dense("mtp:model.embed_tokens.weight", emb.float().numpy())
    return out


def _canonical(name: str) -> str:
    """vLLM's parameter name with its version-specific nesting of the routed experts folded away
    (newer vLLM: mlp.experts.routed_experts.w13_qweight)."""
    return re.sub(r"\.mlp\.experts\.(?:[a-z_]+\.)?(w13|w2)_", r".mlp.experts.\1_", name)


def mismatches(f: File, want: dict, got: dict, rank: int, world: int) -> list[str]:
    import torch

    bad = []
    flat = {f"{tag}:{_canonical(n)}": rec for tag, params in got.items() for n, rec in params.items()}
    unknown = sorted(set(flat) - set(want))
    missing = sorted(set(want) - set(flat))
    if unknown:
        bad.append(f"parameters the expectation does not know: {unknown[:8]}")
    if missing:
        bad.append(f"parameters not in the model: {missing[:8]}")
    for key in sorted(set(want) & set(flat)):
        w, rec = want[key], flat[key]
        data = rec["data"]
        if "dense" in w:
            exp = torch.from_numpy(np.array(w["dense"])).to(data.dtype)
            if tuple(exp.shape) != tuple(data.shape) or not torch.equal(exp, data):
                bad.append(f"{key}: dense values differ from the file's slice")
        elif "types" in w:
            got_types = list(rec.get("types", {}).values()) if w.get("fused") else [rec["type"]]
            if w.get("experts"):
                got_types = [rec["type"]] * len(w["types"]) if not rec.get("types") else list(rec["types"].values())
            if got_types != w["types"]:
                bad.append(f"{key}: GGML types {got_types}, file {w['types']}")
        elif "quant" in w:
            parts = [_split(f.raw(n), how, rank, world) for n, how in w["quant"]]
            arr = data.numpy()
            if w["fused"]:
                offsets = rec.get("offsets", {})
                if len(offsets) != len(parts):
                    bad.append(f"{key}: {len(offsets)} shards held, {len(parts)} in the file")
                    continue
                for i, part in enumerate(parts):
                    start, end, size = offsets[str(i)]
                    if not np.array_equal(arr[start:end, :size], part) or np.any(arr[start:end, size:]):
                        bad.append(f"{key}: shard {i} bytes differ from the file's slice")
            elif not (arr.shape == parts[0].shape and np.array_equal(arr, parts[0])):
                bad.append(f"{key}: bytes differ from the file's slice ({arr.shape} vs {parts[0].shape})")
        elif "experts13" in w:
            gate, up = (f.raw(n) for n in w["experts13"])
            exp = np.concatenate([_rows(gate.transpose(1, 0, 2), rank, world),
                                  _rows(up.transpose(1, 0, 2), rank, world)]).transpose(1, 0, 2)
            if not (data.shape == exp.shape and np.array_equal(data.numpy(), exp)):
                bad.append(f"{key}: routed experts' gate/up bytes differ from the file's slice")
        elif "experts2" in w:
            exp = _cols(f.raw(w["experts2"]), rank, world)
            if not (data.shape == exp.shape and np.array_equal(data.numpy(), exp)):
                bad.append(f"{key}: routed experts' down bytes differ from the file's slice")
    return bad


@pytest.fixture(scope="module")
def file_and_config(tiny):
    from fastcomm_vllm import gguf as fg

    first, _, shape = tiny
    return first, fg.plan(str(first), tensor_parallel_size=8).config_dir, shape


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_rank_holds_its_slice_of_the_file(world, file_and_config, tmp_path):
    import torch

    first, config_dir, shape = file_and_config
    _run_ranks(world, first, config_dir, tmp_path)
    f = File(first)
    dumps = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for rank in range(world):
        want = expected(f, shape.layers, rank, world)
        bad = mismatches(f, want, dumps[rank], rank, world)
        assert bad == [], f"TP {world} rank {rank}: " + "; ".join(bad[:12])
    # Negative control: rank 1's parameters checked as rank 0's must fail (a split weight differs by rank).
    control = mismatches(f, expected(f, shape.layers, 0, world), dumps[1], 0, world)
    assert any("o_proj" in m for m in control) and any("gate_up_proj" in m for m in control), control[:6]
    stats = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert all(s["load_s"]["main"] > 0 for s in stats)
    # The stand-in's sites, counted on the model vLLM built at this TP: each layer's o_proj and its MLP or MoE
    # block, plus the embedding (GLM-5: 2 x 78 + 1 = 157); the MTP model's one block and its embedding.
    sites = [s["standin_sites"] for s in stats]
    assert sites == [{"main": 2 * shape.layers + 1, "mtp": 3}] * world, sites
