"""The profile summary reads Chrome traces as vLLM's torch profiler writes them (gzip, per backend)."""
import gzip
import json

import pytest

from fastcomm_bench import profile_summary as P


def _k(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def k(name, ts, dur, corr):
    """A kernel that CUPTI ties to the launch with correlation id `corr`."""
    return {**_k(name, ts, dur), "args": {"correlation": corr}}


def launch(ts, corr):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts, "dur": 2,
            "args": {"correlation": corr}}


def test_all_reduce_share_busy_time_and_launch_counts(tmp_path):
    events = [
        _k("gemv_kernel", 0, 10), _k("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 10, 5),
        _k("fc_one_shot_bfloat16", 20, 4), _k("gemv_kernel", 22, 8),  # overlaps the previous one
        _k("Memcpy DtoD", 40, 10, cat="gpu_memcpy"), _k("ncclDevKernel_AllGather_RING_LL", 50, 0),
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1, "dur": 1},
        {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernel", "ts": 2, "dur": 1},
    ]
    s = P.summarize_events(events)
    assert s["window_us"] == 50 and s["busy_us"] == 10 + 5 + 10 + 10  # 20..30 counted once
    ar = s["all_reduce"]
    assert ar["calls"] == 2 and ar["total_us"] == 9 and ar["share_of_window"] == round(9 / 50, 3)
    assert set(ar["kernels"]) == {"ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "fc_one_shot_bfloat16"}
    assert [k["name"] for k in s["top_other_kernels"]] == ["gemv_kernel", "Memcpy DtoD", "ncclDevKernel_AllGather_RING_LL"]
    assert s["launches"] == {"graph": 1, "kernel": 2}


def test_directory_of_backends(tmp_path, capsys):
    for backend in ("nccl", "fastcomm"):
        d = tmp_path / backend
        d.mkdir()
        with gzip.open(d / "worker_0.123.pt.trace.json.gz", "wt") as f:
            json.dump({"traceEvents": [_k("cross_device_reduce_1stage", 0, 3), _k("x", 3, 7)]}, f)
    out = tmp_path / "s.json"
    assert P.main([str(tmp_path), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data) == {"nccl", "fastcomm"}
    assert data["nccl"]["worker_0.123.pt.trace.json.gz"]["all_reduce"]["share_of_window"] == 0.3
    assert "fastcomm" in capsys.readouterr().out


def test_no_traces_is_an_error(tmp_path):
    assert P.main([str(tmp_path)]) == 1


def test_one_backend_and_printing_saved_summaries(tmp_path, capsys):
    for backend in ("nccl", "fastcomm"):
        (tmp_path / backend).mkdir()
        with gzip.open(tmp_path / backend / "w.pt.trace.json.gz", "wt") as f:
            json.dump({"traceEvents": [_k("fc_one_shot_bf16", 0, 2)]}, f)
    saved = tmp_path / "fastcomm.json"
    assert P.main([str(tmp_path), "--backend", "fastcomm", "--json", str(saved)]) == 0
    assert set(json.loads(saved.read_text())) == {"fastcomm"}
    capsys.readouterr()
    assert P.main(["--print", str(saved)]) == 0
    assert "fc_one_shot_bf16" in capsys.readouterr().out


def test_graph_steps_exclude_prefill_and_host_gaps():
    events = [k("prefill_gemm", 0, 500, 1),  # eager, launched by cudaLaunchKernel (correlation 1)
              launch(600, 10), k("gemv", 610, 80, 10), k("fc_one_shot_bf16", 690, 5, 10), k("gemv", 695, 5, 10),
              launch(2000, 11), k("gemv", 2010, 90, 11), k("fc_one_shot_bf16", 2100, 10, 11)]
    st = P.summarize_events(events)["graph_steps"]
    assert st["steps"] == 2 and st["all_reduce_calls_per_step"] == 1
    assert st["median_span_us"] == (90 + 100) / 2 and st["median_all_reduce_us"] == 7.5
    assert st["all_reduce_share"] == round(7.5 / 95, 3)
    assert P.summarize_events([_k("x", 0, 1)])["graph_steps"] is None  # no graphs: no per-step figures


def test_graph_steps_leave_piecewise_graphs_out():
    # At 8 concurrent the profile also holds the prefill, replayed as piecewise graphs of a few kernels
    # each: they are not steps, and the median over all graphs would describe them instead.
    events = []
    for p in range(5):  # five prefill pieces: one GEMM and one all-reduce each
        events += [launch(p * 100, p), k("gemm", p * 100 + 1, 20, p), k("fc_two_shot_bf16", p * 100 + 21, 10, p)]
    for s, t0 in ((10, 1000), (11, 2000)):  # two full decode steps: 3 layers of gemv + all-reduce
        events.append(launch(t0, s))
        for layer in range(3):
            events += [k("gemv", t0 + layer * 30, 25, s), k("fc_one_shot_bf16", t0 + layer * 30 + 25, 5, s)]
    st = P.summarize_events(events)["graph_steps"]
    assert st["steps"] == 2 and st["piecewise_graphs_left_out"] == 5
    assert st["all_reduce_calls_per_step"] == 3 and st["median_span_us"] == 90 and st["median_all_reduce_us"] == 15
    # Per step, the piecewise prefill's GEMMs stay out of the other kernels' times too.
    assert st["top_other_kernels_us"] == [{"name": "gemv", "median_us": 75.0}]


def test_graph_steps_other_kernels_per_step_median():
    events = [launch(0, 1), k("moe", 1, 40, 1), k("gemv", 41, 10, 1), k("fc_one_shot_bf16", 51, 5, 1),
              launch(100, 2), k("moe", 101, 60, 2), k("fc_one_shot_bf16", 161, 5, 2), k("moe", 166, 10, 2),
              launch(200, 3), k("moe", 201, 50, 3), k("gemv", 251, 30, 3), k("fc_one_shot_bf16", 281, 5, 3)]
    st = P.summarize_events(events)["graph_steps"]
    # moe per step: 40, 70, 50 -> 50; gemv: 10, 0 (absent), 30 -> 10; all-reduce kernels are not "other".
    assert st["top_other_kernels_us"] == [{"name": "moe", "median_us": 50.0}, {"name": "gemv", "median_us": 10.0}]


def test_graph_steps_table_every_kernel_with_its_calls_and_time_a_step(capsys):
    # Three steps: moe twice in step 2 only, gemv absent from step 2, the stand-in in each.
    events = [launch(0, 1), k("moe", 1, 40, 1), k("gemv", 41, 10, 1), k("fastcomm_standin", 51, 5, 1),
              launch(100, 2), k("moe", 101, 60, 2), k("fastcomm_standin", 161, 5, 2), k("moe", 166, 10, 2),
              launch(200, 3), k("moe", 201, 50, 3), k("gemv", 251, 30, 3), k("fastcomm_standin", 281, 7, 3)]
    st = P.summarize_events(events)["graph_steps"]
    rows = {r["name"]: r for r in st["kernels"]}
    # moe: 40, 70, 50 us in 1, 2, 1 calls -> 50 us, 1 call; gemv: 10, 0, 30 in 1, 0, 1 -> 10 us, 1 call.
    assert rows["moe"] == {"name": "moe", "family": "other", "calls": 1, "us": 50.0, "us_a_call": 50.0}
    assert rows["gemv"]["us"] == 10.0 and rows["gemv"]["calls"] == 1 and rows["gemv"]["family"] == "GEMM"
    assert rows["fastcomm_standin"]["family"] == "all-reduce" and rows["fastcomm_standin"]["us"] == 5.0
    assert [r["name"] for r in st["kernels"]] == ["moe", "gemv", "fastcomm_standin"]  # busiest first
    P.print_summary({"b": {"t": P.summarize_events(events)}}, kernel_rows=2)
    out = capsys.readouterr().out
    assert "step   0.050 ms =     1 x  50.00 us  other" in out and "moe" in out, out
    assert "step   0.005 ms =     1 calls of 1 other kernels" in out, out


def test_the_difference_of_two_steps_by_kernel_and_family(tmp_path, capsys):
    # A 1-request step and a 4-request one: the MoE kernel doubles, a quantize appears, the gemv is unchanged.
    def summary(moe, extra):
        ev = []
        for step, t0 in ((1, 0), (2, 1000)):
            ev += [launch(t0, step), k("fc_kq_moe_up_s_bf16", t0 + 1, moe, step), k("gemv", t0 + 200, 10, step)]
            if extra:
                ev.append(k("fc_kq_quantize_bf16", t0 + 300, extra, step))
        return {"b": {"t": P.summarize_events(ev)}}

    base, four = tmp_path / "c1.json", tmp_path / "c4.json"
    base.write_text(json.dumps(summary(20, 0)))
    four.write_text(json.dumps(summary(45, 3)))
    rows = P.step_diff(P._steps_of(json.loads(base.read_text())), P._steps_of(json.loads(four.read_text())))
    by = {r["name"]: r for r in rows}
    assert by["fc_kq_moe_up_s_bf16"]["delta_us"] == 25.0 and by["gemv"]["delta_us"] == 0.0
    assert by["fc_kq_quantize_bf16"] == {"name": "fc_kq_quantize_bf16", "family": "fastcomm K-quant", "base_us": 0.0,
                                         "us": 3.0, "delta_us": 3.0, "base_calls": 0, "calls": 1}
    assert rows[0]["name"] == "fc_kq_moe_up_s_bf16"  # the largest change first
    assert P.main(["--diff", str(base), str(four)]) == 0
    out = capsys.readouterr().out
    assert "by family (ms): fastcomm K-quant +0.028" in out and "  +0.025 ms    0.020 ->   0.045 ms  calls 1 -> 1" in out, out
    assert P.main(["--diff", str(base), str(tmp_path / "none.json")]) == 2
    assert "--diff" in capsys.readouterr().err


def test_a_summary_from_before_the_kernel_table_prints_its_top_kernels(capsys):
    st = {"steps": 1, "median_span_us": 100.0, "median_all_reduce_us": 1.0, "all_reduce_calls_per_step": 1,
          "all_reduce_share": 0.01, "top_other_kernels_us": [{"name": "gemv", "median_us": 75.0}]}
    old = {"gpu_events": 2, "window_us": 100.0, "busy_share": 1.0, "launches": {"graph": 1, "kernel": 0},
           "all_reduce": {"calls": 1, "total_us": 1.0, "share_of_window": 0.01, "median_us": 1.0, "kernels": {}},
           "top_other_kernels": [], "graph_steps": st}
    P.print_summary({"b": {"t": old}})
    assert "step   0.075 ms  gemv" in capsys.readouterr().out


def test_graph_steps_by_kernel_family_read_gguf_and_fp8_side_by_side(capsys):
    # Kernel names as vllm-gguf-plugin's and vLLM's FP8 path launch them (templated names abbreviated).
    gguf = ["void mul_mat_vec_q<c10::BFloat16, 256, 32, block_q4_K>(...)", "void quantize_q8_1<c10::BFloat16>(...)",
            "void moe_vec_q<c10::BFloat16, 256, 32, block_q5_K>(...)", "void mul_mat_q4_K<c10::BFloat16, false>(...)",
            "void vllm::rms_norm_kernel<c10::BFloat16>(...)", "flash_fwd_splitkv_mla_kernel", "fc_one_shot_bf16",
            "triton_poi_fused_add_0"]
    fp8 = ["fused_moe_kernel", "sm90_xmma_gemm_e4m3bf16_e4m3f32", "void vllm::scaled_fp8_quant_kernel<...>"]
    events, t = [], 0
    for step in (1, 2):
        events.append(launch(t, step))
        for i, name in enumerate(gguf + fp8):
            events.append(k(name, t + 1 + 10 * i, i + 1, step))
        t += 1000
    st = P.summarize_events(events)["graph_steps"]
    durs = {name: i + 1 for i, name in enumerate(gguf + fp8)}
    fams = st["families_us"]
    assert fams["activation quantize"] == durs[gguf[1]] + durs[fp8[2]] and fams["K-quant GEMV"] == 1.0
    assert (fams["K-quant MoE"], fams["K-quant GEMM"], fams["fused MoE"], fams["GEMM"]) == (3.0, 4.0, 9.0, 10.0)
    assert (fams["norm"], fams["attention"], fams["all-reduce"], fams["other"]) == (5.0, 6.0, 7.0, 8.0)
    assert list(fams) == sorted(fams, key=lambda f: -fams[f])  # busiest first
    P.print_summary({"gguf": {"t": P.summarize_events(events)}})
    assert "step by kernel family (ms): activation quantize 0.013, GEMM 0.010" in capsys.readouterr().out


def test_mistakes_are_one_line_errors(tmp_path, capsys):
    def one_line(argv, text):
        assert P.main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and text in err and "Traceback" not in err, err

    one_line([str(tmp_path / "nope")], "nope: no such directory")
    one_line(["--print", str(tmp_path / "none.json")], "none.json: No such file")
    (tmp_path / "bad.json").write_text("{")
    one_line(["--print", str(tmp_path / "bad.json")], "not JSON")
    one_line([], "name a PROFILE_DIR")


def test_summarize_tables_and_its_one_line_errors(tmp_path, capsys):
    # python -m fastcomm_bench.summarize: the RESULTS.md tables from `fastcomm bench --json` files.
    from fastcomm_bench import summarize as S

    rows = [{"impl": impl, "size": 4096, "redop": "sum", "graph_us": us}
            for impl, us in (("fastcomm-auto", 5.0), ("nccl", 10.0), ("symm-one_shot", 4.0))]
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"meta": {"label": "x", "nccl": "2.28", "torch": "2.11"}, "rows": rows}))
    assert S.main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "| 4 KiB | 5.00 | - | - | 10.00 | 4.00 | - | 0.50 |" in out and "4 KiB 1.25" in out
    for argv, text in (([str(tmp_path / "none.json")], "none.json: No such file"),
                       ([str(run), "--nop2p", str(tmp_path / "none.json")], "none.json: No such file"),
                       ([str(tmp_path)], "Is a directory")):
        assert S.main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and text in err, err
    (tmp_path / "other.json").write_text("[]")
    assert S.main([str(tmp_path / "other.json")]) == 2 and "no rows" in capsys.readouterr().err


