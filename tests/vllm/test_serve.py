"""`fastcomm-serve`: the command it builds (--dry-run) and its errors.

Parsing, help and the errors found before vLLM is needed run anywhere; the dry runs need a real vLLM install
(`serve.vllm_installed`, which a namespace package such as this tests/vllm folder on sys.path cannot fool).
"""
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fastcomm_vllm import serve



def needs_vllm(test):
    return pytest.mark.vllm(pytest.mark.skipif(not serve.vllm_installed(), reason="needs a real vLLM install")(test))


@pytest.fixture()
def model(tmp_path):
    d = tmp_path / "glm5-mini"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["GlmMoeDsaForCausalLM"]}')
    return str(d)


@pytest.fixture()
def clean_env(monkeypatch):
    for name in ("FASTCOMM_VLLM", "FASTCOMM_TRANSPORT", "VLLM_PLUGINS", "NCCL_P2P_LEVEL"):
        monkeypatch.delenv(name, raising=False)


def dry_run(capsys, argv):
    rc = serve.main(argv + ["--dry-run"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    lines = out.strip().splitlines()
    command = shlex.split(lines[-1])
    env = dict(a.split("=", 1) for a in command if "=" in a and not a.startswith("-") and a.split("=")[0].isupper())
    argv_ = [a for a in command if a not in {f"{k}={v}" for k, v in env.items()}]
    return env, argv_, err


@needs_vllm
def test_dry_run_defaults_tp_and_passes_vllm_args_untouched(capsys, clean_env, model):
    cc = '{"cudagraph_capture_sizes": [1, 2, 4, 8]}'
    vllm_args = [model, "--max-model-len", "4096", "--served-model-name", "glm-5", "--load-format", "dummy",
                 "--compilation-config", cc, "--port=8001"]
    env, argv, err = dry_run(capsys, vllm_args + ["--gpus", "2"])
    assert argv[:4] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]
    assert argv[4:] == vllm_args + ["--tensor-parallel-size", "2"]
    assert env == {"FASTCOMM_VLLM": "1"}
    assert "--enforce-eager" not in argv and "tensor parallel 2" in err


@needs_vllm
@pytest.mark.parametrize("tp_args", [["-tp", "2"], ["--tensor-parallel-size=2"], ["--tensor_parallel_size", "2"]])
def test_explicit_tp_is_kept(capsys, clean_env, model, tp_args):
    env, argv, _ = dry_run(capsys, ["--gpus", "4", model] + tp_args)
    assert argv[4:] == [model] + tp_args


@needs_vllm
def test_fastcomm_options_and_environment(capsys, clean_env, monkeypatch, model):
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    env, argv, _ = dry_run(capsys, [model, "--fastcomm-transport", "host", "--gpus=2", "--enforce-eager"])
    assert env == {"FASTCOMM_VLLM": "1", "FASTCOMM_TRANSPORT": "host",
                   "VLLM_PLUGINS": "lora_filesystem_resolver,fastcomm"}
    assert argv[4:] == [model, "--enforce-eager", "--tensor-parallel-size", "2"]

    monkeypatch.setenv("FASTCOMM_VLLM", "0")  # the user's environment wins, and it says so
    env, _, err = dry_run(capsys, [model, "--gpus", "2"])
    assert "FASTCOMM_VLLM" not in env and "keeping FASTCOMM_VLLM=0" in err

    monkeypatch.delenv("FASTCOMM_VLLM")
    env, _, _ = dry_run(capsys, ["--no-fastcomm", "--model", model, "--gpus", "2"])
    assert env["FASTCOMM_VLLM"] == "0"

    # The fusion is opt-in: only --fastcomm-fusion sets it, and it needs fastcomm on.
    env, argv, _ = dry_run(capsys, [model, "--gpus", "2", "--fastcomm-fusion"])
    assert env["FASTCOMM_VLLM_FUSION"] == "1" and "--fastcomm-fusion" not in argv
    env, _, _ = dry_run(capsys, [model, "--gpus", "2"])
    assert "FASTCOMM_VLLM_FUSION" not in env
    with pytest.raises(serve.ServeError, match="needs fastcomm"):
        serve.build(*serve.split_args([model, "--no-fastcomm", "--fastcomm-fusion"]), {}, topo=_topology("nvlink", True))


@needs_vllm
def test_hugging_face_ids_are_not_paths(capsys, clean_env):
    env, argv, _ = dry_run(capsys, ["zai-org/GLM-5", "--gpus", "8"])
    assert argv[4:] == ["zai-org/GLM-5", "--tensor-parallel-size", "8"]


def _topology(link: str, p2p: bool, n: int = 2):
    from fastcomm.topology import GpuInfo, LinkType, Topology

    lt = LinkType(link)
    return Topology(gpus=tuple(GpuInfo(index=i, name="NVIDIA L40S") for i in range(n)),
                    link=tuple(tuple(lt for _ in range(n)) for _ in range(n)),
                    p2p=tuple(tuple(p2p for _ in range(n)) for _ in range(n)), source="recorded")


@needs_vllm
@pytest.mark.parametrize("link,p2p,expect", [("host_bridge", True, {"NCCL_P2P_LEVEL": "PHB"}),
                                             ("host_bridge", False, {}), ("cross_socket", True, {}),
                                             ("pcie_switch", True, {})])
def test_nccl_env_follows_the_topology(clean_env, model, link, p2p, expect):
    opts, rest = serve.split_args([model])
    launch = serve.build(opts, rest, {}, topo=_topology(link, p2p))
    assert {k: v for k, v, _ in launch.env if k.startswith("NCCL")} == expect
    assert launch.gpus == 2 and rest == [model]
    opts, rest = serve.split_args([model, "--no-nccl-env"])
    assert not [k for k, _, _ in serve.build(opts, rest, {}, topo=_topology(link, p2p)).env if k.startswith("NCCL")]


def test_help_lists_own_flags(capsys):
    assert serve.main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--dry-run", "--gpus", "--fastcomm-transport", "--fastcomm-fusion", "--no-fastcomm", "--no-nccl-env",
                 "--version", "--no-mtp", "--mtp-tokens", "NCCL_P2P_LEVEL", 'pip install -e ".[gguf]"'):
        assert flag in out


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "fastcomm-serve"
    r = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "fastcomm-serve" in r.stdout


