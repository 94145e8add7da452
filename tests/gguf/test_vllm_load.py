"""fastcomm's GLM-5 weight stream into vLLM's own GLM-5 and MTP models (built on the CPU from the tiny
config, with vllm-gguf-plugin's quantization config): every GGUF tensor lands in exactly one parameter of
the model that loads it, every parameter is filled, and the fused projections hold their shards in
canonical order -- which a swapped control run must break."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import installed, needs_gguf

pytestmark = [needs_gguf, pytest.mark.vllm,
              pytest.mark.skipif(not (installed("vllm") and installed("vllm_gguf_plugin")),
                                 reason="needs vLLM and vllm-gguf-plugin")]

WORKER = Path(__file__).with_name("vllm_load_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load(first, config_dir, out, swap=False, env=None):
    import json

    env = {**os.environ, "PORT": str(_free_port()), "VLLM_LOGGING_LEVEL": "WARNING", **(env or {})}
    argv = [sys.executable, str(WORKER), str(first), str(config_dir), str(out)] + (["swap"] if swap else [])
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(Path(out).read_text())


@pytest.fixture(scope="module")
def loaded(tiny, tmp_path_factory):
    from fastcomm_vllm import gguf as fg

    first, truth, shape = tiny
    plan = fg.plan(str(first))
    d = tmp_path_factory.mktemp("load")
    # The load also serves a forms table (FASTCOMM_GGUF_FORMS) for two of the file's shapes: test_measured_forms_*.
    table = d / "forms.json"
    _dump_forms(first, shape, table)
    return (_load(first, plan.config_dir, d / "ok.json", env={"FASTCOMM_GGUF_FORMS": str(table)}),
            _load(first, plan.config_dir, d / "swap.json", swap=True))


# The forms the table above gives o_proj and the routed experts at each token count ("": the rule's). Forms every
# layer may take (no tensor-core form: whether the tiny shapes allow one is the pure policy's, test_kquant_forms).
O_PROJ_FORMS = ["unstaged", "staged", "", "unstaged", "", "", "", "staged"]
EXPERT_FORMS = ["pairs", "", "staged", "", "", "", "", "pairs"]


def _dump_forms(first, shape, path):
    """A forms table keyed by the file's own o_proj and routed experts (types and sizes as the GGUF holds them)."""
    import gguf

    from fastcomm.kquant import forms
    from fastcomm_vllm.gguf import files

    tensors = {t.name: t for p in files.discover(str(first)).shards for t in gguf.GGUFReader(p).tensors}
    layer = shape.dense  # the first MoE layer, whose o_proj is like every other's
    out = tensors[f"blk.{layer}.attn_output.weight"]
    cols, rows = (int(n) for n in out.shape[:2])  # ggml's order: the row's length first
    up, down = tensors[f"blk.{layer}.ffn_up_exps.weight"], tensors[f"blk.{layer}.ffn_down_exps.weight"]

    def entry(shape_, names):
        return forms.Entry(shape_, tuple(names))

    table = forms.Table("any GPU", "tests/gguf/test_vllm_load.py", (
        entry(forms.LinearShape((int(out.tensor_type),), (rows,), cols), O_PROJ_FORMS),
        entry(forms.MoeShape(int(up.tensor_type), int(down.tensor_type), shape.hidden, shape.moe_ffn, shape.top_k),
              EXPERT_FORMS)))
    forms.dump(table, path)


def _row_sums(first, gguf_names):
    import gguf

    from fastcomm_vllm.gguf import files

    want = {}
    for p in files.discover(str(first)).shards:
        for t in gguf.GGUFReader(p).tensors:
            if t.name in gguf_names:
                want[t.name] = np.asarray(t.data).astype(np.float64).sum(axis=1)
    return np.concatenate([want[n] for n in gguf_names])


def test_every_tensor_to_exactly_one_parameter_and_every_parameter_filled(loaded):
    report, _ = loaded
    for tag, m in report["models"].items():
        assert m["params"], tag
        assert sorted(set(m["params"]) - set(m["loaded"])) == [], f"{tag}: parameters left unfilled"
        streamed = [n for t, n in report["stream"] if t == tag]
        assert len(streamed) == len(set(streamed)), f"{tag}: a tensor streamed twice"
        assert [n for n in streamed if n not in m["fed"]] == [], f"{tag}: tensors no parameter took"
        assert {n: ps for n, ps in m["fed"].items() if len(ps) != 1} == {}, f"{tag}: a tensor went to 2 parameters"
    assert report["models"]["main"]["arch"] == "GlmMoeDsaForCausalLM"
    assert "MTP" in report["models"]["mtp"]["arch"]


