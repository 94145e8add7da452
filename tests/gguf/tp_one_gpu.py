"""GLM-5 GGUF at tensor parallel 1, 2, 4 and 8 with every rank on one GPU (fastcomm_vllm.one_gpu), each engine
in its own process (gpu_worker.py --one-gpu --graphs: torch.compile and CUDA graphs on).

    python tests/gguf/tp_one_gpu.py OUT_DIR PART[,PART...]      # run parts, one JSON per engine in OUT_DIR
    python tests/gguf/tp_one_gpu.py --report OUT_DIR [OUT_DIR...] # check and summarise what the folders hold

Parts: ref (bf16 reference at TP 1), tpN (N = 1, 2, 4, 8: one engine for the prefill logits and greedy
without MTP, one for greedy with MTP, one for greedy without MTP on the verify steps' kernel forms (greedyN@mma1);
the all-reduce counts of all), controlN (layer 0's gate/up shards swapped
at TP N: must be far off), skewN (TP N with rank 1 waiting 60 s before its first forward under
FASTCOMM_TIMEOUT_S=30: must start), greedyN (greedy without MTP alone in its engine, no logits request before
it), mtpN (greedy with MTP alone), logitsN (tpN's first engine alone: prefill logits and greedy without MTP, as
TP 1's row for the other TPs' comparisons). A part may name variants after '@', joined by '+' (VARIANTS: e.g.
greedy8@eager+check): a wrong result's search, each variant's run compared with the same TP's run with MTP. The report checks:
- logits at every TP against the bf16 reference (median per-position error < TOL, as test_gguf_gpu) and
  against TP 1 (reported); the swapped control's error > CONTROL_MIN;
- greedy tokens with and without MTP identical at each TP, or parted only at a near-tie (greedy_agreement), and
  MTP proposed drafts; the same for greedy at each TP against TP 1. Where the run on the verify steps' forms
  exists (greedyN@mma1), it decides: a 1-token step on the default forms (staged dp4a) rounds differently from
  a 2-token verify step (tensor cores), so runs on different forms may part where a routing or a token nearly
  ties, and only runs on the same forms must agree (at TP 8 they do, all 32 tokens, while the default forms part
  at token 14: bench/results/2026-12-07-h100x1-tp-one-gpu-tp8-forms-2811183.json);
- every forward of one token ran 1 + 2 x layers all-reduces (embedding, then attention and MLP per layer; the
  MTP draft's forward 1 + 2) on every rank, all through fastcomm, none falling back.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from greedy import first_difference, greedy_agreement  # noqa: E402
from test_gguf_gpu import CONTROL_MIN, TOL, summary, write_models  # noqa: E402

TIMEOUT_S = 560
# A part's variants: (worker options to drop, environment to add).
VARIANTS = {
    "eager": (("--graphs",), {}),                                   # no torch.compile, no CUDA graphs
    "check": ((), {"FASTCOMM_TEST_CHECK_ALLREDUCE": "1"}),          # every eager all-reduce checked bit for bit
    "plugin": ((), {"FASTCOMM_GGUF_KERNELS": "plugin"}),            # vllm-gguf-plugin's kernels, not fastcomm's
    "mma1": ((), {"FASTCOMM_GGUF_MMA_MIN_TOKENS": "1"}),            # tensor-core linears from 1 token
    "grouped1": ((), {"FASTCOMM_GGUF_GROUPED_MIN_TOKENS": "1"}),    # the MoE grouped by expert from 1 token
    "routing": ((), {"FASTCOMM_TEST_ROUTING": "1"}),                # experts and margins per step (eager only)
}
SAME_FORMS = "mma1"  # the variant whose 1-token step takes the verify steps' K-quant form (module docstring)


def _variant(part: str) -> tuple[str, str, tuple, dict]:
    """``part`` as (base part, name suffix, worker options to drop, environment)."""
    base, _, names = part.partition("@")
    drop, env = [], {}
    for name in filter(None, names.split("+")):
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r} in {part!r} (known: {', '.join(VARIANTS)})")
        drop += VARIANTS[name][0]
        env.update(VARIANTS[name][1])
    return base, f"@{names}" if names else "", tuple(drop), env


def _run(out: Path, name: str, mode: str, model: Path, *extra, env=None) -> dict:
    dest = out / f"{name}.json"
    cmd = [sys.executable, str(HERE / "gpu_worker.py"), mode, str(model), str(dest), *map(str, extra)]
    t0 = time.time()
    with open(out / f"{name}.log", "w") as log:
        r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=TIMEOUT_S,
                           env={**os.environ, **(env or {})})
    took = time.time() - t0
    if r.returncode != 0:
        tail = (out / f"{name}.log").read_text()[-3000:]
        (out / f"{name}.json").write_text(json.dumps({"failed": r.returncode, "seconds": took, "log_tail": tail}))
        print(f"== {name}: FAILED ({r.returncode}) after {took:.0f} s\n{tail}", flush=True)
        return {}
    res = json.loads(dest.read_text())
    res["seconds"] = took
    dest.write_text(json.dumps(res))
    print(f"== {name}: done in {took:.0f} s", flush=True)
    return res


def run_parts(out: Path, parts: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("FASTCOMM_CACHE_DIR", str(out / "cache"))
    os.environ.update(FASTCOMM_TEST_MODE="1", FASTCOMM_TEST_SHARED_GPU="1")
    first, ref = write_models(out / "models")
    for part in parts:
        part, tag, drop, env = _variant(part)
        common = tuple(o for o in ("--one-gpu", "--graphs") if o not in drop)
        if part == "ref":
            _run(out, "ref", "logits", ref, "--tp", 1, *common)
        elif part.startswith(("tp", "mtp", "logits")):  # tpN: all three engines; mtpN, logitsN: that one alone
            kind = part.rstrip("0123456789")
            tp = int(part[len(kind):])
            if kind in ("tp", "logits"):
                _run(out, f"logits-tp{tp}{tag}", "both", first, "--tp", tp, *common, env=env)
            if kind in ("tp", "mtp"):
                _run(out, f"greedy-mtp-tp{tp}{tag}", "greedy", first, "--tp", tp, "--mtp", 1, *common, env=env)
            if kind == "tp" and not tag:
                _, same_tag, _, same_env = _variant(f"greedy{tp}@{SAME_FORMS}")
                _run(out, f"greedy-tp{tp}{same_tag}", "greedy", first, "--tp", tp, *common, env=same_env)
        elif part.startswith("greedy"):
            tp = int(part[len("greedy"):])
            _run(out, f"greedy-tp{tp}{tag}", "greedy", first, "--tp", tp, *common, env=env)
        elif part.startswith("control"):
            tp = int(part[len("control"):])
            _run(out, f"control-tp{tp}", "logits", first, "--tp", tp, "--swap", *common)
        elif part.startswith("skew"):
            tp = int(part[len("skew"):])
            _run(out, f"skew-tp{tp}", "greedy", first, "--tp", tp, *common,
                 env={"FASTCOMM_TEST_STARTUP_DELAY": "1:60", "FASTCOMM_TIMEOUT_S": "30"})
        else:
            raise SystemExit(f"unknown part {part!r}")


def cut_off(dirs) -> list[str]:
    """Engines whose log exists with no result beside it in any folder: ``_run`` writes the result, or a
    ``failed`` entry, whenever the engine exits, so these were stopped with the harness (its call's budget,
    TP_BUDGET_S, or a kill): neither run nor failed, and not to be read as "not run"."""
    logs = {p.name[:-len(".log")] for d in dirs for p in Path(d).glob("*.log")}
    return sorted(n for n in logs if _load(dirs, n) is None)


def _load(dirs, name):
    for d in dirs:
        p = Path(d) / f"{name}.json"
        if p.is_file():
            return json.loads(p.read_text())
    return None


def routing_steps(res: dict) -> dict[str, list]:
    """Per MoE layer, the routing of each decode step after the prompt's prefill (one_gpu.record_routing, rank 0):
    step i's (experts, margin) of the token whose logits gave generated token i (a verify step's first row)."""
    records = ((res.get("allreduce") or [{}])[0]).get("routing") or []
    last_prefill = max((i for i, r in enumerate(records) if "experts" not in r), default=-1)
    steps: dict[str, list] = {}
    for r in records[last_prefill + 1:]:
        steps.setdefault(r["module"], []).append((sorted(r["experts"][0]), r["margin"][0]))
    return steps


def routing_parting(a: dict, b: dict) -> dict | None:
    """The first decode step (generated token index) at which two runs' routing of one layer differs, with
    both runs' margins there; None where both recorded none."""
    ra, rb = routing_steps(a), routing_steps(b)
    if not ra or not rb:
        return None
    for step in range(max(len(v) for v in ra.values())):
        for module in sorted(set(ra) & set(rb)):
            if step >= min(len(ra[module]), len(rb[module])):
                continue
            (ea, ma), (eb, mb) = ra[module][step], rb[module][step]
            if ea != eb:
                return {"token": step + 1, "module": module, "experts": [ea, eb], "margins": [ma, mb]}
    return {"token": None, "steps": min(len(v) for v in ra.values())}


