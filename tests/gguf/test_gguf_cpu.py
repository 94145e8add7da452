"""GLM-5 GGUF support on the CPU: names against gguf-py, split discovery, metadata -> config, MTP detection,
the weight stream (values, canonical fused order), the kernel check and the serving plan."""
import json

import numpy as np
import pytest

from conftest import installed, needs_gguf
from fastcomm_vllm import gguf as fg
from fastcomm_vllm.gguf import files, metadata, names

pytestmark = needs_gguf


# ---- names ----------------------------------------------------------------------------------------------

def test_mapping_covers_gguf_py_glm_dsa_tensors():
    import gguf

    listed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.GLM_DSA]}
    ours = {f"blk.{{bid}}.{k.rsplit('.', 1)[0]}" for k in names.BLOCK} | {k.rsplit(".", 1)[0] for k in names.GLOBAL}
    assert ours <= listed, sorted(ours - listed)
    # What gguf-py lists for glm-dsa that a GLM-5 conversion never writes: the unsplit / non-LoRA MLA forms
    # (GLM-5 has q_lora and llama.cpp splits kv_b) and rope tables llama.cpp computes itself.
    not_written = {"blk.{bid}.attn_q", "blk.{bid}.attn_kv_b", "rope_freqs", "blk.{bid}.attn_rot_embd"}
    assert listed - ours == not_written


def test_join_kv_b_inverts_llama_cpp_split():
    import torch

    heads, nope, v, lora = 3, 5, 4, 7
    kv_b = torch.arange(heads * (nope + v) * lora, dtype=torch.float32).reshape(heads * (nope + v), lora)
    k_b, v_b = names.split_kv_b(kv_b, heads, nope, v)
    assert tuple(k_b.shape) == (heads, lora, nope) and tuple(v_b.shape) == (heads, v, lora)
    assert torch.equal(names.join_kv_b(k_b, v_b), kv_b)
    # swapping the halves' roles is not silently accepted as the same tensor
    with pytest.raises(ValueError):
        names.join_kv_b(v_b, k_b)


def test_fused_slots_are_canonical():
    assert names.fused_slot("model.layers.3.self_attn.q_a_proj.weight") == (
        "model.layers.3.self_attn.fused_qkv_a_proj.weight", 0, 2)
    assert names.fused_slot("model.layers.3.self_attn.kv_a_proj_with_mqa.weight")[1] == 1
    assert names.fused_slot("model.layers.3.self_attn.indexer.weights_proj.weight")[1] == 1
    assert names.fused_slot("model.layers.3.mlp.shared_experts.up_proj.weight")[1] == 1
    assert names.fused_slot("model.layers.3.mlp.experts.7.up_proj.weight") is None  # placed by name (w1/w3)
    assert names.fused_slot("model.layers.3.self_attn.o_proj.weight") is None


# ---- files ----------------------------------------------------------------------------------------------

def test_split_discovery(tiny, tmp_path):
    first, _, _ = tiny
    shards = sorted(first.parent.glob("*.gguf"))
    assert len(shards) == 3
    for given in (first, shards[1], first.parent):
        assert files.discover(str(given)).shards == tuple(shards)
    # a missing shard is named
    part = tmp_path / "part"
    part.mkdir()
    for s in (shards[0], shards[2]):
        (part / s.name).symlink_to(s)
    with pytest.raises(fg.GgufError, match=shards[1].name + " is missing"):
        files.discover(str(part / shards[0].name))
    with pytest.raises(fg.GgufError, match="does not exist"):
        files.discover(str(tmp_path / "nope.gguf"))
    # two models in one folder: ask which
    (part / "other.gguf").write_bytes(b"")
    with pytest.raises(fg.GgufError, match="holds 2 GGUF models"):
        files.discover(str(part))


def test_shard_metadata_must_agree(tiny, tmp_path):
    first, _, _ = tiny
    shards = sorted(first.parent.glob("*.gguf"))
    # shard 3's file under shard 2's name: its split.no gives it away
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / shards[0].name).symlink_to(shards[0])
    (bad / shards[1].name).symlink_to(shards[2])
    (bad / shards[2].name).symlink_to(shards[2])
    with pytest.raises(fg.GgufError, match="says it is shard 3 of 3"):
        metadata.read(files.discover(str(bad)))


