"""bench-decode's parent side on CPU: configs, model lookup, token comparison, merged reports.

Nothing here needs vLLM: the parent never imports it (only its worker processes do)."""
import json
import os
import sys
import types

import pytest

from fastcomm_bench import bench_decode as B
from fastcomm_bench import decode_backends, decode_merge, decode_models, decode_report, decode_worker


def result(name, tokens, tok_s=40.0, fastcomm=False):
    return {"backend": name, "ok": True, "startup_s": 200.0, "single": {"tok_s": tok_s, "tpot_ms": 1e3 / tok_s},
            "sweep": [{"concurrency": c, "out_tok_s": tok_s * c, "tpot_ms": 25.0, "decode_tok_s": 40.0 * c}
                      for c in (1, 4, 16, 64)],
            "greedy_tokens": tokens, "workers": [{"fastcomm": fastcomm, "why_not": None if fastcomm else "off"}] * 2}


def test_backends_cover_the_issue():
    assert {"vllm", "nccl", "fastcomm", "nccl-nop2p", "fastcomm-host"} <= set(decode_backends.BACKENDS)
    assert decode_backends.BACKENDS["fastcomm-nofuse"].env == {"FASTCOMM_VLLM": "1", "FASTCOMM_VLLM_FUSION": "0"}
    assert decode_backends.BACKENDS["nccl"].disable_custom_all_reduce and not decode_backends.BACKENDS["vllm"].disable_custom_all_reduce
    assert decode_backends.BACKENDS["fastcomm-host"].env == {"FASTCOMM_VLLM": "1", "FASTCOMM_TRANSPORT": "host",
                                               "FASTCOMM_VLLM_FUSION": "1", "NCCL_P2P_DISABLE": "1"}
    # Every fastcomm row names its fusion setting, so a row means the same whatever the default is.
    assert all("FASTCOMM_VLLM_FUSION" in b.env for b in decode_backends.BACKENDS.values() if b.fastcomm)
    assert decode_backends.BACKENDS["fastcomm"].env["FASTCOMM_VLLM_FUSION"] == "1"
    assert decode_backends.BACKENDS["nccl-nop2p"].env["NCCL_P2P_DISABLE"] == "1"
    assert all("FASTCOMM_VLLM" in b.env for b in decode_backends.BACKENDS.values())


def one_line_error(capsys, argv, *expected):
    """bench-decode's answer to a mistake: exit status 2 and one line on stderr naming it, no traceback."""
    assert B.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert all(e in err for e in expected), err
    return err


def test_shipped_configs_work_outside_the_repository(tmp_path, monkeypatch):
    # The default model comes with the package: found from any directory, without shared/models.
    monkeypatch.chdir(tmp_path)
    assert {"glm5-78L-16E", "glm5-mini"} <= set(decode_models.shipped())
    m = decode_models.resolve(B.parse_args([]).model)
    config = json.loads((decode_models.Path(m.engine["model"]) / "config.json").read_text())
    assert config["architectures"] == ["GlmMoeDsaForCausalLM"] and config["num_hidden_layers"] == 78
    assert (m.source, m.weights, m.engine["load_format"], m.mtp) == ("shipped", "dummy", "dummy", 0)
    assert "dummy weights" in m.describe()


