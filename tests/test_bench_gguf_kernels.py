"""bench/gguf_kernels.py's report on the CPU (the timings need a GPU): the policy's form per op, speed-ups, and
the per-step sums weighted by how many layers run each product."""
from fastcomm_bench import gguf_kernels as gk


def test_report_weights_each_product_by_its_layers():
    rows = [{"op": name, "tokens": 1, "weight_MB": 1.0, "plugin_us": 10.0, "default": "staged", "mma_us": 4.5,
             "staged_us": 4.0, "unstaged_us": 5.0, "bf16_cublas_us": 3.0, "rel_diff_vs_plugin": 0.001}
            for name, *_ in gk.LINEARS]
    rows.append({"op": gk.MOE[0], "tokens": 1, "weight_MB_read": 2.0, "plugin_us": 100.0, "default": "grouped",
                 "grouped_us": 90.0, "pairs_us": 80.0, "rel_diff_vs_plugin": 0.01})
    text, steps = gk.report(rows, [1])
    layers = sum(n for *_, n in gk.LINEARS)
    assert steps[1]["plugin_us"] == round((10.0 * layers + 100.0 * gk.MOE[-1]) / 1000, 2)
    assert steps[1]["fastcomm_default_us"] == round((4.0 * layers + 90.0 * gk.MOE[-1]) / 1000, 2)
    assert steps[1]["fastcomm_best_us"] == round((4.0 * layers + 80.0 * gk.MOE[-1]) / 1000, 2)
    assert "| 90.0 (grouped) | 1.11x | grouped 90.0, pairs 80.0 |" in text
    assert "| 4.0 (staged) | 2.50x | mma 4.5, staged 4.0, unstaged 5.0 | 3.0 |" in text


def _rows(mma: dict[int, float], grouped: dict[int, float]) -> list[dict]:
    """Every linear at mma_us = mma[n] against staged 4.0 / unstaged 5.0; the MoE grouped[n] against pairs 80."""
    rows = []
    for n in mma:
        rows += [{"op": name, "tokens": n, "mma_us": mma[n], "staged_us": 4.0, "unstaged_us": 5.0}
                 for name, *_ in gk.LINEARS]
        rows.append({"op": gk.MOE[0], "tokens": n, "grouped_us": grouped[n], "pairs_us": 80.0})
    return rows


def test_suggest_takes_the_fewest_tokens_from_which_the_tensor_cores_win_at_every_larger_count():
    got = gk.suggest(_rows({1: 4.5, 2: 3.9, 4: 3.0, 8: 2.0}, {1: 90.0, 2: 70.0, 4: 60.0, 8: 50.0}))
    assert got == {"mma_min_tokens": 2, "grouped_min_tokens": 2}
    # a win at 2 but a loss at 4: 2 is no threshold (the form would serve 4 too)
    got = gk.suggest(_rows({1: 4.5, 2: 3.9, 4: 4.2, 8: 2.0}, {1: 79.0, 2: 70.0, 4: 60.0, 8: 50.0}))
    assert got == {"mma_min_tokens": 8, "grouped_min_tokens": 1}
    got = gk.suggest(_rows({1: 4.5, 8: 4.1}, {1: 90.0, 8: 81.0}))
    assert got == {"mma_min_tokens": gk.NEVER, "grouped_min_tokens": gk.NEVER}


