"""End-to-end decode benchmark: vLLM serving a GLM-5-shaped model, one all-reduce backend per process.

    fastcomm bench-decode --model glm5-78L-16E --configs vllm,nccl,fastcomm --max-tokens 128
    fastcomm bench-decode --compare run1.json run2.json      # merge runs made in separate calls (a backend
                                                             # in several files: one row of medians)

The model directory holds only a config.json: weights are vLLM's dummy ones (same seed, so every backend
computes with the same weights), the tokenizer is skipped and prompts are token ids. Each backend runs in
its own subprocess (start-up of a 78-layer model takes minutes) and reports:
- single request: decode tok/s and time per output token (TPOT), from (t(N tokens) - t(1 token)) / (N - 1),
  which cancels prefill and scheduling start-up;
- a concurrency sweep (default 1, 4, 16, 64 requests): output tok/s and TPOT at each;
- the greedy tokens of the single request, compared across backends (first divergence, if any).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    about: str
    env: dict
    disable_custom_all_reduce: bool = False
    fastcomm: bool = False


# Each backend sets FASTCOMM_VLLM explicitly so an inherited value cannot change what a row measures.
BACKENDS = {b.name: b for b in (
    Backend("vllm", "vLLM default (its custom all-reduce, NCCL above its range)", {"FASTCOMM_VLLM": "0"}),
    Backend("nccl", "vLLM, custom all-reduce off: NCCL only", {"FASTCOMM_VLLM": "0"}, True),
    Backend("fastcomm", "vLLM + fastcomm with the all-reduce + RMSNorm fusion (FASTCOMM_VLLM_FUSION=1)",
            {"FASTCOMM_VLLM": "1", "FASTCOMM_VLLM_FUSION": "1"}, fastcomm=True),
    Backend("fastcomm-nofuse", "vLLM + fastcomm all-reduce only (FASTCOMM_VLLM_FUSION=0, the default)",
            {"FASTCOMM_VLLM": "1", "FASTCOMM_VLLM_FUSION": "0"}, fastcomm=True),
    # Stand-ins for GPUs without P2P: vLLM's custom all-reduce needs P2P, so it is off in both.
    Backend("nccl-nop2p", "NCCL only, NCCL_P2P_DISABLE=1", {"FASTCOMM_VLLM": "0", "NCCL_P2P_DISABLE": "1"}, True),
    Backend("fastcomm-host", "fastcomm host transport with the fusion, NCCL_P2P_DISABLE=1",
            {"FASTCOMM_VLLM": "1", "FASTCOMM_TRANSPORT": "host", "FASTCOMM_VLLM_FUSION": "1",
             "NCCL_P2P_DISABLE": "1"}, True, fastcomm=True),
    Backend("fastcomm-host-nofuse", "fastcomm host transport, all-reduce only, NCCL_P2P_DISABLE=1",
            {"FASTCOMM_VLLM": "1", "FASTCOMM_TRANSPORT": "host", "FASTCOMM_VLLM_FUSION": "0",
             "NCCL_P2P_DISABLE": "1"}, True, fastcomm=True),
)}
REFERENCE_ORDER = ("vllm", "nccl", "nccl-nop2p", "fastcomm", "fastcomm-host")


# ---- worker: one backend, inside its own process --------------------------------------------------------

# Runs made before 2026-11-30 session 5 drew each prompt as one token id repeated (a new generator per
# token); their files carry no "prompts" key. A new run's prompts are distinct random ids.
PROMPTS = "random ids"
LEGACY_PROMPTS = "one id repeated"


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Request i's prompt: `length` random token ids from its own seeded generator (same on every run)."""
    prompts = []
    for i in range(count):
        rng = random.Random(seed * 1000 + i)
        prompts.append([rng.randrange(100, vocab - 100) for _ in range(length)])
    return prompts


