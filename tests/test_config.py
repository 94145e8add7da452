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


def test_algorithm_choices_include_the_lamport_two_shot():
    assert Config.from_env({"FASTCOMM_ALGO": "two_shot_ll"}).algo == "two_shot_ll"
    assert Config(algo="two_shot_ll").algo == "two_shot_ll"
    with pytest.raises(ValueError, match="two_shot_ll"):  # the message lists it among the choices
        Config(algo="ll")


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
    for f in root.rglob("*.py"):
        if f.name != "config.py":
            assert not reads.search(f.read_text()), f"{f.name} reads FASTCOMM_* itself; use fastcomm.config"


def test_vllm_fusion_switch():
    # Opt-in until an end-to-end run shows the fused kernel faster than all-reduce + vLLM's norm.
    assert not Config.from_env({}).vllm_fusion
    assert Config.from_env({"FASTCOMM_VLLM_FUSION": "1"}).vllm_fusion
    assert not Config.from_env({"FASTCOMM_VLLM_FUSION": "0"}).vllm_fusion
    assert Config.from_env({"FASTCOMM_VLLM_FUSION": "0"}).vllm_enabled


# ---- validation: one line naming the variable (issue 12, item 7) ------------------------------------------

from fastcomm.config import ConfigError, check_environment, read  # noqa: E402
from fastcomm.errors import FastcommError  # noqa: E402


@pytest.mark.parametrize("name,value,says", [
    ("FASTCOMM_TIMEOUT_S", "abc", "not a number of seconds"),
    ("FASTCOMM_TIMEOUT_S", "inf", "finite"),
    ("FASTCOMM_TIMEOUT_S", "nan", "finite"),
    ("FASTCOMM_TIMEOUT_S", "-1", "> 0"),
    ("FASTCOMM_MAX_BYTES", "-8M", "not a size"),
    ("FASTCOMM_MAX_BYTES", "0", "positive"),
    ("FASTCOMM_MAX_BYTES", "inf", "not a size"),
    ("FASTCOMM_MAX_BLOCKS", "-2", ">= 0"),
    ("FASTCOMM_MAX_BLOCKS", "many", "whole number"),
    ("FASTCOMM_LOG", "bogus", "debug, info, warning, error, off"),
    ("FASTCOMM_VLLM", "maybe", "not a boolean"),
    ("FASTCOMM_VLLM_FUSION", "2", "not a boolean"),
    ("FASTCOMM_P2P_CHECK", "sometimes", "not a boolean"),
    ("FASTCOMM_ISLANDS", "0,1;2", "same size"),
    ("FASTCOMM_ISLANDS", "0,1;1,2", "appears twice"),
    ("FASTCOMM_ISLANDS", "1,2;3,4", "ranks 0..3"),
    ("FASTCOMM_ISLANDS", "0,1;;2,3", "empty"),
    ("FASTCOMM_ISLANDS", "a,b", "comma-separated ranks"),
    ("FASTCOMM_TEST_MODE", "yes please", "not a boolean"),
])
def test_a_bad_value_is_one_line_naming_the_variable(name, value, says):
    with pytest.raises(ConfigError) as e:
        Config.from_env({name: value})
    text = str(e.value)
    assert text.startswith(f"{name}={value!r}: ") and says in text and "\n" not in text
    assert isinstance(e.value, FastcommError) and isinstance(e.value, ValueError)


def test_sizes_take_units_like_the_command_line():
    c = Config.from_env({"FASTCOMM_MAX_BYTES": "8M", "FASTCOMM_ONE_SHOT_MAX_BYTES": "512K"})
    assert (c.max_bytes, c.one_shot_max_bytes) == (8 << 20, 512 << 10)
    assert Config.from_env({"FASTCOMM_MAX_BYTES": "4096"}).max_bytes == 4096


@pytest.mark.parametrize("text,want", [("1", True), ("true", True), ("YES", True), ("on", True),
                                       ("0", False), ("False", False), ("no", False), ("off", False)])
def test_booleans(text, want):
    assert Config.from_env({"FASTCOMM_VLLM": text}).vllm_enabled is want