def test_is_gguf(tiny, tmp_path):
    first, _, _ = tiny
    assert fg.is_gguf(str(first)) and fg.is_gguf(str(first.parent)) and fg.is_gguf("x/y-00001-of-00002.gguf")
    (tmp_path / "config.json").write_text("{}")
    assert not fg.is_gguf(str(tmp_path)) and not fg.is_gguf("zai-org/GLM-5")


# ---- metadata -------------------------------------------------------------------------------------------

# Fields vLLM's GLM-5 model (deepseek_v2 / deepseek_v32 and the MTP models) reads from the config.
VLLM_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
               "num_nextn_predict_layers", "num_attention_heads", "num_key_value_heads", "q_lora_rank",
               "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_routed_experts",
               "n_shared_experts", "num_experts_per_tok", "first_k_dense_replace", "routed_scaling_factor",
               "norm_topk_prob", "n_group", "topk_group", "scoring_func", "topk_method", "hidden_act", "rms_norm_eps",
               "max_position_embeddings", "index_n_heads", "index_head_dim", "index_topk", "tie_word_embeddings",
               "rope_theta")


def test_metadata_to_config(tiny):
    from fastcomm_vllm.gguf import synth as tinyglm

    first, _, shape = tiny
    cfg = metadata.hf_config(metadata.read(files.discover(str(first))))
    want = tinyglm.hf_config(shape)
    assert {k: cfg[k] for k in VLLM_FIELDS} == {k: want[k] for k in VLLM_FIELDS}
    assert cfg["architectures"] == ["GlmMoeDsaForCausalLM"] and cfg["model_type"] == "glm_moe_dsa"
    assert cfg["eos_token_id"] == tinyglm.special_id(shape, "<|endoftext|>")


def test_derived_config_loads_in_transformers(tiny):
    transformers = pytest.importorskip("transformers")
    from fastcomm_vllm.gguf import synth as tinyglm

    first, _, shape = tiny
    plan = fg.plan(str(first))
    c = transformers.AutoConfig.from_pretrained(plan.config_dir)
    assert type(c).__name__ == "GlmMoeDsaConfig"
    assert (c.num_hidden_layers, c.num_nextn_predict_layers, c.kv_lora_rank, c.index_head_dim) == (
        shape.layers, 1, shape.kv_lora, shape.index_dim)
    tok = transformers.AutoTokenizer.from_pretrained(plan.config_dir)
    ids = tok("hello <|user|>").input_ids
    assert tinyglm.special_id(shape, "<|user|>") in ids and all(0 <= i < shape.vocab for i in ids)  # the special token stays whole


def test_mtp_detection(tiny, tiny_no_mtp, tmp_path):
    from fastcomm_vllm.gguf import synth as tinyglm

    assert metadata.mtp_layers(metadata.read(files.discover(str(tiny[0])))) == 1
    assert metadata.mtp_layers(metadata.read(files.discover(str(tiny_no_mtp[0])))) == 0
    # the key says 1 but the converter dropped the block's tensors: no MTP
    first, _ = tinyglm.write_gguf(tmp_path, tinyglm.Shape(), shards=1, mtp_tensors=False)
    meta = metadata.read(files.discover(str(first)))
    assert meta.get("{arch}.nextn_predict_layers") == 1 and metadata.mtp_layers(meta) == 0


# ---- the weight stream ----------------------------------------------------------------------------------

def _stream(first, part=None, main_layers=None):
    import torch

    from fastcomm_vllm.gguf import weights

    return list(weights.iter_weights(files.discover(str(first)), torch.float32, part, main_layers))


