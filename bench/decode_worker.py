"""bench-decode's worker: one backend, inside its own vLLM process.

    python -m fastcomm_bench.decode_worker BACKEND SPEC.json RESULT.json

Started by ``decode_runner`` with the backend's environment. Writes RESULT.json after each step (atomically),
so a run cut short at its timeout still reports what it measured:
- single request: decode tok/s and time per output token (TPOT), from (t(N tokens) - t(1 token)) / (N - 1),
  which cancels prefill and scheduling start-up;
- a concurrency sweep: output tok/s and TPOT at each concurrency;
- the greedy tokens of the single request (the report compares them across backends);
- with MTP, the accepted draft tokens per decode step at each point, from vLLM's spec-decode counters.
"""
from __future__ import annotations

import importlib.metadata
import json
import random
import statistics
import sys
import time
from pathlib import Path

from .decode_backends import BACKENDS, Backend

# vLLM v1's spec-decode counters (vllm/v1/spec_decode/metrics.py, the same names since 0.25).
DRAFTS = "vllm:spec_decode_num_drafts"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Request i's prompt: `length` random token ids from its own seeded generator (same on every run)."""
    out = []
    for i in range(count):
        rng = random.Random(seed * 1000 + i)
        out.append([rng.randrange(100, vocab - 100) for _ in range(length)])
    return out


def engine_kwargs(spec: dict, backend: Backend) -> dict:
    """vllm.LLM's arguments for this row: the model's (spec["engine"]) over the benchmark's own."""
    # seed: dummy weights come from it, so every backend computes with the same ones.
    kwargs = {**dict(tensor_parallel_size=spec["tp"], skip_tokenizer_init=True, seed=0,
                     max_model_len=spec["max_model_len"],
                     max_num_seqs=spec.get("max_num_seqs") or max(spec["concurrency"]),
                     gpu_memory_utilization=spec["gpu_memory_utilization"],
                     disable_custom_all_reduce=backend.disable_custom_all_reduce), **spec["engine"]}
    if spec.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    if spec.get("mtp"):
        kwargs["disable_log_stats"] = False  # LLM.get_metrics() needs vLLM's stat logging
    if spec["capture_sizes"] is not None:
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": spec["capture_sizes"]}
    if spec.get("profile_dir"):
        # vLLM's own torch profiler (0.25 and newer): per-worker traces plus a CUDA-time table, to see where
        # one backend's decode step spends time that another's does not.
        kwargs["profiler_config"] = {"profiler": "torch",
                                     "torch_profiler_dir": str(Path(spec["profile_dir"]) / backend.name),
                                     "torch_profiler_with_stack": False,
                                     "torch_profiler_dump_cuda_time_total": True}
    return kwargs


def sweep_params(make, count: int, tokens: int, temperature: float, seed: int):
    """The sampling of a sweep point's ``count`` requests (``make``: vLLM's SamplingParams): greedy at
    temperature 0 (one params for all); else each request samples from its own seed, so every repeat draws the
    same tokens and the requests draw different ones."""
    common = dict(max_tokens=tokens, ignore_eos=True, detokenize=False)
    if temperature == 0:
        return make(temperature=0.0, **common)
    return [make(temperature=temperature, seed=seed * 1000 + i, **common) for i in range(count)]


def distinct_per_step(token_lists: list[list[int]]) -> float | None:
    """The median, over a run's steps, of how many distinct tokens its requests had at that step: a step's
    requests route to experts by their tokens, so 8 requests on 1-2 distinct tokens read one request's experts."""
    steps = min((len(t) for t in token_lists), default=0)
    if len(token_lists) < 2 or steps == 0:
        return None
    return statistics.median(len({t[i] for t in token_lists}) for i in range(steps))


def spec_counters(metrics) -> dict[str, float]:
    """The spec-decode counters in a ``LLM.get_metrics()`` snapshot, summed over engines."""
    out = {DRAFTS: 0.0, ACCEPTED: 0.0, DRAFT_TOKENS: 0.0}
    for m in metrics:
        if m.name in out and isinstance(getattr(m, "value", None), (int, float)):
            out[m.name] += m.value
    return out


def acceptance(before: dict[str, float], after: dict[str, float]) -> dict | None:
    """Accepted draft tokens per decode step between two snapshots (None: no drafts were made)."""
    drafts = after[DRAFTS] - before[DRAFTS]
    if drafts <= 0:
        return None
    accepted = after[ACCEPTED] - before[ACCEPTED]
    return {"drafts": int(drafts), "accepted": int(accepted),
            "accepted_per_step": round(accepted / drafts, 3),
            # What one decode step emits per request: the target's token plus the accepted drafts.
            "tokens_per_step": round(1 + accepted / drafts, 3),
            "acceptance_rate": round(accepted / (after[DRAFT_TOKENS] - before[DRAFT_TOKENS]), 3)
            if after[DRAFT_TOKENS] > before[DRAFT_TOKENS] else None}


