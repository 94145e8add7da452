"""A model, from measured numbers, of one request's decode of GLM-5 on 8 x RTX PRO 6000 over PCIe, with and
without MTP.

    python -m fastcomm_bench.predict_mtp [SHARD_RECORD.json] [--floor F.json] [--mtp-record M.json]
                                         [--plugin-record P.json]

It is a model, labelled as one; every input is named in its output:
- measured on one GPU (the record, default the committed bench/results file): one TP 8 rank's decode step,
  rank 0 of GLM-5 at TP 8 as a GGUF run as a TP 1 engine, each of its 157 all-reduce sites a stand-in kernel
  spinning a set time (bench/device_gguf.sh shard plain). The step over the stand-in's times is a line:
  C, the step without all-reduce, and the step's cost per all-reduce microsecond (157 x the share that does
  not overlap), both measured. The same engine's steps at 2-4 requests stand for the verify steps of 1-3
  drafts (one forward over k + 1 tokens reads what k + 1 requests' step reads); its floor: the step's weight
  bytes at the GPU's measured copy bandwidth (the floor record).
- on RTX PRO 6000, two bounds: the floor scaled by peak bandwidth (the measuring GPU's / 1.79 TB/s) in both,
  the rest of C (launches and small kernels, per node) unscaled (the high bound) or scaled by SM clock (the
  low); a verify step's increment over the plain step scaled by clock (low) or by bandwidth (high).
- fastcomm's all-reduce per call at 8 ranks over PCIe Gen5 (one switch): bench/pcie_model.py's prediction from
  its measured constants, the cheaper of the one-shot and the Lamport two-shot.
- the draft: measured where the shard's MTP run is given (3 drafts whose random weights accept none, so its step
  less the 4-token verify is 3 drafts), else one decoder layer's share of C plus the shard's LM head's; plus
  its three all-reduces.
- the acceptance length L of published GLM-5 MTP runs at 3 drafts, turned into a per-draft acceptance rate a
  with L = (1 - a^(k+1)) / (1 - a), so other k follow from the same a.
Validation: the same model with NCCL's published per-call costs in place of fastcomm's, on the step of the
kernels the user ran (vllm-gguf-plugin's: --plugin-record), must give back the user's 43 and 57 tok/s within
10 %; beside it, the C that the user's two points imply (calibrate).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from pathlib import Path

from . import pcie_model
from .pcie_model import ALLREDUCES_PER_STEP, DECODE_BYTES, LAYERS

RESULTS = Path(__file__).resolve().parent / "results"
# The TP 8 shard's step with fastcomm's current K-quant kernels (f893d0e: the staged MoE at 1-2 tokens, short rows
# on the tensor cores from 1 token), and its floor's inputs. Earlier runs (1db05e8, 92412e6) pair with their own
# floor records the same way.
RECORD = RESULTS / "2026-12-07-h100x1-shard-tp8-plain-f893d0e.json"
FLOOR = RESULTS / "2026-12-07-h100x1-shard-tp8-floor-f893d0e.json"
# The same shard's step with vllm-gguf-plugin's kernels (FASTCOMM_GGUF_KERNELS=plugin, as the user's NCCL figures
# ran; kernels unchanged since f893d0e): the validation's step.
PLUGIN_RECORD = RESULTS / "2026-12-07-h100x1-shard-tp8-plugin-c1bdc80.json"

ALLREDUCES_PER_DRAFT = 3           # the MTP block's two, and its eh_proj's
# The shard's LM head (19,360 x 6144 Q6_K, 97.6 MB) over the weight bytes of its one-token step (5.23 GB).
HEAD_SHARE = 97.6 / 5227.4
ESTIMATED_DRAFT_SHARE = 1 / LAYERS + HEAD_SHARE   # one decoder layer and the LM head, of a plain step
PUBLISHED_L = (2.2, 2.8, 3.2)      # acceptance length at 3 draft tokens (published 8-GPU GLM-5 MTP runs)
PUBLISHED_K = 3
GOALS = {"no MTP": 90.0, "MTP": 160.0}   # tok/s (the fork on that box: ~88 and 158-163)


@dataclasses.dataclass(frozen=True)
class Gpu:
    name: str
    peak_tbps: float   # memory bandwidth, the data sheet's
    sm_mhz: float      # the SM clock a decode step runs at (the boost clock)


H100 = Gpu("H100 SXM", 3.35, 1980.0)
H200 = Gpu("H200", 4.8, 1980.0)
RTX_PRO_6000 = Gpu("RTX PRO 6000 Blackwell", 1.79, 2617.0)
TARGET = RTX_PRO_6000


def gpu_of(device: str) -> Gpu:
    """The data-sheet figures of the GPU a record names (torch's device name)."""
    for gpu in (H200, H100):
        if gpu.name.split()[0] in device:
            return gpu
    raise ValueError(f"no data-sheet figures for {device!r} (known: H100, H200)")


ALLREDUCE_ALGOS = ("one_shot", "two_shot_ll")  # the policy's candidates at decode sizes over PCIe P2P


@functools.lru_cache(maxsize=None)
def _measured() -> pcie_model.Measured:
    return pcie_model.measure()


def allreduce_us(tokens: int) -> float:
    """fastcomm's all-reduce of ``tokens`` x HIDDEN bf16 on 8 x PCIe Gen5 (one switch), the cheaper of the
    one-shot and the Lamport two-shot, as bench/pcie_model.py predicts it from the measured constants."""
    return min(pcie_model.predict(a, tokens * DECODE_BYTES, pcie_model.ONE_SWITCH, _measured()).us
               for a in ALLREDUCE_ALGOS)


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


@dataclasses.dataclass(frozen=True)
class Shard:
    """One TP 8 rank's decode step as measured (ms): step = constant + per_us x the all-reduce's us."""
    constant_ms: float
    per_us_ms: float                 # over all ALLREDUCES_PER_STEP sites
    floor_ms: float                  # the one-token step's weight bytes at the measured copy bandwidth
    gpu: Gpu
    requests_ms: dict[int, float]    # the step at c requests (stand-in 0), for the verify steps
    commit: str = "?"

    def increment_ms(self, k: int) -> float:
        """The verify step of k drafts less the plain step, on the measuring GPU: the c = k + 1 request step
        less the 1-request step of the same sweep."""
        if k == 0:
            return 0.0
        if k + 1 not in self.requests_ms or 1 not in self.requests_ms:
            raise ValueError(f"the shard's sweep has no step at 1 and {k + 1} requests")
        return self.requests_ms[k + 1] - self.requests_ms[1]


def _lowest_standin(result: dict) -> dict:
    """A bench-decode backend's row at the stand-in's lowest time (the step nearest a free all-reduce)."""
    return min(result["standin"], key=lambda s: s["us"])


def shard_from(record: dict, floor: dict) -> Shard:
    """The shard's step from a bench-decode record with stand-in rows and its floor record."""
    row = record["results"]["vllm"]
    points = [(s["us"], s["single"]["tpot_ms"]) for s in row["standin"]]
    if len({us for us, _ in points}) < 2:
        raise ValueError("the record has the step at fewer than two stand-in times: no line")
    line = pcie_model.fit_line(points)
    requests = {p["concurrency"]: p["tpot_ms"] for p in _lowest_standin(row).get("sweep", ())}
    floor_ms = floor["weight_bytes"] / (floor["copy_gbps"] * 1e9) * 1e3
    return Shard(line.intercept, line.slope, floor_ms, gpu_of(floor["device"]), requests,
                 record["meta"].get("fastcomm_commit", "?"))


def constant_bounds(shard: Shard) -> tuple[float, float]:
    """C on the target GPU (ms), (low, high): the floor scaled by peak bandwidth; the rest scaled by SM clock
    (low) or kept (high)."""
    floor = shard.floor_ms * shard.gpu.peak_tbps / TARGET.peak_tbps
    rest = shard.constant_ms - shard.floor_ms
    return floor + rest * shard.gpu.sm_mhz / TARGET.sm_mhz, floor + rest


def increment_bounds(shard: Shard, k: int) -> tuple[float, float]:
    """A verify step's increment on the target GPU (ms), (low, high): scaled by SM clock, or by bandwidth."""
    inc = shard.increment_ms(k)
    clock, bandwidth = shard.gpu.sm_mhz / TARGET.sm_mhz, shard.gpu.peak_tbps / TARGET.peak_tbps
    return tuple(sorted((inc * clock, inc * bandwidth)))


def per_site_ms(shard: Shard) -> float:
    """The step's cost of one all-reduce site per microsecond of its all-reduce (measured)."""
    return shard.per_us_ms / ALLREDUCES_PER_STEP


@dataclasses.dataclass(frozen=True)
class MtpRun:
    k: int                 # draft tokens per step
    step_ms: float         # one whole step (drafts + verify): TPOT x tokens per step, at the stand-in's 0 us
    tokens_per_step: float


def mtp_run_from(record: dict) -> MtpRun:
    """The measured MTP step of a bench-decode record: its single-request row at the stand-in's lowest time
    (a record without stand-in rows: its one row)."""
    res = next(iter(record["results"].values()))
    row = _lowest_standin(res)["single"] if "standin" in res else res["single"]
    spec = row["spec_decode"]
    return MtpRun(record["meta"]["mtp"], row["tpot_ms"] * spec["tokens_per_step"], spec["tokens_per_step"])


def draft_share(shard: Shard, run: MtpRun) -> float:
    """One draft's cost as a share of C: the MTP step less the (k + 1)-token verify (the plain step plus the
    sweep's increment), over k drafts. Negative where the verify would be longer than the whole MTP step (the
    split is then not measurable; ``table`` says so and takes the estimate)."""
    verify = shard.constant_ms + shard.increment_ms(run.k)
    return (run.step_ms - verify) / run.k / shard.constant_ms


def predict(shard: Shard, k: int, length: float, bound: int, share: float = ESTIMATED_DRAFT_SHARE,
            allreduce=allreduce_us) -> dict:
    """One request's tok/s on 8 x RTX PRO 6000 for k draft tokens (k = 0: no MTP) at acceptance length
    ``length``; ``bound``: 0 the low step (clock-scaled), 1 the high; ``allreduce(tokens)``: us a call."""
    c = constant_bounds(shard)[bound]
    verify = c + increment_bounds(shard, k)[bound] + shard.per_us_ms * allreduce(k + 1)
    draft = c * share + ALLREDUCES_PER_DRAFT * per_site_ms(shard) * allreduce(1)
    step = verify + k * draft
    tokens = length if k else 1.0
    return {"k": k, "acceptance_length": round(tokens, 2), "verify_ms": round(verify, 2),
            "draft_ms": round(k * draft, 2), "step_ms": round(step, 2), "tok_s": round(tokens / step * 1e3, 1)}


# The user's single request on 8 x RTX PRO 6000 through NCCL with CUDA graphs (the brief), and NCCL's published
# per-call cost at 12-16 KB on 8 ranks for each protocol: (low, high) us.
USER_TOK_S = {"default": 43.0, "LL": 57.0}
NCCL_PUBLISHED_US = {"default": (55.0, 65.0), "LL": (18.0, 24.0)}
VALIDATION_TOLERANCE = 0.10


def implied_constant_ms(tok_s: float, allreduce_call_us: float) -> float:
    """C such that C + 157 x the per-call cost is the step that gives ``tok_s``."""
    return 1e3 / tok_s - ALLREDUCES_PER_STEP * allreduce_call_us / 1e3


def calibrate(nccl_us: dict[str, float], user: dict[str, float] = USER_TOK_S) -> dict:
    """C fitted to the user's points (the mean of each point's implied C: least squares on the step time),
    and each point as the model gives it back, with its error: whether one C explains both."""
    c = sum(implied_constant_ms(user[p], nccl_us[p]) for p in user) / len(user)
    back = {p: 1e3 / (c + ALLREDUCES_PER_STEP * nccl_us[p] / 1e3) for p in user}
    return {"constant_ms": c, "tok_s": back, "error": {p: back[p] / user[p] - 1 for p in user}}


def validate(shard: Shard, nccl_us: dict[str, float], user: dict[str, float] = USER_TOK_S) -> dict:
    """The model's no-MTP step on ``shard`` with NCCL's per-call cost for each protocol, at both bounds, against
    the user's figures: {protocol: {"tok_s": (low-step, high-step), "error": (..)}}; "ok" where every point is
    within VALIDATION_TOLERANCE at one bound at least."""
    out = {}
    for p, us in nccl_us.items():
        rates = tuple(predict(shard, 0, 1.0, b, allreduce=lambda tokens, us=us: us)["tok_s"] for b in (0, 1))
        out[p] = {"tok_s": rates, "error": tuple(r / user[p] - 1 for r in rates)}
    out["bounds"] = tuple(b for b in (0, 1) if all(abs(out[p]["error"][b]) <= VALIDATION_TOLERANCE for p in nccl_us))
    out["ok"] = bool(out["bounds"])
    return out


def validation_lines(shard: Shard, kernels: str) -> list[str]:
    lines = []
    for label, pick in (("low", lambda r: r[0]), ("high", lambda r: r[1])):
        us = {p: pick(r) for p, r in NCCL_PUBLISHED_US.items()}
        v, cal = validate(shard, us), calibrate(us)
        lines.append(f"# validation ({label} published NCCL: " + ", ".join(f"{p} {us[p]:g} us" for p in us)
                     + f"; the step of {kernels}): "
                     + ", ".join(f"{p} {v[p]['tok_s'][1]:.1f}-{v[p]['tok_s'][0]:.1f} tok/s "
                                 f"({v[p]['error'][1]:+.0%} to {v[p]['error'][0]:+.0%} of {USER_TOK_S[p]:g})"
                                 for p in USER_TOK_S)
                     + f": {'within' if v['ok'] else 'OUTSIDE'} {VALIDATION_TOLERANCE:.0%}"
                     + (f" at the {' and '.join(('low', 'high')[b] for b in v['bounds'])} bound" if v["ok"] else "")
                     + "; the C the user's two "
                     f"points imply: {cal['constant_ms']:.2f} ms (gives both back within "
                     f"{max(abs(e) for e in cal['error'].values()):.1%})")
    return lines


def table(shard: Shard, run: MtpRun | None = None, plugin: Shard | None = None) -> list[str]:
    """The model's lines: inputs, validation, and rows by bound, k and L."""
    measured = None if run is None else draft_share(shard, run)
    share = measured if measured is not None and measured >= 0 else ESTIMATED_DRAFT_SHARE
    low, high = constant_bounds(shard)
    incs = ", ".join(f"k={k}: {shard.increment_ms(k):+.2f}" for k in range(1, PUBLISHED_K + 1)
                     if k + 1 in shard.requests_ms)
    lines = [f"# MODEL, not a measurement. The TP 8 shard's step ({shard.gpu.name}, {shard.commit}): C = "
             f"{shard.constant_ms:.2f} ms + {shard.per_us_ms:.3f} ms per all-reduce us ({ALLREDUCES_PER_STEP} sites); "
             f"weight-read floor {shard.floor_ms:.2f} ms; verify steps over the plain one (ms): {incs}",
             f"# on {TARGET.name} ({TARGET.peak_tbps} TB/s, {TARGET.sm_mhz:g} MHz): C = {low:.2f} ms (the rest "
             f"clock-scaled) to {high:.2f} ms (unscaled), of it the floor "
             f"{shard.floor_ms * shard.gpu.peak_tbps / TARGET.peak_tbps:.2f} ms",
             f"# fastcomm all-reduce (bench/pcie_model.py, 8 x PCIe Gen5, one switch): {allreduce_us(1):.1f} us at 1 "
             f"token, {allreduce_us(4):.1f} us at 4"]
    if run is None:
        lines.append(f"# draft: estimated, {ESTIMATED_DRAFT_SHARE:.3f} of C (one layer and the LM head)")
    elif measured >= 0:
        lines.append(f"# draft: measured, MTP step k={run.k} {run.step_ms:.2f} ms less the verify: {share:.3f} of C "
                     f"(estimate: {ESTIMATED_DRAFT_SHARE:.3f})")
    else:
        lines.append(f"# draft: the MTP step k={run.k} ({run.step_ms:.2f} ms) is shorter than the sweep's verify, so "
                     f"the drafts cannot be split off: the estimate, {ESTIMATED_DRAFT_SHARE:.3f} of C")
    lines += validation_lines(plugin, "vllm-gguf-plugin's kernels, as the user ran") if plugin else \
        validation_lines(shard, "fastcomm's kernels; the user ran the plugin's, whose shard step is not given")
    lines += ["| step bound | k | L | verify ms | drafts ms | step ms | tok/s | goal |",
              "|---|---|---|---|---|---|---|---|"]
    for bound, label in ((0, "low (per-node part clock-scaled)"), (1, "high (per-node part unscaled)")):
        for k in range(PUBLISHED_K + 1):
            if k and k + 1 not in shard.requests_ms:
                continue
            for L in ((1.0,) if k == 0 else PUBLISHED_L):
                length = expected_length(acceptance_rate(L, PUBLISHED_K), k) if k else 1.0
                r = predict(shard, k, length, bound, share)
                goal = GOALS["MTP" if k else "no MTP"]
                lines.append(f"| {label} | {k} | {r['acceptance_length']} | {r['verify_ms']} | {r['draft_ms']} | "
                             f"{r['step_ms']} | {r['tok_s']} | {'met' if r['tok_s'] >= goal else 'missed'} "
                             f"(>= {goal:g}) |")
    return lines


def _load(path: str) -> dict:
    return json.loads(Path(path).read_text())


def _floor_beside(record: Path) -> Path:
    """The floor record of a shard record: the committed pair, or shard-floor.json in the same folder."""
    named = record.with_name(record.name.replace("-plain-", "-floor-"))
    return named if named.is_file() else record.with_name("shard-floor.json")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m fastcomm_bench.predict_mtp", description=__doc__.split("\n\n")[0])
    p.add_argument("record", nargs="?", default=str(RECORD), help="bench-decode record of the TP 8 shard (shard plain)")
    p.add_argument("--floor", default=None, help="its floor record (default: the one beside it)")
    p.add_argument("--mtp-record", default=None, help="the shard's MTP run (shard mtp), for the draft's cost")
    p.add_argument("--plugin-record", default=str(PLUGIN_RECORD),
                   help="the shard's step with vllm-gguf-plugin's kernels (shard plugin), for the validation "
                        "(default: the committed one; 'none': validate on the fastcomm record's step)")
    a = p.parse_args(argv)
    floor = _load(a.floor or str(_floor_beside(Path(a.record))))
    shard = shard_from(_load(a.record), floor)
    run = mtp_run_from(_load(a.mtp_record)) if a.mtp_record else None
    plugin = shard_from(_load(a.plugin_record), floor) if a.plugin_record != "none" else None
    print("\n".join(table(shard, run, plugin)))


if __name__ == "__main__":
    main()
