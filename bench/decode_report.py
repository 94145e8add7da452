"""bench-decode's report: the table of rows, each row's spread and warnings, and the greedy-token check."""
from __future__ import annotations

import statistics

from .decode_backends import BACKENDS, REFERENCE_ORDER


def check_active(res: dict) -> str | None:
    """Why a row does not measure what its name says (a fastcomm row without fastcomm), or None."""
    workers = res.get("workers")
    if not isinstance(workers, list):
        return None
    active = [bool(w.get("fastcomm")) for w in workers]
    wanted = BACKENDS[res["backend"]].fastcomm if res["backend"] in BACKENDS else any(active)
    if wanted and not all(active):
        reasons = {w.get("why_not") for w in workers if not w.get("fastcomm")}
        return f"fastcomm inactive on some ranks: {sorted(map(str, reasons))}"
    if not wanted and any(active):
        return "fastcomm active in a baseline row"
    return None


def compare_tokens(results: dict) -> dict:
    """Each row's greedy tokens against the reference row's: how many match and where they first differ."""
    ok = {k: v for k, v in results.items() if v.get("greedy_tokens")}
    ref = next((k for k in REFERENCE_ORDER if k in ok), next(iter(ok), None))
    out = {"reference": ref}
    if ref is None:
        return out
    base = ok[ref]["greedy_tokens"]
    for name, res in ok.items():
        toks = res["greedy_tokens"]
        n = min(len(toks), len(base))
        first = next((i for i in range(n) if toks[i] != base[i]), None)
        out[name] = {"compared": n, "matching": sum(a == b for a, b in zip(toks, base)),
                     "first_divergence": first, "distinct_tokens": len(set(toks))}
    return out


def spread_pct(runs: list[float] | None) -> float | None:
    """(max - min) / median of one point's timed runs, in percent; None for fewer than two runs."""
    if not runs or len(runs) < 2:
        return None
    return 100.0 * (max(runs) - min(runs)) / statistics.median(runs)


def env_text(env: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(env.items()))


def header(meta: dict) -> str:
    weights = meta.get("weights", "dummy")
    return (f"# model {meta.get('model')}  tp {meta.get('tp')}  max_tokens {meta.get('max_tokens')}  "
            f"capture sizes {meta.get('capture_sizes') or 'vLLM default'}"
            + (f"  max_num_seqs {meta['max_num_seqs']}" if meta.get("max_num_seqs") else "")
            + (f"  max_num_batched_tokens {meta['max_num_batched_tokens']}" if meta.get("max_num_batched_tokens")
               else "")
            + ("  weights: vLLM dummy (random, same seed in every row)" if weights == "dummy" else "  weights: real")
            + (f"  quantization {meta['quantization']}" if meta.get("quantization") else "")
            + ("  routers re-drawn to spread tokens (--spread-routing)" if meta.get("spread_routing") else "")
            + (f"  sweep sampled at temperature {meta['sweep_temperature']:g} (a seed a request)"
               if meta.get("sweep_temperature") else "")
            + (f"  MTP {meta['mtp']} draft tokens" if meta.get("mtp") else "")
            + (f"  fastcomm rows with {env_text(meta['fastcomm_env'])}" if meta.get("fastcomm_env") else "")
            + (f"  settings {env_text(meta['settings'])}" if meta.get("settings") else ""))


def print_report(results: dict, meta: dict) -> None:
    conc = sorted({s["concurrency"] for r in results.values() for s in r.get("sweep", ())})
    print(header(meta))
    spec_rows = any("spec_decode" in r.get("single", {}) for r in results.values())
    # With MTP, tokens per step beside tok/s: 1 + the accepted draft tokens per decode step.
    head = (f"{'backend':<14} {'start s':>8} {'bs1 tok/s':>10} " + (f"{'tok/step':>8} " if spec_rows else "")
            + f"{'TPOT ms':>8} " + " ".join(f"{'c=' + str(c) + ' tok/s':>12}" for c in conc))
    print(head)
    for name, r in results.items():
        if "single" not in r:
            print(f"{name:<14} FAILED: {r.get('error')} (log {r.get('log')})")
            continue
        by_c = {s["concurrency"]: s for s in r.get("sweep", ())}
        cols = " ".join(f"{by_c[c]['out_tok_s']:>12.1f}" if c in by_c else f"{'-':>12}" for c in conc)
        spec = r["single"].get("spec_decode")
        step = (f"{spec['tokens_per_step']:>8.2f} " if spec else f"{'-':>8} ") if spec_rows else ""
        print(f"{name:<14} {r['startup_s']:>8.0f} {r['single']['tok_s']:>10.1f} {step}{r['single']['tpot_ms']:>8.2f} {cols}")
        points = [("bs1", r["single"])] + [(f"c={c}", by_c[c]) for c in conc if c in by_c]
        # Each concurrency's TPOT and its prompts' first token (prefill): out tok/s counts both.
        swept = [(c, by_c[c]) for c in conc if c in by_c and "first_ms" in by_c[c]]
        if swept:
            print(f"{'':<14} TPOT / first token of all the prompts, ms: "
                  + ", ".join(f"c={c} {p['tpot_ms']:.2f} / {p['first_ms']:.0f}" for c, p in swept))
        distinct = [(c, p["distinct_tokens"]) for c, p in swept if p.get("distinct_tokens") is not None]
        if distinct:
            print(f"{'':<14} distinct tokens across the requests a step (median): "
                  + ", ".join(f"c={c} {d:g}" for c, d in distinct))
        accepted = [(label, p["spec_decode"]) for label, p in points if p.get("spec_decode")]
        if accepted:
            print(f"{'':<14} accepted draft tokens per step: "
                  + ", ".join(f"{label} {s['accepted_per_step']:.2f}" for label, s in accepted))
        spreads = [(label, spread_pct(point.get("runs_s"))) for label, point in points]
        if any(p is not None for _, p in spreads):
            print(f"{'':<14} spread of the timed runs, (max - min) / median: "
                  + ", ".join(f"{label} {p:.1f} %" for label, p in spreads if p is not None))
        if r.get("rounds"):
            print(f"{'':<14} rounds (in run order), TPOT ms: "
                  + ", ".join("-" if x["tpot_ms"] is None else f"{x['tpot_ms']:.2f}" for x in r["rounds"])
                  + " (row: medians)")
        if r.get("setup_note"):
            print(f"{'':<14} NOTE: {r['setup_note']} (not as the header says)")
        if not r.get("ok"):
            print(f"{'':<14} INCOMPLETE: {r.get('error')} (log {r.get('log')})")
        problem = check_active(r)
        if problem:
            print(f"{'':<14} WARNING: {problem}")
        workers = r.get("workers")
        if isinstance(workers, list) and workers and workers[0].get("fastcomm"):
            w = workers[0]
            print(f"{'':<14} {w.get('describe')}; fusion: DSA helper {'routed' if w.get('helper_routed') else 'not loaded'}, "
                  f"{w.get('compile_pass_rewrites', 0)} compile-pass rewrites (0 on a compile-cache hit)")
    cmp = compare_tokens(results)
    if cmp.get("reference"):
        print(f"# greedy tokens vs {cmp['reference']}:")
        for name, c in cmp.items():
            if name != "reference":
                verdict = "identical" if c["first_divergence"] is None else f"diverge at token {c['first_divergence']}"
                print(f"  {name:<14} {c['matching']}/{c['compared']} match, {verdict} "
                      f"({c['distinct_tokens']} distinct tokens)")