def test_fused_projections_hold_canonical_shard_order(loaded, tiny):
    report, swapped = loaded
    first, _, shape = tiny
    fused = report["models"]["main"]["fused"]
    for layer in range(shape.layers):
        f = fused[f"model.layers.{layer}.self_attn.fused_qkv_a_proj"]
        assert f["offsets"]["0"][:2] == [0, shape.q_lora]                       # q_a first ...
        assert f["offsets"]["1"][:2] == [shape.q_lora, shape.q_lora + shape.kv_lora + shape.rope]  # ... then kv_a
        want = _row_sums(first, [f"blk.{layer}.attn_q_a.weight", f"blk.{layer}.attn_kv_a_mqa.weight"])
        np.testing.assert_array_equal(np.array(f["sum_rows"]), want)
    dense_gate_up = fused["model.layers.0.mlp.gate_up_proj"]
    np.testing.assert_array_equal(np.array(dense_gate_up["sum_rows"]),
                                  _row_sums(first, ["blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"]))
    mtp = report["models"]["mtp"]["fused"][f"model.layers.{shape.layers}.mtp_block.self_attn.fused_qkv_a_proj"]
    np.testing.assert_array_equal(np.array(mtp["sum_rows"]), _row_sums(
        first, [f"blk.{shape.layers}.attn_q_a.weight", f"blk.{shape.layers}.attn_kv_a_mqa.weight"]))
    # Negative control: layer 0's q_a and kv_a handed over under each other's names. The plugin loads it
    # without a word (it narrows kv_a's 576 rows to q_a's 256 and keeps q_a's 256 as the second shard),
    # so only a check like this one sees it.
    bad = swapped["models"]["main"]["fused"]["model.layers.0.self_attn.fused_qkv_a_proj"]
    want = _row_sums(first, ["blk.0.attn_q_a.weight", "blk.0.attn_kv_a_mqa.weight"])
    got = np.array(bad["sum_rows"])
    assert got.shape != want.shape or not np.array_equal(got, want)


def _file_types(first) -> dict[str, int]:
    import gguf

    from fastcomm_vllm.gguf import files

    return {t.name: int(t.tensor_type) for p in files.discover(str(first)).shards for t in gguf.GGUFReader(p).tensors}


def test_decode_kernel_plans_after_loading(loaded, tiny):
    """fastcomm's K-quant decode kernels (kquant_vllm) decide per layer after vLLM's loading: every GGUF layer
    went through the hook; the mixed-type fused_qkv_a_proj is read as two segments in the plugin's stored
    order and types (q_a's then kv_a's rows, as the file's types); routed experts, o_proj and the LM head
    take the kernels."""
    report, _ = loaded
    first, _, shape = tiny
    types = _file_types(first)
    m = report["models"]["main"]
    plans = m["kq_plans"]
    assert plans and "absent" not in plans.values(), [k for k, v in plans.items() if v == "absent"]
    for layer in range(shape.layers):
        offsets = m["fused"][f"model.layers.{layer}.self_attn.fused_qkv_a_proj"]["offsets"]
        want = [[types[f"blk.{layer}.attn_q_a.weight"], offsets["0"][0], offsets["0"][1] - offsets["0"][0]],
                [types[f"blk.{layer}.attn_kv_a_mqa.weight"], offsets["1"][0], offsets["1"][1] - offsets["1"][0]]]
        assert want[0][0] != want[1][0]  # the file mixes types here, the case the segments exist for
        assert plans[f"model.layers.{layer}.self_attn.fused_qkv_a_proj"] == want
        assert isinstance(plans[f"model.layers.{layer}.self_attn.o_proj"], list)
    moe = [k for k in plans if ".mlp.experts" in k]  # vLLM >= 0.3x: mlp.experts.routed_experts
    assert len(moe) == shape.layers - shape.dense and all(plans[k] is True for k in moe), moe
    assert all(v is not None for v in plans.values()), [k for k, v in plans.items() if v is None]
    assert plans["lm_head"] == [[types["output.weight"], 0, shape.vocab]]