def test_a_prefill_s_rows_suggest_the_dequantized_forms_and_sum_without_the_lm_head():
    """Prefill rows (past kquant.MAX_TOKENS: plugin against dequant only, no LM head) leave the decode thresholds
    to the decode rows and suggest the dequantized forms' from where they win at every larger count; the MoE's as
    routed tokens an expert (16 experts, top 8: 64 tokens are 32 an expert)."""
    rows = _rows({4: 3.0, 8: 2.0}, {4: 90.0, 8: 50.0})
    for n, linear_us, moe_us in ((16, 12.0, 400.0), (64, 9.0, 300.0), (256, 8.0, 200.0)):
        rows += [{"op": name, "tokens": n, "weight_MB": 1.0, "plugin_us": 10.0, "default": "plugin",
                  "dequant_us": linear_us, "bf16_cublas_us": 1.0, "rel_diff_vs_plugin": 0.004}
                 for name, *_ in gk.LINEARS if name != "lm_head"]
        rows.append({"op": gk.MOE[0], "tokens": n, "weight_MB_read": 2.0, "plugin_us": 350.0, "default": "plugin",
                     "dequant_us": moe_us, "rel_diff_vs_plugin": 0.01})
    got = gk.suggest(rows)
    assert got == {"mma_min_tokens": 4, "grouped_min_tokens": 8, "dequant_min_tokens": 64, "dequant_moe_min": 32}
    assert gk._settings(got).endswith("FASTCOMM_GGUF_DEQUANT_MIN_TOKENS=64 FASTCOMM_GGUF_DEQUANT_MOE_MIN=32")
    text, steps = gk.report([r for r in rows if r["tokens"] == 256], [256])
    layers = sum(n for name, *_, n in gk.LINEARS if name != "lm_head")
    assert steps[256]["plugin_us"] == round((10.0 * layers + 350.0 * gk.MOE[-1]) / 1000, 2)
    assert steps[256]["fastcomm_best_us"] == round((8.0 * layers + 200.0 * gk.MOE[-1]) / 1000, 2)
    assert "# per prefill of 256 tokens (no LM head)" in text
    assert gk.MAX_DECODE == 8


def test_prefill_rows_with_chunks_suggest_how_far_the_chunks_go_and_dequant_against_the_better_other():
    """Each row of a prefill count: the plugin 100 us a linear, 1000 the MoE; dequant 60 a linear at every count;
    chunks (eagerly launched; their graph time is half) cheap at 16, dear at 256. Dequant's thresholds come
    against the better of the plugin and the chunks, and the chunks go as far as they beat the plugin where
    dequant leaves them work."""
    def prefill(chunks, moe_dequant=500.0):
        rows = []
        for n, (lin, moe) in chunks.items():
            rows += [{"op": name, "tokens": n, "plugin_us": 100.0, "dequant_us": 60.0, "chunks_us": lin / 2,
                      "chunks_eager_us": lin} for name, *_ in gk.LINEARS if name != "lm_head"]
            rows.append({"op": gk.MOE[0], "tokens": n, "plugin_us": 1000.0, "dequant_us": moe_dequant,
                         "chunks_us": moe / 2, "chunks_eager_us": moe})
        return _rows({8: 2.0}, {8: 50.0}) + rows

    got = gk.suggest(prefill({16: (20.0, 200.0), 64: (80.0, 400.0), 256: (320.0, 3200.0)}))
    # linears: a prefill's chunks are host-bound (never taken eagerly), so dequant (60) against the plugin (100)
    # from 16; the MoE's dequant (500) beats its chunks only at 256 (3200), 128 routed tokens an expert; so the
    # chunks take the MoE at 16 and 64, where they beat the plugin, and up to 256, where dequant takes over
    assert (got["dequant_min_tokens"], got["dequant_moe_min"], got["chunk_max_tokens"]) == (16, 128, 256)
    assert gk._settings(got).endswith("FASTCOMM_GGUF_DEQUANT_MOE_MIN=128 FASTCOMM_GGUF_CHUNK_MAX_TOKENS=256")
    # the MoE's chunks at 64: 550 us in a graph would beat the plugin's 1000, but a prefill runs them eagerly
    got = gk.suggest(prefill({16: (20.0, 200.0), 64: (80.0, 1100.0), 256: (320.0, 3200.0)}, moe_dequant=5000.0))
    assert (got["dequant_moe_min"], got["chunk_max_tokens"]) == (0, 16)
    # chunks that lose at the smallest count never start
    got = gk.suggest(prefill({16: (120.0, 1200.0), 64: (80.0, 800.0)}, moe_dequant=5000.0))
    assert got["chunk_max_tokens"] == 0
    rows = [dict(r, weight_MB=1.0, default="chunks", rel_diff_vs_plugin=0.01) for r in prefill({16: (20.0, 200.0)})
            if r["tokens"] == 16]
    text, _ = gk.report(rows, [16])
    assert "| 10.0 (chunks) | 10.00x | dequant 60.0, chunks 10.0 (eager 20.0) |" in text


