"""The attention configuration fastcomm-serve picks for GLM-5 GGUF per GPU (fastcomm_vllm.gguf.attention), and
vLLM's own engine configuration and backend selection run on it with the capability faked to 12.0 (the user's
RTX PRO 6000 Blackwell), 9.0 and 10.0 (attention_probe.py)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import installed, needs_gguf
from fastcomm_vllm.gguf import attention as A

GOOD = A.Stack(vllm="0.33.0", flashinfer="0.7.2.post1", sm120_backend=True, backend_passes_scale_format=True,
               sparse_api=True, takes_scale_format=True)
SM120 = (12, 0)


def test_sm120_gets_the_backend_dtype_kv_and_pages_it_needs():
    plan = A.choose(SM120, 2048, A.UserAttention(), GOOD)
    assert plan.error is None
    args = dict(zip(plan.args[::2], plan.args[1::2]))
    assert args == {"--attention-backend": "FLASHINFER_MLA_SPARSE_SM120", "--dtype": "bfloat16",
                    "--kv-cache-dtype": "fp8_ds_mla", "--block-size": "64"}
    assert len(plan.notes) == 4 and all(plan.notes)


def test_the_users_compatible_choices_are_kept():
    plan = A.choose(SM120, 2048, A.UserAttention(dtype="bfloat16", kv_cache_dtype="fp8", block_size=256), GOOD)
    assert plan.error is None and plan.args == ("--attention-backend", "FLASHINFER_MLA_SPARSE_SM120")


@pytest.mark.parametrize("user, words", [
    (A.UserAttention(dtype="float16"), "--dtype float16"),
    (A.UserAttention(kv_cache_dtype="bfloat16"), "--kv-cache-dtype bfloat16"),
    (A.UserAttention(block_size=16), "--block-size 16"),
    (A.UserAttention(backend="TRITON_MLA"), "--attention-backend TRITON_MLA"),
])
def test_sm120_refuses_what_its_backend_cannot_take(user, words):
    plan = A.choose(SM120, 2048, user, GOOD)
    assert plan.error is not None and words in plan.error and "\n" not in plan.error


def test_sm120_refuses_a_stack_that_cannot_run_and_names_what_to_install():
    # vLLM 0.25.0 pins flashinfer 0.6.13, whose MLA decode has no kv_scale_format.
    old = A.Stack(vllm="0.25.0", flashinfer="0.6.13", sm120_backend=True, backend_passes_scale_format=True,
                  sparse_api=True, takes_scale_format=False)
    msg = A.choose(SM120, 2048, A.UserAttention(), old).error
    assert "vLLM 0.25.0" in msg and "flashinfer-python 0.6.13" in msg and "kv_scale_format" in msg
    assert A.SM120_KNOWN_GOOD in msg
    for stack, words in ((A.Stack(None, None, False, False, False, False), "vLLM is not installed"),
                         (A.Stack("0.20.0", "0.5.0", False, False, False, False), "no FLASHINFER_MLA_SPARSE_SM120"),
                         (A.Stack("0.33.0", None, True, True, False, False), "lacks the sparse-MLA decode")):
        msg = A.choose(SM120, 2048, A.UserAttention(), stack).error
        assert words in msg and A.SM120_KNOWN_GOOD in msg
    assert "index_topk 2048" in A.choose(SM120, 1024, A.UserAttention(), GOOD).error


def test_other_gpus_and_models_are_vllms_choice():
    for capability in ((9, 0), (10, 0), (8, 9)):
        plan = A.choose(capability, 2048, A.UserAttention(dtype="float16"), None)
        assert plan.args == () and plan.error is None and "vLLM's own choice" in plan.notes[0]
    assert A.choose(SM120, None, A.UserAttention(), None) == A.AttentionPlan((), ())
    assert "capability unknown" in A.choose(None, 2048, A.UserAttention(), None).notes[0]


def test_signature_reader():
    text = "x = 1\ndef f(\n    a: int,\n    b: tuple[int, int] = (1, 2),\n    kv_scale_format: str = 'auto',\n) -> None:\n    g(kv)\n"
    assert "kv_scale_format" in A._signature(text, "f") and "g(kv)" not in A._signature(text, "f")
    assert A._signature(text, "g") is None


@pytest.mark.vllm
@pytest.mark.skipif(not installed("vllm"), reason="needs vLLM")
def test_the_installed_stack_is_read_from_its_files():
    """The newest vLLM (CI) with its FlashInfer can run the sm_120 backend: every fact true."""
    s = A.stack()
    assert s.vllm and s.sm120_backend and s.backend_passes_scale_format
    if s.flashinfer is not None:
        assert s.sparse_api and s.takes_scale_format, s


PROBE = Path(__file__).with_name("attention_probe.py")


@pytest.mark.vllm
@needs_gguf
@pytest.mark.skipif(not (installed("vllm") and installed("vllm_gguf_plugin") and installed("flashinfer")),
                    reason="needs vLLM, vllm-gguf-plugin and FlashInfer")
def test_vllm_selects_a_valid_backend_for_the_configuration_fastcomm_serve_picks(tiny, tmp_path, monkeypatch):
    """fastcomm-serve's vLLM arguments for the tiny GLM-5 GGUF (index_topk 2048, as GLM-5's) at capability 12.0,
    9.0 and 10.0, through vLLM's own create_engine_config and attention selector: the backend takes the dtype
    and KV cache it gets. Control: at 12.0 an fp16 run (what fastcomm-serve refuses) finds no backend."""
    from fastcomm_vllm import serve

    monkeypatch.setattr(serve, "_gguf_adapter_installed", lambda: True)
    first = tiny[0]

    def serve_args(capability, tp, *extra):
        opts, rest = serve.split_args([str(first), "--capability", capability, "-tp", str(tp),
                                       "--max-model-len", "1024", *extra])
        launch = serve.build(opts, rest, {}, gpus=8)
        return list(launch.argv[launch.argv.index("serve") + 1:])

    # vLLM's CPU-only import cannot load its all-reduce + RMSNorm fusion pass (it names CUDA ops at import),
    # which vLLM turns on at TP > 1 on sm_90 and sm_100: off there; it does not bear on attention.
    no_fusion = ["--compilation-config", '{"pass_config": {"fuse_allreduce_rms": false}}']
    cases = [("12.0", serve_args("12.0", 8)), ("9.0", serve_args("9.0", 8, *no_fusion)),
             ("10.0", serve_args("10.0", 8, *no_fusion)),
             ("12.0", serve_args("9.0", 8) + ["--dtype", "float16"]), ("12.0", serve_args("9.0", 8))]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    r = subprocess.run([sys.executable, str(PROBE), str(tmp_path / "cases.json")], capture_output=True, text=True,
                       timeout=600)
    results = [json.loads(line[6:]) for line in r.stdout.splitlines() if line.startswith("PROBE ")]
    assert len(results) == len(cases), r.stderr[-4000:]
    sm120, sm90, sm100, fp16, plain = results
    for res in (sm120, sm90, sm100):
        assert "error" not in res, res
        assert res["dtype"] in res["backend_dtypes"] and res["kv_dtype"] in res["backend_kv_dtypes"], res
        assert "SPARSE" in res["backend"], res  # a DSA (sparse-MLA) backend
    assert sm120["backend"] == "FLASHINFER_MLA_SPARSE_SM120" and sm120["dtype"] == "bfloat16"
    assert sm120["kv_dtype"] == "fp8_ds_mla"  # what its implementation demands
    assert sm120["block_size"] % 64 == 0 and all(p == 64 for p in sm120["backend_pages"])
    assert sm90["capability"].endswith("major=9, minor=0)") and sm100["capability"].endswith("major=10, minor=0)")
    assert "error" in fp16 and "FLASHINFER_MLA_SPARSE_SM120" not in fp16.get("backend", ""), fp16
    # Without fastcomm-serve's pins vLLM reaches the same backend from the derived config's bf16 (its page
    # size it fixes later, at the workers): the pins make the choice explicit and refuse what cannot run.
    assert plain["backend"] == "FLASHINFER_MLA_SPARSE_SM120" and plain["kv_dtype"] == "fp8_ds_mla", plain
