"""The measured forms table (fastcomm.kquant.forms): built from bench/gguf_kernels.py's rows, its JSON, which
forms a layer may take from it, which table serves, and the table fastcomm ships, keyed as the TP 8 shard's
layers are. Pure: no GPU, no vLLM."""
import json
from pathlib import Path

import pytest

from fastcomm import kquant
from fastcomm.kquant import forms
from fastcomm.kquant.settings import Settings
from fastcomm.config import ConfigError

from conftest import needs_gguf

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "bench" / "results" / "2026-12-07-h100x1-kquant-kernels-tp8-7ba2134.json"
H100 = "NVIDIA H100 80GB HBM3"
Q = kquant


def _table_of_run():
    from fastcomm_bench import gguf_kernels

    return gguf_kernels.forms_table(json.loads(RUN.read_text()), RUN.name)


def test_pick_takes_the_fastest_unless_the_policys_form_is_within_the_margin():
    assert forms.pick({"mma": 4.75, "staged": 3.71, "unstaged": 6.0}, "mma") == "staged"
    assert forms.pick({"mma": 8.03, "staged": 7.88, "unstaged": 10.55}, "mma") == "mma"  # 1.9 % apart: noise
    assert forms.pick({"mma": 8.03, "staged": 7.88}, "mma", margin=0.01) == "staged"
    assert forms.pick({"grouped": 31.7, "pairs": 24.1, "staged": None}, "staged") == "pairs"  # staged never ran
    assert forms.pick({"mma": 5.0, "staged": 5.0}, "staged") == "staged"
    with pytest.raises(ValueError):
        forms.pick({"mma": None}, "mma")


def test_a_table_from_the_committed_tp8_run_on_an_h100():
    # At 2 tokens the tensor-core form the rule takes loses to staged dp4a on q_b (4.75 -> 3.71 us) and shared
    # gate_up (7.11 -> 5.71), is within the margin on o_proj (8.03 / 7.88) and wins on dense gate_up; at 1 token
    # the short rows' mma (shared down, 3.49 against staged 5.45) as the rule now takes it. Counts the run did
    # not time (3-8 tokens) stay with the rule.
    t = _table_of_run()
    assert t.device == H100 and RUN.name in t.source
    by_op = {e.op.split(" (")[0]: e for e in t.entries}
    assert set(by_op) == {"fused_qkv_a", "q_b", "indexer wq_b", "o_proj", "shared gate_up", "shared down",
                          "dense gate_up", "dense down", "lm_head", "routed experts"}
    assert by_op["q_b"].forms[:2] == ("staged", "staged") and by_op["q_b"].us[1] == (3.71, 4.75)
    assert by_op["shared gate_up"].forms[1] == "staged"
    assert by_op["o_proj"].forms[1] == "mma" and by_op["dense gate_up"].forms[1] == "mma"
    assert by_op["shared down"].forms[:2] == ("mma", "mma")
    assert by_op["routed experts"].forms[:2] == ("staged", "staged")
    assert all(e.forms[2:] == ("",) * 6 for e in t.entries)
    assert by_op["q_b"].shape == forms.LinearShape((Q.Q4_K,), (2048,), 2048)
    assert by_op["fused_qkv_a"].shape == forms.LinearShape((Q.Q5_K, Q.Q8_0), (2048, 576), 6144)
    assert by_op["routed experts"].shape == forms.MoeShape(Q.Q4_K, Q.Q5_K, 6144, 256, 8)


def test_the_json_round_trip_keeps_every_form_and_time(tmp_path):
    t = _table_of_run()
    forms.dump(t, tmp_path / "t.json")
    back = forms.load(tmp_path / "t.json")
    assert back == t
    assert json.loads((tmp_path / "t.json").read_text())["format"] == forms.FORMAT


@pytest.mark.parametrize("edit, problem", [
    (lambda d: d.update(format="fastcomm-tune"), "not a fastcomm-kquant-forms file"),
    (lambda d: d.update(schema=forms.SCHEMA_VERSION + 1), "newer than this fastcomm's"),
    (lambda d: d.pop("device"), "missing field 'device'"),
    (lambda d: d["entries"][0].update(types=["Q3_K"]), "entries[0].types"),
    (lambda d: d["entries"][0].update(rows=[2048]), "entries[0].rows"),
    (lambda d: d["entries"][0]["forms"].update({"9": {"form": "mma"}}), "a token count 1-8"),
    (lambda d: d["entries"][0]["forms"].update({"2": {"form": "grouped"}}), "'grouped' is not one of"),
    (lambda d: d["entries"][0].update(kind="conv"), "field 'entries[0].kind' must be 'linear' or 'moe'"),
    (lambda d: d["entries"].append(d["entries"][0]), "a shape appears twice"),
    (lambda d: d["entries"][-1].update(types=["Q4_K"]), "a MoE has two"),
])
def test_a_malformed_table_is_refused_naming_the_file_and_the_field(tmp_path, edit, problem):
    data = forms.to_json(_table_of_run())
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(forms.FormsError) as e:
        forms.load(path)
    assert str(path) in str(e.value) and problem in str(e.value) and "\n" not in str(e.value), e.value