def test_suggest_prints_settings_from_a_saved_run(tmp_path, capsys):
    import json

    path = tmp_path / "run.json"
    path.write_text(json.dumps({"rows": _rows({4: 3.0, 8: 2.0}, {4: 90.0, 8: 50.0})}))
    assert gk.main(["--suggest", str(path)]) == 0
    assert capsys.readouterr().out.strip() == "FASTCOMM_GGUF_MMA_MIN_TOKENS=4 FASTCOMM_GGUF_GROUPED_MIN_TOKENS=8"


def test_device_ab_takes_committed_trees_and_names_what_is_missing(tmp_path):
    """bench/device_gguf.sh ab-prepare writes a revision's tree as DIR/REV.tar (what `ab` runs on the device);
    `ab` without the gguf wheel in DIR stops with a line naming it, before running anything."""
    import shutil
    import subprocess
    import tarfile
    from pathlib import Path

    import pytest

    root = Path(__file__).resolve().parents[1]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("needs a git checkout")
    script = root / "bench" / "device_gguf.sh"
    done = subprocess.run(["bash", str(script), "ab-prepare", str(tmp_path), "HEAD"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    with tarfile.open(tmp_path / "HEAD.tar") as tar:
        assert {"csrc/kquant/kquant_mma.cuh", "bench/gguf_kernels.py", "tests/gguf/test_kquant_gpu.py"} <= set(tar.getnames())
    done = subprocess.run(["bash", str(script), "ab", str(tmp_path), "HEAD"], capture_output=True, text=True)
    assert done.returncode == 1 and "no gguf wheel in" in done.stderr

def test_device_ab_times_a_tree_whose_tests_fail(tmp_path):
    """`ab` runs the first tree's GPU tests, then every tree's kernel table: a failed test marks the call failed
    but still leaves the table (device time is scarce). A stand-in `python` fails pytest
    and writes a table line."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    import pytest

    root = Path(__file__).resolve().parents[1]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("needs a git checkout")
    script = root / "bench" / "device_gguf.sh"
    stage, out, bindir = tmp_path / "stage", tmp_path / "out", tmp_path / "bin"
    bindir.mkdir()
    subprocess.run(["bash", str(script), "ab-prepare", str(stage), "HEAD"], check=True, capture_output=True)
    (stage / "gguf-0.19.0-py3-none-any.whl").write_bytes(b"")
    fake = bindir / "python"
    fake.write_text('#!/bin/bash\nif [ "$2" = pytest ]; then echo "1 failed, 2 passed"; exit 1; fi\n'
                    'for a in "$@"; do [ "$prev" = --json ] && echo "{}" > "$a"; prev=$a; done\n'
                    'echo "# per decode step at 8 token(s), these products only (ms): fastcomm 1.0"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "OUT": str(out), "AB_TESTS": "1",
           "AB_TOKENS": "8"}
    done = subprocess.run(["bash", str(script), "ab", str(stage), "HEAD"], capture_output=True, text=True, env=env)
    assert done.returncode == 1 and "== ab: HEAD failed" in done.stdout
    assert "HEAD # per decode step at 8 token(s)" in done.stdout
    assert (out / "kernels-HEAD.json").exists() and "1 failed" in (out / "tests-HEAD.log").read_text()


def test_kquant_profile_takes_every_benchmarked_product_and_refuses_a_token_count_the_kernels_do_not_serve(capsys):
    import pytest

    from fastcomm_bench import gguf_kernels as gk
    from fastcomm_bench import kquant_profile as kp

    for op in {"moe"} | {name.split(" (")[0] for name, *_ in gk.LINEARS}:
        assert kp.parse(["--op", op]).op == op
    with pytest.raises(SystemExit):
        kp.parse(["--op", "not_a_product"])
    args = kp.parse(["--op", "o_proj", "--form", "mma"])
    assert (args.op, args.tokens, args.form, args.calls) == ("o_proj", 8, "mma", 4)
    with pytest.raises(SystemExit):
        kp.parse(["--op", "moe", "--tokens", "9"])
    assert "--tokens 9: the kernels serve 1-8" in capsys.readouterr().err


def test_device_ncu_names_what_is_missing(tmp_path):
    """`bash bench/device_gguf.sh ncu DIR` stops with one line naming the missing tool or wheel."""
    import os
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "device_gguf.sh"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    env = {**os.environ, "PATH": f"{bindir}:/usr/bin:/bin", "CUDA_HOME": str(tmp_path / "nocuda")}
    done = subprocess.run(["bash", str(script), "ncu", str(tmp_path)], capture_output=True, text=True, env=env)
    assert done.returncode == 1 and "no ncu on PATH" in done.stderr
    ncu = bindir / "ncu"
    ncu.write_text("#!/bin/bash\nexit 0\n")
    ncu.chmod(0o755)
    done = subprocess.run(["bash", str(script), "ncu", str(tmp_path)], capture_output=True, text=True, env=env)
    assert done.returncode == 1 and "no gguf wheel in" in done.stderr


def test_device_figures_take_the_tensor_parallel_size_and_its_rows(tmp_path):
    """`figures` at FIGURE_TP=2 (the issue's TP 2 on a two-GPU machine) runs bench-decode at --tp 2 for
    fastcomm's all-reduce and vLLM's own, one process each; unset, TP 1 and vLLM's row alone. Stand-ins for
    python, fastcomm and nvidia-smi record what would run."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    import pytest

    root = Path(__file__).resolve().parents[1]
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    bindir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bindir.mkdir()
    for name in ("python", "python3", "nvidia-smi"):
        (bindir / name).write_text("#!/bin/bash\nexit 0\n")
    (bindir / "fastcomm").write_text(f'#!/bin/bash\necho "$*" >> {calls}\n')
    for f in bindir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "FIGURE_CONCURRENCY": "1,8"}

    def run(**extra) -> list[str]:
        calls.unlink(missing_ok=True)
        subprocess.run(["bash", str(root / "bench" / "device_gguf.sh"), "figures", str(tmp_path), "gguf"],
                       cwd=root, capture_output=True, text=True, env={**env, **extra})
        return [line for line in calls.read_text().splitlines() if line.startswith("bench-decode --model")]

    two = run(FIGURE_TP="2")
    assert [line.split("--configs ")[1].split()[0] for line in two] == ["fastcomm-nofuse", "vllm"]
    assert all("--tp 2 " in line and "--concurrency 1,8" in line for line in two)
    one = run()
    assert len(one) == 1 and "--configs vllm " in one[0] and "--tp 1 " in one[0]


def test_a_prefill_row_times_each_form_from_its_own_calls(monkeypatch):
    """_prefill_times on the CPU with the timers replaced by ones that run what they time: the dequantized form
    runs on every weight copy with the policy's kernel and with the other one, and each form's difference is
    its own result's against the plugin's."""
    import torch

    ran = []
    monkeypatch.setattr(gk, "_graph_time_us", lambda fns: len([f() for f in fns]) * 1.0)
    monkeypatch.setattr(gk, "_eager_us", lambda fn: fn().numel() * 0.0 + 9.0)
    ref = torch.ones(4, 4)

    def dequant(w, kernel=None):
        ran.append((w, kernel))
        return ref * (1.5 if kernel == gk.OTHER_DEQUANT else 1.25)

    row = gk._prefill_times([lambda: ref], dequant, ["w0", "w1"], [lambda: ref * 0.5] * 3)
    assert set(ran) == {(w, k) for w in ("w0", "w1") for k in (None, gk.OTHER_DEQUANT)}
    assert (row["plugin_us"], row["dequant_us"], row[f"dequant_{gk.OTHER_DEQUANT}_us"]) == (1.0, 2.0, 2.0)
    assert (row["chunks_us"], row["chunks_eager_us"]) == (3.0, 9.0)
    assert (row["rel_diff_vs_plugin"], row["chunks_rel_diff_vs_plugin"]) == (0.25, 0.5)


def test_tp_shapes_are_one_rank_s_share_as_the_tp8_shard_holds_it():
    """--tp 8 times the products at the shapes the TP 8 shard GGUF (synth.rank_shard) gives rank 0."""
    import pytest

    pytest.importorskip("gguf")  # synth writes GGUF files (the gguf extra)
    from fastcomm_vllm.gguf import synth

    full, _ = gk.tp_shapes(1)
    linears, moe = gk.tp_shapes(8)
    s = synth.TP8_SHARD
    got = {name.split(" (")[0]: (sum(r for _, r in shards), cols) for name, shards, cols, _ in linears}
    whole = {name.split(" (")[0]: (sum(r for _, r in shards), cols) for name, shards, cols, _ in full}
    assert got["q_b"] == (s.heads * (s.qk_nope + s.rope), s.q_lora)
    assert got["o_proj"] == (s.hidden, s.heads * s.v_head)
    assert got["shared gate_up"] == (2 * s.moe_ffn, s.hidden)
    assert got["shared down"] == (s.hidden, s.moe_ffn)
    assert got["dense gate_up"] == (2 * s.ffn, s.hidden)
    assert got["dense down"] == (s.hidden, s.ffn)
    assert got["lm_head"] == (s.vocab, s.hidden)
    assert moe[4] == s.moe_ffn and moe[2:4] == gk.MOE[2:4]
    assert moe[1] == s.experts == 256 and moe[0].startswith("routed experts (256, top 8;")  # every expert a slice
    for replicated in ("fused_qkv_a", "indexer wq_b"):
        assert got[replicated] == whole[replicated]
    with pytest.raises(ValueError, match="tensor parallel 3"):
        gk.tp_shapes(3)


def test_routes_are_distinct_across_a_steps_tokens_where_the_experts_allow():
    """The benchmark's routes as the TP 8 shard's routers spread a verify step: 8 distinct experts a token and
    none shared between tokens while 256 experts allow it; 16 experts share past 2 tokens."""
    import numpy as np

    for n in (1, 2, 4, 8):
        ids = gk.route_ids(n, 256, 8, np.random.default_rng(n))
        assert ids.shape == (n, 8) and ids.dtype == np.int32 and len(set(ids.flatten())) == 8 * n
    assert len(set(gk.route_ids(2, 16, 8, np.random.default_rng(0)).flatten())) == 16
    ids = gk.route_ids(4, 16, 8, np.random.default_rng(0))
    assert all(len(set(row)) == 8 for row in ids) and ids.max() < 16


def test_two_runs_side_by_side(tmp_path, capsys):
    """--compare: each product and form both runs timed, the second's us against the first's; a MoE row of
    another routing (16 against 256 experts) is marked; runs of different TP are refused."""
    import json

    base = {"tp": 8, "rows": [
        {"op": "q_b", "tokens": 2, "mma_us": 4.75, "staged_us": 3.71, "unstaged_us": 6.0, "plugin_us": 7.2},
        {"op": "routed experts (16, top 8; Q4_K up, Q5_K down)", "tokens": 1, "staged_us": 20.12, "pairs_us": 24.06},
        {"op": "q_b", "tokens": 64, "dequant_us": 9.0, "plugin_us": 20.0}]}
    other = {"tp": 8, "rows": [
        {"op": "q_b", "tokens": 2, "mma_us": 4.70, "staged_us": 3.34, "unstaged_us": 6.1, "plugin_us": 7.3},
        {"op": "routed experts (256, top 8; Q4_K up, Q5_K down)", "tokens": 1, "staged_us": 19.0, "pairs_us": 23.0,
         "experts": 256}]}
    rows = gk.compare(base["rows"], other["rows"])
    assert [(r["op"], r["tokens"]) for r in rows] == [("q_b", 2), ("routed experts", 1)]
    assert rows[0]["forms"]["staged"] == (3.71, 3.34, 0.9) and "plugin" not in rows[0]["forms"]
    assert rows[0]["same_routing"] and not rows[1]["same_routing"]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(base))
    b.write_text(json.dumps(other))
    assert gk.main(["--compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "| q_b | 2 | staged | 3.71 | 3.34 | 0.9 |" in out and "| routed experts (other routing) | 1 |" in out, out
    b.write_text(json.dumps({**other, "tp": 1}))
    assert gk.main(["--compare", str(a), str(b)]) == 2
    assert "TP 8 and 1" in capsys.readouterr().err