def run_worker(spec: dict, backend: Backend, save) -> dict:
    """Measure one backend; ``save(result)`` after each step, so a run cut short still reports."""
    from vllm import LLM, SamplingParams

    kwargs = dict(model=spec["model"], tensor_parallel_size=spec["tp"], load_format="dummy",
                  skip_tokenizer_init=True, seed=0, max_model_len=spec["max_model_len"],
                  max_num_seqs=spec.get("max_num_seqs") or max(spec["concurrency"]),
                  gpu_memory_utilization=spec["gpu_memory_utilization"],
                  disable_custom_all_reduce=backend.disable_custom_all_reduce)
    if spec["capture_sizes"] is not None:
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": spec["capture_sizes"]}
    if spec.get("profile_dir"):
        # vLLM's own torch profiler (0.25 and newer): per-worker traces plus a CUDA-time table, to see where
        # one backend's decode step spends time that another's does not.
        kwargs["profiler_config"] = {"profiler": "torch",
                                     "torch_profiler_dir": str(Path(spec["profile_dir"]) / backend.name),
                                     "torch_profiler_with_stack": False,
                                     "torch_profiler_dump_cuda_time_total": True}
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    result = {"startup_s": round(time.perf_counter() - t0, 1), "vllm": importlib.metadata.version("vllm")}
    try:
        from fastcomm_vllm.plugin import worker_status

        result["workers"] = llm.collective_rpc(worker_status)
    except Exception as e:  # informational; the row is still measured
        result["workers"] = f"status unavailable: {type(e).__name__}: {e}"
    save(result)

    vocab = json.loads((Path(spec["model"]) / "config.json").read_text())["vocab_size"]
    prompts = _prompts(max(spec["concurrency"]), spec["prompt_len"], vocab, spec["seed"])

    def timed(batch: int, tokens: int):
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
        times, outs = [], None
        for _ in range(spec["repeats"]):
            t = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:batch]], params, use_tqdm=False)
            times.append(time.perf_counter() - t)
        # Every repeat's wall time goes on record beside the median: the spread says what a ratio can bear.
        return statistics.median(times), outs, [round(x, 4) for x in times]

    n = spec["max_tokens"]
    timed(1, 8)  # warm-up: first-request allocations, sampler JIT
    t1, _, _ = timed(1, 1)
    tn, outs, runs = timed(1, n)
    tpot = (tn - t1) / (n - 1)
    result["single"] = {"tpot_ms": round(tpot * 1e3, 3), "tok_s": round(1 / tpot, 2),
                        "ttft_ms": round(t1 * 1e3, 2), "wall_s": round(tn, 3),
                        "runs_s": runs}
    result["greedy_tokens"] = list(outs[0].outputs[0].token_ids)
    save(result)
    if spec.get("profile_dir"):
        try:  # after the timed runs, so profiling never skews them
            llm.start_profile()
            params = SamplingParams(temperature=0.0, max_tokens=spec.get("profile_tokens", 16), ignore_eos=True,
                                    detokenize=False)
            batch = spec.get("profile_concurrency", 1)
            llm.generate([{"prompt_token_ids": p} for p in prompts[:batch]], params, use_tqdm=False)
            llm.stop_profile()
            result["profile"] = str(Path(spec["profile_dir"]) / backend.name)
        except Exception as e:  # the row stands without a profile
            result["profile"] = f"failed: {type(e).__name__}: {e}"
    sweep = result["sweep"] = []
    save(result)
    for c in spec["concurrency"]:
        # Untimed first: a new batch size compiles Triton kernels for its shapes (vLLM warns "JIT compilation
        # during inference"), which would otherwise land in the 1-token run and shrink the TPOT difference.
        llm.generate([{"prompt_token_ids": p} for p in prompts[:c]],
                     SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False), use_tqdm=False)
        c1, _, _ = timed(c, 1)
        cn, _, runs = timed(c, n)
        tpot_c = (cn - c1) / (n - 1)
        sweep.append({"concurrency": c, "out_tok_s": round(c * n / cn, 1), "tpot_ms": round(tpot_c * 1e3, 3),
                      "decode_tok_s": round(c / tpot_c, 1), "runs_s": runs})
        save(result)
    return result


def worker_main(args) -> int:
    spec = json.loads(Path(args.spec).read_text())
    out = Path(args.result)

    def save(result: dict) -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(out)  # the parent never reads a half-written file

    run_worker(spec, BACKENDS[args.worker], save)
    return 0


# ---- parent: one subprocess per backend -----------------------------------------------------------------

