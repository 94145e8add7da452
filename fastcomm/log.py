"""Where the 'fastcomm' logger's records go: FASTCOMM_LOG sets its level, and a stderr handler prints them as
``fastcomm INFO ...`` (NCCL_DEBUG style) unless the application configured logging itself.

Inside vLLM the plugin logs through vLLM's logger and vLLM's handlers print; ``setup`` then adds nothing, so
no line appears twice.
"""
from __future__ import annotations

import logging

from .config import Config

LOGGER = "fastcomm"
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
           "off": logging.CRITICAL + 1}


class _Formatter(logging.Formatter):
    """``fastcomm LEVEL message``; messages written as 'fastcomm: ...' (so they read well in other handlers'
    output) drop that prefix here, where the logger name already leads the line."""

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if msg.startswith("fastcomm: "):
            msg = msg[len("fastcomm: "):]
        line = f"{LOGGER} {record.levelname} {msg}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _Handler(logging.StreamHandler):
    """Ours, so a second ``setup`` recognises it (and stderr is looked up at emit time, as pytest swaps it)."""

    def __init__(self):
        super().__init__()
        self.setFormatter(_Formatter())

    @property
    def stream(self):
        import sys

        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def setup(config: Config) -> None:
    """Apply ``config.log_level`` to the 'fastcomm' logger; add the stderr handler when nobody configured one
    (neither this logger nor the root logger has a handler). Idempotent: safe on every workspace build."""
    logger = logging.getLogger(LOGGER)
    logger.setLevel(_LEVELS[config.log_level])
    ours = [h for h in logger.handlers if isinstance(h, _Handler)]
    others = [h for h in logger.handlers if not isinstance(h, _Handler)] + logging.getLogger().handlers
    if ours or others:
        if others:  # the application configured logging after our handler went in: let it print
            for h in ours:
                logger.removeHandler(h)
            logger.propagate = True
        return
    logger.addHandler(_Handler())
    logger.propagate = False  # our handler prints it; the root's lastResort must not print it again
