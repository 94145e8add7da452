"""The multi-process harness never waits forever: hung ranks are killed at the deadline and reported."""
import time

import pytest

pytest.importorskip("torch")

import spawn_bodies as B  # noqa: E402

from fastcomm.spawn import check_all_ok, run_ranks  # noqa: E402


def test_results_come_back_per_rank():
    assert check_all_ok(run_ranks(B.ok, 2, timeout=60, backend="gloo")) == [0, 2]


def test_a_hung_rank_is_killed_at_the_deadline():
    t0 = time.monotonic()
    res = run_ranks(B.hang_on_rank_1, 2, timeout=15, backend="gloo")
    assert time.monotonic() - t0 < 40
    assert res[0] == ("ok", "done")
    assert res[1][0] == "error" and "deadline" in res[1][1]


def test_an_exception_is_reported_with_its_rank():
    res = run_ranks(B.raise_on_rank_0, 2, timeout=60, backend="gloo")
    assert res[0][0] == "error" and "ValueError: boom" in res[0][1]
    with pytest.raises(AssertionError, match="rank 0"):
        check_all_ok(res)
