"""The TP 8 shard model (synth.rank_shard, TP8_SHARD): one rank's share of GLM-5 written as a TP 1 model, so
that one GPU times what a TP 8 rank reads per step. Its tensors are checked against GLM-5's own plan sliced
here as vLLM slices it, its router on a small file of 256 experts read back with gguf-py alone, and the
command's refusals without writing anything large."""
import dataclasses
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import needs_gguf

pytestmark = needs_gguf

TP = 8

# How vLLM's DeepSeek-V2 / GLM-5 layers hold each GGUF tensor at TP > 1, written from its layer classes and
# not from synth: the axis (of the stored numpy array) a rank gets 1/TP of, or None for a replicated tensor.
#   column-parallel (q_b_proj, kv_b_proj, gate/up of the dense MLP, the shared expert and every routed
#   expert): the output rows; row-parallel (o_proj, down_proj): the input columns; vocabulary-parallel
#   (embeddings, LM heads): the rows. Replicated: q_a / kv_a (vLLM builds them with disable_tp), the indexer
#   (ReplicatedLinear), the router and its bias, eh_proj, every norm.
SPLIT_AXIS = {
    "token_embd.weight": 0, "output.weight": 0, "output_norm.weight": None,
    "attn_norm.weight": None, "ffn_norm.weight": None,
    "attn_q_a.weight": None, "attn_q_a_norm.weight": None, "attn_kv_a_mqa.weight": None,
    "attn_kv_a_norm.weight": None,
    "attn_q_b.weight": 0,
    "attn_k_b.weight": 0, "attn_v_b.weight": 0,   # [heads, ...]: whole heads per rank
    "attn_output.weight": -1,
    "indexer.attn_k.weight": None, "indexer.attn_q_b.weight": None, "indexer.proj.weight": None,
    "indexer.k_norm.weight": None, "indexer.k_norm.bias": None,
    "ffn_gate.weight": 0, "ffn_up.weight": 0, "ffn_down.weight": -1,
    "ffn_gate_inp.weight": None, "exp_probs_b.bias": None,
    "ffn_gate_shexp.weight": 0, "ffn_up_shexp.weight": 0, "ffn_down_shexp.weight": -1,
    "ffn_gate_exps.weight": 1, "ffn_up_exps.weight": 1,   # [experts, moe_ffn, hidden]
    "ffn_down_exps.weight": -1,                           # [experts, hidden, moe_ffn]
    "nextn.eh_proj.weight": None, "nextn.enorm.weight": None, "nextn.hnorm.weight": None,
    "nextn.shared_head_norm.weight": None, "nextn.embed_tokens.weight": 0, "nextn.shared_head_head.weight": 0,
}


def _leaf(name: str) -> str:
    return re.sub(r"^blk\.\d+\.", "", name)


@pytest.fixture(scope="module")
def synth():
    from fastcomm_vllm.gguf import synth

    return synth


def test_rank_shard_splits_what_vllm_splits_and_keeps_the_rest(synth):
    s = synth.rank_shard(synth.GLM5, TP)
    assert (s.heads, s.moe_ffn, s.ffn, s.vocab) == (8, 256, 1536, 19360)
    split = {"heads", "moe_ffn", "ffn", "vocab"}
    for f in dataclasses.fields(s):
        if f.name not in split:
            assert getattr(s, f.name) == getattr(synth.GLM5, f.name), f.name
    assert (s.hidden, s.q_lora, s.kv_lora, s.experts, s.top_k, s.layers) == (6144, 2048, 512, 256, 8, 78)
    assert synth.TP8_SHARD == s


def test_rank_shard_refuses_splits_vllm_could_not_make(synth):
    with pytest.raises(ValueError, match=r"heads=64 does not split 3 ways"):
        synth.rank_shard(synth.GLM5, 3)
    # TP 16 halves moe_ffn below a 256-element K-quant super-block: a rank's rows would cut blocks.
    with pytest.raises(ValueError, match=r"moe_ffn=128 per rank"):
        synth.rank_shard(synth.GLM5, 16)
    with pytest.raises(ValueError, match=r"^ffn=128 per rank"):
        synth.rank_shard(dataclasses.replace(synth.GLM5, ffn=1024), TP)
    with pytest.raises(ValueError, match=r"heads x v_head=1600 per rank"):  # o_proj's columns: 8 x 200
        synth.rank_shard(dataclasses.replace(synth.GLM5, v_head=200), TP)


@pytest.fixture(scope="module")
def plans(synth):
    return synth.plan(synth.GLM5), synth.plan(synth.TP8_SHARD)


