"""The MTP prediction model's pieces (bench/predict_mtp.py): each recovers what it was built from."""
import pytest

from fastcomm_bench import predict_mtp as M


def test_fit_recovers_a_line_and_ignores_points_past_four_tokens():
    fit = M.fit_step({1: 20.0, 2: 23.0, 3: 26.0, 4: 29.0, 8: 500.0})
    assert fit.base_ms == pytest.approx(20.0) and fit.per_token_ms == pytest.approx(3.0)
    with pytest.raises(ValueError):
        M.fit_step({1: 20.0})


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


def test_prediction_grows_with_drafts_and_the_table_labels_itself_a_model():
    fit = M.Fit(25.0, 12.0)
    plain = M.predict(0, 1.0, 0.0, scaled=True)
    assert plain["draft_ms"] == 0 and plain["tok_s"] == pytest.approx(1e3 / plain["step_ms"], rel=1e-2)
    k3 = M.predict(3, 2.5, 3 * fit.per_token_ms, scaled=True)
    assert k3["verify_ms"] > plain["verify_ms"] and k3["tok_s"] == pytest.approx(2.5e3 / k3["step_ms"], rel=1e-2)
    assert M.predict(3, 2.5, 3 * fit.per_token_ms, scaled=False)["step_ms"] > k3["step_ms"]
    lines = M.table({1: 24.8, 2: 36.2, 3: 55.0, 4: 58.5})
    assert lines[0].startswith("# MODEL, not a measurement") and len(lines) == 5 + 2 * 7 + 3


def test_committed_record_feeds_the_model():
    points = M.points_from(__import__("json").loads(M.RECORD.read_text()))
    assert sorted(points) == [1, 2, 4, 8] and all(v > 0 for v in points.values())


def test_verify_increments_are_the_sweeps_own_where_it_has_them():
    points = {1: 17.8, 2: 22.7, 4: 21.4, 8: 22.1}   # a jump from 1 to 2 tokens, then flat: no line fits it
    assert M.verify_increment_ms(points, 0) == 0.0
    assert M.verify_increment_ms(points, 1) == pytest.approx(4.9)
    assert M.verify_increment_ms(points, 3) == pytest.approx(3.6)
    assert M.verify_increment_ms(points, 2) == pytest.approx((22.7 + 21.4) / 2 - 17.8)   # between 2 and 4
    # nothing above 3 tokens: the fit's slope
    assert M.verify_increment_ms({1: 20.0, 2: 23.0}, 3) == pytest.approx(3 * 3.0)
    # the launch-bound rows carry the increment as measured; the bandwidth-scaled ones shrink it
    fit = M.fit_step(points)
    row = M.predict(1, 1.6, M.verify_increment_ms(points, 1), scaled=False)
    assert row["verify_ms"] == pytest.approx(M.pcie_model.step_ms(0.0) + 4.9 + M._verify_allreduce_ms(1), abs=0.01)
    assert row["verify_ms"] > M.predict(1, 1.6, fit.per_token_ms, scaled=False)["verify_ms"]  # the fit's slope: 0.9 ms
    lines = M.table(points)
    assert "verify increments (ms over a plain step, the sweep's where it has the count): k=1: 4.9" in lines[0]
    assert any(line.startswith("| as on the H200 (launch-bound) | 1 |") and f"| {row['verify_ms']} |" in line
               for line in lines)


def test_measured_mtp_step_sets_the_draft_cost():
    points = {1: 24.8, 2: 36.2, 3: 55.0, 4: 58.5}
    run = M.MtpRun(k=3, step_ms=64.5, tokens_per_step=1.0)
    assert M.draft_share(points, run) == pytest.approx(2.0 / 24.8)   # (64.5 - 58.5) / 3 drafts / 24.8
    fit = M.fit_step(points)
    cheap = M.predict(3, 2.5, 3 * fit.per_token_ms, scaled=True)
    dear = M.predict(3, 2.5, 3 * fit.per_token_ms, scaled=True, share=M.draft_share(points, run))
    assert dear["verify_ms"] == cheap["verify_ms"] and dear["draft_ms"] > cheap["draft_ms"]
    lines = M.table(points, run)
    assert any(line.startswith("# measured H200 MTP step, k=3: 64.5 ms") for line in lines)
    assert len(lines) == 6 + 3 + 2 * 7 + 2   # and the whole step's two rows
    with pytest.raises(ValueError, match="no step at 1 and 4"):
        M.draft_share({1: 24.8, 2: 36.2}, run)


