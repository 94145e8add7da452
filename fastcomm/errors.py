"""Errors, and the text that turns the device-side error record into a message naming the stalled peer."""
from __future__ import annotations

from .abi import GROUPS, STEPS, ErrorRecord


class FastcommError(RuntimeError):
    """A call fastcomm cannot serve (bad input, broken contract); nothing was sent."""


class FastcommTimeoutError(FastcommError):
    """A peer did not arrive within the timeout; the CUDA context is no longer usable."""


def describe(rec: ErrorRecord, timeout_s: float) -> str | None:
    if rec.code == 0:
        return None
    step = STEPS.get(rec.step, f"step {rec.step}")
    group = GROUPS.get(rec.group, f"group {rec.group}")
    return (f"fastcomm: rank {rec.rank} timed out after {timeout_s:g} s waiting for peer rank {rec.peer} "
            f"in the {step} ({group}, call epoch {rec.epoch}, block {rec.block}). The peer is dead, stalled, "
            f"or called a different collective sequence (every rank must make the same calls in the same "
            f"order). The CUDA context is unusable after this error; restart the process.")