def spread_router_(model, seed: int = 0) -> int:
    """Re-draw each MoE router of ``model`` (a decoder layer holding ``post_attention_layernorm`` and
    ``mlp.gate`` with ``e_score_correction_bias``) as the GGUF benchmark file draws it: logits of unit variance
    for the layer's normalized input (gate ~ N(0, 1) / (sqrt(hidden) x rms(norm weight))) and a bias ~ N(0,
    1/sqrt(experts)); returns the routers changed.

    Why: vLLM's dummy weights (+-1e-3, the norms too on vLLM 0.25) make the router's logits ~1e-5 against a
    bias of ~1e-3, so every token takes the same top-k experts and an 8-request step reads no more expert
    bytes than a 1-request one, where the GGUF file's random weights spread the tokens over the experts. With
    this, both read the experts alike and the FP8 row stays the same shapes' baseline at every concurrency."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    changed = 0
    with torch.no_grad():
        for layer in model.modules():
            norm = getattr(layer, "post_attention_layernorm", None)
            gate = getattr(getattr(layer, "mlp", None), "gate", None)
            bias = getattr(gate, "e_score_correction_bias", None)
            if norm is None or bias is None or getattr(gate, "weight", None) is None:
                continue
            w = gate.weight
            rms = float(norm.weight.detach().float().pow(2).mean().sqrt()) or 1.0
            draw = torch.randn(w.shape, generator=g) / (w.shape[-1] ** 0.5 * rms)
            w.copy_(draw.to(w.dtype))
            bias.copy_((torch.randn(bias.shape, generator=g) / bias.numel() ** 0.5).to(bias.dtype))
            changed += 1
    return changed


def spread_routing(worker) -> int:
    """``spread_router_`` on this worker's model (for ``LLM.collective_rpc``)."""
    from fastcomm_vllm.plugin import worker_model

    return spread_router_(worker_model(worker))


def _vocab_size(llm) -> int:
    model_config = getattr(llm, "model_config", None) or llm.llm_engine.model_config
    return int(model_config.get_vocab_size())


def run(spec: dict, backend: Backend, save) -> dict:
    """Measure one backend; ``save(result)`` after each step, so a run cut short still reports."""
    from vllm import LLM

    if spec.get("gguf"):  # the GGUF contract again, in this process: it registers vLLM's GGUF adapter here
        from fastcomm_vllm import gguf

        from .decode_models import gguf_engine_kwargs

        spec = {**spec, "engine": {"model": spec["gguf"]["model"], **gguf_engine_kwargs(gguf, spec["gguf"])}}
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(spec, backend))
    result = {"startup_s": round(time.perf_counter() - t0, 1), "vllm": importlib.metadata.version("vllm")}
    try:
        from fastcomm_vllm.plugin import worker_status

        result["workers"] = llm.collective_rpc(worker_status)
    except Exception as e:  # informational; the row is still measured
        result["workers"] = f"status unavailable: {type(e).__name__}: {e}"
    if spec.get("spread_routing"):  # before any timed run; the captured graphs read the weights in place
        result["spread_routers"] = llm.collective_rpc(spread_routing)
    save(result)

    batch_prompts = prompts(max(spec["concurrency"]), spec["prompt_len"], _vocab_size(llm), spec["seed"])

    def counters():
        return spec_counters(llm.get_metrics()) if spec.get("mtp") else None

    if spec.get("standin_us"):  # one rank's TP 8 shard at TP 1: the stand-ins where its all-reduces would be
        from fastcomm_vllm import standin

        result["standin_sites"] = llm.collective_rpc(standin.worker_sites)
        result["standin"] = []
        for i, us in enumerate(spec["standin_us"]):
            llm.collective_rpc(standin.worker_set_us, args=(float(us),))
            point = {"us": us}
            result["standin"].append(point)
            measure(llm, spec, batch_prompts, counters, point, lambda: save(result))
            if i == 0:  # the row's own figures (the report's table) are the first time's
                result.update({k: point[k] for k in ("single", "greedy_tokens", "sweep")})
        if spec.get("profile_dir"):  # after every timed run, at the first time
            llm.collective_rpc(standin.worker_set_us, args=(float(spec["standin_us"][0]),))
            result["profile"] = profile_step(llm, spec, batch_prompts, backend.name)
            save(result)
        return result
    measure(llm, spec, batch_prompts, counters, result, lambda: save(result), profile_name=backend.name)
    return result


def profile_folder(name: str, concurrency: int) -> str:
    """The folder of a backend's profile at ``concurrency`` requests under the profile dir: the backend's own
    for 1 (where vLLM's profiler writes), BACKEND-cN beside it for N."""
    return name if concurrency == 1 else f"{name}-c{concurrency}"


def stamps(folder: Path) -> dict[Path, int]:
    """The files of ``folder`` with their modification times (none where it does not exist)."""
    return {f: f.stat().st_mtime_ns for f in folder.iterdir() if f.is_file()} if folder.is_dir() else {}