def test_a_given_draft_share_replaces_the_estimate():
    points = {1: 17.8, 2: 23.7, 3: 27.4, 4: 27.6}
    estimated, given = M.table(points), M.table(points, share=0.115)
    assert any(line.startswith("# draft cost given: 0.115 of a plain step") for line in given)
    rate = lambda lines: float(lines[-1].rsplit("|", 2)[1])  # noqa: E731  (k = 3, L = 2.8, launch-bound)
    assert rate(given) < rate(estimated)


def test_a_verify_longer_than_the_whole_mtp_step_is_not_split_and_the_step_is_taken_whole():
    points = {1: 17.8, 2: 23.7, 3: 27.4, 4: 27.6}
    run = M.MtpRun(k=3, step_ms=26.6, tokens_per_step=1.0)   # shorter than the 4-request step
    assert M.draft_share(points, run) < 0
    lines = M.table(points, run)
    assert any("cannot be split off: drafts at the estimate" in line for line in lines)
    assert lines[-16:-2] == M.table(points)[-14:]   # the split families as with no run: the estimate
    whole = [line for line in lines if line.startswith("| the H200's whole MTP step (x 1.49)")]
    assert len(whole) == 2
    for line, L in zip(whole, M.PUBLISHED_L):
        step, rate = (float(v) for v in line.rsplit("|", 3)[1:3])
        assert rate == pytest.approx(L / step * 1e3, rel=1e-3)
    dear = M.predict_whole(M.MtpRun(3, 2 * 26.6, 1.0), 17.8, 2.5)
    assert dear["step_ms"] > M.predict_whole(run, 17.8, 2.5)["step_ms"] > M.pcie_model.step_ms(0.0) * 26.6 / 17.8


def test_the_default_records_are_fastcomms_kernels_and_the_plugins_pair_apart():
    import json

    assert json.loads(M.RECORD.read_text())["meta"]["fastcomm_commit"] == "96eb59d"
    assert json.loads(M.EARLIER_RECORD.read_text())["meta"]["fastcomm_commit"] == "b3b4269"
    assert json.loads(M.EARLIER_MTP_RECORD.read_text())["meta"]["fastcomm_commit"] == "91efbed"
    assert sorted(M.points_from(json.loads(M.PLUGIN_RECORD.read_text()))) == [1, 2, 3, 4, 8]


@pytest.mark.parametrize("record", ["EARLIER_MTP_RECORD", "PLUGIN_MTP_RECORD"])
def test_committed_mtp_records_are_three_draft_steps(record):
    run = M.mtp_run_from(__import__("json").loads(getattr(M, record).read_text()))
    assert run.k == 3 and run.step_ms > 0 and run.tokens_per_step >= 1.0


def test_the_command_takes_an_mtp_run_only_when_given_one(capsys):
    # the default sweep's kernels have no MTP run: the draft at its estimate
    M.main([])
    default = capsys.readouterr().out
    M.main([str(M.EARLIER_RECORD), "--mtp-record", str(M.EARLIER_MTP_RECORD)])
    paired = capsys.readouterr().out
    assert "whole MTP step" not in default and "measured H200 MTP step" not in default
    assert "1: 17.8, 2: 22.7, 4: 21.4, 8: 22.1" in default   # the committed sweep's steps, as read
    assert "the H200's whole MTP step" in paired and "measured H200 MTP step, k=3" in paired


@pytest.mark.parametrize("end", [0, 1])
def test_published_nccl_costs_give_back_the_users_43_and_57_tok_s(end):
    # One constant C for the step's non-all-reduce time must reproduce both of the user's NCCL figures
    # (CUDA graphs 43 tok/s, NCCL_PROTO=LL 57 tok/s) from NCCL's published per-call costs, at either end of them.
    us = {p: r[end] for p, r in M.NCCL_PUBLISHED_US.items()}
    cal = M.calibrate(us)
    assert all(abs(e) <= M.VALIDATION_TOLERANCE for e in cal["error"].values()), cal
    assert 12.0 < cal["constant_ms"] < 15.5, cal
    # Stricter: C from the default point alone predicts the LL one.
    assert abs(M.predict_other(us)["LL"]) <= M.VALIDATION_TOLERANCE


def test_the_briefs_assumed_40_us_fails_the_cross_check():
    # 40 us at default leaves C ~17 ms, which puts LL (published ~21 us) far below the user's 57 tok/s.
    assert M.predict_other({"default": 40.0, "LL": 21.0})["LL"] < -M.VALIDATION_TOLERANCE
    assert M.implied_constant_ms(43.0, 40.0) == pytest.approx(1e3 / 43 - 157 * 0.040)


def test_the_table_carries_the_validation_and_fastcomms_row():
    lines = M.table({1: 24.8, 2: 36.2, 3: 55.0, 4: 58.5})
    checks = [l for l in lines if l.startswith("# validation")]
    assert len(checks) == 3 and all("fastcomm without MTP at this C" in l for l in checks)
