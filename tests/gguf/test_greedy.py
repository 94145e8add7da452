"""greedy.greedy_agreement: when two greedy runs of one model count as agreeing (CPU)."""
from greedy import NEAR_TIE, greedy_agreement


def run(tokens, tops):
    return {"tokens": tokens, "top_logprobs": tops}


SAME = [[[5, -0.1], [6, -2.0]], [[7, -0.3], [8, -1.5]]]


def test_identical_runs_agree():
    assert greedy_agreement(run([5, 7], SAME), run([5, 7], SAME)) == {"identical": True, "ok": True}


def test_a_parting_at_a_near_tie_agrees():
    a = run([5, 7, 1], [SAME[0], [[7, -0.70], [9, -0.72]], [[1, -0.1]]])
    b = run([5, 9, 2], [SAME[0], [[9, -0.69], [7, -0.73]], [[2, -0.1]]])
    res = greedy_agreement(a, b)
    assert res["ok"] and not res["identical"] and res["first_difference"] == 1
    assert [round(m, 3) for m in res["margins"]] == [0.02, 0.04]  # nothing after the parting is compared


def test_a_wide_margin_or_a_token_outside_the_top_two_does_not():
    a = run([5, 7], [SAME[0], [[7, -0.1], [9, -0.1 - 2 * NEAR_TIE]]])
    b = run([5, 9], [SAME[0], [[9, -0.3], [7, -0.35]]])
    res = greedy_agreement(a, b)
    assert not res["ok"] and "above" in res["why"]
    c = run([5, 4], [SAME[0], [[4, -0.3], [3, -0.31], [7, -0.4]]])  # 7 is c's third choice
    res = greedy_agreement(a, c)
    assert not res["ok"] and "outside" in res["why"]


def test_without_log_probabilities_nothing_agrees_but_identity():
    assert not greedy_agreement({"tokens": [1, 2]}, {"tokens": [1, 3]})["ok"]
    assert not greedy_agreement(run([1, 2], SAME), run([1], SAME[:1]))["ok"]  # one run is shorter