def test_a_layer_takes_only_the_forms_it_may_run():
    lin = forms.LinearShape((Q.Q4_K,), (512,), 6144)
    moe = forms.MoeShape(Q.Q4_K, Q.Q5_K, 6144, 256, 40)  # top 40: past 6 tokens the grouped route table is full
    t = forms.Table("gpu", "test", (forms.Entry(lin, ("mma", "staged", "unstaged", "", "", "", "", "mma")),
                                    forms.Entry(moe, ("staged", "grouped", "shared", "", "", "", "grouped", "staged"))))
    assert forms.forms_for(t, lin, tensor_cores=True) == t.entries[0].forms
    # FASTCOMM_GGUF_KERNELS=dp4a, or segments the tensor cores cannot read: the rule (itself dp4a) serves there
    assert forms.forms_for(t, lin, tensor_cores=False) == ("", "staged", "unstaged", "", "", "", "", "")
    assert forms.forms_for(t, lin, tensor_cores=True, mma=False)[0] == ""
    # 7 tokens x top 40 = 280 pairs > KQ_MAX_PAIRS (256): the grouped form cannot route them
    assert forms.forms_for(t, moe, tensor_cores=True)[6] == "" and forms.forms_for(t, moe, tensor_cores=True)[1] == "grouped"
    assert forms.forms_for(t, moe, tensor_cores=False)[1:3] == ("", "")
    assert forms.forms_for(t, moe, tensor_cores=True, staged_fits=lambda n: n < 8) == \
        ("staged", "grouped", "shared", "", "", "", "", "")
    # a shape the table lacks, or no table: the rule at every count
    assert forms.forms_for(t, forms.LinearShape((Q.Q6_K,), (512,), 6144), tensor_cores=True) == ("",) * 8
    assert forms.forms_for(None, lin, tensor_cores=True) == ("",) * 8


def test_which_table_serves(tmp_path):
    mine = forms.Table("my GPU", "mine", ())
    h100 = forms.Table(H100, "h100", ())
    assert forms.resolve("auto", H100, [mine, h100]) is h100
    assert forms.resolve("auto", "RTX PRO 6000 Blackwell (sm_120)", [mine, h100]) is None
    assert forms.resolve("none", H100, [mine, h100]) is None
    forms.dump(mine, tmp_path / "mine.json")
    assert forms.resolve(str(tmp_path / "mine.json"), H100) == mine  # a named file serves wherever it is named


@needs_gguf
def test_the_shipped_table_is_the_committed_runs_and_keyed_as_the_tp8_shards_layers():
    """fastcomm/kquant/tables/ holds the H100's table, the one `gguf_kernels --forms-from` makes of the committed
    TP 8 run; its shapes are those vLLM's layers of the TP 8 shard file have (synth.TP8_SHARD's tensors: a
    linear's types, rows and columns as the GGUF holds them, merged where vLLM merges them), so on that shard
    every product it measured finds its entry."""
    from fastcomm_vllm.gguf import synth

    shipped = {t.device: t for t in forms.shipped()}
    assert set(shipped) == {H100}
    made = _table_of_run()
    assert shipped[H100].entries == made.entries
    tensors = {name: (t, shape) for name, shape, t, _ in synth.plan(synth.TP8_SHARD)}

    def cols(name):
        t, shape = tensors[name]
        values, nbytes = kquant.BLOCKS[int(t)]
        return shape[-1] // nbytes * values

    def lin(*names):
        return forms.LinearShape(tuple(int(tensors[n][0]) for n in names), tuple(tensors[n][1][-2] for n in names),
                                 cols(names[0]))

    def merged(a, b):  # vLLM's gate_up_proj: one segment where both halves have one type
        (ta, sa), (tb, sb) = tensors[a], tensors[b]
        assert ta == tb
        return forms.LinearShape((int(ta),), (sa[-2] + sb[-2],), cols(a))

    moe, dense = synth.TP8_SHARD.dense + 1, 0
    up, down = f"blk.{moe}.ffn_up_exps.weight", f"blk.{moe}.ffn_down_exps.weight"
    shard = {lin(f"blk.{moe}.attn_q_a.weight", f"blk.{moe}.attn_kv_a_mqa.weight"),
             lin(f"blk.{moe}.attn_q_b.weight"), lin(f"blk.{moe}.indexer.attn_q_b.weight"),
             lin(f"blk.{moe}.attn_output.weight"),
             merged(f"blk.{moe}.ffn_gate_shexp.weight", f"blk.{moe}.ffn_up_shexp.weight"),
             lin(f"blk.{moe}.ffn_down_shexp.weight"),
             merged(f"blk.{dense}.ffn_gate.weight", f"blk.{dense}.ffn_up.weight"), lin(f"blk.{dense}.ffn_down.weight"),
             lin("output.weight"),
             forms.MoeShape(int(tensors[up][0]), int(tensors[down][0]), synth.TP8_SHARD.hidden, cols(down),
                            synth.TP8_SHARD.top_k)}
    assert {e.shape for e in shipped[H100].entries} == shard
    # gguf_kernels' own split of its products at TP 8 (tp_shapes, SPLIT) is the shard's, so the next table is too
    from fastcomm_bench import gguf_kernels

    assert set(gguf_kernels.forms_shapes(8).values()) == shard


