"""The 8-GPU prediction model's pieces (bench/predict_mtp.py): each recovers what it was built from."""
import json

import pytest

from fastcomm_bench import predict_mtp as M


def _record(points, requests=None, mtp=0, spec=None, commit="abc1234"):
    """A bench-decode shard record: the single-request TPOT at each stand-in time, the sweep at the first."""
    rows = []
    for i, (us, tpot) in enumerate(points):
        single = {"tpot_ms": tpot}
        if spec:
            single["spec_decode"] = spec
        row = {"us": us, "single": single}
        if i == 0 and requests:
            row["sweep"] = [{"concurrency": c, "tpot_ms": t} for c, t in requests.items()]
        rows.append(row)
    return {"meta": {"fastcomm_commit": commit, "mtp": mtp}, "results": {"vllm": {"standin": rows}}}


FLOOR = {"device": "NVIDIA H100 80GB HBM3", "copy_gbps": 3000.0, "weight_bytes": 6_000_000_000}   # 2.0 ms


def _shard(constant=10.0, per_us=0.157, requests=None):
    rec = _record([(0.0, constant), (20.0, constant + 20 * per_us)], requests or {1: constant, 2: constant + 2,
                                                                                  3: constant + 4, 4: constant + 5})
    return M.shard_from(rec, FLOOR)


@pytest.mark.parametrize("a,k", [(0.0, 3), (0.5, 1), (0.6, 3), (0.9, 2)])
def test_acceptance_rate_inverts_the_expected_length(a, k):
    assert M.acceptance_rate(M.expected_length(a, k), k) == pytest.approx(a, abs=1e-6)
    with pytest.raises(ValueError):
        M.acceptance_rate(k + 1.5, k)


def test_allreduce_is_the_pcie_models_cheaper_algorithm():
    from fastcomm_bench import pcie_model

    m = pcie_model.measure()
    for tokens in (1, 4):
        each = [pcie_model.predict(a, tokens * 6144 * 2, pcie_model.ONE_SWITCH, m).us for a in M.ALLREDUCE_ALGOS]
        assert M.allreduce_us(tokens) == pytest.approx(min(each))
    assert M.allreduce_us(4) > M.allreduce_us(1)


def test_the_shard_record_gives_its_line_floor_and_verify_steps():
    s = _shard(constant=10.0, per_us=0.157)
    assert s.constant_ms == pytest.approx(10.0) and s.per_us_ms == pytest.approx(0.157)
    assert M.per_site_ms(s) == pytest.approx(0.001)
    assert s.floor_ms == pytest.approx(2.0) and s.gpu == M.H100 and s.commit == "abc1234"
    assert [s.increment_ms(k) for k in range(4)] == pytest.approx([0.0, 2.0, 4.0, 5.0])
    with pytest.raises(ValueError, match="no step at 1 and 4"):
        M.shard_from(_record([(0.0, 10.0), (20.0, 13.0)], {1: 10.0, 2: 12.0}), FLOOR).increment_ms(3)
    with pytest.raises(ValueError, match="fewer than two stand-in times"):
        M.shard_from(_record([(0.0, 10.0)]), FLOOR)


def test_the_target_bounds_scale_the_floor_by_bandwidth_and_the_rest_by_clock_or_not():
    s = _shard(constant=10.0)
    floor = 2.0 * 3.35 / 1.79
    low, high = M.constant_bounds(s)
    assert high == pytest.approx(floor + 8.0) and low == pytest.approx(floor + 8.0 * 1980 / 2617)
    lo, hi = M.increment_bounds(s, 1)
    assert lo == pytest.approx(2.0 * 1980 / 2617) and hi == pytest.approx(2.0 * 3.35 / 1.79)


def test_a_row_adds_the_all_reduces_at_the_measured_cost_per_microsecond():
    s = _shard(constant=10.0, per_us=0.157)
    plain = M.predict(s, 0, 1.0, 1, allreduce=lambda tokens: 10.0)
    assert plain["step_ms"] == pytest.approx(M.constant_bounds(s)[1] + 1.57, abs=0.01)
    assert plain["tok_s"] == pytest.approx(1e3 / plain["step_ms"], rel=1e-2) and plain["draft_ms"] == 0
    k3 = M.predict(s, 3, 2.5, 1, share=0.05, allreduce=lambda tokens: 10.0)
    c = M.constant_bounds(s)[1]
    assert k3["verify_ms"] == pytest.approx(c + M.increment_bounds(s, 3)[1] + 1.57, abs=0.01)
    assert k3["draft_ms"] == pytest.approx(3 * (c * 0.05 + 3 * 0.001 * 10.0), abs=0.01)
    assert M.predict(s, 3, 2.5, 0, share=0.05)["step_ms"] < M.predict(s, 3, 2.5, 1, share=0.05)["step_ms"]


def test_a_measured_mtp_step_sets_the_draft_cost_and_one_too_short_takes_the_estimate():
    s = _shard(constant=10.0)
    run = M.mtp_run_from(_record([(20.0, 99.0), (0.0, 18.0)], mtp=3, spec={"tokens_per_step": 1.0}))
    assert (run.k, run.step_ms) == (3, pytest.approx(18.0))          # the stand-in's 0 us row
    assert M.draft_share(s, run) == pytest.approx((18.0 - 15.0) / 3 / 10.0)
    lines = M.table(s, run)
    assert any(line.startswith("# draft: measured, MTP step k=3 18.00 ms") for line in lines)
    short = M.MtpRun(3, 14.0, 1.0)
    assert M.draft_share(s, short) < 0
    assert any("cannot be split off: the estimate" in line for line in M.table(s, short))


