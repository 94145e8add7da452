"""bench-decode's parent side on CPU: configs, model lookup, token comparison, merged reports."""
import json

import pytest

pytest.importorskip("vllm")

from fastcomm_bench import bench_decode as B  # noqa: E402

pytestmark = pytest.mark.vllm


def result(name, tokens, tok_s=40.0, fastcomm=False):
    return {"backend": name, "ok": True, "startup_s": 200.0, "single": {"tok_s": tok_s, "tpot_ms": 1e3 / tok_s},
            "sweep": [{"concurrency": c, "out_tok_s": tok_s * c, "tpot_ms": 25.0, "decode_tok_s": 40.0 * c}
                      for c in (1, 4, 16, 64)],
            "greedy_tokens": tokens, "workers": [{"fastcomm": fastcomm, "why_not": None if fastcomm else "off"}] * 2}


def test_backends_cover_the_issue():
    assert {"vllm", "nccl", "fastcomm", "nccl-nop2p", "fastcomm-host"} <= set(B.BACKENDS)
    assert B.BACKENDS["fastcomm-nofuse"].env == {"FASTCOMM_VLLM": "1", "FASTCOMM_VLLM_FUSION": "0"}
    assert B.BACKENDS["nccl"].disable_custom_all_reduce and not B.BACKENDS["vllm"].disable_custom_all_reduce
    assert B.BACKENDS["fastcomm-host"].env == {"FASTCOMM_VLLM": "1", "FASTCOMM_TRANSPORT": "host",
                                               "FASTCOMM_VLLM_FUSION": "1", "NCCL_P2P_DISABLE": "1"}
    # Every fastcomm row names its fusion setting, so a row means the same whatever the default is.
    assert all("FASTCOMM_VLLM_FUSION" in b.env for b in B.BACKENDS.values() if b.fastcomm)
    assert B.BACKENDS["fastcomm"].env["FASTCOMM_VLLM_FUSION"] == "1"
    assert B.BACKENDS["nccl-nop2p"].env["NCCL_P2P_DISABLE"] == "1"
    assert all("FASTCOMM_VLLM" in b.env for b in B.BACKENDS.values())


def test_model_names_resolve_to_shared_configs():
    try:
        path = B.resolve_model("glm5-mini")
    except SystemExit:
        pytest.skip("shared/models is not next to this checkout")
    assert json.loads((path / "config.json").read_text())["architectures"] == ["GlmMoeDsaForCausalLM"]
    with pytest.raises(SystemExit, match="no config.json"):
        B.resolve_model("no-such-model")


def test_arguments():
    a = B.parse_args(["--configs", "vllm,fastcomm", "--max-tokens", "64", "--capture-sizes", "1,2,4,8"])
    assert (a.configs, a.max_tokens, a.capture_sizes, a.concurrency) == ("vllm,fastcomm", 64, "1,2,4,8", "1,4,16,64")
    with pytest.raises(SystemExit, match="unknown config"):
        B.main(["--configs", "vllm,nvlink"])


def test_token_comparison_and_active_check():
    base = list(range(100, 228))
    res = {"vllm": result("vllm", base), "fastcomm": result("fastcomm", base[:70] + [0] * 58, fastcomm=True),
           "fastcomm-host": result("fastcomm-host", base)}
    cmp = B.compare_tokens(res)
    assert cmp["reference"] == "vllm"
    assert cmp["fastcomm"] == {"compared": 128, "matching": 70, "first_divergence": 70, "distinct_tokens": 71}
    assert cmp["vllm"]["first_divergence"] is None
    assert B.check_active(res["fastcomm"]) is None
    assert "inactive" in B.check_active(res["fastcomm-host"])  # a fastcomm row that ran without fastcomm
    assert B.check_active(res["vllm"]) is None


def test_compare_merges_separate_runs(tmp_path, capsys):
    tokens = list(range(64))
    meta = {"model": "glm5-78L-16E", "tp": 2, "max_tokens": 64, "capture_sizes": [1, 2, 4, 8]}
    for name, fc in (("vllm", False), ("fastcomm", True)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"meta": meta, "results": {name: result(name, tokens, fastcomm=fc)}}))
    failed = {"backend": "nccl", "ok": False, "error": "timed out", "log": "nccl.log"}
    cut = {**result("nccl-nop2p", tokens[:40] + [7] * 24), "ok": False, "error": "timed out", "log": "x.log"}
    cut["sweep"] = cut["sweep"][:2]  # a run cut short keeps what it measured
    (tmp_path / "nccl.json").write_text(json.dumps({"meta": meta, "results": {"nccl": failed, "nccl-nop2p": cut}}))
    assert B.main(["--compare"] + [str(tmp_path / f"{n}.json") for n in ("vllm", "fastcomm", "nccl")]) == 0
    out = capsys.readouterr().out
    assert "c=64 tok/s" in out and "nccl           FAILED: timed out" in out
    assert "fastcomm       64/64 match, identical" in out
    assert "INCOMPLETE: timed out" in out and "nccl-nop2p     40/64 match, diverge at token 40" in out


