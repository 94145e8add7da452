"""tp_one_gpu's parts and report on CPU: variants parse, and the report fails a variant that parts from the
run with MTP or whose all-reduces were not the exact sum (synthetic engine files, as gpu_worker writes them)."""
import json

import pytest

import tp_one_gpu as T

CALLS = 1 + 2 * 2  # the tiny model's 2 layers: embedding, then attention and MLP per layer


def _engine(tokens, mismatches=()):
    tops = [[[t, -1.0], [t + 1, -2.0]] for t in tokens]
    ranks = [{"forwards": [[1, CALLS, CALLS, 0]], "outside": 0, "fastcomm": True, "checked": CALLS,
              "mismatches": list(mismatches)} for _ in range(8)]
    return {"tokens": tokens, "top_logprobs": tops, "spec_decode": {}, "allreduce": ranks}


def test_variants_parse_into_options_and_environment():
    assert T._variant("greedy8") == ("greedy8", "", (), {})
    base, tag, drop, env = T._variant("greedy8@eager+check")
    assert (base, tag, drop) == ("greedy8", "@eager+check", ("--graphs",))
    assert env == {"FASTCOMM_TEST_CHECK_ALLREDUCE": "1"}
    with pytest.raises(SystemExit, match="unknown variant 'fast'"):
        T._variant("greedy8@fast")


def test_report_compares_each_variant_with_the_mtp_run(tmp_path):
    pytest.importorskip("gguf")  # the report reads the tiny model's layer count from synth
    (tmp_path / "greedy-mtp-tp8.json").write_text(json.dumps(_engine([3, 4, 5])))
    (tmp_path / "greedy-tp8@eager.json").write_text(json.dumps(_engine([3, 4, 5])))
    (tmp_path / "greedy-tp8@plugin.json").write_text(json.dumps(_engine([3, 4, 9])))
    bad = {"call": 2, "forward": 1, "tokens": 1, "elements": 512, "wrong": 3, "max_abs_diff": 0.5,
           "ranks_agree": True}
    (tmp_path / "greedy-tp8@check.json").write_text(json.dumps(_engine([3, 4, 5], [bad])))
    res = T.report([tmp_path])
    v = res["variants"]
    assert v["greedy-tp8@eager"]["vs_mtp"]["identical"] and v["greedy-tp8@eager"]["allreduce"]["ok"]
    assert v["greedy-tp8@plugin"]["vs_mtp"]["first_difference"] == 2
    assert v["greedy-tp8@check"]["allreduce"]["mismatches"][0]["wrong"] == 3
    assert "greedy-tp8@plugin vs MTP" in res["failures"] and "greedy-tp8@check allreduce" in res["failures"]
    assert not any("eager" in f for f in res["failures"])
