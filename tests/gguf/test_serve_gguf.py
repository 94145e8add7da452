"""`fastcomm-serve` with GGUF models: what --dry-run runs and says, and the one-line errors."""
import json
import shlex
import sys

import pytest

from conftest import installed, needs_gguf
from fastcomm_vllm import serve

pytestmark = [needs_gguf, pytest.mark.vllm,
              pytest.mark.skipif(not (serve.vllm_installed() and installed("vllm_gguf_plugin")),
                                 reason="needs vLLM and vllm-gguf-plugin")]


@pytest.fixture(autouse=True)
def env(monkeypatch):
    for name in ("FASTCOMM_VLLM", "FASTCOMM_TRANSPORT", "VLLM_PLUGINS", "NCCL_P2P_LEVEL", "VLLM_GGUF_USE_CUDA",
                 "FASTCOMM_GGUF_KERNELS"):
        monkeypatch.delenv(name, raising=False)
    # The entry point comes with the package's metadata (pyproject); this checkout's install may predate it.
    monkeypatch.setattr(serve, "_gguf_adapter_installed", lambda: True)


def dry(capsys, argv):
    rc = serve.main(argv + ["--dry-run"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    words = shlex.split(out.strip().splitlines()[-1])
    i = words.index(sys.executable)
    return dict(w.split("=", 1) for w in words[:i]), words[i + 4:], err


def opt(args, name):
    return args[args.index(name) + 1] if name in args else None


def test_glm5_with_mtp_block(capsys, tiny):
    first, _, shape = tiny
    env, args, err = dry(capsys, [str(first.parent), "--gpus", "2", "--max-model-len", "4096"])
    assert args[0] == str(first) and args[1:3] == ["--max-model-len", "4096"]   # the folder -> its first shard
    spec = json.loads(opt(args, "--speculative-config"))
    assert spec == {"method": "mtp", "num_speculative_tokens": 1, "model": str(first), "quantization": "gguf"}
    cfg = json.loads((__import__("pathlib").Path(opt(args, "--hf-config-path")) / "config.json").read_text())
    assert cfg["num_hidden_layers"] == shape.layers and cfg["num_nextn_predict_layers"] == 1
    assert opt(args, "--tokenizer") == opt(args, "--hf-config-path")
    assert opt(args, "--tensor-parallel-size") == "2" and env == {"FASTCOMM_VLLM": "1"}
    assert "MTP on: block 2 of the file drafts 1 token(s) per step (default" in err
    assert "3 shard(s), architecture 'glm-dsa'" in err and "K-quant kernels" in err


def test_glm5_mtp_off_and_tokens(capsys, tiny):
    first, _, _ = tiny
    _, args, err = dry(capsys, [str(first), "--gpus", "1", "--no-mtp"])
    assert "--speculative-config" not in args and "MTP off (--no-mtp)" in err
    _, args, err = dry(capsys, ["--model", str(first), "--gpus", "1", "--mtp-tokens", "3", "--tokenizer", "zai-org/GLM-5"])
    assert json.loads(opt(args, "--speculative-config"))["num_speculative_tokens"] == 3
    assert args.count("--tokenizer") == 1 and opt(args, "--tokenizer") == "zai-org/GLM-5"
    spec = '{"method": "mtp", "num_speculative_tokens": 2}'
    _, args, err = dry(capsys, [str(first), "--gpus", "1", "--speculative-config", spec])
    assert args.count("--speculative-config") == 1 and opt(args, "--speculative-config") == spec
    assert "as your --speculative-config says" in err


@pytest.mark.parametrize("user", [["-sc", '{"method": "mtp"}'], ["--speculative-config.method=mtp"],
                                  ["--spec-method", "mtp"], ["--spec-tokens", "2"], ["--spec_model=x"]])
def test_every_spelling_of_speculation_is_the_users(capsys, tiny, user):
    # vLLM's other spellings of a speculative-decoding choice: fastcomm-serve adds no MTP config of its own
    # (it would override or clash with the user's) and refuses --no-mtp beside them.
    first, _, _ = tiny
    _, args, err = dry(capsys, [str(first), "--gpus", "1"] + user)
    assert "--speculative-config" not in args and all(u in args for u in user)
    assert "speculative decoding as your " in err and "MTP on" not in err
    assert "both choose speculative decoding" in error(capsys, [str(first), "--gpus", "1", "--no-mtp"] + user)


def test_skip_tokenizer_init_needs_no_tokenizer(capsys, tiny, monkeypatch):
    from fastcomm_vllm.gguf import derive

    first, _, _ = tiny
    monkeypatch.setattr(derive, "has_tokenizer", lambda d: False)   # a file whose vocabulary cannot be derived
    assert "no tokenizer" in error(capsys, [str(first), "--gpus", "1"])
    _, args, err = dry(capsys, [str(first), "--gpus", "1", "--skip-tokenizer-init"])
    assert "--tokenizer" not in args and "--skip-tokenizer-init" in args


def test_glm5_without_mtp_block(capsys, tiny_no_mtp):
    first, _, _ = tiny_no_mtp
    _, args, err = dry(capsys, [str(first), "--gpus", "1"])
    assert "--speculative-config" not in args and "MTP off: the file has no MTP block (blk.2.nextn.*)" in err
    assert error(capsys, [str(first), "--gpus", "1", "--mtp-tokens", "2"]).startswith(
        "fastcomm-serve: error: MTP requested, but")


def test_other_architecture_passes_unchanged(capsys, tmp_path):
    from fastcomm_vllm.gguf import synth as tinyglm

    path = tinyglm.write_other_arch(tmp_path / "tiny-llama.gguf")
    _, args, err = dry(capsys, [str(path), "--gpus", "2"])
    assert args == [str(path), "--tensor-parallel-size", "2"] and "not GLM-5" in err


def error(capsys, argv):
    rc = serve.main(argv + ["--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_errors(capsys, tiny, tmp_path, monkeypatch):
    first, _, _ = tiny
    shards = sorted(first.parent.glob("*.gguf"))
    part = tmp_path / "part"
    part.mkdir()
    for s in (shards[0], shards[2]):
        (part / s.name).symlink_to(s)
    assert shards[1].name + " is missing" in error(capsys, [str(part / shards[0].name), "--gpus", "1"])
    assert "does not exist" in error(capsys, ["no-such-model-00001-of-00002.gguf", "--gpus", "1"])
    assert "both choose speculative decoding" in error(capsys, [str(first), "--gpus", "1", "--no-mtp",
                                                                "--speculative-config", "{}"])
    cfg = tmp_path / "hf"
    cfg.mkdir()
    (cfg / "config.json").write_text("{}")
    assert "--no-mtp / --mtp-tokens choose MTP for a GGUF model" in error(capsys, [str(cfg), "--gpus", "1", "--no-mtp"])
    monkeypatch.setattr(serve, "_gguf_adapter_installed", lambda: False)
    assert "entry point (fastcomm_gguf) is not installed" in error(capsys, [str(first), "--gpus", "1"])


def test_missing_plugin_names_the_extra(capsys, tiny, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "gguf" else real(n, *a))
    err = error(capsys, [str(tiny[0]), "--gpus", "1"])
    assert "the `gguf` package" in err and 'pip install -e ".[gguf]"' in err


def test_plugins_restricted(capsys, tiny, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "fastcomm")
    env, _, _ = dry(capsys, [str(tiny[0]), "--gpus", "1"])
    assert env["VLLM_PLUGINS"] == "fastcomm,gguf,fastcomm_gguf"


def test_slow_fallback_warns(capsys, tiny, monkeypatch):
    monkeypatch.setenv("VLLM_GGUF_USE_CUDA", "0")
    _, _, err = dry(capsys, [str(tiny[0]), "--gpus", "1"])
    assert "warning: vllm-gguf-plugin will run its slow Triton fallback" in err


def test_dry_run_says_which_kernels_take_the_products(capsys, tiny, monkeypatch):
    _, _, err = dry(capsys, [str(tiny[0]), "--gpus", "1"])
    assert "GGUF products of 1-8 tokens (decode, MTP verify) of Q8_0/Q4_K/Q5_K/Q6_K weights: fastcomm's" in err
    monkeypatch.setenv("FASTCOMM_GGUF_KERNELS", "plugin")
    _, _, err = dry(capsys, [str(tiny[0]), "--gpus", "1"])
    assert "GGUF products: vllm-gguf-plugin's kernels at every token count" in err
    monkeypatch.setenv("FASTCOMM_GGUF_KERNELS", "dp4a")
    _, _, err = dry(capsys, [str(tiny[0]), "--gpus", "1"])
    assert "fastcomm's K-quant kernels (dp4a forms only: FASTCOMM_GGUF_KERNELS=dp4a)" in err
    # which forms tables can serve, and a bad one named before vLLM starts
    assert "their forms by the forms table for the GPU's name where it measured" in err
    assert "--save-forms`, else a shipped one: NVIDIA H100 80GB HBM3)" in err
    monkeypatch.setenv("FASTCOMM_GGUF_FORMS", "none")
    _, _, err = dry(capsys, [str(tiny[0]), "--gpus", "1"])
    assert "their forms by the token thresholds alone (FASTCOMM_GGUF_FORMS=none)" in err
    monkeypatch.setenv("FASTCOMM_GGUF_FORMS", "/no/such/forms.json")
    assert error(capsys, [str(tiny[0]), "--gpus", "1"]).endswith(
        "FASTCOMM_GGUF_FORMS='/no/such/forms.json': No such file or directory")
    monkeypatch.delenv("FASTCOMM_GGUF_FORMS")
    monkeypatch.setenv("FASTCOMM_GGUF_KERNELS", "fast")
    assert error(capsys, [str(tiny[0]), "--gpus", "1"]).endswith(
        "FASTCOMM_GGUF_KERNELS='fast': must be one of auto, dp4a, plugin")


def test_served_under_the_files_own_name(capsys, tiny, monkeypatch):
    # vLLM would name a GGUF model by its path; fastcomm-serve puts the file's name first and keeps the path.
    first, _, _ = tiny
    _, args, err = dry(capsys, [str(first), "--gpus", "1"])
    i = args.index("--served-model-name")
    assert args[i + 1:i + 3] == ["GLM-5-tiny-UD-Q4_K_XL", str(first)]
    assert "served as 'GLM-5-tiny-UD-Q4_K_XL'" in err
    # ...and the engine arguments vLLM parses say so (its own parser, this vLLM's spelling).
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if not current_platform.device_type:  # a CPU-only vLLM build reports none; its parser needs one
        monkeypatch.setattr(type(current_platform), "device_type", "cpu")

    parsed = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(["--model", args[0], *args[1:]])
    assert parsed.served_model_name == ["GLM-5-tiny-UD-Q4_K_XL", str(first)] and parsed.model == str(first)
    _, args, err = dry(capsys, [str(first), "--gpus", "1", "--served-model-name", "glm5"])
    assert args.count("--served-model-name") == 1 and opt(args, "--served-model-name") == "glm5"
    assert "served as" not in err


def test_hf_config_path_brings_its_tokenizer_or_the_derived_one(capsys, tiny, tmp_path):
    first, _, _ = tiny
    bare = tmp_path / "config-only"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    _, args, err = dry(capsys, [str(first), "--gpus", "1", "--hf-config-path", str(bare)])
    # A config folder without a tokenizer: the one derived from the GGUF vocabulary, said so.
    assert opt(args, "--hf-config-path") == str(bare) and opt(args, "--tokenizer") not in (None, str(bare))
    assert "tokenizer derived from the GGUF vocabulary" in err
    derived = opt(args, "--tokenizer")
    assert (__import__("pathlib").Path(derived) / "tokenizer.json").is_file()
    # One holding a tokenizer (here the derived folder itself) is the tokenizer too.
    _, args, err = dry(capsys, [str(first), "--gpus", "1", "--hf-config-path", derived])
    assert opt(args, "--tokenizer") == derived and f"tokenizer from --hf-config-path {derived}" in err
    # A Hub id: vLLM resolves it (and reports a missing tokenizer itself).
    _, args, err = dry(capsys, [str(first), "--gpus", "1", "--hf-config-path", "zai-org/GLM-5"])
    assert opt(args, "--tokenizer") == "zai-org/GLM-5" and "tokenizer from --hf-config-path zai-org/GLM-5" in err


def test_tensor_parallel_sizes_the_file_cannot_take(capsys, tiny, tmp_path):
    """One line each, before vLLM starts: a TP size the heads do not divide among; a file whose row-parallel
    quantized rows would split mid-block at that TP (the tiny file's 2048-wide down projections are 8 Q6_K
    blocks: whole at TP 8, not at TP 16 = 128 elements a rank); a missing shard at TP 8."""
    first, _, shape = tiny
    msg = error(capsys, [str(first), "--gpus", "3"])
    assert f"{shape.heads} attention heads" in msg and "3 tensor-parallel ranks" in msg and "\n" not in msg.strip()
    msg = error(capsys, [str(first), "--gpus", "16"])
    assert "does not split on block boundaries at tensor parallel 16" in msg and "\n" not in msg.strip()
    assert "Q6_K" in msg or "Q5_K" in msg or "Q4_K" in msg
    env, args, err = dry(capsys, [str(first), "--gpus", "8"])
    assert opt(args, "--tensor-parallel-size") == "8"
    assert "tensor parallel 8: every split weight divides on block boundaries" in err
    shards = sorted(first.parent.glob("*.gguf"))
    part = tmp_path / "part8"
    part.mkdir()
    for s in shards[:-1]:
        (part / s.name).symlink_to(s)
    assert shards[-1].name + " is missing" in error(capsys, [str(part / shards[0].name), "--gpus", "8"])


def test_sm120_configuration_and_refusals(capsys, tiny, monkeypatch):
    """On capability 12.0 (detected, or --capability) the DSA backend's needs are passed and said; what that
    backend cannot take, and a vLLM + FlashInfer pair that cannot run it, are one line before vLLM starts."""
    from fastcomm_vllm.gguf import attention

    first = tiny[0]
    env, args, err = dry(capsys, [str(first), "--gpus", "8", "--capability", "12.0"])
    assert (opt(args, "--attention-backend"), opt(args, "--dtype"), opt(args, "--kv-cache-dtype"),
            opt(args, "--block-size")) == ("FLASHINFER_MLA_SPARSE_SM120", "bfloat16", "fp8_ds_mla", "64")
    assert "attention: FLASHINFER_MLA_SPARSE_SM120" in err and "activations bfloat16" in err
    env, args, err = dry(capsys, [str(first), "--gpus", "8", "--capability", "12.0", "--block-size", "128"])
    assert args.count("--block-size") == 1 and opt(args, "--block-size") == "128"
    env, args, err = dry(capsys, [str(first), "--gpus", "8", "--capability", "9.0"])
    assert "--attention-backend" not in args and "--kv-cache-dtype" not in args and "vLLM's own choice" in err
    msg = error(capsys, [str(first), "--gpus", "8", "--capability", "12.0", "--dtype", "float16"])
    assert "--dtype float16" in msg and "bfloat16 only" in msg
    assert "MAJOR.MINOR" in error(capsys, [str(first), "--gpus", "8", "--capability", "12"])
    old = attention.Stack("0.25.0", "0.6.13", True, True, True, False)
    monkeypatch.setattr(attention, "stack", lambda: old)
    msg = error(capsys, [str(first), "--gpus", "8", "--capability", "12.0"])
    assert "vLLM 0.25.0" in msg and "flashinfer-python 0.6.13" in msg and "install vllm==" in msg
    # The detected capability: the topology probe's GPUs.
    from fastcomm import topology

    gpus = tuple(topology.GpuInfo(index=i, name="NVIDIA RTX PRO 6000 Blackwell", compute_capability=(12, 0))
                 for i in range(8))
    link = tuple(tuple(topology.LinkType("host_bridge") for _ in gpus) for _ in gpus)
    topo = topology.Topology(gpus=gpus, link=link, p2p=tuple(tuple(True for _ in gpus) for _ in gpus),
                             source="recorded")
    assert serve.detect_capability(topo) == (12, 0)
