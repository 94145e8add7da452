"""Errors, and the device-side error record that turns a stalled peer into a message naming it."""
from __future__ import annotations

import ctypes

# Mirrors FC_STEP_* in csrc/common.cuh.
STEPS = {1: "one-shot exchange", 2: "two-shot reduce-scatter", 3: "two-shot all-gather",
         4: "fused all-reduce + RMSNorm exchange"}
GROUPS = {0: "all ranks", 1: "island", 2: "cross-island partners"}


class FastcommError(RuntimeError):
    """A call fastcomm cannot serve (bad input, broken contract); nothing was sent."""


class FastcommTimeoutError(FastcommError):
    """A peer did not arrive within the timeout; the CUDA context is no longer usable."""


class ErrorRecord(ctypes.Structure):
    """Mirrors ``struct FcError`` (pinned, mapped host memory, so it survives the kernel's trap)."""

    _fields_ = [(n, ctypes.c_uint32) for n in ("code", "rank", "peer", "step", "epoch", "block", "group", "pad")]


assert ctypes.sizeof(ErrorRecord) == 32


def describe(rec: ErrorRecord, timeout_s: float) -> str | None:
    if rec.code == 0:
        return None
    step = STEPS.get(rec.step, f"step {rec.step}")
    group = GROUPS.get(rec.group, f"group {rec.group}")
    return (f"fastcomm: rank {rec.rank} timed out after {timeout_s:g} s waiting for peer rank {rec.peer} "
            f"in the {step} ({group}, call epoch {rec.epoch}, block {rec.block}). The peer is dead, stalled, "
            f"or called a different collective sequence (every rank must make the same calls in the same "
            f"order). The CUDA context is unusable after this error; restart the process.")
