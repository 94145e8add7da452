"""GLM-5 GGUF on the GPU, through vLLM + vllm-gguf-plugin's K-quant kernels + fastcomm's adapter.

- prefill: the prompt log-probabilities of a random 128-token prompt from the GGUF path match the same
  weights dequantized into a bf16 safetensors checkpoint loaded by vLLM's normal loader. Metric: per
  position, the log-probabilities centred (mean over the vocabulary removed, which is the logits up to a
  constant), error = ||gguf - ref|| / ||ref|| of that position; the test bounds the MEDIAN over positions by
  TOL. Why the median: the plugin quantizes activations to 8 bits (q8_1) and the reference rounds weights to
  bf16, ~5 % at the logits of this model, and that noise flips the MoE's top-2 choice at the few positions
  where two experts nearly tie, which then come out entirely different (measured on an H200: 5 of 127
  positions, error 0.8-1.0, the other 122 at 0.03-0.11). A wrong mapping moves every position.
- negative control: layer 0's fused gate / up shards (the dense gate_up_proj) swapped: same shapes and
  types, so it loads and runs; its median must exceed CONTROL_MIN (else the check cannot see the bug it
  exists for: fused shards in the wrong order).
- MTP: greedy tokens identical with and without MTP (or parted only at a near-tie: greedy_agreement), and
  the draft proposed tokens.
Every engine runs in its own process (gpu_worker.py). Run with pytest on a machine with 2+ GPUs (the suite's
conftest skips `gpu` tests below two), or as `python tests/gguf/test_gguf_gpu.py OUT_DIR` on one GPU
(bench/device_gguf.sh does; a third argument such as `mtp` runs only that part), which writes the measured errors to OUT_DIR/gguf_gpu.json.
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
from greedy import greedy_agreement  # noqa: E402

TOL = 0.1           # median over positions of the relative error of the centred prompt log-probabilities
CONTROL_MIN = 0.3   # the swapped control's median must be at least this far off


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

    from fastcomm_vllm.gguf import synth as tinyglm

    from fastcomm_vllm import gguf as fg

    first, truth = tinyglm.write_gguf(root / "gguf", tinyglm.Shape())
    plan = fg.plan(str(first), derive_tokenizer=False)
    ref = tinyglm.write_reference(root / "ref", truth)
    shutil.copy(plan.config_dir / "config.json", ref / "config.json")  # same config: only the weights path differs
    return first, ref


def position_errors(got, ref) -> np.ndarray:
    """Per prompt position: relative error of the centred log-probabilities."""
    g, r = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    g -= g.mean(axis=1, keepdims=True)
    r -= r.mean(axis=1, keepdims=True)
    return np.linalg.norm(g - r, axis=1) / np.linalg.norm(r, axis=1)


def summary(got, ref) -> dict:
    e = position_errors(got, ref)
    return {"median": float(np.median(e)), "p90": float(np.percentile(e, 90)), "max": float(e.max()),
            "positions": int(e.size), "above_0.5": int((e > 0.5).sum()),
            "top1_agreement": float(np.mean(np.argmax(got, 1) == np.argmax(ref, 1)))}


def check_prefill(root: Path, tp: int = 1) -> dict:
    first, ref = write_models(root)
    r = run("logits", ref, root / f"ref{tp}.json", "--tp", tp)["prompt_logprobs"]
    g = run("logits", first, root / f"gguf{tp}.json", "--tp", tp)["prompt_logprobs"]
    s = run("logits", first, root / f"swap{tp}.json", "--tp", tp, "--swap")["prompt_logprobs"]
    gs, cs = summary(g, r), summary(s, r)
    res = {"tp": tp, "tolerance": TOL, "error": gs["median"], "control_error": cs["median"], "gguf": gs,
           "control": cs}
    print(f"GGUF prefill vs bf16 reference (TP {tp}): median per-position error {gs['median']:.4f} (tolerance "
          f"{TOL}), p90 {gs['p90']:.4f}, {gs['above_0.5']} of {gs['positions']} positions above 0.5, top-1 "
          f"agreement {gs['top1_agreement']:.3f}; swapped-shard control median {cs['median']:.4f} (must exceed "
          f"{CONTROL_MIN})")
    return res


def check_mtp(root: Path, tp: int = 1, k: int = 1) -> dict:
    first, _ = write_models(root)
    plain = run("greedy", first, root / f"greedy{tp}.json", "--tp", tp)
    mtp = run("greedy", first, root / f"greedy_mtp{tp}.json", "--tp", tp, "--mtp", k)
    drafted = sum(v for n, v in mtp["spec_decode"].items() if "num_draft_tokens" in n and "per_pos" not in n)
    accepted = sum(v for n, v in mtp["spec_decode"].items() if "num_accepted_tokens" in n and "per_pos" not in n)
    agree = greedy_agreement(plain, mtp)
    res = {"tp": tp, "k": k, "plain": plain["tokens"], "mtp": mtp["tokens"], "identical": agree["identical"],
           "agreement": agree, "draft_tokens": drafted, "accepted_tokens": accepted, "counters": mtp["spec_decode"]}
    print(f"greedy with / without MTP (k={k}, TP {tp}): {agree}; draft proposed {drafted} "
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
    assert res["agreement"]["ok"], res


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "gguf_gpu_out")
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("FASTCOMM_CACHE_DIR", str(out / "cache"))
    parts = sys.argv[2].split(",") if len(sys.argv) > 2 else ["prefill", "mtp"]
    results, failures = {}, []
    for name, fn in (("prefill", check_prefill), ("mtp", check_mtp)):
        if name not in parts:
            continue
        try:
            results[name] = fn(out / name)
        except Exception as e:  # keep going: one failing part should not hide the other's numbers
            results[name] = {"exception": f"{type(e).__name__}: {e}"[-6000:]}
            failures.append(name)
    p, m = results.get("prefill", {}), results.get("mtp", {})
    if "error" in p and not (p["error"] < TOL and p["control_error"] > CONTROL_MIN):
        failures.append("prefill tolerance")
    if "agreement" in m and not (m["agreement"]["ok"] and m["draft_tokens"] > 0):
        failures.append("mtp")
    results["failures"] = failures
    (out / "gguf_gpu.json").write_text(json.dumps(results, indent=1))
    print("FAILED: " + ", ".join(failures) if failures else "PASSED")
    sys.exit(1 if failures else 0)
