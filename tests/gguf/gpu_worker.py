"""One vLLM engine per process, for test_gguf_gpu.py (run on a GPU machine with vLLM + vllm-gguf-plugin).

    python gpu_worker.py MODE MODEL OUT_JSON [--tp N] [--swap] [--mtp K] [--one-gpu] [--graphs]

MODE logits: the prompt log-probabilities (every vocabulary entry, every prompt position) of a fixed random
128-token prompt. MODE greedy: 32 greedy tokens after the same prompt (each with its top-5
log-probabilities), and the MTP draft counters.
MODEL: a GGUF (fastcomm's engine_kwargs) or a checkpoint folder (vLLM's normal loader). --swap hands layer 0's
fused gate / up shards (the dense MLP's gate_up_proj: the same shape and type, so a wrong order loads and
runs, silently wrong) over under each other's names (the negative control). --one-gpu: every rank on one GPU
(fastcomm_vllm.one_gpu, FASTCOMM_TEST_MODE=1), and the all-reduces of every forward pass counted by where they
went ("allreduce" in the JSON, per rank). --graphs: torch.compile and CUDA graphs (vLLM's default capture
sizes for the engine's limits) instead of eager.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "integrations" / "vllm")]

PROMPT_LEN = 128
GREEDY_TOKENS = 32
TOP_LOGPROBS = 5


def prompt(vocab: int, seed: int = 1234) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(vocab - 16) for _ in range(PROMPT_LEN)]  # below GLM's special tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("logits", "greedy", "both"))
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--swap", action="store_true")
    ap.add_argument("--mtp", type=int, default=0)
    ap.add_argument("--one-gpu", action="store_true")
    ap.add_argument("--graphs", action="store_true")
    a = ap.parse_args()
    if a.tp == 1 and not a.one_gpu:
        # One process: fastcomm's adapter (registered below) is then in the process that loads the weights
        # even where the fastcomm_gguf entry point is not installed.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from vllm import LLM, SamplingParams

    from fastcomm_vllm import gguf as fg

    kwargs = dict(tensor_parallel_size=a.tp, dtype="bfloat16", max_model_len=1024, max_num_seqs=4, seed=0,
                  gpu_memory_utilization=0.35, enforce_eager=not a.graphs, skip_tokenizer_init=True,
                  disable_log_stats=False)
    if a.one_gpu:
        from fastcomm_vllm import one_gpu

        kwargs.update(one_gpu.engine_kwargs(a.tp))
    if fg.is_gguf(a.model):
        kwargs.update(fg.engine_kwargs(a.model, mtp=a.mtp > 0, num_speculative_tokens=max(a.mtp, 1),
                                       derive_tokenizer=False, tensor_parallel_size=a.tp))
        if a.swap and a.one_gpu:  # the workers are other processes: the harness swaps there
            os.environ["FASTCOMM_TEST_SWAP_SHARDS"] = "1"
        elif a.swap:
            from fastcomm_vllm.gguf import weights

            original = weights.iter_weights

            def swapped(*args, **kw):
                a0, b0 = "model.layers.0.mlp.gate_proj.", "model.layers.0.mlp.up_proj."
                for n, t in original(*args, **kw):
                    yield (b0 + n[len(a0):] if n.startswith(a0) else a0 + n[len(b0):] if n.startswith(b0) else n), t

            weights.iter_weights = swapped
    else:
        kwargs["model"] = a.model
    vocab = json.loads(Path(kwargs.get("hf_config_path", a.model), "config.json").read_text())["vocab_size"]
    kwargs["max_logprobs"] = vocab
    t0 = time.time()
    llm = LLM(**kwargs)
    started = time.time() - t0
    ids = prompt(vocab)
    result = {"mode": a.mode, "model": a.model, "tp": a.tp, "mtp": a.mtp, "swap": a.swap, "start_s": started}
    if a.mode in ("logits", "both"):
        sp = SamplingParams(max_tokens=1, prompt_logprobs=vocab, detokenize=False, temperature=0.0)
        out = llm.generate([{"prompt_token_ids": ids}], sp)[0]
        rows = []
        for pos in out.prompt_logprobs[1:]:   # position 0 has none
            row = [0.0] * vocab
            for tok, lp in pos.items():
                row[tok] = lp.logprob
            rows.append(row)
        result["prompt_logprobs"] = rows
    if a.mode in ("greedy", "both"):
        sp = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False,
                            logprobs=TOP_LOGPROBS)
        out = llm.generate([{"prompt_token_ids": ids}], sp)[0]
        result["tokens"] = list(out.outputs[0].token_ids)
        # Each generated position's best few (token, log-probability), best first: where two runs part, how
        # close the two tokens were there (tp_one_gpu.greedy_agreement).
        result["top_logprobs"] = [sorted(([t, lp.logprob] for t, lp in pos.items()), key=lambda x: -x[1])
                                  for pos in (out.outputs[0].logprobs or [])]
        counters = {}
        for m in llm.get_metrics():
            if m.name.startswith("vllm:spec_decode") and hasattr(m, "value"):
                counters[m.name] = m.value
        result["spec_decode"] = counters
    if a.one_gpu and a.tp > 1:
        result["allreduce"] = llm.collective_rpc("fastcomm_counts")
    Path(a.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