def _allreduce_check(res: dict, layers: int, mtp: bool) -> dict:
    """Every forward whose Python ran (warm-up, graph capture, eager steps; a graph replay runs none, and routes
    as its capture did) on every rank: how many all-reduces it ran and where they went. A main-model forward
    runs 1 + 2 x layers (embedding, then attention and MLP per layer: 157 for GLM-5), the MTP draft's 3."""
    ranks = res.get("allreduce") or []
    main, draft = 1 + 2 * layers, 3
    seen, bad = {}, []
    for rank, c in enumerate(ranks):
        for tokens, calls, fc, fallback in c["forwards"]:
            key = f"{calls} calls"
            seen[key] = seen.get(key, 0) + 1
            if fallback or calls not in ((main, draft) if mtp else (main,)):
                bad.append({"rank": rank, "tokens": tokens, "calls": calls, "fastcomm": fc, "fallback": fallback})
        if c["outside"]:
            bad.append({"rank": rank, "outside_a_forward": c["outside"]})
    checked = sum(c.get("checked", 0) for c in ranks)
    mismatches = [{"rank": rank, **m} for rank, c in enumerate(ranks) for m in c.get("mismatches", [])]
    ok = (bool(ranks) and not bad and not mismatches and f"{main} calls" in seen
          and (not mtp or f"{draft} calls" in seen))
    return {"forwards_by_calls": seen, "ranks": len(ranks), "expected_main": main,
            "expected_draft": draft if mtp else None, "bad": bad[:8],
            "checked_bit_for_bit": checked, "mismatches": mismatches[:8],
            "fastcomm_every_rank": all(c.get("fastcomm") for c in ranks) if ranks else None, "ok": ok}