def test_every_shard_tensor_is_glm5s_tensor_sliced_as_vllm_slices_it(plans):
    full, shard = plans
    assert [t[0] for t in shard] == [t[0] for t in full]  # the same tensors, in the same order
    unknown = sorted({_leaf(n) for n, *_ in full} - set(SPLIT_AXIS))
    assert not unknown, f"tensors the expectation does not know: {unknown}"
    by_name = {n: (shape, q, nbytes) for n, shape, q, nbytes in full}
    for name, shape, qtype, nbytes in shard:
        fshape, fq, fbytes = by_name[name]
        axis = SPLIT_AXIS[_leaf(name)]
        assert qtype == fq, name
        if axis is None:
            assert (shape, nbytes) == (fshape, fbytes), name
            continue
        want = list(fshape)
        assert want[axis] % TP == 0, name
        want[axis] //= TP  # on the last axis of a quantized tensor: whole blocks' bytes, so still exact
        assert (shape, nbytes * TP) == (tuple(want), fbytes), (name, shape, fshape)


def test_the_shard_file_is_78_layers_and_the_mtp_block_in_59_gb(plans):
    _, shard = plans
    assert len(shard) == 1811
    total = sum(t[3] for t in shard)
    assert round(total / 1e9, 1) == 59.3, total
    blocks = {int(m.group(1)) for n, *_ in shard if (m := re.match(r"blk\.(\d+)\.", n))}
    assert blocks == set(range(79))
    assert {n for n, *_ in shard if n.startswith("blk.78.nextn.")}  # blk.78 is the MTP block
    assert not any(".nextn." in n for n, *_ in shard if not n.startswith("blk.78."))
    dense = sorted({int(n.split(".")[1]) for n, *_ in shard if n.endswith(".ffn_gate.weight")})
    assert dense == [0, 1, 2]


def test_router_sends_every_token_to_its_own_experts(synth, tmp_path):
    """The file's routers (noaux_tc: sigmoid + bias, top-k) on random hidden states: tokens must spread over
    the 256 experts, or a batched step would read fewer expert bytes than GLM-5's at the same batch."""
    import gguf

    # The smallest widths the writer's K-quant blocks allow (256-element rows), GLM-5's router width.
    s = synth.Shape(hidden=256, vocab=512, layers=1, dense=0, heads=1, q_lora=256, ffn=256, moe_ffn=256,
                    experts=256, top_k=8, mtp=False)
    first, _ = synth.write_gguf(tmp_path, s, shards=1, name="router", truth=False)  # as --tp8-shard writes
    tensors = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(first).tensors}
    gate = tensors["blk.0.ffn_gate_inp.weight"].astype(np.float64)
    bias = tensors["blk.0.exp_probs_b.bias"].astype(np.float64)
    norm = tensors["blk.0.ffn_norm.weight"].astype(np.float64)
    assert gate.shape == (256, 256) and bias.shape == (256,)
    x = np.random.default_rng(1).standard_normal((64, s.hidden))
    h = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * norm
    scores = 1 / (1 + np.exp(-(h @ gate.T))) + bias
    chosen = np.argsort(-scores, axis=-1)[:, :8]
    sets = {frozenset(row.tolist()) for row in chosen}
    assert len(sets) == 64
    # Four tokens decoded together: at least 24 of their 32 picks distinct on average (GLM-5 width: ~28.4).
    together = [len(set(chosen[i:i + 4].ravel().tolist())) for i in range(0, 64, 4)]
    assert np.mean(together) >= 24, together


def test_tp8_shard_and_full_are_one_or_the_other(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fastcomm_bench.glm5_gguf", str(tmp_path / "out"), "--tp8-shard",
                        "--full"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "not allowed with" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_tp8_shard_without_the_disk_space_is_one_line(synth, tmp_path, monkeypatch, capsys):
    asked = []
    real = shutil.disk_usage

    def small_disk(path):
        asked.append(path)
        return real(path)._replace(free=10 * 2**30)  # the real call: a folder that is not there raises

    monkeypatch.setattr(shutil, "disk_usage", small_disk)
    out = tmp_path / "new" / "shard"  # two folders that do not exist yet: the writer makes both
    with pytest.raises(SystemExit) as e:
        synth.main([str(out), "--tp8-shard"])
    assert e.value.code == 2
    need = sum(t[3] for t in synth.plan(synth.TP8_SHARD))
    err = capsys.readouterr().err
    assert err.splitlines() == [f"glm5_gguf: {out}: {need / 2**30:.1f} GiB needed, 10.0 GiB free"], err
    assert asked and not (tmp_path / "new").exists()


def test_a_plain_step_reads_its_layers_head_and_one_tokens_experts(synth, plans):
    _, shard = plans
    s = synth.TP8_SHARD
    # Summed here from the plan's names: main layers and the LM head whole, routed experts 8/256, no
    # embedding table (a lookup), no MTP block (blk.78).
    main = [(n, b) for n, _, _, b in shard if not n.startswith("token_embd.") and not n.startswith("blk.78.")]
    experts = sum(b for n, b in main if "_exps." in n)
    rest = sum(b for n, b in main if "_exps." not in n)
    assert synth.step_read_bytes(s) == rest + experts * 8 // 256
    assert synth.step_read_bytes(s, 0) == rest and synth.step_read_bytes(s, 256) == rest + experts
    assert 5.0e9 < synth.step_read_bytes(s) < 5.5e9   # ~5.2 GB a rank's one-token step
    with pytest.raises(ValueError, match="experts_read=257"):
        synth.step_read_bytes(s, 257)
