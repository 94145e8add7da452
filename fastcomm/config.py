"""Every FASTCOMM_* environment variable, read in one place.

Constructor arguments override the environment; nothing else in the package reads ``os.environ``
for fastcomm settings, and no op reads it on the hot path: a ``Config`` is resolved once per workspace.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Mapping

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Var:
    name: str
    default: str
    meaning: str


# The single list of variables (also printed by `fastcomm env`).
VARIABLES: tuple[Var, ...] = (
    Var("FASTCOMM_TIMEOUT_S", "30", "Bound on every device-side wait; a peer that does not arrive in time "
        "aborts the kernel with an error naming rank, peer and step."),
    Var("FASTCOMM_MAX_BYTES", str(8 * MiB), "Largest message the workspace serves; larger ones are refused "
        "(the vLLM integration sends them to NCCL)."),
    Var("FASTCOMM_ONE_SHOT_MAX_BYTES", str(1 * MiB), "Largest message the one-shot (flag-in-data) buffers hold; "
        "also caps the fused all-reduce + RMSNorm."),
    Var("FASTCOMM_TRANSPORT", "auto", "auto | p2p | host: peer GPU memory or shared pinned host memory."),
    Var("FASTCOMM_ALGO", "auto", "auto | one_shot | two_shot: force an algorithm for every call."),
    Var("FASTCOMM_ISLANDS", "", "Force a hierarchical island layout, e.g. '0,1;2,3' (ranks per island)."),
    Var("FASTCOMM_MAX_BLOCKS", "0", "Cap on thread blocks per kernel; 0 picks from the device."),
    Var("FASTCOMM_CACHE_DIR", "~/.cache/fastcomm", "Where compiled kernels (cubins) are cached."),
    Var("FASTCOMM_TUNE_FILE", "", "Tuning cache written by `fastcomm tune`; read at workspace start if set "
        "or present at the default path under FASTCOMM_CACHE_DIR."),
    Var("FASTCOMM_VLLM", "1", "0 turns the vLLM plugin off (vLLM then runs unchanged)."),
    Var("FASTCOMM_VLLM_FUSION", "0", "1 also fuses all-reduce + RMSNorm in vLLM (compile pass and GLM-5 helper "
        "routing). Opt-in until an end-to-end run shows it faster than the all-reduce alone (bench/RESULTS.md)."),
    Var("FASTCOMM_LOG", "info", "Log level of the 'fastcomm' logger."),
    Var("FASTCOMM_P2P_CHECK", "1", "Check every pair's P2P writes at workspace build (falls back to the host "
        "transport, with a warning naming the pair, when a pair drops them); 0 trusts the driver."),
    Var("FASTCOMM_TEST_MODE", "0", "Marks a test run; the FASTCOMM_TEST_* switches are refused without it."),
    Var("FASTCOMM_TEST_SHARED_GPU", "0", "Test only: ranks may share a GPU (each rank a process)."),
    Var("FASTCOMM_TEST_BREAK_P2P", "", "Test only: e.g. '0-1': the build-time P2P check loses rank 0's writes "
        "to rank 1."),
)
_BY_NAME = {v.name: v for v in VARIABLES}

TRANSPORTS = ("auto", "p2p", "host")
ALGOS = ("auto", "one_shot", "two_shot")


def _get(env: Mapping[str, str], name: str) -> str:
    raw = env.get(name)
    return _BY_NAME[name].default if raw is None or raw == "" else raw


def _flag(text: str) -> bool:
    return text.strip().lower() not in ("0", "false", "off", "no")


def _parse_islands(text: str) -> tuple[tuple[int, ...], ...] | None:
    text = text.strip()
    if not text:
        return None
    try:
        return tuple(tuple(int(r) for r in part.split(",") if r.strip()) for part in text.split(";") if part.strip())
    except ValueError as e:
        raise ValueError(f"FASTCOMM_ISLANDS={text!r}: expected ranks like '0,1;2,3'") from e


def _parse_pair(text: str) -> tuple[int, int] | None:
    text = text.strip()
    if not text:
        return None
    try:
        a, b = (int(p) for p in text.split("-"))
    except ValueError:
        raise ValueError(f"FASTCOMM_TEST_BREAK_P2P={text!r}: expected two ranks like '0-1'") from None
    return a, b


@dataclasses.dataclass(frozen=True)
class Config:
    timeout_s: float = 30.0
    max_bytes: int = 8 * MiB
    one_shot_max_bytes: int = 1 * MiB
    transport: str = "auto"
    algo: str = "auto"
    islands: tuple[tuple[int, ...], ...] | None = None
    max_blocks: int = 0
    cache_dir: Path = Path("~/.cache/fastcomm").expanduser()
    tune_file: Path | None = None
    vllm_enabled: bool = True
    vllm_fusion: bool = False  # opt-in, see FASTCOMM_VLLM_FUSION
    log_level: str = "info"
    p2p_check: bool = True
    test_mode: bool = False
    test_shared_gpu: bool = False
    test_break_p2p: tuple[int, int] | None = None

    def __post_init__(self):
        if (self.test_shared_gpu or self.test_break_p2p) and not self.test_mode:
            raise ValueError("FASTCOMM_TEST_SHARED_GPU / FASTCOMM_TEST_BREAK_P2P are test-only switches: "
                             "they are refused unless FASTCOMM_TEST_MODE=1")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.algo not in ALGOS:
            raise ValueError(f"algo must be one of {ALGOS}, got {self.algo!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.max_bytes <= 0 or self.one_shot_max_bytes <= 0:
            raise ValueError("max_bytes and one_shot_max_bytes must be positive")
        if self.max_blocks < 0:
            raise ValueError("max_blocks must be >= 0")

    def agreed(self) -> tuple:
        """The settings every rank of a workspace must share (compared at build)."""
        return (self.max_bytes, self.one_shot_max_bytes, self.transport, self.algo, self.islands, self.timeout_s,
                self.p2p_check, self.test_shared_gpu, self.test_break_p2p)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> "Config":
        """Resolve the environment, then apply explicit ``overrides`` (constructor arguments win)."""
        env = os.environ if env is None else env
        tune = _get(env, "FASTCOMM_TUNE_FILE")
        values = dict(
            timeout_s=float(_get(env, "FASTCOMM_TIMEOUT_S")),
            max_bytes=int(_get(env, "FASTCOMM_MAX_BYTES")),
            one_shot_max_bytes=int(_get(env, "FASTCOMM_ONE_SHOT_MAX_BYTES")),
            transport=_get(env, "FASTCOMM_TRANSPORT").lower(),
            algo=_get(env, "FASTCOMM_ALGO").lower(),
            islands=_parse_islands(_get(env, "FASTCOMM_ISLANDS")),
            max_blocks=int(_get(env, "FASTCOMM_MAX_BLOCKS")),
            cache_dir=Path(_get(env, "FASTCOMM_CACHE_DIR")).expanduser(),
            tune_file=Path(tune).expanduser() if tune else None,
            vllm_enabled=_flag(_get(env, "FASTCOMM_VLLM")),
            vllm_fusion=_flag(_get(env, "FASTCOMM_VLLM_FUSION")),
            log_level=_get(env, "FASTCOMM_LOG").lower(),
            p2p_check=_flag(_get(env, "FASTCOMM_P2P_CHECK")),
            test_mode=_flag(_get(env, "FASTCOMM_TEST_MODE")),
            test_shared_gpu=_flag(_get(env, "FASTCOMM_TEST_SHARED_GPU")),
            test_break_p2p=_parse_pair(_get(env, "FASTCOMM_TEST_BREAK_P2P")),
        )
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def describe_variables() -> str:
    return "\n".join(f"{v.name} (default {v.default!r}): {v.meaning}" for v in VARIABLES)