def test_one_shot_limit_above_the_workspace_limit():
    # Unset, the one-shot limit follows a smaller workspace down; set above it, it is an error.
    assert Config.from_env({"FASTCOMM_MAX_BYTES": "256K"}).one_shot_max_bytes == 256 << 10
    assert Config.from_env({}).one_shot_max_bytes == 1 << 20
    with pytest.raises(ConfigError, match="FASTCOMM_ONE_SHOT_MAX_BYTES.*FASTCOMM_MAX_BYTES"):
        Config.from_env({"FASTCOMM_MAX_BYTES": "1M", "FASTCOMM_ONE_SHOT_MAX_BYTES": "2M"})
    with pytest.raises(ConfigError):
        Config(max_bytes=1 << 20, one_shot_max_bytes=2 << 20)
    assert Config(max_bytes=4096).one_shot_max_bytes == 4096


def test_constructor_arguments_are_checked_too():
    for kwargs in (dict(timeout_s=float("inf")), dict(max_bytes=0), dict(islands=((0, 1), (2,))),
                   dict(log_level="loud"), dict(max_blocks=-1)):
        with pytest.raises(ConfigError, match=next(iter(kwargs))):
            Config(**kwargs)
    with pytest.raises(TypeError, match="unknown fastcomm setting"):
        Config.from_env({}, not_a_setting=1)


def test_log_level_default_and_choices():
    assert Config.from_env({}).log_level == "warning"
    assert Config.from_env({"FASTCOMM_LOG": "INFO"}).log_level == "info"


def test_test_switches_need_test_mode():
    with pytest.raises(ConfigError, match="FASTCOMM_TEST_SHARED_GPU.*FASTCOMM_TEST_MODE=1"):
        Config.from_env({"FASTCOMM_TEST_SHARED_GPU": "1"})
    with pytest.raises(ConfigError, match="FASTCOMM_TEST_BREAK_P2P.*FASTCOMM_TEST_MODE=1"):
        Config.from_env({"FASTCOMM_TEST_BREAK_P2P": "0-1"})
    with pytest.raises(ConfigError, match="FASTCOMM_TEST_MODE=1"):
        Config(test_shared_gpu=True)  # constructor overrides too
    with pytest.raises(ConfigError, match="FASTCOMM_TEST_MODE=1"):
        Config.from_env({}, test_break_p2p=(0, 1))
    c = Config.from_env({"FASTCOMM_TEST_MODE": "1", "FASTCOMM_TEST_SHARED_GPU": "1", "FASTCOMM_TEST_BREAK_P2P": "1-0"})
    assert c.test_mode and c.test_shared_gpu and c.test_break_p2p == (1, 0)
    d = Config.from_env({})
    assert not d.test_mode and not d.test_shared_gpu and d.test_break_p2p is None


@pytest.mark.parametrize("text,want", [("10", 10.0), ("2.5", 2.5), ("0", 0.0)])
def test_standin_microseconds(text, want):
    c = Config.from_env({"FASTCOMM_TEST_MODE": "1", "FASTCOMM_TEST_STANDIN_US": text})
    assert c.test_standin_us == want and isinstance(c.test_standin_us, float)
    assert Config.from_env({"FASTCOMM_TEST_MODE": "1"}).test_standin_us is None  # unset: no stand-ins


@pytest.mark.parametrize("value,says", [("abc", "not a number"), ("-1", ">= 0"), ("inf", "finite"),
                                        ("nan", "finite")])
def test_standin_bad_values_name_the_variable(value, says):
    with pytest.raises(ConfigError) as e:
        Config.from_env({"FASTCOMM_TEST_MODE": "1", "FASTCOMM_TEST_STANDIN_US": value})
    text = str(e.value)
    assert text.startswith(f"FASTCOMM_TEST_STANDIN_US={value!r}: ") and says in text and "\n" not in text


@pytest.mark.parametrize("value", ["5", "0"])  # 0 us is a stand-in that only copies: on, so a test switch too
def test_standin_needs_test_mode(value):
    with pytest.raises(ConfigError, match=r"FASTCOMM_TEST_STANDIN_US \(test_standin_us\).*FASTCOMM_TEST_MODE=1"):
        Config.from_env({"FASTCOMM_TEST_STANDIN_US": value})
    with pytest.raises(ConfigError, match="FASTCOMM_TEST_MODE=1"):
        Config(test_standin_us=float(value))  # the constructor's override too