def test_cli_hands_every_argument_to_bench_decode():
    # argparse's REMAINDER used to swallow a leading "--model": the CLI must pass arguments through as-is.
    from fastcomm import commands as cli

    with pytest.raises(SystemExit, match="unknown config"):
        cli.main(["bench-decode", "--model", "glm5-mini", "--configs", "nvlink"])


def test_rounds_give_medians_and_keep_each_round():
    def run(tpot, ok=True, startup=100.0):
        r = result("fastcomm", list(range(64)), tok_s=1e3 / tpot, fastcomm=True)
        r["single"].update(ttft_ms=30.0, tpot_ms=tpot)
        r.update(ok=ok, startup_s=startup)
        for s in r["sweep"]:
            s["tpot_ms"] = tpot
        return r

    assert B.combine_rounds([run(25.0)])["single"]["tpot_ms"] == 25.0  # one round: unchanged
    row = B.combine_rounds([run(30.0, startup=270.0), run(22.0), run(24.0)])
    assert row["single"]["tpot_ms"] == 24.0 and row["single"]["tok_s"] == round(1e3 / 24.0, 2)
    assert [r["tpot_ms"] for r in row["rounds"]] == [30.0, 22.0, 24.0] and row["ok"]
    assert {s["concurrency"]: s["tpot_ms"] for s in row["sweep"]} == {1: 24.0, 4: 24.0, 16: 24.0, 64: 24.0}
    cut = B.combine_rounds([run(30.0), {"backend": "fastcomm", "ok": False, "error": "timed out"}])
    assert not cut["ok"] and "round 2: timed out" in cut["error"] and cut["single"]["tpot_ms"] == 30.0


def test_rounds_argument():
    assert B.parse_args(["--rounds", "2"]).rounds == 2
    with pytest.raises(SystemExit, match="rounds"):
        B.main(["--configs", "nccl", "--rounds", "0", "--model", str(B.REPO / "tests")])


def test_compare_turns_repeated_backends_into_rounds(tmp_path, capsys):
    meta = {"model": "glm5-78L-16E", "tp": 2, "max_tokens": 128, "capture_sizes": [1, 2, 4, 8]}
    for k, tok_s in enumerate((40.0, 50.0, 45.0)):
        (tmp_path / f"r{k}.json").write_text(json.dumps({"meta": meta, "results": {
            "nccl": result("nccl", list(range(128)), tok_s=tok_s)}}))
    assert B.main(["--compare"] + [str(tmp_path / f"r{k}.json") for k in range(3)]) == 0
    out = capsys.readouterr().out
    assert "rounds (in run order), TPOT ms: 25.00, 20.00, 22.22 (row: medians)" in out
    assert "nccl                200       45.0    22.22" in out


def test_cli_help_is_bench_decodes_own(capsys):
    from fastcomm import commands as cli

    with pytest.raises(SystemExit) as e:
        cli.main(["bench-decode", "--help"])
    assert e.value.code == 0 and "--rounds" in capsys.readouterr().out


def test_compare_never_merges_different_setups(tmp_path, capsys):
    # Session 3 merged a default-capture-sizes run under a "[1, 2, 4, 8]" header; such rows must say so.
    meta = {"model": "glm5-78L-16E", "tp": 2, "max_tokens": 128, "capture_sizes": [1, 2, 4, 8]}
    files = []
    for k, (sizes, tok_s) in enumerate((([1, 2, 4, 8], 40.0), (None, 50.0), ([1, 2, 4, 8], 44.0))):
        f = tmp_path / f"r{k}.json"
        f.write_text(json.dumps({"meta": {**meta, "capture_sizes": sizes},
                                 "results": {"fastcomm": result("fastcomm", list(range(128)), tok_s=tok_s,
                                                                fastcomm=True)}}))
        files.append(str(f))
    results, _ = B.merge_files([json.loads(open(f).read()) for f in files])
    assert set(results) == {"fastcomm", "fastcomm#2"}
    assert len(results["fastcomm"]["rounds"]) == 2  # the two [1, 2, 4, 8] runs are rounds of one row
    assert results["fastcomm#2"]["setup_note"] == "measured with capture_sizes vLLM default"
    assert B.main(["--compare"] + files) == 0
    out = capsys.readouterr().out
    assert "NOTE: measured with capture_sizes vLLM default (not as the header says)" in out


def test_max_num_seqs_option():
    # vLLM's default capture-size list depends on max_num_seqs (256 -> the 51 sizes the issue names).
    assert B.parse_args(["--max-num-seqs", "256"]).max_num_seqs == 256
    assert B.parse_args([]).max_num_seqs is None
    with pytest.raises(SystemExit, match="below the largest concurrency"):
        B.main(["--configs", "nccl", "--concurrency", "1,64", "--max-num-seqs", "8", "--model", str(B.REPO / "tests")])