def resolve_model(name: str) -> Path:
    """A directory with config.json, or the name of one under shared/models (next to or above the repo)."""
    path = Path(name).expanduser()
    candidates = [path] + [root / "models" / name for root in (REPO / "shared", REPO.parent / "shared")]
    for cand in candidates:
        if (cand / "config.json").is_file():
            return cand.resolve()
    raise SystemExit(f"bench-decode: no config.json for model {name!r} (looked in {', '.join(map(str, candidates))})")


def _check_plugin() -> None:
    names = [ep.name for ep in importlib.metadata.entry_points(group="vllm.general_plugins")]
    if "fastcomm" not in names:
        raise SystemExit("bench-decode: fastcomm's vLLM plugin is not registered in this environment; install "
                         "the repo (pip install --no-deps --no-build-isolation -e .) so vLLM's workers load it")


def row_env(backend: Backend, spec: dict) -> dict:
    """What a row sets in its process: the backend's own variables, plus --fastcomm-env in fastcomm rows."""
    extra = (spec.get("fastcomm_env") or {}) if backend.fastcomm else {}
    return {**backend.env, **extra}


def run_backend(backend: Backend, spec: dict, log_dir: Path, timeout: float, tag: str = "") -> dict:
    spec_file = log_dir / "spec.json"
    spec_file.write_text(json.dumps(spec))
    result_file = log_dir / f"{backend.name}{tag}.result.json"
    result_file.unlink(missing_ok=True)
    log = log_dir / f"{backend.name}{tag}.log"
    # status RPC: collective_rpc ships worker_status by reference (cloudpickle), which vLLM gates on this.
    env_set = row_env(backend, spec)
    env = {**os.environ, **env_set, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", backend.name, "--spec", str(spec_file),
           "--result", str(result_file)]
    t0 = time.perf_counter()
    with open(log, "w") as out:
        # Own session, so a timeout can stop vLLM's engine and worker processes with it.
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    res = {"backend": backend.name, "about": backend.about, "env": env_set,
           "disable_custom_all_reduce": backend.disable_custom_all_reduce, "wall_s": round(time.perf_counter() - t0, 1),
           "log": str(log)}
    if result_file.is_file():  # complete, or what a run cut short had measured
        res.update(json.loads(result_file.read_text()))
    res["ok"] = rc == 0 and "sweep" in res
    if not res["ok"]:
        res["error"] = "timed out" if rc is None else f"exit status {rc}"
        res["log_tail"] = log.read_text(errors="replace").splitlines()[-30:]
    return res


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
                         **_pooled_runs(r["single"] for r in done)}
        ttft = [r["single"]["ttft_ms"] for r in done if "ttft_ms" in r["single"]]
        if ttft:
            row["single"]["ttft_ms"] = round(statistics.median(ttft), 2)
        sweeps = [{s["concurrency"]: s for s in r.get("sweep", ())} for r in done]
        row["sweep"] = []
        for c in sorted(set.intersection(*(set(sw) for sw in sweeps))):
            row["sweep"].append({"concurrency": c, **{k: round(statistics.median(sw[c][k] for sw in sweeps), 3)
                                                      for k in ("out_tok_s", "tpot_ms", "decode_tok_s")},
                                 **_pooled_runs(sw[c] for sw in sweeps)})
    return row


def _pooled_runs(points) -> dict:
    """Every round's timed runs of one point together (the spread over all rounds), where all rounds kept them."""
    points = list(points)
    if not all(p.get("runs_s") for p in points):
        return {}
    return {"runs_s": [x for p in points for x in p["runs_s"]]}


# What makes two runs the same measurement; runs that differ in any of these are never merged as rounds.
SETUP_KEYS = ("model", "tp", "max_tokens", "capture_sizes", "prompt_len", "prompts", "max_num_seqs",
              "fastcomm_env")


def _setup_value(meta: dict, key: str):
    return meta.get(key, LEGACY_PROMPTS) if key == "prompts" else meta.get(key)


def _setup_text(meta: dict, keys) -> str:
    values = {k: _setup_value(meta, k) for k in keys}
    return ", ".join(f"{k} {'vLLM default' if v is None else v}" for k, v in values.items())


def _setup(meta: dict) -> tuple:
    return tuple(json.dumps(_setup_value(meta, k)) for k in SETUP_KEYS)  # lists (capture sizes) as text