def report(dirs) -> dict:
    from fastcomm_vllm.gguf import synth as tinyglm

    layers = tinyglm.Shape().layers
    ref = _load(dirs, "ref")
    tp1 = _load(dirs, "logits-tp1")
    out, failures = {"tolerance": TOL, "control_min": CONTROL_MIN, "tp": {}}, []
    stopped = cut_off(dirs)
    for tp in (1, 2, 4, 8):
        lg, gm = (_load(dirs, f"{k}-tp{tp}") for k in ("logits", "greedy-mtp"))
        g = lg
        if lg is None and g is None:
            continue
        row = {}
        if lg and "prompt_logprobs" in lg and ref:
            row["vs_ref"] = summary(lg["prompt_logprobs"], ref["prompt_logprobs"])
            if not row["vs_ref"]["median"] < TOL:
                failures.append(f"TP {tp} logits vs reference")
        if lg and "prompt_logprobs" in lg and tp1 and tp != 1:
            row["vs_tp1"] = summary(lg["prompt_logprobs"], tp1["prompt_logprobs"])
        if g and tp1 and tp != 1 and "tokens" in g and "tokens" in tp1:
            row["greedy_vs_tp1"] = greedy_agreement(g, tp1)
            if not row["greedy_vs_tp1"]["ok"]:
                failures.append(f"TP {tp} greedy vs TP 1")
        if g and gm and "tokens" in g and "tokens" in gm:
            drafts = sum(v for n, v in gm["spec_decode"].items() if "num_draft_tokens" in n and "per_pos" not in n)
            row["greedy_with_mtp"] = greedy_agreement(g, gm)
            row["mtp_draft_tokens"] = drafts
            same = _load(dirs, f"greedy-tp{tp}@{SAME_FORMS}")  # greedy on the verify steps' forms
            if same and "tokens" in same:
                row["greedy_with_mtp_same_forms"] = greedy_agreement(same, gm)
            decides = row.get("greedy_with_mtp_same_forms", row["greedy_with_mtp"])
            if not (decides["ok"] and drafts > 0):
                failures.append(f"TP {tp} MTP")
        if tp > 1:
            for name, res, mtp in (("allreduce", g, False), ("allreduce_mtp", gm, True)):
                if res and "allreduce" in res:
                    row[name] = _allreduce_check(res, layers, mtp)
                    if not row[name]["ok"]:
                        failures.append(f"TP {tp} {name}")
        row["start_s"] = {k: r.get("start_s") for k, r in (("plain", lg), ("mtp", gm)) if r}
        for k, r, name in (("plain", lg, f"logits-tp{tp}"), ("mtp", gm, f"greedy-mtp-tp{tp}")):
            if r is None:  # not run (a logitsN part), unless cut off: that one fails below
                if name not in stopped:
                    row.setdefault("not_run", []).append(k)
            elif "failed" in r:
                failures.append(f"TP {tp} {k} engine")
        out["tp"][tp] = row
    for tp in (1, 2, 4, 8):
        for path in sorted({p.name for d in dirs for p in Path(d).glob(f"greedy-tp{tp}*.json")}):
            name = path[:-len(".json")]
            v, gm, lg = _load(dirs, name), _load(dirs, f"greedy-mtp-tp{tp}"), _load(dirs, f"logits-tp{tp}")
            if not v or "tokens" not in v:
                failures.append(f"{name} engine")
                continue
            row = {"tokens": v["tokens"]}
            for other, res in (("vs_mtp", gm), ("vs_plain", lg)):
                if res and "tokens" in res:
                    row[other] = greedy_agreement(v, res)
            mtp_routed = _load(dirs, f"greedy-mtp-tp{tp}{name[name.index('@'):]}") if "@" in name else None
            if mtp_routed and "tokens" in mtp_routed:  # the MTP run with the same variants
                row["vs_mtp_same_variant"] = greedy_agreement(v, mtp_routed)
                row["routing_vs_mtp_same_variant"] = routing_parting(v, mtp_routed)
            if tp > 1 and "allreduce" in v:
                row["allreduce"] = _allreduce_check(v, layers, False)
                if not row["allreduce"]["ok"]:
                    failures.append(f"{name} allreduce")
            if "vs_mtp" in row and not row["vs_mtp"]["ok"]:
                failures.append(f"{name} vs MTP")
            out.setdefault("variants", {})[name] = row
    for tp in (2, 4, 8):
        c = _load(dirs, f"control-tp{tp}")
        if c and "prompt_logprobs" in c and ref:
            out[f"control_tp{tp}"] = summary(c["prompt_logprobs"], ref["prompt_logprobs"])
            if not out[f"control_tp{tp}"]["median"] > CONTROL_MIN:
                failures.append(f"control TP {tp}")
        s = _load(dirs, f"skew-tp{tp}")
        if s is not None:
            out[f"skew_tp{tp}"] = {"started": "tokens" in s, "start_s": s.get("start_s")}
            if "tokens" not in s:
                failures.append(f"skew TP {tp}")
    if stopped:
        out["cut_off"] = stopped
        failures += [f"{n} engine cut off mid-run (a log, no result)" for n in stopped]
    out["failures"] = failures
    return out


if __name__ == "__main__":
    if sys.argv[1] == "--report":
        res = report(sys.argv[2:])
        print(json.dumps(res, indent=1))
        sys.exit(1 if res["failures"] else 0)
    run_parts(Path(sys.argv[1]), sys.argv[2].split(","))