def test_profile_concurrency_option():
    # Profiles at N concurrent requests show the all-reduce share where the issue's 8-concurrent figure is set.
    assert B.parse_args([]).profile_concurrency == 1
    assert B.parse_args(["--profile-concurrency", "8"]).profile_concurrency == 8
    for bad in ("0", "64"):
        with pytest.raises(SystemExit, match="--profile-concurrency"):
            B.main(["--configs", "nccl", "--concurrency", "1,8", "--profile-concurrency", bad,
                    "--model", str(B.REPO / "tests")])


def test_fastcomm_env_sets_one_knob_in_fastcomm_rows_only():
    # An A/B of one fastcomm knob (say FASTCOMM_ALGO=one_shot at 64 requests) in the same call.
    env = B.parse_fastcomm_env(["FASTCOMM_ALGO=one_shot", "FASTCOMM_MAX_BLOCKS=32"])
    assert env == {"FASTCOMM_ALGO": "one_shot", "FASTCOMM_MAX_BLOCKS": "32"}
    spec = {"fastcomm_env": env}
    assert B.row_env(B.BACKENDS["fastcomm-nofuse"], spec) == {**B.BACKENDS["fastcomm-nofuse"].env, **env}
    assert B.row_env(B.BACKENDS["nccl"], spec) == B.BACKENDS["nccl"].env  # baselines stay as they are
    assert B.row_env(B.BACKENDS["vllm"], {}) == {"FASTCOMM_VLLM": "0"}
    for bad in ("NCCL_PROTO=LL", "FASTCOMM_ALGO", "FASTCOMM_VLLM_FUSION=1", "FASTCOMM_TRANSPORT=host"):
        with pytest.raises(SystemExit, match="--fastcomm-env"):
            B.parse_fastcomm_env([bad])
    assert B.parse_args(["--fastcomm-env", "FASTCOMM_ALGO=one_shot"]).fastcomm_env == ["FASTCOMM_ALGO=one_shot"]


def test_compare_keeps_fastcomm_env_runs_apart(tmp_path):
    meta = {"model": "glm5-78L-16E", "tp": 2, "max_tokens": 128, "capture_sizes": None, "max_num_seqs": 256}
    files = []
    for k, extra in enumerate((None, {"FASTCOMM_ALGO": "one_shot"})):
        f = tmp_path / f"r{k}.json"
        f.write_text(json.dumps({"meta": {**meta, "fastcomm_env": extra},
                                 "results": {"fastcomm-nofuse": result("fastcomm-nofuse", list(range(128)),
                                                                       fastcomm=True)}}))
        files.append(str(f))
    results, _ = B.merge_files([json.loads(open(f).read()) for f in files])
    assert set(results) == {"fastcomm-nofuse", "fastcomm-nofuse#2"}
    assert "FASTCOMM_ALGO" in results["fastcomm-nofuse#2"]["setup_note"]


def test_prompts_are_random_ids_and_the_same_every_run():
    a = B._prompts(4, 32, 154880, seed=0)
    assert a == B._prompts(4, 32, 154880, seed=0) and len(a) == 4 and all(len(p) == 32 for p in a)
    assert all(len(set(p)) > 16 for p in a)  # not one id repeated (what runs before session 5 sent)
    assert len({tuple(p) for p in a}) == 4 and all(100 <= t < 154780 for p in a for t in p)


def test_compare_keeps_runs_with_the_old_prompts_apart():
    meta = {"model": "glm5-78L-16E", "tp": 2, "max_tokens": 128, "capture_sizes": None}
    old = {"meta": meta, "results": {"nccl": result("nccl", list(range(128)))}}
    new = {"meta": {**meta, "prompts": B.PROMPTS}, "results": {"nccl": result("nccl", list(range(128)))}}
    results, _ = B.merge_files([new, old])
    assert set(results) == {"nccl", "nccl#2"}
    assert results["nccl#2"]["setup_note"] == f"measured with prompts {B.LEGACY_PROMPTS}"


def test_spread_of_timed_runs_is_reported(capsys):
    assert B.spread_pct(None) is None and B.spread_pct([3.0]) is None
    assert B.spread_pct([3.0, 3.3, 2.7]) == pytest.approx(20.0)
    r = result("nccl", list(range(128)))
    r["single"]["runs_s"] = [3.0, 3.03, 3.0]
    r["sweep"][-1]["runs_s"] = [4.0, 4.4, 4.2]
    B.print_report({"nccl": r}, {"model": "m", "tp": 2, "max_tokens": 128})
    assert "spread of the timed runs, (max - min) / median: bs1 1.0 %, c=64 9.5 %" in capsys.readouterr().out


def test_rounds_pool_their_timed_runs():
    rounds = []
    for runs in ([3.0, 3.1], [3.2, 3.3]):
        r = result("nccl", list(range(128)))
        r["single"]["runs_s"] = runs
        r["sweep"][0]["runs_s"] = [x + 1 for x in runs]
        rounds.append(r)
    row = B.combine_rounds(rounds)
    assert row["single"]["runs_s"] == [3.0, 3.1, 3.2, 3.3]
    assert row["sweep"][0]["runs_s"] == [4.0, 4.1, 4.2, 4.3]
    assert "runs_s" not in row["sweep"][1]  # rounds that kept no runs pool nothing