def test_graph_steps_count_nodes_idle_gaps_and_the_standin_as_an_all_reduce(capsys):
    # Two steps of 4 nodes; the stand-in kernel (fastcomm_vllm.standin) counts as the step's all-reduce.
    # Step 1: [0,10] [12,20] [20,25] [30,31]: span 31, busy 24, idle 7 over 3 gaps.
    # Step 2: [100,110] [110,120] [121,130] [131,132]: span 32, busy 30, idle 2.
    events = [launch(-5, 1), k("gemv", 0, 10, 1), k("fastcomm_standin", 12, 8, 1), k("rms_norm", 20, 5, 1),
              k("gemv", 30, 1, 1),
              launch(95, 2), k("gemv", 100, 10, 2), k("fastcomm_standin", 110, 10, 2), k("rms_norm", 121, 9, 2),
              k("gemv", 131, 1, 2)]
    st = P.summarize_events(events)["graph_steps"]
    assert st["all_reduce_calls_per_step"] == 1 and st["median_all_reduce_us"] == 9.0
    assert st["nodes_per_step"] == 4 and st["median_idle_us"] == 4.5
    assert st["median_gap_us"] == round((7 / 3 + 2 / 3) / 2, 3)
    P.print_summary({"b": {"t": P.summarize_events(events)}}, layers=2, floor=P.floor_ms(15.5e3, 1.0))
    out = capsys.readouterr().out
    assert "4 nodes a step (2.0 a layer of 2)" in out and "floor 0.02 ms, step 2.03x it" in out, out


