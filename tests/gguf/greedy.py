"""Comparing two greedy runs of one model (gpu_worker.py's "tokens" and "top_logprobs"): pure, CPU-tested in
test_greedy.py, used by test_gguf_gpu.py and tp_one_gpu.py."""


def first_difference(a: list, b: list) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


# Two greedy runs of the same model may part where its two best tokens nearly tie: a verify step reduces 2 tokens
# in the order a 1-token step does not, so the last bits of a logit differ (vLLM's own spec-decode tests accept
# such partings, through check_logprobs_close). A parting counts as a near-tie only where each run's token is
# the other's first or second choice and both runs put the two within NEAR_TIE nats; anything else (a token
# outside the other's top two, a wide margin) is a wrong result. After a parting the inputs differ, so nothing
# later is compared.
NEAR_TIE = 0.1


def greedy_agreement(a: dict, b: dict) -> dict:
    """Compare the greedy runs ``a`` and ``b`` (gpu_worker.py's "tokens" and "top_logprobs")."""
    ta, tb = a["tokens"], b["tokens"]
    i = first_difference(ta, tb)
    if i is None:
        return {"identical": True, "ok": True}
    res = {"identical": False, "first_difference": i, "ok": False}
    if i >= min(len(ta), len(tb)) or i >= min(len(a.get("top_logprobs") or ()), len(b.get("top_logprobs") or ())):
        res["why"] = "no log-probabilities at the parting position"
        return res
    margins = []
    for run, own, other in ((a, ta[i], tb[i]), (b, tb[i], ta[i])):
        top = {int(t): lp for t, lp in run["top_logprobs"][i][:2]}
        margins.append(top[own] - top[other] if own in top and other in top else None)
    res["margins"] = margins
    res["ok"] = all(m is not None and 0 <= m <= NEAR_TIE for m in margins)
    if not res["ok"]:
        res["why"] = "not a near-tie: " + ("a token outside the other run's top two" if None in margins
                                            else f"margins {margins} nats above {NEAR_TIE}")
    return res