def merge_files(files: list[dict]) -> tuple[dict, dict]:
    """Rows from several result files: a backend measured under the same setup in several files (rounds
    made in separate device calls) becomes one row of medians; a setup other than the first file's stays
    a row of its own and says how it differs, so a table never silently mixes capture sizes or lengths."""
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
            row = {**row, "setup_note": "measured with " + _setup_text(metas[setup], diff)}
        names_seen[name] = names_seen.get(name, 0) + 1
        results[name if names_seen[name] == 1 else f"{name}#{names_seen[name]}"] = row
    return results, meta


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


def print_report(results: dict, meta: dict) -> None:
    conc = sorted({s["concurrency"] for r in results.values() for s in r.get("sweep", ())})
    print(f"# model {meta.get('model')}  tp {meta.get('tp')}  max_tokens {meta.get('max_tokens')}  "
          f"capture sizes {meta.get('capture_sizes') or 'vLLM default'}"
          + (f"  max_num_seqs {meta['max_num_seqs']}" if meta.get("max_num_seqs") else "")
          + (f"  fastcomm rows with {_env_text(meta['fastcomm_env'])}" if meta.get("fastcomm_env") else ""))
    head = f"{'backend':<14} {'start s':>8} {'bs1 tok/s':>10} {'TPOT ms':>8} " + \
        " ".join(f"{'c=' + str(c) + ' tok/s':>12}" for c in conc)
    print(head)
    for name, r in results.items():
        if "single" not in r:
            print(f"{name:<14} FAILED: {r.get('error')} (log {r.get('log')})")
            continue
        by_c = {s["concurrency"]: s for s in r.get("sweep", ())}
        cols = " ".join(f"{by_c[c]['out_tok_s']:>12.1f}" if c in by_c else f"{'-':>12}" for c in conc)
        print(f"{name:<14} {r['startup_s']:>8.0f} {r['single']['tok_s']:>10.1f} {r['single']['tpot_ms']:>8.2f} {cols}")
        spreads = [(label, spread_pct(point.get("runs_s")))
                   for label, point in [("bs1", r["single"])] + [(f"c={c}", by_c[c]) for c in conc if c in by_c]]
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


# The variables that make a row what its name says; --fastcomm-env may not change them.
ROW_DEFINING = ("FASTCOMM_VLLM", "FASTCOMM_VLLM_FUSION", "FASTCOMM_TRANSPORT")


def _env_text(env: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(env.items()))