def test_stream_values_match_truth(tiny):
    import gguf
    import torch

    first, truth, shape = tiny
    out = _stream(first)
    got = {}
    for n, t in out:
        assert n not in got, f"{n} streamed twice"
        got[n] = t
    base = {n.removesuffix(".qweight").removesuffix(".qweight_type") + ".weight" if ".qweight" in n else n
            for n in got}
    assert base == set(truth), (sorted(base - set(truth)), sorted(set(truth) - base))
    for name, want in truth.items():
        if name in got:  # handed over dense: equal to the truth
            np.testing.assert_allclose(got[name].numpy(), want, rtol=0, atol=1e-6, err_msg=name)
        else:            # quantized: the blocks, whose dequantization is the truth
            b = name.removesuffix(".weight")
            qtype = gguf.GGMLQuantizationType(int(got[b + ".qweight_type"]))
            deq = gguf.quants.dequantize(got[b + ".qweight"].numpy(), qtype)
            np.testing.assert_allclose(deq, want, rtol=0, atol=0, err_msg=name)
    assert got["model.layers.0.self_attn.kv_b_proj.weight"].shape == (shape.heads * (shape.qk_nope + shape.v_head),
                                                                     shape.kv_lora)
    assert got["model.layers.0.self_attn.kv_b_proj.weight"].dtype == torch.float32


def test_stream_puts_fused_shards_in_canonical_order(tiny):
    import gguf

    first, _, shape = tiny
    in_file = [t.name for p in files.discover(str(first)).shards for t in gguf.GGUFReader(p).tensors]
    order = [n for n, _ in _stream(first)]
    for layer in range(shape.layers + 1):
        pairs = ((f"blk.{layer}.attn_kv_a_mqa.weight", f"blk.{layer}.attn_q_a.weight",
                  f"model.layers.{layer}.self_attn.q_a_proj.qweight", f"model.layers.{layer}.self_attn.kv_a_proj_with_mqa.qweight"),
                 (f"blk.{layer}.indexer.proj.weight", f"blk.{layer}.indexer.attn_k.weight",
                  f"model.layers.{layer}.self_attn.indexer.wk.weight", f"model.layers.{layer}.self_attn.indexer.weights_proj.weight"))
        for file_first, file_second, canon_first, canon_second in pairs:
            assert in_file.index(file_first) < in_file.index(file_second)   # llama.cpp's order: reversed
            assert order.index(canon_first) < order.index(canon_second)     # what vLLM receives: canonical


def test_stream_parts(tiny):
    first, _, shape = tiny
    main = {n for n, _ in _stream(first, "main", shape.layers)}
    mtp = {n for n, _ in _stream(first, "mtp", shape.layers)}
    assert not any(n.startswith(f"model.layers.{shape.layers}.") for n in main)
    assert all(n.startswith(f"model.layers.{shape.layers}.") or n.startswith("model.embed_tokens") for n in mtp)
    # the draft's embedding goes dense (vLLM's generic MTP model builds it unquantized)
    assert "model.embed_tokens.weight" in mtp and f"model.layers.{shape.layers}.embed_tokens.weight" in mtp
    assert "model.embed_tokens.qweight" in main


def test_unknown_tensor_is_named(tmp_path):
    from fastcomm_vllm.gguf import synth as tinyglm

    first, _ = tinyglm.write_gguf(tmp_path, tinyglm.Shape(), shards=1,
                                  extra=(("blk.0.attn_sinks.weight", np.zeros(16, np.float32)),))
    with pytest.raises(fg.GgufError, match="'blk.0.attn_sinks.weight' has no place"):
        _stream(first)


# ---- kernels --------------------------------------------------------------------------------------------

def test_kernel_status_says_why(monkeypatch, tmp_path):
    from fastcomm_vllm.gguf import kernels

    monkeypatch.setenv("VLLM_GGUF_USE_CUDA", "0")
    st = kernels.status()
    assert not st.cuda and "VLLM_GGUF_USE_CUDA" in st.detail and "Triton" in st.warning()
    monkeypatch.delenv("VLLM_GGUF_USE_CUDA")
    fake = tmp_path / "vllm_gguf_plugin"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "_C_gguf.abi3.so").write_bytes(b"not an ELF file")
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    importlib.invalidate_caches()
    monkeypatch.delitem(__import__("sys").modules, "vllm_gguf_plugin", raising=False)
    monkeypatch.delitem(__import__("sys").modules, "vllm_gguf_plugin._C_gguf", raising=False)
    st = kernels.status()
    assert not st.cuda and "does not load" in st.detail, st