@pytest.mark.parametrize("value", ["0", "0-0", "a-b", "0-1-2", "0-9"])
def test_break_p2p_needs_two_different_ranks(value):
    with pytest.raises(ConfigError, match=f"FASTCOMM_TEST_BREAK_P2P={value!r}"):
        Config.from_env({"FASTCOMM_TEST_MODE": "1", "FASTCOMM_TEST_BREAK_P2P": value})


def test_p2p_check_switch():
    assert Config.from_env({}).p2p_check
    assert not Config.from_env({"FASTCOMM_P2P_CHECK": "0"}).p2p_check


def test_ranks_agree_on_the_switches_that_change_the_build():
    base = Config.from_env({"FASTCOMM_TEST_MODE": "1"})
    for other in (Config.from_env({"FASTCOMM_TEST_MODE": "1", "FASTCOMM_P2P_CHECK": "0"}),
                  Config.from_env({"FASTCOMM_TEST_MODE": "1", "FASTCOMM_TEST_SHARED_GPU": "1"}),
                  Config.from_env({"FASTCOMM_TEST_MODE": "1", "FASTCOMM_TEST_BREAK_P2P": "0-1"}),
                  Config.from_env({"FASTCOMM_TEST_MODE": "1", "FASTCOMM_MAX_BYTES": "4M"})):
        assert other.agreed() != base.agreed()
    # Not agreed: where kernels are cached and how loudly a rank logs are local matters.
    assert Config.from_env({"FASTCOMM_TEST_MODE": "1", "FASTCOMM_LOG": "debug"}).agreed() == base.agreed()


def test_read_one_variable_alone():
    env = {"FASTCOMM_TIMEOUT_S": "abc", "FASTCOMM_CACHE_DIR": "/tmp/kernels"}
    assert read("FASTCOMM_CACHE_DIR", env) == Path("/tmp/kernels")  # the bad timeout does not matter here
    assert read("FASTCOMM_ISLANDS", {}) is None and read("FASTCOMM_MAX_BYTES", {}) == 8 << 20
    with pytest.raises(ConfigError, match="FASTCOMM_TIMEOUT_S='abc'"):
        read("FASTCOMM_TIMEOUT_S", env)


def test_check_environment_reports_each_variable():
    env = {"FASTCOMM_TIMEOUT_S": "abc", "FASTCOMM_MAX_BYTES": "8M", "FASTCOMM_LOG": "bogus"}
    by = {s.var.name: s for s in check_environment(env)}
    assert set(by) == {v.name for v in VARIABLES}
    assert by["FASTCOMM_TIMEOUT_S"].raw == "abc" and "not a number" in by["FASTCOMM_TIMEOUT_S"].error
    assert by["FASTCOMM_MAX_BYTES"].raw == "8M" and by["FASTCOMM_MAX_BYTES"].error is None
    assert by["FASTCOMM_LOG"].error and by["FASTCOMM_ALGO"].raw is None and by["FASTCOMM_ALGO"].error is None
    # A rule between variables is reported on the variables it names.
    pair = {s.var.name: s for s in check_environment({"FASTCOMM_MAX_BYTES": "1M",
                                                       "FASTCOMM_ONE_SHOT_MAX_BYTES": "2M"})}
    assert pair["FASTCOMM_ONE_SHOT_MAX_BYTES"].error and pair["FASTCOMM_MAX_BYTES"].error
    assert pair["FASTCOMM_TIMEOUT_S"].error is None
    # ... only on those that are set: an unset variable's default is not the mistake.
    alone = {s.var.name: s for s in check_environment({"FASTCOMM_ONE_SHOT_MAX_BYTES": "16M"})}
    assert alone["FASTCOMM_ONE_SHOT_MAX_BYTES"].error and alone["FASTCOMM_MAX_BYTES"].error is None


def test_every_default_is_valid():
    assert all(s.error is None for s in check_environment({}))


def test_algo_pull_is_a_choice_and_its_var_says_p2p_only():
    from fastcomm.config import ALGOS

    assert Config.from_env({"FASTCOMM_ALGO": "pull"}).algo == "pull" and "pull" in ALGOS
    algo = next(v for v in VARIABLES if v.name == "FASTCOMM_ALGO")
    assert "pull" in algo.meaning and "P2P only" in algo.meaning
