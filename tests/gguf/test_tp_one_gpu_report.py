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


def _routed(tokens_per_step, experts, margins):
    """An engine's routing records as one_gpu.record_routing writes them: warm-up, the prefill's mark, steps."""
    recs = [{"forward": 0, "module": "model.layers.1.mlp", "tokens": 1, "experts": [[0, 1]], "margin": [0.5]},
            {"forward": 1, "module": "model.layers.1.mlp", "tokens": 128}]
    for i, (e, m) in enumerate(zip(experts, margins)):
        recs.append({"forward": 2 + i, "module": "model.layers.1.mlp", "tokens": tokens_per_step,
                     "experts": [e] * tokens_per_step, "margin": [m] * tokens_per_step})
    return {"allreduce": [{"routing": recs}]}


def test_routing_parting_names_the_first_step_whose_experts_differ():
    plain = _routed(1, [[3, 5], [1, 2], [4, 6]], [0.2, 0.3, 0.0004])
    mtp = _routed(2, [[5, 3], [2, 1], [4, 7]], [0.2, 0.3, 0.0002])  # the same sets, then a near-tie flip
    res = T.routing_parting(plain, mtp)
    assert res["token"] == 3 and res["experts"] == [[4, 6], [4, 7]] and res["margins"] == [0.0004, 0.0002]
    assert T.routing_parting(plain, plain) == {"token": None, "steps": 3}
    assert T.routing_parting(plain, {"allreduce": [{}]}) is None


def test_mtp_agreement_is_decided_on_the_verify_steps_forms(tmp_path):
    """A plain run on the default forms may part from the MTP run (the forms round differently); the run on the
    verify steps' forms (greedy-tpN@mma1) must not."""
    pytest.importorskip("gguf")
    (tmp_path / "greedy-mtp-tp8.json").write_text(json.dumps({**_engine([3, 4, 5]),
                                                               "spec_decode": {"vllm:spec_decode_num_draft_tokens": 2}}))
    (tmp_path / "logits-tp8.json").write_text(json.dumps(_engine([3, 9, 9])))
    (tmp_path / "greedy-tp8@mma1.json").write_text(json.dumps(_engine([3, 4, 5])))
    res = T.report([tmp_path])
    row = res["tp"][8]
    assert row["greedy_with_mtp"]["first_difference"] == 1 and not row["greedy_with_mtp"]["ok"]
    assert row["greedy_with_mtp_same_forms"]["identical"]
    assert "TP 8 MTP" not in res["failures"]
    (tmp_path / "greedy-tp8@mma1.json").write_text(json.dumps(_engine([3, 4, 7])))
    res = T.report([tmp_path])
    assert res["tp"][8]["greedy_with_mtp_same_forms"]["first_difference"] == 2
    assert "TP 8 MTP" in res["failures"]


def test_each_part_runs_its_engines(tmp_path, monkeypatch):
    """The engines a part starts, by the names the report loads them under (a logitsN part gives TP N's first
    engine alone, so TP 1's row can come from a call that runs no TP 1 MTP engine)."""
    ran = []
    for name in ("FASTCOMM_TEST_MODE", "FASTCOMM_TEST_SHARED_GPU", "FASTCOMM_CACHE_DIR"):  # run_parts sets them:
        monkeypatch.setenv(name, "")  # restored after the test, so no later test inherits them
    monkeypatch.setattr(T, "write_models", lambda d: (d / "q.gguf", d / "bf16.gguf"))
    monkeypatch.setattr(T, "_run", lambda out, name, mode, model, *extra, env=None: ran.append((name, mode)))
    T.run_parts(tmp_path, ["ref", "logits1", "tp4", "mtp8", "control8", "skew4"])
    assert ran == [("ref", "logits"), ("logits-tp1", "both"), ("logits-tp4", "both"), ("greedy-mtp-tp4", "greedy"),
                   ("greedy-tp4@mma1", "greedy"), ("greedy-mtp-tp8", "greedy"), ("control-tp8", "logits"),
                   ("skew-tp4", "greedy")]


def test_an_engine_not_run_is_named_and_a_failed_one_fails(tmp_path):
    """A logitsN part (or a call whose budget ran out) leaves TP N's MTP engine unrun: the row names it, the
    report does not fail; an engine that ran and failed (gpu_worker's exit written as ``failed``) fails it."""
    pytest.importorskip("gguf")
    (tmp_path / "logits-tp1.json").write_text(json.dumps(_engine([3, 4, 5])))
    res = T.report([tmp_path])
    assert res["tp"][1]["not_run"] == ["mtp"] and res["failures"] == []
    (tmp_path / "greedy-mtp-tp1.json").write_text(json.dumps({"failed": 1, "seconds": 9.0, "log_tail": "x"}))
    assert T.report([tmp_path])["failures"] == ["TP 1 mtp engine"]


def test_an_engine_stopped_with_the_harness_is_cut_off_not_unrun(tmp_path):
    """An engine's log with no result beside it (the harness stopped mid-engine by its budget or a kill) fails
    the report as cut off, naming the engine, instead of reading as not run."""
    pytest.importorskip("gguf")
    (tmp_path / "logits-tp1.json").write_text(json.dumps(_engine([3, 4, 5])))
    (tmp_path / "logits-tp1.log").write_text("engine log\n")
    (tmp_path / "ref.log").write_text("half an engine log\n")
    res = T.report([tmp_path])
    assert res["cut_off"] == ["ref"]
    assert res["failures"] == ["ref engine cut off mid-run (a log, no result)"]
    (tmp_path / "ref.log").unlink()
    assert "cut_off" not in T.report([tmp_path]) and T.report([tmp_path])["failures"] == []
    (tmp_path / "greedy-mtp-tp1.log").write_text("half an engine log\n")  # TP 1's MTP engine: cut, not unrun
    res = T.report([tmp_path])
    assert res["cut_off"] == ["greedy-mtp-tp1"] and "not_run" not in res["tp"][1]