def test_dense_parameters_hold_the_truth(loaded, tiny):
    report, _ = loaded
    _, truth, shape = tiny

    def check(dense, name, arrays):
        want = np.concatenate([a.astype(np.float64).ravel() for a in arrays])
        got_sum, got_sq = dense[name]
        assert got_sq == pytest.approx(float(np.square(want).sum()), rel=1e-2), name   # bf16 storage
        assert got_sum == pytest.approx(float(want.sum()), abs=1e-2 * np.sqrt(float(np.square(want).sum()))), name

    main = report["models"]["main"]["dense"]
    for layer in range(shape.layers):
        p = f"model.layers.{layer}.self_attn."
        check(main, p + "kv_b_proj.weight", [truth[p + "kv_b_proj.weight"]])
        check(main, p + "indexer.wk_weights_proj.weight",
              [truth[p + "indexer.wk.weight"], truth[p + "indexer.weights_proj.weight"]])
    check(main, "model.layers.1.mlp.gate.weight", [truth["model.layers.1.mlp.gate.weight"]])
    mtp = report["models"]["mtp"]["dense"]
    m = f"model.layers.{shape.layers}."
    check(mtp, m + "eh_proj.weight", [truth[m + "eh_proj.weight"]])
    check(mtp, m + "mtp_block.self_attn.kv_b_proj.weight", [truth[m + "self_attn.kv_b_proj.weight"]])
    check(mtp, "model.embed_tokens.weight", [truth["model.embed_tokens.weight"]])