# ---- the plan (what fastcomm-serve and bench-decode use) --------------------------------------------------

@pytest.fixture()
def plugin_present(monkeypatch):
    if not installed("vllm_gguf_plugin"):
        pytest.skip("needs vllm-gguf-plugin")


def test_plan_mtp_choices(tiny, tiny_no_mtp, plugin_present):
    first, _, shape = tiny
    auto = fg.plan(str(first))
    assert auto.mtp and auto.kwargs["speculative_config"] == {
        "method": "mtp", "num_speculative_tokens": 1, "model": str(first), "quantization": "gguf"}
    assert any("MTP on" in n and "default" in n for n in auto.notes)
    off = fg.plan(str(first), mtp=False)
    assert not off.mtp and "speculative_config" not in off.kwargs and "MTP off (--no-mtp)" in off.notes
    three = fg.plan(str(first.parent), mtp=True, num_speculative_tokens=3)
    assert three.kwargs["speculative_config"]["num_speculative_tokens"] == 3 and three.kwargs["model"] == str(first)
    none = fg.plan(str(tiny_no_mtp[0]))
    assert not none.mtp and any("no MTP block" in n for n in none.notes)
    with pytest.raises(fg.GgufError, match="MTP requested, but .* has no MTP block"):
        fg.plan(str(tiny_no_mtp[0]), mtp=True)
    kw = fg.engine_kwargs(str(first), mtp=False, tokenizer="zai-org/GLM-5")
    assert kw["tokenizer"] == "zai-org/GLM-5" and json.loads((auto.config_dir / "config.json").read_text())[
        "num_hidden_layers"] == shape.layers


def test_plan_other_architecture_passes_unchanged(tmp_path, plugin_present):
    from fastcomm_vllm.gguf import synth as tinyglm

    p = fg.plan(str(tinyglm.write_other_arch(tmp_path / "tiny-llama.gguf")))
    assert not p.glm and not p.mtp and p.kwargs == {"model": str(tmp_path / "tiny-llama.gguf"),
                                                      "quantization": "gguf", "load_format": "gguf"}
    with pytest.raises(fg.GgufError, match="MTP needs a GLM-5 GGUF"):
        fg.plan(str(tmp_path / "tiny-llama.gguf"), mtp=True)


def test_missing_packages_name_the_extra(monkeypatch, tiny):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "vllm_gguf_plugin" else real(n, *a))
    with pytest.raises(fg.GgufError, match=r'vllm-gguf-plugin is not installed.*pip install -e "\.\[gguf\]"'):
        fg.plan(str(tiny[0]))


@needs_gguf
def test_benchmark_model_is_the_shipped_config_as_gguf(tmp_path):
    """The full-width benchmark file has the shapes of bench/models/glm5-78L-16E (so GGUF and FP8 rows serve
    the same model), and its truth-less fast mode writes the same tensors as the tested mode."""
    import dataclasses
    import json

    from fastcomm_vllm.gguf import synth as g
    from fastcomm_bench.decode_models import SHIPPED_DIR

    shipped = json.loads((SHIPPED_DIR / "glm5-78L-16E" / "config.json").read_text())
    ours = g.hf_config(g.FULL)
    keys = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "first_k_dense_replace", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok", "index_topk",
            "index_head_dim", "index_n_heads")
    assert {k: ours[k] for k in keys} == {k: shipped[k] for k in keys}
    small = dataclasses.replace(g.Shape(), layers=3)
    full, truth = g.build(small, truth=True)
    fast, none = g.build(small, truth=False)
    assert none == {} and truth
    assert [(n, a.shape, a.dtype, q) for n, a, q in full] == [(n, a.shape, a.dtype, q) for n, a, q in fast]
    experts = [a for n, a, q in fast if n.endswith("ffn_up_exps.weight")]
    assert len(experts) == 3 and all(e is experts[0] for e in experts)  # 2 MoE layers + MTP; shared bytes: the 41 GB file writes at disk speed