def test_the_table_labels_itself_a_model_and_rows_every_k_and_acceptance_length():
    lines = M.table(_shard())
    assert lines[0].startswith("# MODEL, not a measurement")
    rows = [line for line in lines if line.startswith("| low") or line.startswith("| high")]
    assert len(rows) == 2 * (1 + 3 * len(M.PUBLISHED_L))
    assert all(("met" in r) != ("missed" in r) for r in rows)
    # without the sweep's 4-request step, no k = 3 rows
    fewer = M.table(_shard(requests={1: 10.0, 2: 12.0}))
    assert not any(r.split("|")[2].strip() == "3" for r in fewer if r.startswith("| low"))


def test_the_validation_passes_only_for_a_step_that_gives_back_the_users_figures():
    # A shard whose target step at the low bound is the C the user's points imply passes; one whose both bounds
    # are well below it does not.
    us = {p: sum(r) / 2 for p, r in M.NCCL_PUBLISHED_US.items()}
    want = M.calibrate(us)["constant_ms"]
    base = _shard(constant=10.0)
    low = M.constant_bounds(base)[0]
    rest = (want - (low - (10.0 - 2.0) * 1980 / 2617)) / (1980 / 2617)   # the rest that puts the low C at want
    fits = _shard(constant=2.0 + rest)
    assert M.constant_bounds(fits)[0] == pytest.approx(want)
    assert M.validate(fits, us)["ok"]
    fast = _shard(constant=2.0 + rest - 9.0)
    assert M.constant_bounds(fast)[1] < 0.7 * want and not M.validate(fast, us)["ok"]
    assert any("within 10%" in line for line in M.validation_lines(fits, "x"))


@pytest.mark.parametrize("end", [0, 1])
def test_published_nccl_costs_give_back_the_users_43_and_57_tok_s(end):
    # One constant C for the step's non-all-reduce time reproduces both of the user's NCCL figures (CUDA graphs
    # 43 tok/s, NCCL_PROTO=LL 57 tok/s) from NCCL's published per-call costs, at either end of them.
    us = {p: r[end] for p, r in M.NCCL_PUBLISHED_US.items()}
    cal = M.calibrate(us)
    assert all(abs(e) <= M.VALIDATION_TOLERANCE for e in cal["error"].values()), cal
    assert 12.0 < cal["constant_ms"] < 15.5, cal
    assert M.implied_constant_ms(43.0, 40.0) == pytest.approx(1e3 / 43 - 157 * 0.040)


def test_the_committed_shard_record_feeds_the_model(capsys):
    rec, floor = json.loads(M.RECORD.read_text()), json.loads(M.FLOOR.read_text())
    s = M.shard_from(rec, floor)
    assert rec["meta"]["fastcomm_commit"] == s.commit == "f893d0e"
    assert 9.0 < s.constant_ms < 12.0 and 0.1 < s.per_us_ms < 0.2 and 1.5 < s.floor_ms < 2.0
    assert sorted(s.requests_ms) == [1, 2, 3, 4]
    M.main([])
    out = capsys.readouterr().out
    assert "(H100 SXM, f893d0e)" in out and out.count("# validation") == 2
    assert out.count("vllm-gguf-plugin's kernels, as the user ran") == 2
    # earlier runs, each by its own floor record, validated on their own step
    for commit in ("1db05e8", "92412e6"):
        M.main([str(M.RESULTS / f"2026-12-06-h100x1-shard-tp8-plain-{commit}.json"), "--plugin-record", "none"])
        out = capsys.readouterr().out
        assert f"(H100 SXM, {commit})" in out and "the user ran the plugin's, whose shard step is not given" in out


@pytest.mark.parametrize("end", [0, 1])
def test_the_plugin_shard_step_gives_back_the_users_figures(end):
    # The validation: the TP 8 shard's measured step with vllm-gguf-plugin's kernels (what the user ran),
    # NCCL's published per-call cost at either end of its range, must give back 43 and 57 tok/s within 10 % at
    # one bound of the transfer at least (bench/results/2026-12-07-h100x1-shard-tp8-plugin-c1bdc80.json).
    rec = json.loads(M.PLUGIN_RECORD.read_text())
    plugin = M.shard_from(rec, json.loads(M.FLOOR.read_text()))
    assert rec["results"]["vllm"]["ok"] and 13.0 < plugin.constant_ms < 17.0, plugin
    us = {p: r[end] for p, r in M.NCCL_PUBLISHED_US.items()}
    v = M.validate(plugin, us)
    assert v["ok"] and 1 in v["bounds"], v
    # fastcomm's own kernels' step is faster: on it the same costs overshoot the user's figures
    assert not M.validate(M.shard_from(json.loads(M.RECORD.read_text()), json.loads(M.FLOOR.read_text())), us)["ok"]


def test_an_unknown_gpu_is_named():
    with pytest.raises(ValueError, match="no data-sheet figures for 'NVIDIA A100'"):
        M.gpu_of("NVIDIA A100")