# ---- errors -------------------------------------------------------------------------------------------

def error(capsys, argv):
    rc = serve.main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    return err


@needs_vllm
def test_tp_larger_than_gpu_count(capsys, model):
    assert "--tensor-parallel-size 4 is larger than the 2 visible GPU(s)" in error(capsys, [model, "--gpus", "2", "-tp", "4"])
    assert "needs 4 GPUs" in error(capsys, [model, "--gpus", "2", "-tp", "2", "--pipeline-parallel-size", "2"])
    assert "positive integer" in error(capsys, [model, "--gpus", "2", "-tp", "two"])


@needs_vllm
def test_missing_model_path(capsys):
    assert "model path '/nonexistent/glm5' does not exist" in error(capsys, ["/nonexistent/glm5", "--gpus", "2"])
    assert "does not exist" in error(capsys, ["./no/such/model", "--gpus", "2"])
    assert "no model given" in error(capsys, ["--gpus", "2", "--max-model-len", "4096"])


@needs_vllm
def test_a_folder_that_holds_no_model(capsys, tmp_path):
    msg = error(capsys, [str(tmp_path), "--gpus", "2"])
    assert "holds no config.json" in msg and "no .gguf file" in msg


def test_bad_fastcomm_options(capsys, model):
    # Parsing fails before anything else is looked at, so these need no vLLM.
    err = error(capsys, [model, "--fastcomm-transport", "nvlink"])
    assert "--fastcomm-transport: invalid choice: 'nvlink'" in err and "auto" in err and len(err.strip().splitlines()) == 1
    assert "--gpus: expects a number, got 'all'" in error(capsys, [model, "--gpus", "all"])
    assert "--gpus: expected one argument" in error(capsys, [model, "--gpus"])
    assert "--mtp-tokens: must be at least 1" in error(capsys, [model, "--mtp-tokens", "0"])
    assert "--no-mtp and --mtp-tokens contradict" in error(capsys, [model, "--no-mtp", "--mtp-tokens", "2"])


def test_unknown_options_pass_through_in_order():
    # vLLM's own options, including ones that start like ours (--gpu-memory-utilization vs --gpus), values
    # that look like options, and '='-joined forms, come back exactly as given.
    vllm_args = ["m", "--gpu-memory-utilization", "0.8", "-tp", "2", "--max_model_len=4096",
                 "--compilation-config", '{"level": 3}', "--no-enable-prefix-caching", "--served-model-name", "x"]
    opts, rest = serve.split_args(vllm_args[:3] + ["--gpus", "4", "--dry-run"] + vllm_args[3:] + ["--no-mtp"])
    assert rest == vllm_args
    assert opts.gpus == 4 and opts.dry_run and opts.mtp is False and opts.fastcomm


def test_version(capsys):
    assert serve.main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fastcomm ") and "vllm " in out and "vllm-gguf-plugin " in out


@needs_vllm
def test_no_gpu(capsys, model):
    if serve.count_gpus(serve.probe_topology()) > 0:
        pytest.skip("this machine has GPUs")
    assert "no GPU found" in error(capsys, [model, "--dry-run"])


def test_vllm_missing(model):
    # The venv's base interpreter has neither vLLM nor the package: give it just the package's directory.
    base = Path(sys.base_prefix) / "bin" / "python3"
    probe = subprocess.run([str(base), "-c", "import vllm"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip("no interpreter without vLLM to run it with")
    pkg_root = Path(serve.__file__).resolve().parents[1]
    code = f"import sys; sys.path.insert(0, {str(pkg_root)!r}); from fastcomm_vllm.serve import main; sys.exit(main())"
    r = subprocess.run([str(base), "-c", code, model, "--gpus", "2", "--dry-run"], capture_output=True, text=True,
                       timeout=120, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert r.returncode == 2 and "vLLM is not installed" in r.stderr, r.stderr
    assert 'pip install -e ".[vllm]"' in r.stderr and "fastcomm[vllm]" not in r.stderr