def test_engine_config_for_target_and_mtp_draft(tiny):
    """vLLM's own engine configuration of fastcomm's kwargs: the target reads the derived config and the
    GGUF weights, and the MTP draft is built from the same GGUF, quantized the same way, as the MTP model."""
    import json

    first, _, shape = tiny
    r = subprocess.run([sys.executable, str(WORKER.with_name("engine_config_worker.py")), str(first)],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    t, d = got["target"], got["draft"]
    assert t["weights"] == str(first) and t["model"] == got["kwargs"]["hf_config_path"]
    assert (t["model_type"], t["quantization"], t["layers"]) == ("glm_moe_dsa", "gguf", shape.layers)
    assert d["method"] == "mtp" and d["model"] == str(first) and d["quantization"] == "gguf" and d["k"] == 1
    assert d["model_type"] == "deepseek_mtp" and "MTP" in d["architectures"][0] and d["marker"] == "glm-dsa"


HOOKS = r'''
import json, sys
import torch
from torch import nn
sys.path.insert(0, sys.argv[1])
from fastcomm_vllm.gguf import plugin
plugin.register()
from vllm.config import model as model_module
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

gguf_file = sys.argv[2]
probe = model_module.get_hf_image_processor_config(gguf_file)

def embedding(quantized):
    e = nn.Module()
    e.register_parameter("qweight" if quantized else "weight", nn.Parameter(torch.zeros(4, 2), requires_grad=False))
    return e

def share(quantized):
    target = nn.Module(); target.model = nn.Module(); target.model.embed_tokens = embedding(quantized)
    proposer = object.__new__(SpecDecodeBaseProposer)   # vLLM's own method, without building an engine
    proposer.model = nn.Module(); proposer.model.model = nn.Module()
    proposer.model.model.embed_tokens = embedding(quantized)
    try:
        proposer._maybe_share_embeddings(target)
    except Exception as e:
        return type(e).__name__
    return proposer.model.model.embed_tokens is target.model.embed_tokens

print(json.dumps({"probe": probe, "gguf": share(True), "plain": share(False)}))
'''


def test_hooks_for_vllm_025_mtp_over_a_gguf(tiny):
    """Two vLLM paths that break the MTP draft over a GGUF file (seen on vLLM 0.25.0 on an H200): the image
    processor probe of the draft's model (the GGUF path) answers {}, and the drafter shares a GGUF-quantized
    embedding (qweight, no weight) instead of failing on its .weight."""
    import json

    first, _, _ = tiny
    r = subprocess.run([sys.executable, "-c", HOOKS, str(Path(__file__).resolve().parents[2] / "integrations" / "vllm"),
                        str(first)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["probe"] == {} and got["gguf"] is True
    assert got["plain"] != "AttributeError"  # a plain embedding still goes through vLLM's own method


def test_measured_forms_reach_the_layers_of_their_shape(loaded, tiny):
    """FASTCOMM_GGUF_FORMS=FILE: each layer whose shape (its segments' types and rows, its columns; a MoE's types,
    sizes and top-k, as vLLM's real model built them from the file) the table holds takes the table's forms,
    every other layer the rule's at every token count; the MTP block's o_proj, of the same shape, too."""
    report, swapped = loaded
    first, _, shape = tiny
    for tag in ("main", "mtp"):
        got = report["models"][tag]["kq_forms"]
        o_proj = {k: v for k, v in got.items() if k.endswith("self_attn.o_proj")}
        experts = {k: v for k, v in got.items() if ".mlp.experts" in k}
        assert o_proj and all(v == O_PROJ_FORMS for v in o_proj.values()), (tag, o_proj)
        assert experts and all(v == EXPERT_FORMS for v in experts.values()), (tag, experts)
        rest = {k: v for k, v in got.items() if k not in o_proj and k not in experts}
        assert rest and all(v == [""] * 8 for v in rest.values()), (tag, rest)
    # Without the setting (the swapped control's load) no layer has a measured form: no table ships for a CPU.
    assert all(v == [""] * 8 for v in swapped["models"]["main"]["kq_forms"].values())
    # and the worker says how many layers took the table's forms (a run's record carries it: worker_status)
    took = sum(1 for m in report["models"].values() for v in m["kq_forms"].values() if any(v))
    assert report["forms_served"] == {"tests/gguf/test_vllm_load.py": took} and swapped["forms_served"] == {}


def test_the_dp4a_setting_keeps_the_products_off_the_tensor_cores(monkeypatch):
    """FASTCOMM_GGUF_KERNELS=dp4a: the plugin hook installs fastcomm's kernels with the tensor-core forms off
    (the form each product then takes is kquant's pure policy, tested in test_kquant_policy.py)."""
    from fastcomm.kquant.settings import Settings
    from fastcomm_vllm.gguf import kquant_vllm, plugin

    try:
        for setting, want in (("dp4a", False), ("auto", True)):
            monkeypatch.setenv("FASTCOMM_GGUF_KERNELS", setting)
            plugin._decode_kernels()
            assert kquant_vllm.installed_settings().tensor_cores is want, setting
    finally:
        kquant_vllm.install(Settings())


def test_the_token_thresholds_reach_the_kernels(monkeypatch):
    """FASTCOMM_GGUF_MMA_MIN_TOKENS / _GROUPED_MIN_TOKENS move the tensor-core forms' thresholds and
    FASTCOMM_GGUF_PDL the dense one's dependent launch, FASTCOMM_GGUF_DEQUANT_* the prefill's dequantized forms,
    as far as the arguments the layers' custom ops are called with; unset, the policy's constants serve; a bad
    value is named when the plugin loads (not at the first product, inside vLLM's model) and the kernels keep
    their last setting."""
    from fastcomm import kquant
    from fastcomm.kquant.settings import Settings
    from fastcomm_vllm.gguf import kquant_vllm, plugin

    def forms():
        s = kquant_vllm.installed_settings()
        return kquant_vllm.linear_args(s), kquant_vllm.moe_args(s)

    try:
        monkeypatch.setenv("FASTCOMM_GGUF_MMA_MIN_TOKENS", "5")
        monkeypatch.setenv("FASTCOMM_GGUF_GROUPED_MIN_TOKENS", "9")
        monkeypatch.setenv("FASTCOMM_GGUF_PDL", "0")
        monkeypatch.setenv("FASTCOMM_GGUF_DEQUANT_MOE_MIN", "32")
        monkeypatch.setenv("FASTCOMM_GGUF_DEQUANT_MIN_TOKENS", "128")
        monkeypatch.setenv("FASTCOMM_GGUF_CHUNK_MAX_TOKENS", "200")
        monkeypatch.setenv("FASTCOMM_GGUF_DEQUANT_KERNEL", "plugin")
        monkeypatch.setenv("FASTCOMM_GGUF_MOE_STAGED", "0" if kquant.MOE_STAGED else "1")
        plugin._decode_kernels()
        # linear: tensor cores, mma_min, pdl, chunk_max, dequant_min, dequant kernel; MoE: tensor cores,
        # grouped_min, staged, chunk_max, dequant_moe_min, dequant kernel
        assert forms() == ((True, 5, False, 200, 128, "plugin"), (True, 9, not kquant.MOE_STAGED, 200, 32, "plugin"))
        for name in ("MMA_MIN_TOKENS", "GROUPED_MIN_TOKENS", "PDL", "DEQUANT_MIN_TOKENS", "DEQUANT_MOE_MIN",
                     "CHUNK_MAX_TOKENS", "DEQUANT_KERNEL", "MOE_STAGED"):
            monkeypatch.delenv(f"FASTCOMM_GGUF_{name}")
        plugin._decode_kernels()
        defaults = forms()
        assert defaults == ((True, kquant.MMA_MIN_TOKENS, True, 256, 16, kquant.DEQUANT_KERNEL),
                            (True, kquant.MOE_GROUPED_MIN_TOKENS, kquant.MOE_STAGED, 256, 0, kquant.DEQUANT_KERNEL))
        monkeypatch.setenv("FASTCOMM_GGUF_MMA_MIN_TOKENS", "2")
        monkeypatch.setenv("FASTCOMM_GGUF_GROUPED_MIN_TOKENS", "0")  # named, and the last setting stays
        plugin._decode_kernels()
        assert forms() == defaults
        monkeypatch.delenv("FASTCOMM_GGUF_GROUPED_MIN_TOKENS")
        monkeypatch.setenv("FASTCOMM_GGUF_PDL", "maybe")  # named, and the last setting stays
        plugin._decode_kernels()
        assert forms() == defaults
    finally:
        kquant_vllm.install(Settings())


def test_the_prefill_dequantized_forms_find_what_they_call():
    """kquant_vllm.dequant_linear / dequant_moe call the plugin's ggml_dequantize and vLLM's fused_experts by
    keyword and position: a newer vLLM or plugin that moves or reorders them fails here, not in a prefill."""
    import inspect

    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
    from vllm_gguf_plugin import ops

    params = inspect.signature(fused_experts).parameters
    assert list(params)[:5] == ["hidden_states", "w1", "w2", "topk_weights", "topk_ids"]
    assert "activation" in params
    assert list(inspect.signature(ops.ggml_dequantize).parameters) == ["W", "quant_type", "m", "n", "dtype"]
    assert MoEActivation.from_str("silu") is not None


def test_a_measured_form_reaches_the_kernels_at_its_token_count(monkeypatch):
    """A layer's measured forms (its plan's, one a token count) reach the decode kernels as their ``form``; a
    count without one leaves the choice to the policy (form None)."""
    import torch

    from fastcomm import kquant
    from fastcomm.kquant.settings import Settings
    from fastcomm_vllm.gguf import kquant_vllm

    seen = []

    def record(*args, **kwargs):
        seen.append(kwargs.get("form"))

    monkeypatch.setattr(kquant, "linear", record)
    monkeypatch.setattr(kquant, "moe", record)
    monkeypatch.setattr(kquant_vllm, "_activation", lambda name: None)
    measured = ["unstaged", "", "mma", "", "", "", "", "staged"]
    moe_measured = ["pairs", "staged", "", "", "", "grouped", "", ""]
    s = Settings()
    w = torch.zeros(16, 144, dtype=torch.uint8)
    w13, w2 = torch.zeros(16, 32, 144, dtype=torch.uint8), torch.zeros(16, 256, 144, dtype=torch.uint8)
    for n in range(1, kquant.MAX_TOKENS + 1):
        seen.clear()
        kquant_vllm._linear_fn(torch.zeros(n, 256), w, [kquant.Q4_K], [0], [16], *kquant_vllm.linear_args(s),
                               kquant_vllm.forms_arg(measured))
        kquant_vllm._moe_fn(torch.zeros(n, 256), w13, w2, torch.ones(n, 8), torch.zeros(n, 8, dtype=torch.int32),
                            kquant.Q4_K, kquant.Q4_K, "silu", *kquant_vllm.moe_args(s),
                            kquant_vllm.forms_arg(moe_measured))
        assert seen == [measured[n - 1] or None, moe_measured[n - 1] or None], n


def test_each_token_count_reaches_the_form_the_policy_names(monkeypatch):
    """The custom ops' routing (kquant_vllm._linear_fn / _moe_fn) on CPU tensors, every kernel replaced by a
    recorder: 1-8 tokens to the decode kernels, past them dequant / chunks / the plugin's as kquant.prefill_form
    and moe_prefill_form say for the installed settings, and an unaligned weight to the plugin's or its
    dequantizer only."""
    import torch
    from vllm_gguf_plugin.quantization import fused_moe as pmoe, linear as plin

    from fastcomm import kquant
    from fastcomm_vllm.gguf import kquant_vllm

    seen = []
    for mod, name in ((kquant, "linear"), (kquant, "linear_chunks"), (kquant, "moe"), (kquant, "moe_chunks"),
                      (kquant_vllm, "dequant_linear"), (kquant_vllm, "dequant_moe"),
                      (plin, "_fused_mul_mat_gguf"), (pmoe, "_fused_moe_gguf")):
        def record(*args, _name=name, **kwargs):
            seen.append((_name, kwargs.get("kernel")))
            return None
        monkeypatch.setattr(mod, name, record)
    monkeypatch.setattr(kquant_vllm, "_activation", lambda name: None)
    import dataclasses

    from fastcomm.kquant.settings import Settings

    settings = Settings(dequant_min_tokens=64, dequant_moe_min=64, chunk_max_tokens=256)  # MoE: from 128 tokens

    def run_linear(x, w):
        kquant_vllm._linear_fn(x, w, [kquant.Q4_K], [0], [16], *kquant_vllm.linear_args(settings),
                               kquant_vllm.forms_arg(kquant_vllm.NO_FORMS))

    w = torch.zeros(16, 144, dtype=torch.uint8)
    w13, w2 = torch.zeros(16, 32, 144, dtype=torch.uint8), torch.zeros(16, 256, 144, dtype=torch.uint8)
    # eager (a prefill): a linear's chunks are host-bound, so the plugin's short of dequant's threshold
    for n, linear, moe in ((8, "linear", "moe"), (9, "_fused_mul_mat_gguf", "moe_chunks"),
                           (64, "dequant_linear", "moe_chunks"), (256, "dequant_linear", "dequant_moe"),
                           (257, "dequant_linear", "dequant_moe")):
        seen.clear()
        run_linear(torch.zeros(n, 256), w)
        kquant_vllm._moe_fn(torch.zeros(n, 256), w13, w2, torch.ones(n, 8), torch.zeros(n, 8, dtype=torch.int32),
                            kquant.Q4_K, kquant.Q4_K, "silu", *kquant_vllm.moe_args(settings),
                            kquant_vllm.forms_arg(kquant_vllm.NO_FORMS))
        assert [s for s, _ in seen] == [linear, moe], n
        # the dequantizer the settings name (FASTCOMM_GGUF_DEQUANT_KERNEL) writes an aligned weight
        assert all(k == settings.dequant_kernel for s, k in seen if s.startswith("dequant")), n
    # inside a CUDA graph capture (a decode batch of 9+) the linear's chunks up to their limit; a CPU tensor
    # stands in for a CUDA one, as the routing asks only is_cuda and the capture state
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    for n, want in ((9, "linear_chunks"), (63, "linear_chunks"), (64, "dequant_linear")):
        seen.clear()
        run_linear(torch.zeros(n, 256), w)
        assert [s for s, _ in seen] == [want], n
    settings = dataclasses.replace(settings, chunk_max_tokens=32)
    seen.clear()
    run_linear(torch.zeros(33, 256), w)
    assert seen == [("_fused_mul_mat_gguf", None)]  # past the chunks' limit, short of dequant's
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    unaligned = torch.zeros(16 * 144 + 8, dtype=torch.uint8)[8:].view(16, 144)
    for n, want in ((8, ("_fused_mul_mat_gguf", None)), (9, ("_fused_mul_mat_gguf", None)),
                    (64, ("dequant_linear", "plugin"))):
        seen.clear()
        run_linear(torch.zeros(n, 256), unaligned)
        assert seen == [want], n
