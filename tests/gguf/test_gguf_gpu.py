"""GLM-5 GGUF on the GPU, through vLLM + vllm-gguf-plugin's K-quant kernels + fastcomm's adapter.

- prefill: the prompt log-probabilities of a random 128-token prompt from the GGUF path match the same
  weights dequantized into a bf16 safetensors checkpoint loaded by vLLM's normal loader. Metric: per
  position, the log-probabilities centred (mean over the vocabulary removed, which is the logits up to a
  constant); error = ||gguf - ref|| / ||ref|| over all positions. Tolerance TOL: the plugin quantizes
  activations to 8 bits (q8_1) in its GEMV/GEMM and the reference rounds weights to bf16, both ~1e-2.
- negative control: layer 0's fused q_a / kv_a shards swapped must exceed the tolerance (else the check
  cannot see the bug it exists for).
- MTP: greedy tokens identical with and without MTP, and the draft proposed tokens.
Every engine runs in its own process (gpu_worker.py). Run with pytest on a machine with 2+ GPUs (the suite's
conftest skips `gpu` tests below two), or as `python tests/gguf/test_gguf_gpu.py OUT_DIR` on one GPU
(bench/device_gguf.sh does), which writes the measured errors to OUT_DIR/gguf_gpu.json.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
TOL = 0.05          # relative error of the centred prompt log-probabilities
CONTROL_MIN = 0.3   # the swapped control must be at least this far off


def _installed(module):
    import importlib.util

    spec = importlib.util.find_spec(module)
    return spec is not None and spec.origin is not None


def _gpus():
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


pytestmark = [pytest.mark.gpu, pytest.mark.vllm,
              pytest.mark.skipif(not (_installed("vllm") and _installed("vllm_gguf_plugin") and _installed("gguf")),
                                 reason="needs vLLM, vllm-gguf-plugin and gguf"),
              pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA GPU")]


def run(mode, model, out, *extra, timeout=600):
    cmd = [sys.executable, str(HERE / "gpu_worker.py"), mode, str(model), str(out), *map(str, extra)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{r.stderr[-6000:]}")
    return json.loads(Path(out).read_text())


def write_models(root: Path):
    """(GGUF first shard, bf16 reference folder): the same weights, the reference with the derived config."""
    import shutil

    import tinyglm

    from fastcomm_vllm import gguf as fg

    first, truth = tinyglm.write_gguf(root / "gguf", tinyglm.Shape())
    plan = fg.plan(str(first), derive_tokenizer=False)
    ref = tinyglm.write_reference(root / "ref", truth)
    shutil.copy(plan.config_dir / "config.json", ref / "config.json")  # same config: only the weights path differs
    return first, ref


def rel_error(got, ref) -> float:
    g, r = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    g -= g.mean(axis=1, keepdims=True)
    r -= r.mean(axis=1, keepdims=True)
    return float(np.linalg.norm(g - r) / np.linalg.norm(r))


def check_prefill(root: Path, tp: int = 1) -> dict:
    first, ref = write_models(root)
    r = run("logits", ref, root / f"ref{tp}.json", "--tp", tp)["prompt_logprobs"]
    g = run("logits", first, root / f"gguf{tp}.json", "--tp", tp)["prompt_logprobs"]
    s = run("logits", first, root / f"swap{tp}.json", "--tp", tp, "--swap")["prompt_logprobs"]
    res = {"tp": tp, "tolerance": TOL, "error": rel_error(g, r), "control_error": rel_error(s, r),
           "top1_agreement": float(np.mean(np.argmax(g, 1) == np.argmax(r, 1)))}
    print(f"GGUF prefill vs bf16 reference (TP {tp}): relative error {res['error']:.4f} (tolerance {TOL}), "
          f"top-1 agreement {res['top1_agreement']:.3f}; swapped-shard control {res['control_error']:.4f} "
          f"(must exceed {CONTROL_MIN})")
    return res


def check_mtp(root: Path, tp: int = 1, k: int = 1) -> dict:
    first, _ = write_models(root)
    plain = run("greedy", first, root / f"greedy{tp}.json", "--tp", tp)
    mtp = run("greedy", first, root / f"greedy_mtp{tp}.json", "--tp", tp, "--mtp", k)
    drafted = sum(v for n, v in mtp["spec_decode"].items() if "num_draft_tokens" in n and "per_pos" not in n)
    accepted = sum(v for n, v in mtp["spec_decode"].items() if "num_accepted_tokens" in n and "per_pos" not in n)
    res = {"tp": tp, "k": k, "plain": plain["tokens"], "mtp": mtp["tokens"], "identical": plain["tokens"] == mtp["tokens"],
           "draft_tokens": drafted, "accepted_tokens": accepted, "counters": mtp["spec_decode"]}
    print(f"greedy with / without MTP (k={k}, TP {tp}): identical={res['identical']}; draft proposed {drafted} "
          f"tokens, {accepted} accepted")
    return res


@pytest.mark.parametrize("tp", [1, 2])
def test_prefill_matches_bf16_reference(tmp_path, tp):
    if tp > _gpus():
        pytest.skip(f"needs {tp} GPUs")
    res = check_prefill(tmp_path, tp)
    assert res["error"] < TOL, res
    assert res["control_error"] > CONTROL_MIN, res


def test_mtp_greedy_identical_and_drafts(tmp_path):
    res = check_mtp(tmp_path)
    assert res["draft_tokens"] > 0, res
    assert res["identical"], res


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "gguf_gpu_out")
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("FASTCOMM_CACHE_DIR", str(out / "cache"))
    results, failures = {}, []
    for name, fn in (("prefill", check_prefill), ("mtp", check_mtp)):
        try:
            results[name] = fn(out / name)
        except Exception as e:  # keep going: one failing part should not hide the other's numbers
            results[name] = {"exception": f"{type(e).__name__}: {e}"[-6000:]}
            failures.append(name)
    p, m = results.get("prefill", {}), results.get("mtp", {})
    if "error" in p and not (p["error"] < TOL and p["control_error"] > CONTROL_MIN):
        failures.append("prefill tolerance")
    if "identical" in m and not (m["identical"] and m["draft_tokens"] > 0):
        failures.append("mtp")
    results["failures"] = failures
    (out / "gguf_gpu.json").write_text(json.dumps(results, indent=1))
    print("FAILED: " + ", ".join(failures) if failures else "PASSED")
    sys.exit(1 if failures else 0)
