"""Every FASTCOMM_* environment variable, read and validated in one place.

Constructor arguments override the environment; nothing else in the package reads ``os.environ``
for fastcomm settings, and no op reads it on the hot path: a ``Config`` is resolved once per workspace.
A bad value raises ``ConfigError`` with one line naming the variable (or the constructor argument), the
value and what was expected, before anything is built. ``fastcomm env`` shows the same verdicts.
"""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any, Callable, Mapping

from .errors import FastcommError
from .units import MiB, parse_size

MAX_RANKS = 8  # abi.MAX_WORLD; ranks named in settings are below it


class ConfigError(FastcommError, ValueError):
    """A FASTCOMM_* variable (or constructor argument) with a value fastcomm cannot use."""


# ---- value parsers: text -> value, or ValueError with the reason (the caller adds name and value) ---------

def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ValueError("not a number of seconds") from None
    if not math.isfinite(v) or v <= 0:
        raise ValueError("must be a finite number of seconds > 0")
    return v


def _seconds_or_off(text: str) -> float:
    if text.strip() == "0":
        return 0.0
    return _seconds(text)


def _bytes(text: str) -> int:
    v = parse_size(text)  # its message names the accepted forms
    if v <= 0:
        raise ValueError("must be a positive size")
    return v


def count(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise ValueError("not a whole number") from None
    if v < 0:
        raise ValueError("must be >= 0")
    return v


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def boolean(text: str) -> bool:
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise ValueError("not a boolean (use 0/1, true/false, yes/no, on/off)")


def choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        t = text.strip().lower()
        if t not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return t
    return parse


def microseconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ValueError("not a number of microseconds") from None
    if not math.isfinite(v) or v < 0:
        raise ValueError("must be a finite number of microseconds >= 0")
    return v


def _path(text: str) -> Path:
    return Path(text).expanduser()


def _islands(text: str) -> tuple[tuple[int, ...], ...] | None:
    """'0,1;2,3' -> ((0, 1), (2, 3)): equal-sized groups that together hold ranks 0..N-1 once each."""
    groups = [g.strip() for g in text.split(";")]
    if any(not g for g in groups):
        raise ValueError("an island is empty (expected ranks like '0,1;2,3')")
    try:
        isl = tuple(tuple(int(r) for r in g.split(",")) for g in groups)
    except ValueError:
        raise ValueError("expected comma-separated ranks per island, islands separated by ';' (e.g. '0,1;2,3')") \
            from None
    return _check_islands(isl)


def _check_islands(isl) -> tuple[tuple[int, ...], ...]:
    isl = tuple(tuple(int(r) for r in g) for g in isl)
    flat = [r for g in isl for r in g]
    if len(set(flat)) != len(flat):
        raise ValueError("a rank appears twice")
    if sorted(flat) != list(range(len(flat))):
        raise ValueError(f"the islands must hold ranks 0..{len(flat) - 1}, each once")
    if len(flat) > MAX_RANKS:
        raise ValueError(f"at most {MAX_RANKS} ranks")
    if len({len(g) for g in isl}) != 1:
        raise ValueError("islands must all have the same size (rank i of each island is a partner)")
    return isl


def _rank_pair(text: str) -> tuple[int, int] | None:
    """'0-1' -> (0, 1): writes from rank 0 to rank 1 (for the P2P check's test switch)."""
    parts = text.strip().split("-")
    try:
        a, b = (int(p) for p in parts)
    except ValueError:
        raise ValueError("expected two ranks like '0-1' (writer-reader)") from None
    return _check_pair((a, b))


def _rank_seconds(text: str) -> tuple[int, float]:
    """'1:60' -> (1, 60.0): rank 1 waits 60 s (the start-up skew test's switch)."""
    rank, sep, seconds = text.strip().partition(":")
    try:
        out = (int(rank), float(seconds))
    except ValueError:
        raise ValueError("expected a rank and seconds like '1:60'") from None
    if not sep or out[0] < 0 or out[1] < 0:
        raise ValueError("expected a rank and seconds like '1:60'")
    return out


def _check_pair(pair) -> tuple[int, int]:
    a, b = (int(r) for r in pair)
    if a == b or not (0 <= a < MAX_RANKS and 0 <= b < MAX_RANKS):
        raise ValueError(f"expected two different ranks in 0..{MAX_RANKS - 1}")
    return a, b


# ---- the single list of variables (also printed by `fastcomm env`) -------------------------------------

@dataclasses.dataclass(frozen=True)
class Var:
    name: str
    field: str                      # the settings object's attribute it sets (Config, kquant.settings.Settings)
    default: str                    # as text, the way a user would write it
    meaning: str
    parse: Callable[[str], Any] = dataclasses.field(repr=False, compare=False)
    names_file: bool = False        # its value may be a file's path (beside words, as FASTCOMM_GGUF_FORMS)


def is_path(var: Var) -> bool:
    """Whether ``var`` names a file or folder (a record of the settings keeps its name, not a machine's path)."""
    return var.parse is _path or var.names_file


# The choices of the variables that take one (parsed, validated and read by policy from here).
TRANSPORTS = ("auto", "p2p", "host")
ALGOS = ("auto", "one_shot", "two_shot", "two_shot_ll", "pull", "two_shot_islands")
FUSED_CLUSTER_SETTINGS = ("auto", "on", "off")
LOG_LEVELS = ("debug", "info", "warning", "error", "off")

VARIABLES: tuple[Var, ...] = (
    Var("FASTCOMM_TIMEOUT_S", "timeout_s", "30", "Bound on every device-side wait, seconds; a peer that does not "
        "arrive in time aborts the kernel with an error naming rank, peer and step.", _seconds),
    Var("FASTCOMM_MAX_BYTES", "max_bytes", "8M", "Largest message the workspace serves (e.g. 8M); larger ones are "
        "refused (the vLLM integration sends them to NCCL).", _bytes),
    Var("FASTCOMM_ONE_SHOT_MAX_BYTES", "one_shot_max_bytes", "1M", "Largest message the one-shot (flag-in-data) "
        "buffers hold; also caps the fused all-reduce + RMSNorm. Unset: 1M or FASTCOMM_MAX_BYTES if smaller; "
        "set above FASTCOMM_MAX_BYTES: an error.", _bytes),
    Var("FASTCOMM_TRANSPORT", "transport", "auto", "auto | p2p | host: peer GPU memory or shared pinned host memory.",
        choice(*TRANSPORTS)),
    Var("FASTCOMM_ALGO", "algo", "auto", "auto | one_shot | two_shot | two_shot_ll | pull | two_shot_islands: force "
        "an algorithm for every call (two_shot_ll: the two-shot with readiness in the data, in the one-shot's "
        "buffers; pull reads peers' GPU memory: P2P only, an error at workspace build on the host transport; "
        "two_shot_islands: the hierarchical two-shot, an error at build without islands of 2+ ranks).",
        choice(*ALGOS)),
    Var("FASTCOMM_FUSED_CLUSTER", "fused_cluster", "auto", "auto | on | off: the flat one-shot fused all-reduce + "
        "RMSNorm as one thread-block cluster per row (auto: sm_90+, where every rank's device launches clusters); "
        "on: an error where it cannot; off: one block per split, every block reading the whole row.",
        choice(*FUSED_CLUSTER_SETTINGS)),
    Var("FASTCOMM_ISLANDS", "islands", "", "Force a hierarchical island layout, e.g. '0,1;2,3' (equal-sized groups "
        "of ranks 0..N-1).", _islands),
    Var("FASTCOMM_MAX_BLOCKS", "max_blocks", "0", "Cap on thread blocks per kernel; 0 picks from the device.", count),
    Var("FASTCOMM_CACHE_DIR", "cache_dir", "~/.cache/fastcomm", "Where compiled kernels (cubins) are cached.", _path),
    Var("FASTCOMM_TUNE_FILE", "tune_file", "", "Tuning cache written by `fastcomm tune`; read at workspace start if "
        "set (it must then be valid) or present at the default path under FASTCOMM_CACHE_DIR.", _path),
    Var("FASTCOMM_P2P_CHECK", "p2p_check", "1", "1 checks at workspace build that every pair's P2P writes arrive "
        "(0 skips the check).", boolean),
    Var("FASTCOMM_VLLM", "vllm_enabled", "1", "0 turns the vLLM plugin off (vLLM then runs unchanged).", boolean),
    Var("FASTCOMM_VLLM_FUSION", "vllm_fusion", "0", "1 also fuses all-reduce + RMSNorm in vLLM (compile pass and "
        "GLM-5 helper routing). Opt-in until an end-to-end run shows it faster than the all-reduce alone "
        "(bench/RESULTS.md).", boolean),
    Var("FASTCOMM_VLLM_STALL_S", "vllm_stall_s", "300", "A vLLM worker whose model step (execute_model / "
        "sample_tokens) has not returned for this many seconds after warm-up logs one line naming rank, step and "
        "the last kernel family launched, and exits (status 3) so that the server stops instead of spinning; 0 "
        "turns the guard off.", _seconds_or_off),
    Var("FASTCOMM_LOG", "log_level", "warning", "debug | info | warning | error | off: level of the 'fastcomm' "
        "logger; info prints the transport and policy each workspace chose (like NCCL_DEBUG=INFO).",
        choice(*LOG_LEVELS)),
    Var("FASTCOMM_TEST_MODE", "test_mode", "0", "1 marks a test run; required by the FASTCOMM_TEST_* switches.", boolean),
    Var("FASTCOMM_TEST_SHARED_GPU", "test_shared_gpu", "0", "Tests only (needs FASTCOMM_TEST_MODE=1): 1 lets ranks "
        "share a GPU.", boolean),
    Var("FASTCOMM_TEST_BREAK_P2P", "test_break_p2p", "", "Tests only (needs FASTCOMM_TEST_MODE=1): e.g. '0-1' makes "
        "the build-time P2P check treat writes from rank 0 to rank 1 as lost.", _rank_pair),
    Var("FASTCOMM_TEST_STARTUP_DELAY", "test_startup_delay", "", "Tests only (needs FASTCOMM_TEST_MODE=1): e.g. "
        "'1:60' makes rank 1 of the one-GPU vLLM harness wait 60 s before its first forward (start-up skew).",
        _rank_seconds),
    Var("FASTCOMM_TEST_SWAP_SHARDS", "test_swap_shards", "0", "Tests only (needs FASTCOMM_TEST_MODE=1): 1 makes the "
        "one-GPU vLLM harness's workers load layer 0's gate and up GGUF shards under each other's names (the "
        "negative control of the TP logits check).", boolean),
    Var("FASTCOMM_TEST_STANDIN_US", "test_standin_us", "", "Benchmarks only (needs FASTCOMM_TEST_MODE=1, TP 1): "
        "e.g. '10': after every module where TP > 1 would all-reduce, a kernel that copies and spins this long "
        "(fastcomm_vllm.standin; the TP 8 shard step's cost per all-reduce microsecond).", microseconds),
    Var("FASTCOMM_TEST_CHECK_ALLREDUCE", "test_check_allreduce", "0", "Tests only (needs FASTCOMM_TEST_MODE=1): "
        "1 makes the one-GPU vLLM harness check every eager all-reduce against the ranks' inputs summed on the "
        "CPU in fastcomm's order (fp32, ranks 0..n-1), bit for bit, and count the calls that differ.", boolean),
    Var("FASTCOMM_TEST_ROUTING", "test_routing", "0", "Tests only (needs FASTCOMM_TEST_MODE=1): 1 makes the "
        "one-GPU vLLM harness record, in eager forwards of up to 8 tokens, the experts each MoE layer routes "
        "each token to and the margin of that choice (a routing near-tie turns a rounding difference into a "
        "different token).", boolean),
)
_BY_NAME = {v.name: v for v in VARIABLES}
# Every FASTCOMM_TEST_* setting but the mode itself needs FASTCOMM_TEST_MODE=1.
_TEST_SWITCHES = tuple(v.field for v in VARIABLES
                       if v.name.startswith("FASTCOMM_TEST_") and v.name != "FASTCOMM_TEST_MODE")
_BY_FIELD = {v.field: v for v in VARIABLES}
# FASTCOMM_* names the repository's scripts read (bench/device_*.sh, .ci/run, the GPU test runner): not settings.
TOOLING_NAMES = frozenset({"FASTCOMM_COMMIT", "FASTCOMM_INSTAFAIL", "FASTCOMM_TEST_BUDGET_S", "FASTCOMM_CI_CACHE",
                           "FASTCOMM_CI_VENV", "FASTCOMM_CI_NOVLLM_VENV", "FASTCOMM_CI_TORCH"})



def _raw(env: Mapping[str, str], name: str) -> str | None:
    """The variable's text, or None when unset (an empty value counts as unset)."""
    raw = env.get(name)
    return None if raw is None or raw.strip() == "" else raw


def read(name: str | Var, env: Mapping[str, str] | None = None):
    """One variable's value (its default when unset), validated alone: for commands that need one setting
    (``fastcomm compile`` needs only the cache directory) and must not fail on an unrelated bad one. ``name``:
    one of VARIABLES' names, or another product's ``Var``."""
    var = name if isinstance(name, Var) else _BY_NAME[name]
    name = var.name
    env = os.environ if env is None else env
    raw = _raw(env, name)
    text = var.default if raw is None else raw
    if text == "":
        return None
    try:
        return var.parse(text)
    except ValueError as e:
        raise ConfigError(f"{name}={text!r}: {e}") from None


def read_fields(variables: tuple[Var, ...], env: Mapping[str, str], overrides: Mapping[str, Any]) -> dict:
    """The fields that ``variables`` set in ``env`` (unset ones are left out, so a settings class's default,
    which may depend on other fields, applies), then ``overrides`` (constructor arguments; None: not given).
    Raises ConfigError naming the first bad variable."""
    values = {}
    for var in variables:
        if overrides.get(var.field) is not None:
            continue
        raw = _raw(env, var.name)
        if raw is None:
            continue
        try:
            values[var.field] = var.parse(raw)
        except ValueError as e:
            raise ConfigError(f"{var.name}={raw!r}: {e}") from None
    values.update({k: v for k, v in overrides.items() if v is not None})
    return values


@dataclasses.dataclass(frozen=True)
class Config:
    timeout_s: float = 30.0
    max_bytes: int = 8 * MiB
    one_shot_max_bytes: int | None = None   # None: 1 MiB, or max_bytes if smaller
    transport: str = "auto"
    algo: str = "auto"
    fused_cluster: str = "auto"  # FASTCOMM_FUSED_CLUSTER (policy.fused.fused_cluster_form)
    islands: tuple[tuple[int, ...], ...] | None = None
    max_blocks: int = 0
    cache_dir: Path = Path("~/.cache/fastcomm").expanduser()
    tune_file: Path | None = None
    p2p_check: bool = True
    vllm_enabled: bool = True
    vllm_fusion: bool = False  # opt-in, see FASTCOMM_VLLM_FUSION
    vllm_stall_s: float = 300.0  # FASTCOMM_VLLM_STALL_S (fastcomm_vllm.watchdog); 0: off
    log_level: str = "warning"
    test_mode: bool = False
    test_shared_gpu: bool = False
    test_break_p2p: tuple[int, int] | None = None
    test_startup_delay: tuple[int, float] | None = None
    test_swap_shards: bool = False
    test_standin_us: float | None = None
    test_check_allreduce: bool = False
    test_routing: bool = False

    def __post_init__(self):
        # Constructor arguments get the same checks as the environment, named by argument.
        def bad(field: str, why: str):
            raise ConfigError(f"{field}={getattr(self, field)!r}: {why}")

        if self.transport not in TRANSPORTS:
            bad("transport", f"must be one of {', '.join(TRANSPORTS)}")
        if self.algo not in ALGOS:
            bad("algo", f"must be one of {', '.join(ALGOS)}")
        if self.fused_cluster not in FUSED_CLUSTER_SETTINGS:
            bad("fused_cluster", f"must be one of {', '.join(FUSED_CLUSTER_SETTINGS)}")
        if self.log_level not in LOG_LEVELS:
            bad("log_level", f"must be one of {', '.join(LOG_LEVELS)}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) \
                or not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            bad("timeout_s", "must be a finite number of seconds > 0")
        for field in ("max_bytes", "one_shot_max_bytes"):
            v = getattr(self, field)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                bad(field, "must be a positive whole number of bytes")
        if self.one_shot_max_bytes is None:
            object.__setattr__(self, "one_shot_max_bytes", min(1 * MiB, self.max_bytes))
        elif self.one_shot_max_bytes > self.max_bytes:
            raise ConfigError(f"one-shot limit {self.one_shot_max_bytes} B (FASTCOMM_ONE_SHOT_MAX_BYTES) is above "
                              f"the workspace limit {self.max_bytes} B (FASTCOMM_MAX_BYTES); lower it or leave it "
                              "unset")
        if isinstance(self.max_blocks, bool) or not isinstance(self.max_blocks, int) or self.max_blocks < 0:
            bad("max_blocks", "must be a whole number >= 0")
        if self.islands is not None:
            try:
                object.__setattr__(self, "islands", _check_islands(self.islands))
            except (ValueError, TypeError) as e:
                bad("islands", str(e))
        if self.test_break_p2p is not None:
            try:
                object.__setattr__(self, "test_break_p2p", _check_pair(self.test_break_p2p))
            except (ValueError, TypeError) as e:
                bad("test_break_p2p", str(e))
        object.__setattr__(self, "cache_dir", Path(self.cache_dir).expanduser())
        if self.tune_file is not None:
            object.__setattr__(self, "tune_file", Path(self.tune_file).expanduser())
        if not self.test_mode:
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            for field in _TEST_SWITCHES:
                if getattr(self, field) != defaults[field]:  # set at all: the stand-in's 0 us is on (off is None)
                    raise ConfigError(f"{_BY_FIELD[field].name} ({field}) is a test switch: it needs "
                                      "FASTCOMM_TEST_MODE=1")

    def agreed(self) -> tuple:
        """The settings every rank of a workspace must share (compared at build)."""
        return (self.max_bytes, self.one_shot_max_bytes, self.transport, self.algo, self.islands, self.timeout_s,
                self.p2p_check, self.test_mode, self.test_shared_gpu, self.test_break_p2p,
                self.fused_cluster)  # the fused op's form decides its sum-of-squares order

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> "Config":
        """Resolve the environment, then apply explicit ``overrides`` (constructor arguments win; None means
        'not given'). Raises ConfigError naming the first bad variable."""
        env = os.environ if env is None else env
        unknown = set(overrides) - set(_BY_FIELD)
        if unknown:
            raise TypeError(f"unknown fastcomm setting(s): {', '.join(sorted(unknown))}")
        return cls(**read_fields(VARIABLES, env, overrides))


@dataclasses.dataclass(frozen=True)
class Status:
    """One variable as `fastcomm env` shows it."""

    var: Var
    raw: str | None      # None: unset (the default applies)
    error: str | None    # None: valid


def check_environment(env: Mapping[str, str] | None = None, groups: tuple | None = None) -> list[Status]:
    """Every variable's current text and verdict, each checked alone and then together (a rule between
    variables, such as the one-shot limit above the workspace limit, is reported on the variables it names).
    ``groups``: (variables, resolve) per product, ``resolve(env)`` building its settings object; None: GROUP."""
    env = os.environ if env is None else env
    out = []
    for variables, resolve in groups or (GROUP,):
        mine = []
        for var in variables:
            raw = _raw(env, var.name)
            try:
                read(var, env)
                error = None
            except ConfigError as e:
                error = str(e)
            mine.append(Status(var, raw, error))
        if not any(s.error for s in mine):
            try:
                resolve(env)
            except ConfigError as e:
                # On the variables it names that are set: an unset one's default is not the mistake.
                named = [s for s in mine if s.var.name in str(e) and s.raw is not None] or \
                    [s for s in mine if s.var.name in str(e)] or mine[:1]
                mine = [dataclasses.replace(s, error=str(e)) if s in named else s for s in mine]
        out += mine
    return out


def unknown_variables(env: Mapping[str, str] | None = None, groups: tuple | None = None) -> list[str]:
    """FASTCOMM_* names set in ``env`` that are no setting of ``groups`` (as check_environment's): a typo, or a
    setting a release removed (such as FASTCOMM_GGUF_GROUPED_FORM). fastcomm ignores them, so `fastcomm env` and
    the vLLM plugin name them."""
    env = os.environ if env is None else env
    known = {v.name for variables, _ in groups or (GROUP,) for v in variables}
    return sorted(n for n in env if n.startswith("FASTCOMM_") and n not in known and n not in TOOLING_NAMES)


def describe_variables(variables: tuple[Var, ...] = None) -> str:
    return "\n".join(f"{v.name} (default {v.default!r}): {v.meaning}" for v in variables or VARIABLES)


# This product's variables and how they resolve together (check_environment, unknown_variables); the K-quant
# serving settings have their own (fastcomm.kquant.settings.GROUP).
GROUP = (VARIABLES, Config.from_env)