def test_a_table_measured_on_this_machine_serves_ahead_of_the_shipped_one(tmp_path, caplog):
    """gguf_kernels --save-forms writes FASTCOMM_CACHE_DIR/kquant-forms/<GPU>.json; auto serves it on a GPU of that
    name before a shipped table; one that cannot be read is left out with a warning (nobody named it)."""
    h100 = forms.Table(H100, "shipped", ())
    here = forms.Table(H100, "measured here", (forms.Entry(forms.LinearShape((Q.Q4_K,), (16,), 256), ("staged",) * 8),))
    path = forms.machine_path(tmp_path, H100)
    assert path == tmp_path / "kquant-forms" / "NVIDIA_H100_80GB_HBM3.json"
    assert forms.file_name(H100) == forms.TABLES.joinpath("NVIDIA_H100_80GB_HBM3.json").name  # the shipped one's
    assert forms.resolve("auto", H100, [h100], cache_dir=tmp_path) is h100  # nothing measured here yet
    path.parent.mkdir()
    forms.dump(here, path)
    assert forms.resolve("auto", H100, [h100], cache_dir=tmp_path) == here
    assert forms.resolve("auto", "other GPU", [h100], cache_dir=tmp_path) is None
    assert forms.resolve("none", H100, [h100], cache_dir=tmp_path) is None
    path.write_text("{")
    with caplog.at_level("WARNING", logger="fastcomm"):
        assert forms.resolve("auto", H100, [h100], cache_dir=tmp_path) is h100
    assert "this machine's forms table is left out" in caplog.text and str(path) in caplog.text


def test_the_one_line_on_which_forms_serve():
    assert "else a shipped one: NVIDIA H100 80GB HBM3)" in forms.describe("auto")
    assert "else a shipped one: none)" in forms.describe("auto", [])
    assert forms.describe("none") == "the token thresholds alone (FASTCOMM_GGUF_FORMS=none)"
    assert forms.describe("/x/t.json").startswith("the forms table /x/t.json where it measured")


def test_the_setting_reads_and_names_a_bad_table(tmp_path):
    assert Settings.from_env({}).forms == "auto"
    # a threshold set by hand says how the products should run: the shipped table stands aside
    assert Settings.from_env({"FASTCOMM_GGUF_MMA_MIN_TOKENS": "3"}).forms == "none"
    assert Settings.from_env({"FASTCOMM_GGUF_GROUPED_MIN_TOKENS": "9", "FASTCOMM_GGUF_FORMS": "auto"}).forms == "auto"
    good = tmp_path / "t.json"
    forms.dump(forms.Table("x", "y", ()), good)
    assert Settings.from_env({"FASTCOMM_GGUF_FORMS": str(good)}).forms == str(good)
    for text, problem in (("/no/such.json", "No such file"), (str(tmp_path), "")):
        with pytest.raises(ConfigError) as e:
            Settings.from_env({"FASTCOMM_GGUF_FORMS": text})
        assert str(e.value).startswith(f"FASTCOMM_GGUF_FORMS={text!r}: ") and problem in str(e.value), e.value
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not JSON"):
        Settings.from_env({"FASTCOMM_GGUF_FORMS": str(tmp_path / "bad.json")})


def test_gguf_kernels_writes_the_table_of_a_saved_run(tmp_path, capsys):
    from fastcomm_bench import gguf_kernels

    out = tmp_path / "forms.json"
    assert gguf_kernels.main(["--forms-from", str(RUN), "--forms-out", str(out)]) == 0
    assert forms.load(out).entries == _table_of_run().entries
    text = capsys.readouterr().out
    assert "q_b at 2 token(s): staged 3.71 us against the policy's 4.75" in text, text
    assert gguf_kernels.main(["--forms-from", str(RUN)]) == 2
    assert "needs --forms-out" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": forms.FORMAT}))
    assert gguf_kernels.main(["--forms-from", str(other), "--forms-out", str(out)]) == 2
    assert "not a gguf_kernels --json record" in capsys.readouterr().err