def parse_fastcomm_env(items: list[str]) -> dict:
    """KEY=VALUE pairs for the fastcomm rows (e.g. FASTCOMM_ALGO=one_shot): an A/B of one knob in the same
    call. Only FASTCOMM_* variables, and none of those that define a row."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("FASTCOMM_"):
            raise SystemExit(f"bench-decode: --fastcomm-env {item!r}: expected FASTCOMM_NAME=VALUE")
        if key in ROW_DEFINING:
            raise SystemExit(f"bench-decode: --fastcomm-env {key} defines the rows; pick another config instead")
        env[key] = value
    return env


def parse_args(argv):
    p = argparse.ArgumentParser(prog="fastcomm bench-decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="glm5-78L-16E", help="directory with config.json, or a name under shared/models")
    p.add_argument("--configs", default=",".join(BACKENDS), help=f"comma list of {', '.join(BACKENDS)}")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (>= 64 for the token check)")
    p.add_argument("--capture-sizes", default="default",
                   help="cudagraph_capture_sizes: 'default' (vLLM's) or a list such as 1,2,4,8")
    p.add_argument("--concurrency", default="1,4,16,64", help="concurrent requests for the sweep")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="vLLM's max_num_seqs (default: the largest concurrency). vLLM's default capture sizes "
                        "grow with it: 256 gives its 51-size list, 64 gives sizes up to 128")
    p.add_argument("--tp", type=int, default=2, help="tensor parallel size")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (median)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    p.add_argument("--seed", type=int, default=0, help="prompt token ids")
    p.add_argument("--profile-dir", default=None,
                   help="also profile decode steps per backend with vLLM's torch profiler (traces per backend)")
    p.add_argument("--profile-tokens", type=int, default=16, help="tokens generated while profiling")
    p.add_argument("--profile-concurrency", type=int, default=1,
                   help="requests decoded together while profiling (e.g. 8: the all-reduce share at 8 concurrent)")
    p.add_argument("--fastcomm-env", action="append", default=[], metavar="FASTCOMM_NAME=VALUE",
                   help="set a fastcomm variable in the fastcomm rows (repeatable), e.g. FASTCOMM_ALGO=one_shot; "
                        "recorded in the results, and --compare never merges it with runs without it")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the configs round-robin this many times; rows are medians (takes run order out)")
    p.add_argument("--timeout", type=float, default=1500, help="seconds per backend (start-up included)")
    p.add_argument("--out", default=None, help="JSON results (default bench/results/decode-<model>-<time>.json)")
    p.add_argument("--compare", nargs="+", default=None, metavar="JSON", help="print merged earlier results and exit")
    p.add_argument("--worker", choices=list(BACKENDS), help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    if args.compare:
        results, meta = merge_files([json.loads(Path(f).read_text()) for f in args.compare])
        print_report(results, meta)
        return 0

    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in BACKENDS]
    if unknown:
        raise SystemExit(f"bench-decode: unknown config(s) {unknown}; choose from {', '.join(BACKENDS)}")
    if args.rounds < 1:
        raise SystemExit("bench-decode: --rounds must be at least 1")
    if args.max_tokens < 2:
        raise SystemExit("bench-decode: --max-tokens must be at least 2 (TPOT needs two lengths)")
    if args.max_tokens < 64:
        print(f"bench-decode: note: the token agreement check covers only {args.max_tokens} tokens (< 64)")
    if any(BACKENDS[n].fastcomm for n in names):
        _check_plugin()
    conc = [int(c) for c in args.concurrency.split(",")]
    if args.max_num_seqs is not None and args.max_num_seqs < max(conc):
        raise SystemExit(f"bench-decode: --max-num-seqs {args.max_num_seqs} is below the largest concurrency "
                         f"{max(conc)}: vLLM would queue requests and the sweep would not measure that concurrency")
    if not 1 <= args.profile_concurrency <= max(conc):
        raise SystemExit(f"bench-decode: --profile-concurrency {args.profile_concurrency} must be between 1 and the "
                         f"largest concurrency {max(conc)} (the prompts and max_num_seqs are sized by it)")
    fastcomm_env = parse_fastcomm_env(args.fastcomm_env)
    model = resolve_model(args.model)
    sizes = None if args.capture_sizes == "default" else [int(s) for s in args.capture_sizes.split(",")]
    spec = dict(model=str(model), tp=args.tp, max_tokens=args.max_tokens, capture_sizes=sizes,
                concurrency=conc, max_num_seqs=args.max_num_seqs, prompt_len=args.prompt_len, prompts=PROMPTS,
                repeats=args.repeats, max_model_len=args.max_model_len, seed=args.seed,
                gpu_memory_utilization=args.gpu_memory_utilization,
                profile_dir=str(Path(args.profile_dir).resolve()) if args.profile_dir else None,
                profile_tokens=args.profile_tokens, profile_concurrency=args.profile_concurrency,
                fastcomm_env=fastcomm_env or None)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else REPO / "bench" / "results" / f"decode-{model.name}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix=f"decode-{stamp}-", dir=out.parent))
    meta = {**spec, "configs": names, "rounds": args.rounds, "started": stamp}
    runs: dict[str, list[dict]] = {name: [] for name in names}
    results = {}
    for k in range(args.rounds):
        for name in names:
            print(f"bench-decode: {name}: {BACKENDS[name].about}"
                  + (f" (round {k + 1}/{args.rounds})" if args.rounds > 1 else "") + " ...", flush=True)
            runs[name].append(run_backend(BACKENDS[name], spec, log_dir, args.timeout,
                                          f"-r{k + 1}" if args.rounds > 1 else ""))
            results[name] = combine_rounds(runs[name])
            out.write_text(json.dumps({"meta": meta, "results": results, "tokens": compare_tokens(results)}, indent=1))
    print_report(results, meta)
    print(f"# results: {out}  (logs: {log_dir})")
    return 0 if all(r.get("ok") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
