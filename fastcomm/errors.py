"""fastcomm's exceptions: the bottom of every layer (the runtime, both products and their integrations raise them)."""
from __future__ import annotations


class FastcommError(RuntimeError):
    """A call fastcomm cannot serve (bad input, broken contract); nothing was sent."""


class FastcommTimeoutError(FastcommError):
    """A peer did not arrive within the timeout; the CUDA context is no longer usable."""
