"""A model, from measured numbers, of single-request decode with GLM-5's MTP on 8 x RTX PRO 6000 over PCIe.

    python -m fastcomm_bench.predict_mtp [DECODE_RECORD.json]

It is a model, labelled as one; every input is named in its output:
- measured on 1 x H200 (the record, default the committed bench/results file): decode step time of the
  78-layer GLM-5-shaped GGUF at 1-4 concurrent requests. A verify step of k draft tokens is one forward over
  k + 1 tokens of one request, which does the work of a decode step of k + 1 requests (same matmul shapes,
  same weights read; attention over short contexts is a small share), so the step time at c requests
  stands for the verify step at k = c - 1. A verify step's increment over a plain step is the sweep's own
  (step at k + 1 requests - step at 1), interpolated between the sweep's neighbours where it lacks k + 1, and the
  line base + (c - 1) x per_token fitted over 1-4 requests only where neither serves. Why not the line
  throughout: with fastcomm's kernels the step jumps from 1 to 2 tokens (the linears' dp4a form at 1 token, the
  tensor-core form from 2) and then stays flat, which no line over 1-4 fits.
- the brief's measurement on the user's 8 x RTX PRO 6000: 43 tok/s with CUDA graphs and NCCL at ~40 us per
  all-reduce, i.e. 23.3 ms per step of which ~17 ms is not all-reduce.
- fastcomm's all-reduce per call at 8 ranks over PCIe Gen5 (one switch): bench/pcie_model.py's prediction from
  its measured per-call constants and the layout's bytes, the cheaper of the one-shot and the Lamport two-shot.
- the per-token increment on 8 GPUs: either scaled from the H200's by the bytes each GPU reads (1/8 of the
  weights) and the bandwidth ratio (1.79 / 4.8 TB/s) -- if that increment is bandwidth-bound -- or kept as
  measured on the H200 -- if it is bound by per-token launches, which TP does not shrink. Both are shown.
- the draft: its cost as a share of a plain step, measured on the H200 (the MTP record: a 3-draft run whose
  random weights accept nothing, so each step is 3 drafts plus a 4-token verify; the 4-request step of the
  sweep stands for the verify, the rest is the drafts; the record must come from the same kernels as the
  sweep), given (--draft-share), else estimated as one decoder layer's share plus the LM head it reads; plus
  its three all-reduces. Where the sweep's (k + 1)-request step is longer than the whole MTP step (with fastcomm's
  kernels: one request's 4-token verify costs less than 4 requests' step), the split is not measurable: the drafts
  take the estimate, and a further row family takes the MTP step whole, as the measured multiple of a plain step;
  the acceptance length L of published GLM-5 MTP runs (2.2-2.8 at 3 draft tokens), turned into a per-draft
  acceptance rate a with L = (1 - a^(k+1)) / (1 - a), so other k follow from the same a.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from pathlib import Path

from . import pcie_model
from .pcie_model import ALLREDUCES_PER_STEP, DECODE_BYTES, LAYERS, WORLD

RESULTS = Path(__file__).resolve().parent / "results"
# The sweep of fastcomm's current K-quant kernels (96eb59d; 1, 2, 4 and 8 requests, two runs on one machine).
RECORD = RESULTS / "2026-12-02-h200x1-s12-gguf-78L-tp1-sweep.json"
# No MTP run has used RECORD's kernels, so by default the draft's cost is the estimate. An earlier pair that
# matches: the 2026-12-02 run s6's sweep (b3b4269) with the 2026-12-02 run s8's MTP run (91efbed: the kernels of 4b38652).
EARLIER_RECORD = RESULTS / "2026-12-02-h200x1-s6-gguf-78L-tp1-mma-decode.json"
EARLIER_MTP_RECORD = RESULTS / "2026-12-02-h200x1-s8-gguf-78L-mtp3-tp1-decode.json"
# The plugin's kernels: a sweep and an MTP run that pair with each other only.
PLUGIN_RECORD = RESULTS / "2026-12-01-h200x1-gguf-78L-tp1-decode.json"
PLUGIN_MTP_RECORD = RESULTS / "2026-12-01-h200x1-gguf-78L-mtp3-tp1-decode.json"

ALLREDUCES_PER_DRAFT = 3           # the MTP block's two, and its eh_proj's
HEAD_SHARE = 0.029                 # LM head bytes / bytes read per token (780 MB of ~27 GB in the GGUF)
H200_TBPS, RTX_PRO_6000_TBPS = 4.8, 1.79
PUBLISHED_L = (2.2, 2.8)           # acceptance length at 3 draft tokens (published 8-GPU GLM-5 MTP runs)
PUBLISHED_K = 3


@dataclasses.dataclass(frozen=True)
class Fit:
    base_ms: float       # one token
    per_token_ms: float  # each further token of the same step


def fit_step(points: dict[int, float], max_tokens: int = 4) -> Fit:
    """Least squares of step time (ms) over tokens per step, base + (c - 1) x per_token, for c <= max_tokens."""
    xs = sorted(c for c in points if c <= max_tokens)
    if len(xs) < 2:
        raise ValueError("need step times at two or more token counts")
    line = pcie_model.fit_line([(c - 1, points[c]) for c in xs])
    return Fit(line.intercept, line.slope)


ALLREDUCE_ALGOS = ("one_shot", "two_shot_ll")  # the policy's candidates at decode sizes over PCIe P2P


@functools.lru_cache(maxsize=None)
def _measured() -> pcie_model.Measured:
    return pcie_model.measure()


def allreduce_us(tokens: int) -> float:
    """fastcomm's all-reduce of ``tokens`` x HIDDEN bf16 on 8 x PCIe Gen5 (one switch), the cheaper of the
    one-shot and the Lamport two-shot, as bench/pcie_model.py predicts it from the measured constants."""
    return min(pcie_model.predict(a, tokens * DECODE_BYTES, pcie_model.ONE_SWITCH, _measured()).us
               for a in ALLREDUCE_ALGOS)


def _verify_allreduce_ms(k: int) -> float:
    """The all-reduces of a verify step of k drafts (k + 1 tokens each)."""
    return ALLREDUCES_PER_STEP * allreduce_us(k + 1) / 1e3


def _draft_allreduce_ms() -> float:
    """The all-reduces of one draft (one token each)."""
    return ALLREDUCES_PER_DRAFT * allreduce_us(1) / 1e3


def acceptance_rate(length: float, k: int) -> float:
    """Per-draft acceptance a with (1 - a^(k+1)) / (1 - a) = length (geometric acceptance), by bisection."""
    if not 1.0 <= length <= k + 1:
        raise ValueError(f"acceptance length {length} impossible with {k} draft tokens")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if expected_length(a, k) < length else (lo, a)
    return (lo + hi) / 2


def expected_length(a: float, k: int) -> float:
    return float(k + 1) if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)


ESTIMATED_DRAFT_SHARE = 1 / LAYERS + HEAD_SHARE   # one decoder layer and the LM head, of a plain step

# The user's single request on 8 x RTX PRO 6000 through NCCL with CUDA graphs (the brief), and NCCL's published
# per-call cost at 12-16 KB on 8 ranks for each protocol: (low, high) us. Two points, one unknown (the step's
# non-all-reduce time C): fitting C to both and getting both back within 10 % is what says the additive model
# (step = C + 157 x per-call cost) holds on that box; the brief's assumed 40 us at default does not (test).
USER_TOK_S = {"default": 43.0, "LL": 57.0}
NCCL_PUBLISHED_US = {"default": (55.0, 65.0), "LL": (18.0, 24.0)}
VALIDATION_TOLERANCE = 0.10


def implied_constant_ms(tok_s: float, allreduce_call_us: float) -> float:
    """C such that C + 157 x the per-call cost is the step that gives ``tok_s``."""
    return 1e3 / tok_s - ALLREDUCES_PER_STEP * allreduce_call_us / 1e3


def calibrate(nccl_us: dict[str, float], user: dict[str, float] = USER_TOK_S) -> dict:
    """C fitted to the user's points (the mean of each point's implied C: least squares on the step time),
    and each point as the model gives it back, with its error."""
    c = sum(implied_constant_ms(user[p], nccl_us[p]) for p in user) / len(user)
    back = {p: 1e3 / (c + ALLREDUCES_PER_STEP * nccl_us[p] / 1e3) for p in user}
    return {"constant_ms": c, "tok_s": back, "error": {p: back[p] / user[p] - 1 for p in user}}


def predict_other(nccl_us: dict[str, float], fit_on: str = "default", user: dict[str, float] = USER_TOK_S) -> dict:
    """C from one of the user's points alone, and the other point predicted from it (the stricter check: no
    parameter is fitted to the point predicted)."""
    c = implied_constant_ms(user[fit_on], nccl_us[fit_on])
    return {p: 1e3 / (c + ALLREDUCES_PER_STEP * nccl_us[p] / 1e3) / user[p] - 1 for p in user if p != fit_on}


def validation_lines() -> list[str]:
    """The calibration at NCCL's published costs (mid and both ends), and fastcomm's no-MTP row at its C."""
    lines = []
    for label, pick in (("mid", lambda r: sum(r) / 2), ("low", lambda r: r[0]), ("high", lambda r: r[1])):
        us = {p: pick(r) for p, r in NCCL_PUBLISHED_US.items()}
        cal = calibrate(us)
        row = 1e3 / (cal["constant_ms"] + ALLREDUCES_PER_STEP * allreduce_us(1) / 1e3)
        lines.append(f"# validation ({label} published NCCL: " + ", ".join(f"{p} {us[p]:g} us" for p in us)
                     + f"): C = {cal['constant_ms']:.2f} ms; gives back "
                     + ", ".join(f"{p} {cal['tok_s'][p]:.1f} tok/s ({cal['error'][p]:+.1%} of {USER_TOK_S[p]:g})"
                                 for p in USER_TOK_S)
                     + "; C from default alone predicts LL at "
                     + f"{predict_other(us)['LL']:+.1%}; fastcomm without MTP at this C: {row:.1f} tok/s (the fork: ~88)")
    return lines


@dataclasses.dataclass(frozen=True)
class MtpRun:
    k: int                 # draft tokens per step
    step_ms: float         # one whole step (drafts + verify): TPOT x tokens per step
    tokens_per_step: float


def mtp_run_from(record: dict) -> MtpRun:
    """The measured MTP step of a bench-decode record (its single-request row)."""
    row = next(iter(record["results"].values()))["single"]
    spec = row["spec_decode"]
    return MtpRun(record["meta"]["mtp"], row["tpot_ms"] * spec["tokens_per_step"], spec["tokens_per_step"])


def draft_share(points: dict[int, float], run: MtpRun) -> float:
    """One draft's cost as a share of a plain step: the measured MTP step less the (k + 1)-token verify (the
    sweep's step at k + 1 requests), over k drafts, over the 1-request step. Negative where that step is longer
    than the whole MTP step (the split is then not measurable; ``table`` says so)."""
    if run.k + 1 not in points or 1 not in points:
        raise ValueError(f"the sweep has no step at 1 and {run.k + 1} requests to set the MTP run against")
    return (run.step_ms - points[run.k + 1]) / run.k / points[1]


def verify_increment_ms(points: dict[int, float], k: int) -> float:
    """How much longer the H200's verify step of k drafts is than its plain step: the sweep's step at k + 1
    requests less its step at 1; where the sweep lacks k + 1, interpolated between its nearest counts on either
    side (up to 4 requests); where nothing brackets it, k times the per-token slope of the line over 1-4."""
    if k == 0:
        return 0.0
    c = k + 1
    if c in points and 1 in points:
        return points[c] - points[1]
    near = sorted(x for x in points if x <= 4)
    below = [x for x in near if x < c]
    above = [x for x in near if x > c]
    if below and above and 1 in points:
        lo, hi = below[-1], above[0]
        return points[lo] + (points[hi] - points[lo]) * (c - lo) / (hi - lo) - points[1]
    return k * fit_step(points).per_token_ms


def predict(k: int, length: float, increment_ms: float, *, scaled: bool,
            share: float = ESTIMATED_DRAFT_SHARE) -> dict:
    """Single-request tok/s on 8 x RTX PRO 6000 with fastcomm for k draft tokens (k = 0: no MTP);
    ``increment_ms``: the H200's verify step less its plain step (verify_increment_ms); ``share``: one draft's
    cost as a share of a plain step."""
    compute_1 = pcie_model.step_ms(0.0)     # ~17 ms of the brief's step is not all-reduce
    verify = compute_1 + increment_ms * ((1 / WORLD) * (H200_TBPS / RTX_PRO_6000_TBPS) if scaled else 1.0)
    verify += _verify_allreduce_ms(k)
    draft = compute_1 * share + _draft_allreduce_ms()
    step = verify + k * draft
    tokens = length if k else 1.0
    return {"k": k, "acceptance_length": round(tokens, 2), "verify_ms": round(verify, 2),
            "draft_ms": round(k * draft, 2), "step_ms": round(step, 2), "tok_s": round(tokens / step * 1e3, 1)}


def predict_whole(run: MtpRun, plain_ms: float, length: float) -> dict:
    """Single-request tok/s on 8 x RTX PRO 6000 with the H200's whole MTP step (``run``, verify and drafts)
    kept as the same multiple of a plain step (``plain_ms``, the H200's): launch-bound, as the H200 rows."""
    ratio = run.step_ms / plain_ms
    step = pcie_model.step_ms(0.0) * ratio + _verify_allreduce_ms(run.k) + run.k * _draft_allreduce_ms()
    return {"k": run.k, "acceptance_length": round(length, 2), "step_ms": round(step, 2),
            "tok_s": round(length / step * 1e3, 1)}


def table(points: dict[int, float], run: MtpRun | None = None, share: float | None = None) -> list[str]:
    """The model's table; the draft's share of a plain step from ``run`` (measured), else ``share`` (given),
    else the estimate. With ``run``, also its whole step as a multiple of a plain step."""
    fit = fit_step(points)
    increments = {k: verify_increment_ms(points, k) for k in range(PUBLISHED_K + 1)}
    measured = None if run is None else draft_share(points, run)
    split = measured is not None and measured >= 0
    given = share is not None and run is None
    share = measured if split else share if given else ESTIMATED_DRAFT_SHARE
    lines = ["# MODEL, not a measurement. H200 step times (ms) by tokens per step: "
             + ", ".join(f"{c}: {points[c]:.1f}" for c in sorted(points))
             + f"; fit over 1-4: {fit.base_ms:.1f} + (c - 1) x {fit.per_token_ms:.1f}"
             + "; verify increments (ms over a plain step, the sweep's where it has the count): "
             + ", ".join(f"k={k}: {increments[k]:.1f}" for k in range(1, PUBLISHED_K + 1)),
             "# H200 verify step cost against a plain decode step: "
             + ", ".join(f"k={c - 1}: {points[c] / points[1]:.2f}x" for c in sorted(points) if 2 <= c <= 4),
             f"# fastcomm all-reduce (bench/pcie_model.py, 8 x PCIe Gen5, one switch): {allreduce_us(1):.1f} us at 1 "
             f"token, {allreduce_us(4):.1f} us at 4",
             *validation_lines(),
             "| per-token increment on 8 GPUs | k | L | verify ms | drafts ms | step ms | tok/s |",
             "|---|---|---|---|---|---|---|"]
    if run is not None:
        head = (f"# measured H200 MTP step, k={run.k}: {run.step_ms:.1f} ms = {run.step_ms / points[1]:.2f}x a "
                f"plain step ({run.tokens_per_step:.2f} tokens per step); ")
        if split:
            head += (f"less the {run.k + 1}-token verify ({points[run.k + 1]:.1f} ms): {share:.3f} of a plain step "
                     f"per draft (estimate without it: {ESTIMATED_DRAFT_SHARE:.3f})")
        else:
            head += (f"the sweep's {run.k + 1}-request step ({points[run.k + 1]:.1f} ms) is longer, so the verify "
                     f"cannot be split off: drafts at the estimate ({ESTIMATED_DRAFT_SHARE:.3f} of a plain step), "
                     f"and the step whole in the last rows")
        lines.insert(2, head)
    if given:
        lines.insert(2, f"# draft cost given: {share:.3f} of a plain step per draft "
                        f"(estimate: {ESTIMATED_DRAFT_SHARE:.3f})")
    for scaled in (True, False):
        label = "bandwidth-scaled (/8, x 4.8/1.79)" if scaled else "as on the H200 (launch-bound)"
        for k in range(PUBLISHED_K + 1):
            for L in ((1.0,) if k == 0 else PUBLISHED_L):
                length = expected_length(acceptance_rate(L, PUBLISHED_K), k) if k else 1.0
                r = predict(k, length, increments[k], scaled=scaled, share=share)
                lines.append(f"| {label} | {k} | {r['acceptance_length']} | {r['verify_ms']} | {r['draft_ms']} | "
                             f"{r['step_ms']} | {r['tok_s']} |")
    if run is not None:
        for L in PUBLISHED_L:
            length = expected_length(acceptance_rate(L, PUBLISHED_K), run.k)
            r = predict_whole(run, points[1], length)
            lines.append(f"| the H200's whole MTP step (x {run.step_ms / points[1]:.2f}) | {run.k} | "
                         f"{r['acceptance_length']} | - | - | {r['step_ms']} | {r['tok_s']} |")
    return lines


def points_from(record: dict) -> dict[int, float]:
    """Step time by concurrency from a decode record: one backend's row, or a bench-decode result file."""
    record = record.get("results", record)
    sweep = record["vllm"]["sweep"] if "vllm" in record else record["sweep"]
    return {p["concurrency"]: p["tpot_ms"] for p in sweep}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m fastcomm_bench.predict_mtp", description=__doc__.split("\n\n")[0])
    p.add_argument("record", nargs="?", default=str(RECORD), help="bench-decode record of the GGUF at TP 1")
    p.add_argument("--mtp-record", default="none",
                   help="bench-decode record of the same GGUF with MTP (one request) and the same kernels as the "
                        f"record (e.g. {EARLIER_MTP_RECORD.name} with {EARLIER_RECORD.name}; for the plugin's: "
                        f"{PLUGIN_MTP_RECORD.name} with {PLUGIN_RECORD.name}); 'none' (default: no MTP run has "
                        "the default record's kernels): --draft-share or the estimate")
    p.add_argument("--draft-share", type=float, default=None,
                   help="one draft's cost as a share of a plain step, instead of the estimate")
    a = p.parse_args(argv)
    if a.mtp_record != "none" and a.draft_share is not None:
        p.error("--mtp-record and --draft-share both set the draft's cost: give one")
    run = None if a.mtp_record == "none" else mtp_run_from(json.loads(Path(a.mtp_record).read_text()))
    print("\n".join(table(points_from(json.loads(Path(a.record).read_text())), run, a.draft_share)))


if __name__ == "__main__":
    main()
