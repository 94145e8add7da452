"""Rows from several bench-decode runs: rounds of one backend become one row of medians, and runs made
under different setups are never merged (a table must not silently mix capture sizes or lengths)."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

# Runs made before 2026-11-30 run 5 drew each prompt as one token id repeated (a new generator per
# token); their files carry no "prompts" key. A new run's prompts are distinct random ids.
PROMPTS = "random ids"
LEGACY_PROMPTS = "one id repeated"

# What makes two runs the same measurement; runs that differ in any of these are never merged as rounds.
SETUP_KEYS = ("model", "tp", "max_tokens", "capture_sizes", "prompt_len", "prompts", "max_num_seqs",
              "fastcomm_env", "weights", "mtp", "quantization", "settings", "sweep_temperature",
              "max_num_batched_tokens", "standin_us")
# What a file written before a key existed measured (every run before weights/mtp were recorded used dummy
# weights without MTP).
LEGACY = {"prompts": LEGACY_PROMPTS, "weights": "dummy", "mtp": 0, "quantization": None, "settings": None,
          "sweep_temperature": 0.0}


def combine_rounds(runs: list[dict]) -> dict:
    """One row from several rounds of a backend: medians of what every complete round measured.

    Why rounds: in every end-to-end comparison so far the backend that ran first in a device call was the
    slowest, whichever it was; running the configs round-robin and taking medians takes that order out.
    """
    if len(runs) == 1:
        return runs[0]
    done = [r for r in runs if "single" in r]
    row = dict(done[-1] if done else runs[-1])
    row["rounds"] = [{"startup_s": r.get("startup_s"), "ok": r.get("ok"),
                      "tpot_ms": r["single"]["tpot_ms"] if "single" in r else None} for r in runs]
    row["ok"] = all(r.get("ok") for r in runs)
    if not row["ok"]:
        row["error"] = "; ".join(f"round {i + 1}: {r.get('error')}" for i, r in enumerate(runs) if not r.get("ok"))
    if len(done) >= 2:
        tpot = statistics.median(r["single"]["tpot_ms"] for r in done)
        row["single"] = {"tpot_ms": round(tpot, 3), "tok_s": round(1e3 / tpot, 2),
                         **_pooled_runs(r["single"] for r in done), **_pooled_spec(r["single"] for r in done)}
        ttft = [r["single"]["ttft_ms"] for r in done if "ttft_ms" in r["single"]]
        if ttft:
            row["single"]["ttft_ms"] = round(statistics.median(ttft), 2)
        sweeps = [{s["concurrency"]: s for s in r.get("sweep", ())} for r in done]
        row["sweep"] = []
        for c in sorted(set.intersection(*(set(sw) for sw in sweeps))):
            row["sweep"].append({"concurrency": c, **{k: round(statistics.median(sw[c][k] for sw in sweeps), 3)
                                                      for k in ("out_tok_s", "tpot_ms", "decode_tok_s")},
                                 **_pooled_runs(sw[c] for sw in sweeps), **_pooled_spec(sw[c] for sw in sweeps)})
            if all("first_ms" in sw[c] for sw in sweeps):
                row["sweep"][-1]["first_ms"] = round(statistics.median(sw[c]["first_ms"] for sw in sweeps), 2)
    return row


def _pooled_runs(points) -> dict:
    """Every round's timed runs of one point together (the spread over all rounds), where all rounds kept them."""
    points = list(points)
    if not all(p.get("runs_s") for p in points):
        return {}
    return {"runs_s": [x for p in points for x in p["runs_s"]]}


def _pooled_spec(points) -> dict:
    """Spec-decode counts of one point summed over the rounds (acceptance is a ratio of totals)."""
    specs = [p.get("spec_decode") for p in points]
    if not specs or not all(specs):
        return {}
    drafts, accepted = sum(s["drafts"] for s in specs), sum(s["accepted"] for s in specs)
    return {"spec_decode": {"drafts": drafts, "accepted": accepted, "accepted_per_step": round(accepted / drafts, 3),
                            "tokens_per_step": round(1 + accepted / drafts, 3)}}


def setup_value(meta: dict, key: str):
    value = meta.get(key, LEGACY.get(key))
    # Older files name the model by an absolute path on the machine that ran them; the name is what counts.
    return Path(value).name if key == "model" and isinstance(value, str) else value


def setup_text(meta: dict, keys) -> str:
    values = {k: setup_value(meta, k) for k in keys}
    return ", ".join(f"{k} {'vLLM default' if v is None else v}" for k, v in values.items())


def _setup(meta: dict) -> tuple:
    return tuple(json.dumps(setup_value(meta, k)) for k in SETUP_KEYS)  # lists (capture sizes) as text


def merge_files(files: list[dict]) -> tuple[dict, dict]:
    """Rows from several result files: a backend measured under the same setup in several files (rounds
    made in separate device calls) becomes one row of medians; a setup other than the first file's stays
    a row of its own and says how it differs."""
    meta = files[0]["meta"] if files else {}
    base = _setup(meta)
    runs: dict[tuple, list[dict]] = {}
    metas: dict[tuple, dict] = {}
    for data in files:
        setup = _setup(data["meta"])
        metas[setup] = data["meta"]
        for name, res in data["results"].items():
            runs.setdefault((name, setup), []).append(res)
    names_seen: dict[str, int] = {}
    results = {}
    for (name, setup), rs in runs.items():
        row = combine_rounds(rs)
        if setup != base:
            diff = [k for k, a, b in zip(SETUP_KEYS, setup, base) if a != b]
            row = {**row, "setup_note": "measured with " + setup_text(metas[setup], diff)}
        names_seen[name] = names_seen.get(name, 0) + 1
        results[name if names_seen[name] == 1 else f"{name}#{names_seen[name]}"] = row
    return results, meta