def test_model_kinds(tmp_path):
    config = tmp_path / "cfg"
    config.mkdir()
    (config / "config.json").write_text("{}")
    m = decode_models.resolve(str(config))
    assert (m.source, m.weights, m.engine) == ("config", "dummy", {"model": str(config), "load_format": "dummy"})
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model-00001-of-00002.safetensors").write_bytes(b"")
    m = decode_models.resolve(str(ckpt))
    assert (m.source, m.weights, m.engine) == ("checkpoint", "real", {"model": str(ckpt)})
    assert "real weights" in m.describe()
    assert decode_models.resolve(str(ckpt), dummy=True).engine["load_format"] == "dummy"
    m = decode_models.resolve("zai-org/GLM-5", mtp=2)
    assert (m.source, m.weights, m.mtp, m.record_name) == ("huggingface", "real", 2, "zai-org/GLM-5")
    assert m.engine == {"model": "zai-org/GLM-5", "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}
    assert decode_models.resolve("zai-org/GLM-5", dummy=True).weights == "dummy"
    with pytest.raises(decode_models.ModelError, match="has no MTP layers"):
        decode_models.resolve(str(config), mtp=1)  # vLLM would fail minutes later, in its worker
    with pytest.raises(decode_models.ModelError, match="glm5-mini-mtp has one"):
        decode_models.resolve("glm5-mini", mtp=1)
    m = decode_models.resolve("glm5-mini-mtp", mtp=1)
    assert m.engine["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 1} and m.weights == "dummy"
    with pytest.raises(decode_models.ModelError, match="no such file or directory, not a shipped config"):
        decode_models.resolve("no-such-model")
    with pytest.raises(decode_models.ModelError, match="neither a GGUF file nor a directory"):
        decode_models.resolve(str(tmp_path))  # a directory without config.json


def fake_gguf(monkeypatch, calls):
    """fastcomm_vllm.gguf's contract (is_gguf, engine_kwargs, GgufError), for the parent's routing only."""
    mod = types.ModuleType("fastcomm_vllm.gguf")

    class GgufError(Exception):
        pass

    def engine_kwargs(model, *, mtp=None, num_speculative_tokens=1, **options):
        calls.append((model, mtp, num_speculative_tokens))
        assert options == {"derive_tokenizer": False}  # prompts are token ids: no tokenizer needed
        if "broken" in model:
            raise GgufError("tensor blk.3.ffn_down has type IQ1_S, which vLLM cannot read")
        kw = {"model": model, "load_format": "gguf", "tokenizer": "/tok"}
        if mtp:
            kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": num_speculative_tokens}
        return kw

    mod.is_gguf = lambda model: model.endswith(".gguf")
    mod.engine_kwargs, mod.GgufError = engine_kwargs, GgufError
    monkeypatch.setitem(sys.modules, "fastcomm_vllm.gguf", mod)


def test_gguf_models_go_through_the_gguf_contract(monkeypatch, capsys, tmp_path):
    calls = []
    for name in ("GLM-5-UD-Q4_K_XL-00001-of-00003.gguf", "x.gguf", "broken.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")  # the fake reader below answers for them
    m_ = str(tmp_path)
    fake_gguf(monkeypatch, calls)
    m = decode_models.resolve(f"{m_}/GLM-5-UD-Q4_K_XL-00001-of-00003.gguf", mtp=3)
    assert calls[-1] == (f"{m_}/GLM-5-UD-Q4_K_XL-00001-of-00003.gguf", True, 3)
    assert (m.source, m.weights, m.mtp, m.label) == ("gguf", "real", 3, "GLM-5-UD-Q4_K_XL-00001-of-00003")
    assert m.engine["load_format"] == "gguf" and m.engine["speculative_config"]["num_speculative_tokens"] == 3
    assert m.gguf == {"model": f"{m_}/GLM-5-UD-Q4_K_XL-00001-of-00003.gguf", "mtp": True, "num_speculative_tokens": 3}
    assert decode_models.resolve(f"{m_}/x.gguf", mtp=0).mtp == 0 and calls[-1][1] is False
    assert decode_models.resolve(f"{m_}/x.gguf").mtp == 0 and calls[-1][1] is None  # the file's default
    one_line_error(capsys, ["--model", f"{m_}/x.gguf", "--dummy"], "--dummy does not apply to a GGUF file")
    one_line_error(capsys, ["--model", f"{m_}/broken.gguf"], f"--model {m_}/broken.gguf: tensor blk.3.ffn_down")


def test_gguf_without_the_gguf_module_is_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "fastcomm_vllm.gguf", None)  # as in an install without it
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    one_line_error(capsys, ["--model", str(tmp_path / "x.gguf")], "needs fastcomm_vllm.gguf",
                   'pip install -e ".[vllm]"')
    one_line_error(capsys, ["--model", "/nonexistent/model.gguf"], "/nonexistent/model.gguf: no such file")


def test_arguments():
    a = B.parse_args(["--configs", "vllm,fastcomm", "--max-tokens", "64", "--capture-sizes", "1,2,4,8"])
    assert (a.configs, a.max_tokens, a.capture_sizes, a.concurrency) == ("vllm,fastcomm", 64, "1,2,4,8", "1,4,16,64")
    assert (B.parse_args(["--mtp", "2"]).mtp, B.parse_args(["--no-mtp"]).mtp, B.parse_args([]).mtp) == (2, 0, None)


def test_mistakes_are_one_line_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    one_line_error(capsys, ["--configs", "vllm,nvlink"], "unknown config")
    one_line_error(capsys, ["--compare", "/nonexistent.json"], "--compare /nonexistent.json", "No such file")
    (tmp_path / "bad.json").write_text("{")
    one_line_error(capsys, ["--compare", str(tmp_path / "bad.json")], "not JSON")
    (tmp_path / "other.json").write_text("[1, 2]")
    one_line_error(capsys, ["--compare", str(tmp_path / "other.json")], "not a bench-decode results file")
    one_line_error(capsys, ["--concurrency", "a,b"], "--concurrency 'a,b'")
    one_line_error(capsys, ["--concurrency", "4,0"], "--concurrency '4,0'")
    one_line_error(capsys, ["--capture-sizes", "x"], "--capture-sizes 'x'")
    one_line_error(capsys, ["--max-tokens", "many"], "--max-tokens")
    one_line_error(capsys, ["--mtp", "1", "--no-mtp"], "not allowed with")
    one_line_error(capsys, ["--mtp", "-1"], "--mtp -1")
    # counts and fractions every backend would start with, before any starts
    one_line_error(capsys, ["--tp", "0"], "--tp 0")
    one_line_error(capsys, ["--repeats", "0"], "--repeats 0")
    one_line_error(capsys, ["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5")
    one_line_error(capsys, ["--max-model-len", "100", "--max-tokens", "128"], "--max-model-len 100")
    one_line_error(capsys, ["--fastcomm-env", "FASTCOMM_TIMEOUT_S=-1"], "FASTCOMM_TIMEOUT_S")
    monkeypatch.setenv("FASTCOMM_MAX_BYTES", "8Q")  # a bad setting of the environment the rows inherit
    one_line_error(capsys, [], "FASTCOMM_MAX_BYTES")
    monkeypatch.delenv("FASTCOMM_MAX_BYTES")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json", "other.json"]  # nothing written


def test_out_is_checked_before_the_run(tmp_path, monkeypatch, capsys):
    # Minutes of vLLM start-up must not end in "cannot write the results".
    started = []
    monkeypatch.setattr(B, "run_backend", lambda *a, **k: started.append(a))
    one_line_error(capsys, ["--configs", "nccl", "--out", "/proc/nope/x.json"], "--out /proc/nope/x.json",
                   "cannot write there")
    one_line_error(capsys, ["--configs", "nccl", "--out", str(tmp_path)], "is a directory")
    assert not started


def test_without_vllm_it_refuses_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "vllm", None)  # what Python does for a package that is not there
    one_line_error(capsys, ["--configs", "nccl"], "vLLM is not installed", 'pip install -e ".[vllm]"')
    assert list(tmp_path.iterdir()) == []


def test_results_go_to_the_current_directory(tmp_path, monkeypatch, capsys):
    # Never into the source tree or site-packages: the default file lands where the command runs.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(B, "why_not_runnable", lambda fastcomm_rows: None)
    seen = []

    def run_backend(backend, spec, log_dir, timeout, tag=""):
        seen.append((backend.name, log_dir))
        return result(backend.name, list(range(64)))

    monkeypatch.setattr(B, "run_backend", run_backend)
    assert B.main(["--configs", "nccl", "--model", "glm5-mini", "--max-tokens", "64"]) == 0
    out = capsys.readouterr().out
    files = sorted(p.name for p in tmp_path.glob("decode-glm5-mini-*.json"))
    assert len(files) == 1 and seen[0][1].parent == tmp_path
    data = json.loads((tmp_path / files[0]).read_text())
    assert data["meta"]["model"] == "glm5-mini" and data["meta"]["weights"] == "dummy"
    assert "/" not in data["meta"]["model"]  # no path of this machine in the record
    assert "vLLM dummy weights" in out and "weights: vLLM dummy" in out


def test_token_comparison_and_active_check():
    base = list(range(100, 228))
    res = {"vllm": result("vllm", base), "fastcomm": result("fastcomm", base[:70] + [0] * 58, fastcomm=True),
           "fastcomm-host": result("fastcomm-host", base)}
    cmp = decode_report.compare_tokens(res)
    assert cmp["reference"] == "vllm"
    assert cmp["fastcomm"] == {"compared": 128, "matching": 70, "first_divergence": 70, "distinct_tokens": 71}
    assert cmp["vllm"]["first_divergence"] is None
    assert decode_report.check_active(res["fastcomm"]) is None
    assert "inactive" in decode_report.check_active(res["fastcomm-host"])  # a fastcomm row that ran without fastcomm
    assert decode_report.check_active(res["vllm"]) is None


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


def test_cli_hands_every_argument_to_bench_decode(capsys):
    # argparse's REMAINDER used to swallow a leading "--model": the CLI must pass arguments through as-is.
    from fastcomm import commands as cli

    assert cli.main(["bench-decode", "--model", "glm5-mini", "--configs", "nvlink"]) == 2
    assert "unknown config" in capsys.readouterr().err


def test_rounds_give_medians_and_keep_each_round():
    def run(tpot, ok=True, startup=100.0):
        r = result("fastcomm", list(range(64)), tok_s=1e3 / tpot, fastcomm=True)
        r["single"].update(ttft_ms=30.0, tpot_ms=tpot)
        r.update(ok=ok, startup_s=startup)
        for s in r["sweep"]:
            s["tpot_ms"] = tpot
        return r

    assert decode_merge.combine_rounds([run(25.0)])["single"]["tpot_ms"] == 25.0  # one round: unchanged
    row = decode_merge.combine_rounds([run(30.0, startup=270.0), run(22.0), run(24.0)])
    assert row["single"]["tpot_ms"] == 24.0 and row["single"]["tok_s"] == round(1e3 / 24.0, 2)
    assert [r["tpot_ms"] for r in row["rounds"]] == [30.0, 22.0, 24.0] and row["ok"]
    assert {s["concurrency"]: s["tpot_ms"] for s in row["sweep"]} == {1: 24.0, 4: 24.0, 16: 24.0, 64: 24.0}
    cut = decode_merge.combine_rounds([run(30.0), {"backend": "fastcomm", "ok": False, "error": "timed out"}])
    assert not cut["ok"] and "round 2: timed out" in cut["error"] and cut["single"]["tpot_ms"] == 30.0


def test_rounds_argument(capsys):
    assert B.parse_args(["--rounds", "2"]).rounds == 2
    one_line_error(capsys, ["--configs", "nccl", "--rounds", "0"], "--rounds")


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
    # A 2026-11-30 merge (run 3) put a default-capture-sizes run under a "[1, 2, 4, 8]" header; such rows must say so.
    meta = {"model": "glm5-78L-16E", "tp": 2, "max_tokens": 128, "capture_sizes": [1, 2, 4, 8]}
    files = []
    for k, (sizes, tok_s) in enumerate((([1, 2, 4, 8], 40.0), (None, 50.0), ([1, 2, 4, 8], 44.0))):
        f = tmp_path / f"r{k}.json"
        f.write_text(json.dumps({"meta": {**meta, "capture_sizes": sizes},
                                 "results": {"fastcomm": result("fastcomm", list(range(128)), tok_s=tok_s,
                                                                fastcomm=True)}}))
        files.append(str(f))
    results, _ = decode_merge.merge_files([json.loads(open(f).read()) for f in files])
    assert set(results) == {"fastcomm", "fastcomm#2"}
    assert len(results["fastcomm"]["rounds"]) == 2  # the two [1, 2, 4, 8] runs are rounds of one row
    assert results["fastcomm#2"]["setup_note"] == "measured with capture_sizes vLLM default"
    assert B.main(["--compare"] + files) == 0
    out = capsys.readouterr().out
    assert "NOTE: measured with capture_sizes vLLM default (not as the header says)" in out


def test_max_num_seqs_option(capsys):
    # vLLM's default capture-size list depends on max_num_seqs (256 -> the 51 sizes the issue names).
    assert B.parse_args(["--max-num-seqs", "256"]).max_num_seqs == 256
    assert B.parse_args([]).max_num_seqs is None
    one_line_error(capsys, ["--configs", "nccl", "--concurrency", "1,64", "--max-num-seqs", "8"],
                   "below the largest concurrency")


def test_profile_concurrency_option(capsys):
    # Profiles at N concurrent requests show the all-reduce share where the issue's 8-concurrent figure is set;
    # 1,2,4 profile the verify steps of 0, 1 and 3 drafts in one engine.
    assert B.parse_args([]).profile_concurrency == "1"
    assert B.parse_args(["--profile-concurrency", "1,2,4"]).profile_concurrency == "1,2,4"
    for bad in ("0", "64", "1,x", "2,2"):
        one_line_error(capsys, ["--configs", "nccl", "--concurrency", "1,8", "--profile-concurrency", bad],
                       "--profile-concurrency")


def test_a_profiled_run_moves_what_it_wrote_to_its_concurrencys_folder(tmp_path):
    # vLLM's profiler writes each profiled run's trace (a new file) and its CUDA-time table (the same file, rewritten)
    # into the backend's folder: the run at 4 requests must take both, and leave the 1-request trace alone.
    written = tmp_path / "vllm"
    written.mkdir()
    (written / "w.1.pt.trace.json.gz").write_text("c1")
    table = written / "profiler_out_0.txt"
    table.write_text("c1 table")
    before = decode_worker.stamps(written)
    table.write_text("c4 table")  # rewritten by the next run (a second later: coarse clocks tie)
    os.utime(table, ns=(before[table] + 10**9, before[table] + 10**9))
    (written / "w.2.pt.trace.json.gz").write_text("c4")
    assert decode_worker.profile_folder("vllm", 1) == "vllm" and decode_worker.profile_folder("vllm", 4) == "vllm-c4"
    folder = tmp_path / decode_worker.profile_folder("vllm", 4)
    decode_worker.move_profile(written, folder, before)
    assert sorted(f.name for f in written.iterdir()) == ["w.1.pt.trace.json.gz"]
    assert sorted(f.name for f in folder.iterdir()) == ["profiler_out_0.txt", "w.2.pt.trace.json.gz"]
    assert (folder / "profiler_out_0.txt").read_text() == "c4 table"
    decode_worker.move_profile(written, written, {})  # the 1-request run stays where vLLM wrote it
    assert sorted(f.name for f in written.iterdir()) == ["w.1.pt.trace.json.gz"]


def test_fastcomm_env_sets_one_knob_in_fastcomm_rows_only():
    # An A/B of one fastcomm knob (say FASTCOMM_ALGO=one_shot at 64 requests) in the same call.
    env = B.parse_fastcomm_env(["FASTCOMM_ALGO=one_shot", "FASTCOMM_MAX_BLOCKS=32"])
    assert env == {"FASTCOMM_ALGO": "one_shot", "FASTCOMM_MAX_BLOCKS": "32"}
    spec = {"fastcomm_env": env}
    assert decode_backends.row_env(decode_backends.BACKENDS["fastcomm-nofuse"], spec) == {**decode_backends.BACKENDS["fastcomm-nofuse"].env, **env}
    assert decode_backends.row_env(decode_backends.BACKENDS["nccl"], spec) == decode_backends.BACKENDS["nccl"].env  # baselines stay as they are
    assert decode_backends.row_env(decode_backends.BACKENDS["vllm"], {}) == {"FASTCOMM_VLLM": "0"}
    for bad in ("NCCL_PROTO=LL", "FASTCOMM_ALGO", "FASTCOMM_VLLM_FUSION=1", "FASTCOMM_TRANSPORT=host"):
        with pytest.raises(B.UsageError, match="--fastcomm-env"):
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
    results, _ = decode_merge.merge_files([json.loads(open(f).read()) for f in files])
    assert set(results) == {"fastcomm-nofuse", "fastcomm-nofuse#2"}
    assert "FASTCOMM_ALGO" in results["fastcomm-nofuse#2"]["setup_note"]


def test_prompts_are_random_ids_and_the_same_every_run():
    a = decode_worker.prompts(4, 32, 154880, seed=0)
    assert a == decode_worker.prompts(4, 32, 154880, seed=0) and len(a) == 4 and all(len(p) == 32 for p in a)
    assert all(len(set(p)) > 16 for p in a)  # not one id repeated (what runs before 2026-11-30 run 5 sent)
    assert len({tuple(p) for p in a}) == 4 and all(100 <= t < 154780 for p in a for t in p)


def test_compare_keeps_runs_with_the_old_prompts_apart():
    meta = {"model": "glm5-78L-16E", "tp": 2, "max_tokens": 128, "capture_sizes": None}
    old = {"meta": meta, "results": {"nccl": result("nccl", list(range(128)))}}
    new = {"meta": {**meta, "prompts": decode_merge.PROMPTS}, "results": {"nccl": result("nccl", list(range(128)))}}
    results, _ = decode_merge.merge_files([new, old])
    assert set(results) == {"nccl", "nccl#2"}
    assert results["nccl#2"]["setup_note"] == f"measured with prompts {decode_merge.LEGACY_PROMPTS}"


def test_spread_of_timed_runs_is_reported(capsys):
    assert decode_report.spread_pct(None) is None and decode_report.spread_pct([3.0]) is None
    assert decode_report.spread_pct([3.0, 3.3, 2.7]) == pytest.approx(20.0)
    r = result("nccl", list(range(128)))
    r["single"]["runs_s"] = [3.0, 3.03, 3.0]
    r["sweep"][-1]["runs_s"] = [4.0, 4.4, 4.2]
    decode_report.print_report({"nccl": r}, {"model": "m", "tp": 2, "max_tokens": 128})
    assert "spread of the timed runs, (max - min) / median: bs1 1.0 %, c=64 9.5 %" in capsys.readouterr().out


def test_report_gives_each_concurrency_its_tpot_and_first_token(capsys):
    """The sweep's TPOT beside its prompts' first token (the 1-token run: prefill and one step), which the out
    tok/s columns count together; rounds take the median of each; a sweep without first_ms prints no line."""
    r = result("nccl", list(range(128)))
    for s, first in zip(r["sweep"], (311.0, 500.0, 900.0, 1241.0)):
        s["first_ms"] = first
    decode_report.print_report({"nccl": r}, {"model": "m", "tp": 2, "max_tokens": 128})
    assert ("TPOT / first token of all the prompts, ms: c=1 25.00 / 311, c=4 25.00 / 500, c=16 25.00 / 900, "
            "c=64 25.00 / 1241") in capsys.readouterr().out
    other = result("nccl", list(range(128)))
    for s in other["sweep"]:
        s["first_ms"] = 100.0
    third = result("nccl", list(range(128)))
    for s in third["sweep"]:
        s["first_ms"] = 200.0
    assert decode_merge.combine_rounds([r, other, third])["sweep"][-1]["first_ms"] == 200.0
    decode_report.print_report({"nccl": result("nccl", list(range(128)))}, {"model": "m", "tp": 2})
    assert "first token" not in capsys.readouterr().out


def test_rounds_pool_their_timed_runs():
    rounds = []
    for runs in ([3.0, 3.1], [3.2, 3.3]):
        r = result("nccl", list(range(128)))
        r["single"]["runs_s"] = runs
        r["sweep"][0]["runs_s"] = [x + 1 for x in runs]
        rounds.append(r)
    row = decode_merge.combine_rounds(rounds)
    assert row["single"]["runs_s"] == [3.0, 3.1, 3.2, 3.3]
    assert row["sweep"][0]["runs_s"] == [4.0, 4.1, 4.2, 4.3]
    assert "runs_s" not in row["sweep"][1]  # rounds that kept no runs pool nothing


def test_accepted_tokens_per_step_from_vllms_counters():
    def snapshot(drafts, accepted, draft_tokens):  # LLM.get_metrics(): counters per engine, plus others
        names = (decode_worker.DRAFTS, decode_worker.ACCEPTED, decode_worker.DRAFT_TOKENS)
        return [types.SimpleNamespace(name=n, value=v / 2) for n, v in zip(names, (drafts, accepted, draft_tokens))
                for _ in range(2)] + [types.SimpleNamespace(name="vllm:num_requests_running", value=3)]

    before = decode_worker.spec_counters(snapshot(10, 5, 20))
    after = decode_worker.spec_counters(snapshot(110, 165, 220))
    got = decode_worker.acceptance(before, after)
    assert got == {"drafts": 100, "accepted": 160, "accepted_per_step": 1.6, "tokens_per_step": 2.6,
                   "acceptance_rate": 0.8}
    assert decode_worker.acceptance(before, before) is None  # no drafts: nothing to report


def test_report_puts_tokens_per_step_beside_tok_s(capsys):
    r = result("nccl", list(range(128)))
    r["single"]["spec_decode"] = {"drafts": 100, "accepted": 160, "accepted_per_step": 1.6, "tokens_per_step": 2.6}
    r["sweep"][1]["spec_decode"] = {"drafts": 50, "accepted": 40, "accepted_per_step": 0.8, "tokens_per_step": 1.8}
    decode_report.print_report({"nccl": r}, {"model": "m", "tp": 2, "max_tokens": 128, "mtp": 2, "weights": "real"})
    out = capsys.readouterr().out.splitlines()
    assert "weights: real  MTP 2 draft tokens" in out[0]
    assert out[1].split()[:6] == ["backend", "start", "s", "bs1", "tok/s", "tok/step"]
    assert out[2].split()[:4] == ["nccl", "200", "40.0", "2.60"]
    assert out[3].strip() == "accepted draft tokens per step: bs1 1.60, c=4 0.80"


def test_rounds_sum_spec_decode_counts_and_mtp_runs_stay_apart():
    rounds = []
    for drafts, accepted in ((100, 150), (300, 150)):
        r = result("nccl", list(range(128)))
        r["single"]["spec_decode"] = {"drafts": drafts, "accepted": accepted}
        rounds.append(r)
    assert decode_merge.combine_rounds(rounds)["single"]["spec_decode"] == {
        "drafts": 400, "accepted": 300, "accepted_per_step": 0.75, "tokens_per_step": 1.75}
    meta = {"model": "/old/machine/path/glm5-78L-16E", "tp": 2, "max_tokens": 128, "capture_sizes": None,
            "prompts": decode_merge.PROMPTS}  # a file from before weights and MTP were recorded
    new = {**meta, "model": "glm5-78L-16E", "weights": "dummy", "mtp": 0}
    results, _ = decode_merge.merge_files([{"meta": m, "results": {"nccl": result("nccl", list(range(128)))}}
                                           for m in (meta, new, {**new, "mtp": 2})])
    assert set(results) == {"nccl", "nccl#2"} and len(results["nccl"]["rounds"]) == 2
    assert results["nccl#2"]["setup_note"] == "measured with mtp 2"


def test_worker_engine_arguments():
    spec = {"tp": 2, "max_model_len": 2048, "max_num_seqs": None, "concurrency": [1, 8], "gpu_memory_utilization": 0.9,
            "capture_sizes": [1, 2], "mtp": 2, "engine": decode_models.resolve("glm5-mini-mtp", mtp=2).engine}
    kw = decode_worker.engine_kwargs(spec, decode_backends.BACKENDS["nccl"])
    assert kw["load_format"] == "dummy" and kw["model"].endswith("glm5-mini-mtp") and kw["max_num_seqs"] == 8
    assert kw["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2}
    assert kw["disable_log_stats"] is False  # LLM.get_metrics() needs it
    assert kw["disable_custom_all_reduce"] and kw["compilation_config"] == {"cudagraph_capture_sizes": [1, 2]}
    plain = decode_worker.engine_kwargs({**spec, "mtp": 0, "engine": {"model": "m"}}, decode_backends.BACKENDS["vllm"])
    assert "disable_log_stats" not in plain and "load_format" not in plain and not plain["disable_custom_all_reduce"]


def _specs_run(tmp_path, monkeypatch) -> list[dict]:
    """bench-decode in tmp_path with every backend's run replaced: the specs the worker would get, in order."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(B, "why_not_runnable", lambda fastcomm_rows: None)
    seen = []

    def run_backend(backend, spec, log_dir, timeout, tag=""):
        seen.append(spec)
        return result(backend.name, list(range(64)))

    monkeypatch.setattr(B, "run_backend", run_backend)
    return seen


def test_quantization_reaches_the_engine_and_the_record(tmp_path, monkeypatch, capsys):
    seen = _specs_run(tmp_path, monkeypatch)
    assert B.main(["--configs", "vllm", "--tp", "1", "--quantization", "fp8", "--max-tokens", "64",
                   "--out", str(tmp_path / "r.json")]) == 0
    assert seen[0]["engine"]["quantization"] == "fp8" and seen[0]["engine"]["load_format"] == "dummy"
    assert json.loads((tmp_path / "r.json").read_text())["meta"]["quantization"] == "fp8"
    assert "quantization fp8" in capsys.readouterr().out
    gguf = decode_models.Model("gguf", "m", "real", 0, {"model": "m.gguf"})
    monkeypatch.setattr(decode_models, "resolve", lambda *a, **k: gguf)
    one_line_error(capsys, ["--model", "m.gguf", "--quantization", "fp8"], "a GGUF file brings its own quantization")


def test_the_record_names_the_settings_every_row_inherited_and_runs_under_other_settings_stay_apart(
        tmp_path, monkeypatch, capsys):
    # A run under FASTCOMM_GGUF_DEQUANT_MIN_TOKENS=64 measured something else than one without it: the record
    # must say so, the report print it, and compare never pool the two as rounds.
    _specs_run(tmp_path, monkeypatch)
    for name in [n for n in os.environ if n.startswith("FASTCOMM_")]:  # the test runner's own, if any
        monkeypatch.delenv(name)
    monkeypatch.setenv("FASTCOMM_GGUF_DEQUANT_MIN_TOKENS", "64")
    monkeypatch.setenv("FASTCOMM_CACHE_DIR", str(tmp_path / "cache"))  # where kernels live: not a setting
    assert B.main(["--configs", "vllm", "--tp", "1", "--max-tokens", "64", "--out", str(tmp_path / "r.json")]) == 0
    meta = json.loads((tmp_path / "r.json").read_text())["meta"]
    assert meta["settings"] == {"FASTCOMM_GGUF_DEQUANT_MIN_TOKENS": "64"}
    assert "settings FASTCOMM_GGUF_DEQUANT_MIN_TOKENS=64" in capsys.readouterr().out
    monkeypatch.delenv("FASTCOMM_GGUF_DEQUANT_MIN_TOKENS")
    assert B.settings_set({}) is None
    tune = tmp_path / "tune.json"
    tune.write_text("{}")
    assert B.settings_set({"FASTCOMM_TUNE_FILE": str(tune)}) == {"FASTCOMM_TUNE_FILE": "tune.json"}  # no path
    other = {**meta, "settings": None}
    tokens = list(range(64))
    results, _ = decode_merge.merge_files([{"meta": m, "results": {"vllm": result("vllm", tokens)}}
                                           for m in (meta, other)])
    assert set(results) == {"vllm", "vllm#2"}


def test_spread_routing_reaches_the_worker_and_the_record_and_refuses_real_weights(tmp_path, monkeypatch, capsys):
    seen = _specs_run(tmp_path, monkeypatch)
    assert B.main(["--configs", "vllm", "--tp", "1", "--quantization", "fp8", "--spread-routing", "--max-tokens",
                   "64", "--out", str(tmp_path / "r.json")]) == 0
    assert seen[0]["spread_routing"] is True
    assert json.loads((tmp_path / "r.json").read_text())["meta"]["spread_routing"] is True
    assert "routers re-drawn to spread tokens" in capsys.readouterr().out
    gguf = decode_models.Model("gguf", "m", "real", 0, {"model": "m.gguf"})
    monkeypatch.setattr(decode_models, "resolve", lambda *a, **k: gguf)
    one_line_error(capsys, ["--model", "m.gguf", "--spread-routing"], "this model has real ones")


def _moe_model(layers, hidden, experts, dummy=1e-3):
    """Decoder layers named as vLLM's DeepSeek-V2 / GLM-5 ones, holding vLLM 0.25's dummy values."""
    import torch

    def param(*shape):
        return torch.nn.Parameter((torch.rand(*shape) * 2 - 1) * dummy)

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList()
    for i in range(layers):
        layer = torch.nn.Module()
        layer.post_attention_layernorm = torch.nn.Module()
        layer.post_attention_layernorm.weight = param(hidden)
        layer.mlp = torch.nn.Module()
        if i > 0:  # a dense first layer: an MLP without a router
            layer.mlp.gate = torch.nn.Module()
            layer.mlp.gate.weight = param(experts, hidden)
            layer.mlp.gate.e_score_correction_bias = param(experts)
        model.layers.append(layer)
    return model


def _routed(layer, tokens, topk):
    """noaux_tc's choice for ``tokens`` normalized inputs: top-k of sigmoid(logits) + bias, and the logits."""
    import torch

    h = tokens / tokens.pow(2).mean(-1, keepdim=True).sqrt() * layer.post_attention_layernorm.weight
    logits = h @ layer.mlp.gate.weight.T
    chosen = (torch.sigmoid(logits) + layer.mlp.gate.e_score_correction_bias).topk(topk, dim=-1).indices
    return {tuple(sorted(row.tolist())) for row in chosen}, logits


def test_spread_router_sends_tokens_to_different_experts():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    hidden, experts, topk = 512, 16, 8
    model = _moe_model(3, hidden, experts)
    tokens = torch.randn(8, hidden)
    before, _ = _routed(model.layers[1], tokens, topk)
    assert len(before) == 1  # dummy weights: the bias decides, every token takes the same experts
    assert decode_worker.spread_router_(model, seed=3) == 2  # the two layers with a router
    with torch.no_grad():
        after, logits = _routed(model.layers[1], tokens, topk)
    assert len(after) == 8 and len(set().union(*after)) >= 12  # each token its own set; most experts read
    assert 0.7 < float(logits.std()) < 1.4  # unit-variance logits for the layer's normalized input
    again = _moe_model(3, hidden, experts)
    again.load_state_dict(model.state_dict())
    decode_worker.spread_router_(again, seed=3)
    assert torch.equal(again.layers[2].mlp.gate.weight, model.layers[2].mlp.gate.weight)  # seeded


def test_a_sampled_sweep_gives_each_request_its_own_seed():
    # Greedy decoding of random weights gives every request the same few tokens, whose step then reads one
    # request's experts: --sweep-temperature samples the sweep, a seed a request, the same draws every repeat.
    SamplingParams = pytest.importorskip("vllm").SamplingParams

    greedy = decode_worker.sweep_params(SamplingParams, 8, 16, 0.0, seed=0)
    assert isinstance(greedy, SamplingParams) and greedy.temperature == 0.0 and greedy.max_tokens == 16
    sampled = decode_worker.sweep_params(SamplingParams, 8, 16, 1.0, seed=0)
    assert len(sampled) == 8 and {p.temperature for p in sampled} == {1.0} and len({p.seed for p in sampled}) == 8
    assert [p.seed for p in sampled] == [p.seed for p in decode_worker.sweep_params(SamplingParams, 8, 4, 1.0, 0)]


def test_a_sampled_sweep_reaches_the_record_and_counts_how_its_tokens_spread(tmp_path, monkeypatch, capsys):
    # steps: {1}, {2, 5}, {3, 4}: median 2 distinct tokens a step; one request has no spread to speak of
    assert decode_worker.distinct_per_step([[1, 2, 3], [1, 5, 3], [1, 2, 4]]) == 2
    assert decode_worker.distinct_per_step([[1, 2, 3]]) is None
    seen = _specs_run(tmp_path, monkeypatch)
    assert B.main(["--configs", "vllm", "--tp", "1", "--max-tokens", "64", "--sweep-temperature", "1",
                   "--out", str(tmp_path / "r.json")]) == 0
    assert seen[0]["sweep_temperature"] == 1.0
    meta = json.loads((tmp_path / "r.json").read_text())["meta"]
    assert meta["sweep_temperature"] == 1.0 and "sweep sampled at temperature 1" in capsys.readouterr().out
    # a greedy sweep (also every file from before the key) measured something else: never pooled as rounds
    tokens = list(range(64))
    old = {k: v for k, v in meta.items() if k != "sweep_temperature"}
    results, _ = decode_merge.merge_files([{"meta": m, "results": {"vllm": result("vllm", tokens)}}
                                           for m in (meta, old)])
    assert set(results) == {"vllm", "vllm#2"} and "sweep_temperature 0.0" in results["vllm#2"]["setup_note"]
    one_line_error(capsys, ["--sweep-temperature", "-1"], "--sweep-temperature -1", "finite number >= 0")


def test_the_report_says_how_many_distinct_tokens_a_swept_step_had(capsys):
    r = result("vllm", list(range(64)))
    r["sweep"] = [{"concurrency": 8, "out_tok_s": 300.0, "tpot_ms": 21.0, "decode_tok_s": 380.0, "first_ms": 650.0,
                   "distinct_tokens": 7.5}]
    decode_report.print_report({"vllm": r}, {"model": "m", "tp": 1, "max_tokens": 64})
    assert "distinct tokens across the requests a step (median): c=8 7.5" in capsys.readouterr().out


def test_max_num_batched_tokens_reaches_the_engine_and_must_hold_the_largest_batch_of_prompts(tmp_path, monkeypatch,
                                                                                              capsys):
    # vLLM's start-up profiles memory with a dummy prefill of max_num_batched_tokens (16384 by default): the
    # figures lower it to the model length; below the sweep's prompts it would split their prefill.
    seen = _specs_run(tmp_path, monkeypatch)
    assert B.main(["--configs", "vllm", "--tp", "1", "--max-tokens", "64", "--concurrency", "1,8",
                   "--max-num-batched-tokens", "2048", "--out", str(tmp_path / "r.json")]) == 0
    kwargs = decode_worker.engine_kwargs(seen[0], decode_backends.BACKENDS["vllm"])
    assert kwargs["max_num_batched_tokens"] == 2048
    assert "max_num_batched_tokens" not in decode_worker.engine_kwargs({**seen[0], "max_num_batched_tokens": None},
                                                                      decode_backends.BACKENDS["vllm"])
    meta = json.loads((tmp_path / "r.json").read_text())["meta"]
    assert meta["max_num_batched_tokens"] == 2048 and "max_num_batched_tokens 2048" in capsys.readouterr().out
    assert "max_num_batched_tokens" in decode_merge.SETUP_KEYS
    one_line_error(capsys, ["--concurrency", "1,8", "--prompt-len", "32", "--max-num-batched-tokens", "255"],
                   "--max-num-batched-tokens 255", "8 x 32 tokens")


def test_standin_us_mistakes_are_one_line_before_any_backend_starts(tmp_path, monkeypatch, capsys):
    seen = _specs_run(tmp_path, monkeypatch)
    one_line_error(capsys, ["--tp", "1", "--standin-us", "x"], "--standin-us 'x'", "microseconds")
    one_line_error(capsys, ["--tp", "1", "--standin-us", "5,-1"], "--standin-us '5,-1'", ">= 0")
    one_line_error(capsys, ["--tp", "1", "--standin-us", "nan"], "--standin-us 'nan'")
    # At TP > 1 the real all-reduces run: a stand-in there would time them twice.
    one_line_error(capsys, ["--tp", "2", "--standin-us", "5"], "--tp 2")
    assert seen == [] and list(tmp_path.iterdir()) == []


def test_standin_us_reaches_the_spec_and_every_rows_environment(tmp_path, monkeypatch):
    seen = _specs_run(tmp_path, monkeypatch)
    assert B.main(["--configs", "vllm,fastcomm", "--tp", "1", "--max-tokens", "64", "--standin-us", "0,5,10",
                   "--out", str(tmp_path / "r.json")]) == 0
    assert [s["standin_us"] for s in seen] == [[0.0, 5.0, 10.0]] * 2
    assert json.loads((tmp_path / "r.json").read_text())["meta"]["standin_us"] == [0.0, 5.0, 10.0]
    # Every row, baselines too, starts with the stand-ins at the first time (the worker sets the others).
    for name in ("vllm", "nccl", "fastcomm"):
        env = decode_backends.row_env(decode_backends.BACKENDS[name], seen[0])
        assert env["FASTCOMM_TEST_MODE"] == "1" and env["FASTCOMM_TEST_STANDIN_US"] == "0", env
        assert env.items() >= decode_backends.BACKENDS[name].env.items()
    # ... and the plugin's own configuration accepts what the row sets.
    from fastcomm.config import Config

    assert Config.from_env(decode_backends.row_env(decode_backends.BACKENDS["vllm"], seen[0])).test_standin_us == 0.0
    seen.clear()
    assert B.main(["--configs", "vllm", "--tp", "1", "--max-tokens", "64", "--out", str(tmp_path / "s.json")]) == 0
    assert seen[0].get("standin_us") is None
    env = decode_backends.row_env(decode_backends.BACKENDS["vllm"], seen[0])
    assert "FASTCOMM_TEST_STANDIN_US" not in env and "FASTCOMM_TEST_MODE" not in env
    # A stand-in run is another measurement: --compare never pools it with a plain run as rounds of one row.
    plain, standin = (json.loads((tmp_path / f).read_text())["meta"] for f in ("s.json", "r.json"))
    assert decode_merge._setup(plain) != decode_merge._setup(standin)


def test_deadline_bounds_each_backend():
    # shard runs pass the device call's end: a backend started late gets what is left, never more than --timeout
    assert B.parse_args(["--deadline", "1000.5"]).deadline == 1000.5
    assert B.parse_args([]).deadline is None
    assert B.backend_timeout(1500, None, 10.0) == 1500
    assert B.backend_timeout(1500, 400.0, 100.0) == 300.0
    assert B.backend_timeout(200, 400.0, 100.0) == 200
    assert B.backend_timeout(1500, 400.0, 500.0) == 1.0   # past it: cut at once, the row says timed out