def move_profile(written: Path, folder: Path, before: dict[Path, int]) -> None:
    """Move the files a profiled run wrote or rewrote in ``written`` (``before``: its ``stamps`` at the
    run's start) into ``folder``; nothing where they are the same folder."""
    if folder == written:
        return
    folder.mkdir(parents=True, exist_ok=True)
    for f, stamp in stamps(written).items():
        if before.get(f) != stamp:
            f.rename(folder / f.name)


def profile_step(llm, spec: dict, batch_prompts, name: str) -> dict[str, str]:
    """One profiled generate per concurrency of ``spec["profile_concurrency"]``; {concurrency: its folder under
    ``spec["profile_dir"]``, or why it failed}. vLLM's profiler writes every profiled run into the backend's folder
    (fixed at the engine's start), so a run's new or rewritten files (its traces; the CUDA-time table, which
    each run rewrites) move to its concurrency's folder after it stops."""
    from vllm import SamplingParams

    root = Path(spec["profile_dir"])
    written = root / name
    out = {}
    for batch in spec.get("profile_concurrency", [1]):
        try:
            before = stamps(written)
            params = sweep_params(SamplingParams, batch, spec.get("profile_tokens", 16),
                                  spec.get("sweep_temperature", 0.0), spec["seed"])
            llm.start_profile()
            try:
                llm.generate([{"prompt_token_ids": p} for p in batch_prompts[:batch]], params, use_tqdm=False)
            finally:  # a profile left running would make the next start a no-op
                llm.stop_profile()
            folder = root / profile_folder(name, batch)
            move_profile(written, folder, before)
            out[str(batch)] = str(folder)
        except Exception as e:  # the row stands without this profile
            out[str(batch)] = f"failed: {type(e).__name__}: {e}"
    return out


def measure(llm, spec: dict, batch_prompts, counters, result: dict, save, *, profile_name: str | None = None) -> None:
    """The single request, the profile (with ``profile_name`` and a profile folder) and the sweep, into
    ``result``."""
    from vllm import SamplingParams

    def timed(batch: int, tokens: int, temperature: float = 0.0):
        params = sweep_params(SamplingParams, batch, tokens, temperature, spec["seed"])
        times, outs = [], None
        before = counters()
        for _ in range(spec["repeats"]):
            t = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in batch_prompts[:batch]], params, use_tqdm=False)
            times.append(time.perf_counter() - t)
        accepted = acceptance(before, counters()) if before is not None else None
        # Every repeat's wall time goes on record beside the median: the spread says what a ratio can bear.
        return statistics.median(times), outs, [round(x, 4) for x in times], accepted

    n = spec["max_tokens"]
    sweep_t = spec.get("sweep_temperature", 0.0)  # the sweep's and the profile's sampling (sweep_params)
    timed(1, 8)  # warm-up: first-request allocations, sampler JIT
    t1, _, _, _ = timed(1, 1)
    tn, outs, runs, accepted = timed(1, n)
    tpot = (tn - t1) / (n - 1)
    result["single"] = {"tpot_ms": round(tpot * 1e3, 3), "tok_s": round(1 / tpot, 2),
                        "ttft_ms": round(t1 * 1e3, 2), "wall_s": round(tn, 3), "runs_s": runs}
    if accepted:
        result["single"]["spec_decode"] = accepted
    result["greedy_tokens"] = list(outs[0].outputs[0].token_ids)
    save()
    if profile_name and spec.get("profile_dir"):  # after the timed runs, so profiling never skews them
        result["profile"] = profile_step(llm, spec, batch_prompts, profile_name)
    sweep = result["sweep"] = []
    save()
    for c in spec["concurrency"]:
        # Untimed first: a new batch size compiles Triton kernels for its shapes (vLLM warns "JIT compilation
        # during inference"), which would otherwise land in the 1-token run and shrink the TPOT difference.
        llm.generate([{"prompt_token_ids": p} for p in batch_prompts[:c]],
                     sweep_params(SamplingParams, c, 4, sweep_t, spec["seed"]), use_tqdm=False)
        c1, _, _, _ = timed(c, 1, sweep_t)
        cn, outs, runs, accepted = timed(c, n, sweep_t)
        tpot_c = (cn - c1) / (n - 1)
        # first_ms: the c prompts' prefill and first step (the 1-token run), which out_tok_s counts and TPOT not.
        point = {"concurrency": c, "out_tok_s": round(c * n / cn, 1), "tpot_ms": round(tpot_c * 1e3, 3),
                 "decode_tok_s": round(c / tpot_c, 1), "first_ms": round(c1 * 1e3, 2), "runs_s": runs,
                 "distinct_tokens": distinct_per_step([list(o.outputs[0].token_ids) for o in outs])}
        if accepted:
            point["spec_decode"] = accepted
        sweep.append(point)
        save()


def main(argv=None) -> int:
    backend, spec_file, result_file = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(spec_file).read_text())
    out = Path(result_file)

    def save(result: dict) -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(out)  # the parent never reads a half-written file

    run(spec, BACKENDS[backend], save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