def test_floor_options_go_together(tmp_path, capsys):
    assert P.main([str(tmp_path), "--weight-bytes", "1e9"]) == 2
    assert "go together" in capsys.readouterr().err
    assert P.main([str(tmp_path), "--weight-bytes", "1e9", "--copy-gbps", "0"]) == 2
    assert "positive" in capsys.readouterr().err
    assert P.floor_ms(4.0e9, 4000.0) == 1.0   # 4 GB at 4 TB/s


@pytest.mark.parametrize("name, fam", [
    ("fastcomm_standin", "all-reduce"), ("fc_oneshot_bf16_w8", "all-reduce"), ("fc_lamport_2shot_bf16", "all-reduce"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "all-reduce"), ("cross_device_reduce_1stage", "all-reduce"),
    # seen in the TP 8 shard's profile (2026-12-06-h100x1-shard-tp8-profile-92412e6.txt), once counted as all-reduce:
    ("fc_kq_gemvs1_bf16", "fastcomm K-quant"), ("fc_kq_moe_mma_down_q5k", "fastcomm K-quant"),
    ("fc_kq_quantize_silu_bf16", "fastcomm K-quant"), ("triton_poi_fused_add_all_reduce_mul_1", "other"),
    # 2026-12-07-h100x1-shard-tp8-profile-f893d0e.txt: FlashAttention 3 once counted as GEMM (its cutlass template)
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::Col", "attention"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>", "GEMM"),
    ("std::enable_if<!(false), void>::type internal::gemvx::kernel<int, int, float, float, float", "GEMM"),
])
def test_kernel_families_by_name(name, fam):
    assert P.family(name) == fam
