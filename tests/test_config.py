from pathlib import Path

import pytest

from fastcomm.config import VARIABLES, Config, describe_variables


def test_defaults():
    c = Config.from_env({})
    assert c.timeout_s == 30 and c.transport == "auto" and c.algo == "auto" and c.islands is None
    assert c.vllm_enabled


def test_environment_then_overrides():
    env = {"FASTCOMM_TIMEOUT_S": "2.5", "FASTCOMM_TRANSPORT": "HOST", "FASTCOMM_ISLANDS": "0,1; 2,3",
           "FASTCOMM_VLLM": "0", "FASTCOMM_CACHE_DIR": "/tmp/x", "FASTCOMM_MAX_BYTES": "1024"}
    c = Config.from_env(env)
    assert c.timeout_s == 2.5 and c.transport == "host" and c.islands == ((0, 1), (2, 3))
    assert not c.vllm_enabled and c.cache_dir == Path("/tmp/x") and c.max_bytes == 1024
    assert Config.from_env(env, transport="p2p", timeout_s=None).transport == "p2p"  # None means 'not given'


@pytest.mark.parametrize("env", [{"FASTCOMM_TRANSPORT": "nvlink"}, {"FASTCOMM_ALGO": "ring"},
                                 {"FASTCOMM_TIMEOUT_S": "0"}, {"FASTCOMM_ISLANDS": "a,b"}])
def test_bad_values_are_rejected_with_the_name(env):
    with pytest.raises(ValueError):
        Config.from_env(env)


def test_every_variable_is_documented_once():
    names = [v.name for v in VARIABLES]
    assert len(names) == len(set(names))
    text = describe_variables()
    assert all(n in text for n in names)


def test_no_other_module_reads_fastcomm_environment():
    import re

    import fastcomm

    root = Path(fastcomm.__file__).parent
    reads = re.compile(r"""(environ\.get\(|getenv\(|environ\[)\s*["']FASTCOMM_""")
    for f in root.glob("*.py"):
        if f.name != "config.py":
            assert not reads.search(f.read_text()), f"{f.name} reads FASTCOMM_* itself; use fastcomm.config"


def test_vllm_fusion_switch():
    # Opt-in until an end-to-end run shows the fused kernel faster than all-reduce + vLLM's norm.
    assert not Config.from_env({}).vllm_fusion
    assert Config.from_env({"FASTCOMM_VLLM_FUSION": "1"}).vllm_fusion
    assert not Config.from_env({"FASTCOMM_VLLM_FUSION": "0"}).vllm_fusion
    assert Config.from_env({"FASTCOMM_VLLM_FUSION": "0"}).vllm_enabled
